"""The replicated deployment's configuration and JetStream assets (kvservice/state/nats/config.py, assets.py).

- NatsConfig: each refusal of an impossible configuration, word for word; the names docs/HA.md gives for a
  deployment N (stream KVS_N, subject kvs.N.journal, bucket KVS_N_snapshots, KVS_N_leader).
- ensure_assets against a real nats-server (the shared nats1 fixture): what it creates, read back from the
  server (docs/HA.md "The NATS layout": file storage, the configured replicas); without create, a missing
  stream is Unrecoverable and a missing bucket None; a second call finds what the first made.
"""

from __future__ import annotations

import uuid

import nats.js.errors
import numpy as np
import pytest
from nats.js import api

from kvservice.contract.errors import InvalidArgument
from kvservice.state.nats.assets import ensure_assets
from kvservice.state.nats.config import NatsConfig, Unrecoverable, parse_state_url

from .test_nats_store import call, link  # noqa: F401  (fixtures)

SERVERS = ("nats://127.0.0.1:4222",)


@pytest.mark.parametrize(("fields", "message"), [
    ({"servers": ()}, "--state nats://HOST:PORT needs at least one NATS server"),
    ({"name": "a b"}, "NATS name 'a b' must match [A-Za-z0-9_-]{1,32}"),
    ({"name": "x" * 33}, f"NATS name {'x' * 33!r} must match [A-Za-z0-9_-]{{1,32}}"),
    ({"replicas": 2}, "replicas must be 1, 3 or 5 (a Raft group of an odd size), got 2"),
    ({"replicas": 0}, "replicas must be 1, 3 or 5 (a Raft group of an odd size), got 0"),
    ({"request_seconds": 0.0}, "request_seconds must be > 0 and append_seconds >= request_seconds"),
    ({"request_seconds": -1.0, "append_seconds": -2.0},
     "request_seconds must be > 0 and append_seconds >= request_seconds"),
    ({"request_seconds": 3.0, "append_seconds": 2.5},
     "request_seconds must be > 0 and append_seconds >= request_seconds"),
])
def test_an_impossible_configuration_is_refused_in_its_own_words(fields, message):
    fields = {"servers": SERVERS, **fields}
    with pytest.raises(InvalidArgument) as ei:
        NatsConfig(**fields)
    assert ei.value.message == message


def test_the_boundaries_of_a_valid_configuration_and_the_names_it_gives():
    rng = np.random.default_rng(2932)
    for replicas in (1, 3, 5):
        t = float(rng.uniform(0.01, 5))
        name = "d" + uuid.uuid4().hex[:int(rng.integers(4, 31))]
        c = NatsConfig((*SERVERS, "nats://10.0.0.2:4223"), name=name, replicas=replicas, request_seconds=t,
                       append_seconds=t)                      # append_seconds may equal request_seconds
        assert (c.stream, c.subject, c.snapshot_bucket, c.leader_bucket, c.url) == (
            f"KVS_{name}", f"kvs.{name}.journal", f"KVS_{name}_snapshots", f"KVS_{name}_leader",
            "nats://127.0.0.1:4222,nats://10.0.0.2:4223")
    assert NatsConfig(SERVERS, name="A_-9" + "z" * 28).name == "A_-9" + "z" * 28     # 32 characters
    assert (NatsConfig(SERVERS).name, NatsConfig(SERVERS).replicas) == ("kvservice", 1)


def test_a_state_url_lists_its_servers_and_passes_the_other_fields_on():
    c = parse_state_url("nats://h1:4222/ ,h2.example:14222,, nats://[::1]:4222", name="n1", replicas=3)
    assert c.servers == ("nats://h1:4222", "nats://h2.example:14222", "nats://[::1]:4222")
    assert (c.name, c.replicas) == ("n1", 3)
    for bad in ("nats://h1", "nats://h1:123456", "nats://h 1:4222", "nats://h1:4222,h2", "nats://"):
        with pytest.raises(InvalidArgument, match=r"--state: '.*' is not nats://HOST:PORT"):
            parse_state_url(bad)
    with pytest.raises(InvalidArgument) as ei:
        parse_state_url("memory2")
    assert ei.value.message == "--state 'memory2': expected 'memory' or nats://HOST:PORT[,HOST:PORT...]"


def test_ensure_assets_makes_what_the_layout_says_and_finds_it_again(link):  # noqa: F811
    c = link.config
    path = f"nats-test-{c.name}"
    with pytest.raises(Unrecoverable) as ei:
        call(link, ensure_assets(link.js, c, path, False))
    assert ei.value.message == f"{path}: no kvservice journal there (stream {c.stream} is missing)"
    with pytest.raises(nats.js.errors.NotFoundError):
        call(link, link.js.stream_info(c.stream))         # a refused open creates nothing
    obs = call(link, ensure_assets(link.js, c, path, True))
    assert obs is not None
    s = call(link, link.js.stream_info(c.stream)).config
    assert (s.name, s.subjects, s.storage, s.num_replicas, s.retention, s.discard, s.duplicate_window,
            s.description) == (c.stream, [c.subject], api.StorageType.FILE, c.replicas, api.RetentionPolicy.LIMITS,
                               api.DiscardPolicy.NEW, 120.0, "kvservice manager journal (docs/DURABILITY.md)")
    assert s.max_msg_size in (-1, None)
    b = call(link, link.js.stream_info(f"OBJ_{c.snapshot_bucket}")).config     # an object store's own stream
    assert (b.storage, b.num_replicas, b.description) == (api.StorageType.FILE, c.replicas,
                                                          "kvservice manager snapshots")
    again = call(link, ensure_assets(link.js, c, path, True))          # made already: found, nothing new
    assert again is not None and call(link, link.js.stream_info(c.stream)).config.description == s.description
    assert call(link, ensure_assets(link.js, c, path, False)) is not None
    call(link, link.js.delete_object_store(c.snapshot_bucket))
    assert call(link, ensure_assets(link.js, c, path, False)) is None    # no snapshot was ever written
    with pytest.raises(nats.js.errors.NotFoundError):
        call(link, link.js.stream_info(f"OBJ_{c.snapshot_bucket}"))    # and looking made none
