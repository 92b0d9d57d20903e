"""ensure_assets' races and refusals on a stand-in JetStream context (kvservice/state/nats/assets.py, module doc):
managers started together all try to create the assets; a creation refused (any APIError: 400, or 500 for more
replicas than peers) while another manager made the asset meanwhile finds that one; a creation refused while
nobody made it is a StoreError in the server's words, naming the path, the asset and the replicas."""

from __future__ import annotations

import asyncio
import secrets

import nats.js.errors
import pytest
from nats.js import api

from kvservice.state.nats.assets import ensure_assets
from kvservice.state.nats.config import NatsConfig, StoreError, Unrecoverable


class FakeJS:
    """Streams and object stores by name; a creation in `refuse` raises that error (after making the asset, if
    `meanwhile`: another manager won the race)."""

    def __init__(self, refuse: dict, meanwhile: bool) -> None:
        self.streams, self.buckets, self.refuse, self.meanwhile, self.asked = set(), {}, refuse, meanwhile, []
        self.configs = []

    async def stream_info(self, name):
        self.asked.append(("stream_info", name))
        if name not in self.streams:
            raise nats.js.errors.NotFoundError
        return name

    async def add_stream(self, config):
        self.asked.append(("add_stream", config.name))
        self.configs.append(config)
        if "stream" in self.refuse:
            if self.meanwhile:
                self.streams.add(config.name)
            raise self.refuse["stream"]
        self.streams.add(config.name)

    async def object_store(self, bucket):
        self.asked.append(("object_store", bucket))
        if bucket not in self.buckets:
            raise nats.js.errors.BucketNotFoundError
        return self.buckets[bucket]

    async def create_object_store(self, bucket, config):
        self.asked.append(("create_object_store", bucket))
        self.configs.append(config)
        if "bucket" in self.refuse:
            if self.meanwhile:
                self.buckets[bucket] = ("another manager's", bucket)
            raise self.refuse["bucket"]
        self.buckets[bucket] = ("ours", bucket)
        return self.buckets[bucket]


def _config(replicas: int = 3) -> NatsConfig:
    return NatsConfig(("nats://127.0.0.1:4222",), name="t" + secrets.token_hex(5), replicas=replicas)


def _refusal(code: int = 500) -> nats.js.errors.APIError:
    return nats.js.errors.APIError(code=code, err_code=10074, description="insufficient resources")


@pytest.mark.parametrize("code", [400, 500])
def test_a_refused_stream_creation_takes_the_stream_another_manager_made(code):
    c = _config()
    js = FakeJS({"stream": _refusal(code)}, meanwhile=True)
    assert asyncio.run(ensure_assets(js, c, "p", True)) == ("ours", c.snapshot_bucket)
    assert js.asked[:3] == [("stream_info", c.stream), ("add_stream", c.stream), ("stream_info", c.stream)]


@pytest.mark.parametrize("replicas", [3, 5])
def test_a_refused_bucket_creation_nobody_made_is_a_store_error_in_the_servers_words(replicas):
    c = _config(replicas)
    js = FakeJS({"bucket": _refusal()}, meanwhile=False)
    path = "path-" + secrets.token_hex(3)
    with pytest.raises(StoreError) as err:
        asyncio.run(ensure_assets(js, c, path, True))
    assert err.value.message == (f"{path}: creating the snapshot bucket {c.snapshot_bucket} ({replicas} replicas) "
                                 "was refused: insufficient resources (err_code 10074)")
    assert js.asked[-3:] == [("object_store", c.snapshot_bucket), ("create_object_store", c.snapshot_bucket),
                             ("object_store", c.snapshot_bucket)]


def test_a_refused_bucket_creation_takes_the_bucket_another_manager_made():
    c = _config()
    js = FakeJS({"bucket": _refusal(400)}, meanwhile=True)
    assert asyncio.run(ensure_assets(js, c, "p", True)) == ("another manager's", c.snapshot_bucket)


def test_an_existing_stream_and_bucket_are_found_without_creating_anything():
    c = _config()
    js = FakeJS({}, meanwhile=False)
    js.streams.add(c.stream)
    js.buckets[c.snapshot_bucket] = "found"
    for create in (True, False):
        js.asked.clear()
        assert asyncio.run(ensure_assets(js, c, "p", create)) == "found"
        assert js.asked == [("stream_info", c.stream), ("object_store", c.snapshot_bucket)]


@pytest.mark.parametrize("replicas", [1, 3, 5])
def test_what_is_created_is_what_the_layout_says(replicas):
    """docs/HA.md "The NATS layout": stream KVS_N on subject kvs.N.journal, file storage, the configured replicas,
    limits retention, new messages refused when full, a 120 s duplicate window, no message size limit of its own;
    bucket KVS_N_snapshots, file storage, the configured replicas."""
    c = _config(replicas)
    js = FakeJS({}, meanwhile=False)
    assert asyncio.run(ensure_assets(js, c, "p", True)) == ("ours", c.snapshot_bucket)
    s, b = js.configs
    assert (s.name, s.subjects, s.storage, s.num_replicas, s.retention, s.discard, s.duplicate_window, s.max_msg_size,
            s.description) == (c.stream, [c.subject], api.StorageType.FILE, replicas, api.RetentionPolicy.LIMITS,
                               api.DiscardPolicy.NEW, 120.0, -1, "kvservice manager journal (docs/DURABILITY.md)")
    assert (b.replicas, b.storage, b.description) == (replicas, api.StorageType.FILE, "kvservice manager snapshots")


def test_without_create_a_missing_stream_is_unrecoverable_and_a_missing_bucket_none():
    c = _config()
    js = FakeJS({}, meanwhile=False)
    with pytest.raises(Unrecoverable) as err:
        asyncio.run(ensure_assets(js, c, "the-path", False))
    assert err.value.message == f"the-path: no kvservice journal there (stream {c.stream} is missing)"
    assert js.asked == [("stream_info", c.stream)]
    js.streams.add(c.stream)
    assert asyncio.run(ensure_assets(js, c, "the-path", False)) is None and js.configs == []


def test_a_refused_stream_creation_nobody_made_names_the_path_replicas_and_reason():
    c = _config(5)
    js = FakeJS({"stream": _refusal(400)}, meanwhile=False)
    with pytest.raises(StoreError) as err:
        asyncio.run(ensure_assets(js, c, "the-path", True))
    assert err.value.message == ("the-path: creating the journal stream (5 replicas) was refused: insufficient "
                                 "resources (err_code 10074)")
