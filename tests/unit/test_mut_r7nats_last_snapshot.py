"""NatsStore._last_snapshot's whole contract on a stand-in object store (kvservice/state/nats/journal.py, module doc:
snap-<seq> objects whose description is a JSON header with the journal seq, stream seq, epoch, bytes and blake2b
digest): no bucket, no listing or no snapshot object -> None; the newest live snap-* object is read; a header that
cannot be read (not JSON, a key missing, another format) is Unrecoverable naming the store, the object and why;
a SHA-256 mismatch reported by the object store is "corrupt"; bytes that do not match the header's size or digest
are refused naming both sizes; otherwise (header, bytes)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from types import SimpleNamespace

import nats.js.errors
import pytest

from kvservice.state.nats.config import Unrecoverable
from kvservice.state.nats.journal import NatsStore

OLDER = ("snapshot format 1 is not 2 (written by an older kvservice: export it with that version, import the state "
         "dir with this one)")


class FakeObs:
    def __init__(self, infos, blobs, listing_error=None, get_error=None) -> None:
        self.infos, self.blobs, self.listing_error, self.get_error, self.got = infos, blobs, listing_error, \
            get_error, []

    async def list(self, ignore_deletes=False):
        assert ignore_deletes is True
        if self.listing_error is not None:
            raise self.listing_error
        return self.infos

    async def get(self, name, writeinto):
        self.got.append(name)
        if self.get_error is not None:
            raise self.get_error
        writeinto.write(self.blobs[name])


def _header(blob: bytes, **over) -> str:
    meta = {"format": 2, "seq": 9, "stream_seq": 31, "epoch": 4, "lineage": "00000000000000aa", "at": 1.5,
            "bytes": len(blob), "digest": hashlib.blake2b(blob, digest_size=16).hexdigest(), **over}
    return json.dumps(meta)


def _info(name, description=None, deleted=False):
    return SimpleNamespace(name=name, description=description, deleted=deleted)


def _read(obs):
    store = SimpleNamespace(_obs=obs, path="nats://h:1 (stream KVS_x)")
    return asyncio.run(NatsStore._last_snapshot(store))


def test_nothing_to_read_is_none():
    assert _read(None) is None
    assert _read(FakeObs([], {}, listing_error=nats.js.errors.NotFoundError())) is None
    assert _read(FakeObs([_info("other"), _info("snap-00000000000000000007", "{}", deleted=True)], {})) is None


def test_the_newest_live_snapshot_is_read_and_returned_with_its_header():
    blob, older = secrets.token_bytes(300 + secrets.randbelow(300)), secrets.token_bytes(50)
    infos = [_info("snap-00000000000000000009", _header(blob)), _info("snap-00000000000000000003", _header(older)),
             _info("snap-00000000000000000012", "junk", deleted=True), _info("zzz", "junk")]
    obs = FakeObs(infos, {"snap-00000000000000000009": blob, "snap-00000000000000000003": older})
    meta, got = _read(obs)
    assert got == blob and meta == json.loads(_header(blob)) and obs.got == ["snap-00000000000000000009"]


@pytest.mark.parametrize(("description", "why"), [
    (None, "Expecting value: line 1 column 1 (char 0)"),
    ("{}", "'format'"),
    (json.dumps({"format": 1}), OLDER),
    (json.dumps({"format": "two"}), "invalid literal for int() with base 10: 'two'"),
])
def test_an_unreadable_header_is_unrecoverable_naming_the_object_and_why(description, why):
    name = f"snap-{secrets.randbelow(10**6):020d}"
    with pytest.raises(Unrecoverable) as err:
        _read(FakeObs([_info(name, description)], {name: b"x"}))
    assert err.value.message == f"nats://h:1 (stream KVS_x): snapshot {name} has an unreadable header ({why})"


def test_a_digest_mismatch_in_the_object_store_is_corrupt():
    name, blob = "snap-00000000000000000004", b"abc"
    with pytest.raises(Unrecoverable) as err:
        _read(FakeObs([_info(name, _header(blob))], {}, get_error=nats.js.errors.DigestMismatchError()))
    assert err.value.message == f"nats://h:1 (stream KVS_x): snapshot {name} is corrupt (SHA-256 mismatch)"


@pytest.mark.parametrize("wrong", ["bytes", "digest"])
def test_bytes_that_do_not_match_the_header_are_refused_naming_both_sizes(wrong):
    name, blob = "snap-00000000000000000004", secrets.token_bytes(64)
    over = {"bytes": 65} if wrong == "bytes" else {"digest": "0" * 32}
    with pytest.raises(Unrecoverable) as err:
        _read(FakeObs([_info(name, _header(blob, **over))], {name: blob}))
    says = 65 if wrong == "bytes" else 64
    assert err.value.message == (f"nats://h:1 (stream KVS_x): snapshot {name} does not match its header (64 bytes, "
                                 f"header says {says})")
