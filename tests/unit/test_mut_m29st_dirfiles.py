"""The state dir's lock and MANIFEST (kvservice/state/sqlite/dirfiles.py), checked with fcntl, json and hashlib.

docs/DURABILITY.md: ``lock`` is the flock of the serving process with its pid inside (one manager per state
dir; a check holds it shared); ``MANIFEST`` is JSON with its own checksum (blake2b-128, hex, of the other
fields as sorted JSON), replaced atomically; a damaged one is refused (STATE_DAMAGED) until --repair.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.state.sqlite.dirfiles import fsync_dir, lock_dir, read_manifest, write_manifest

DAMAGED = ("{path}: damaged (checksum or fields); it is the witness of how much this dir acknowledged. run "
           "`kvservice check-state DIR --repair` to accept the state dir as it is after checking it, or restore the "
           "state dir from a backup")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def held_by_other(path) -> bool:
    """Whether some open file holds a lock on `path` that an exclusive one conflicts with (a fresh open file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_the_exclusive_lock_is_a_private_file_holding_the_pid(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / "lock").write_bytes(b"999999999 an older holder's pid and more\n")
    old = os.umask(0)
    try:
        fd = lock_dir(d)
        fresh = tmp_path / "f"
        fresh.mkdir()
        fd2 = lock_dir(fresh)
    finally:
        os.umask(old)
    try:
        assert fd >= 0 and fd2 >= 0
        for where in (d, fresh):
            assert (where / "lock").read_bytes() == f"{os.getpid()}\n".encode()    # replaced, not appended
            assert held_by_other(where / "lock")
        assert stat.S_IMODE((fresh / "lock").stat().st_mode) == 0o600
        assert sorted(p.name for p in fresh.iterdir()) == ["lock"]
    finally:
        os.close(fd)
        os.close(fd2)
    assert not held_by_other(d / "lock")                  # closing the fd is the release


@pytest.mark.parametrize(("content", "named"), [
    (b"4242\n", "4242"),
    (b"", "?"),
    (b"  \n\t", "?"),
    (b"7" * 80 + b"\n", "7" * 64),                         # the first 64 bytes
    (b"12\xff34\n", "12\ufffd34"),                          # bytes that are not UTF-8 are replaced
])
def test_a_busy_dir_is_refused_naming_the_holder(tmp_path, content, named):
    d = tmp_path / "s"
    d.mkdir()
    (d / "lock").write_bytes(content)
    holder = os.open(d / "lock", os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)                    # another manager serving this dir
    try:
        before = open_fds()
        with pytest.raises(StateError) as ei:
            lock_dir(d)
        assert ei.value.reason == "STATE_BUSY"
        assert ei.value.message == f"state dir {d} is in use by another kvservice (pid {named})"
        assert lock_dir(d, shared=True) is None           # a check beside a serving manager: no lock, no error
        assert open_fds() == before                       # the refused opens closed their files
        assert (d / "lock").read_bytes() == content       # and wrote nothing
    finally:
        os.close(holder)


def test_shared_locks_coexist_and_keep_a_manager_out(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    assert lock_dir(d, shared=True) == -1                 # no lock file: nothing to share, nothing created
    assert list(d.iterdir()) == []
    fd = lock_dir(d)
    os.close(fd)
    a, b = lock_dir(d, shared=True), lock_dir(d, shared=True)
    try:
        assert a >= 0 and b >= 0 and a != b
        with pytest.raises(StateError) as ei:
            lock_dir(d)
        assert ei.value.reason == "STATE_BUSY" and f"(pid {os.getpid()})" in ei.value.message
        assert (d / "lock").read_bytes() == f"{os.getpid()}\n".encode()     # a check does not write its pid
    finally:
        os.close(a)
        os.close(b)
    os.close(lock_dir(d))                                 # free again once the checks are done


def test_a_manifest_round_trips_with_the_documented_checksum(tmp_path):
    rng = np.random.default_rng(2933)
    fields = {"incarnation": int(rng.integers(1, 1000)), "lineage": f"{int(rng.integers(1, 2**62)):016x}",
              "running": bool(rng.integers(2)), "last_seq": int(rng.integers(0, 2**40)),
              "snapshot_seq": int(rng.integers(0, 2**40)), "acked_mark": True}
    assert read_manifest(tmp_path) is None
    write_manifest(tmp_path, **fields)
    raw = (tmp_path / "MANIFEST").read_bytes()
    assert raw.endswith(b"}\n") and sorted(p.name for p in tmp_path.iterdir()) == ["MANIFEST"]    # no .tmp left
    m = json.loads(raw)
    body = {k: v for k, v in m.items() if k != "digest"}
    assert m["digest"] == hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()
    assert isinstance(body.pop("updated"), float)
    assert body == {"format": 2, **fields}
    assert read_manifest(tmp_path) == m


def _signed(body: dict) -> bytes:
    body = dict(body)
    body["digest"] = hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()
    return json.dumps(body).encode()


GOOD = {"format": 2, "incarnation": 3, "lineage": "00000000000000ab", "running": False, "last_seq": 17,
        "snapshot_seq": 12, "acked_mark": True, "updated": 1.5}


@pytest.mark.parametrize("raw", [
    _signed(GOOD)[:-1],                                               # cut short: not JSON
    _signed(GOOD).replace(b'"last_seq": 17', b'"last_seq": 18'),      # a field changed, the checksum kept
    _signed(GOOD).replace(b'"digest": "', b'"digest": "0'),            # the checksum itself damaged
    json.dumps(GOOD).encode(),                                         # no checksum
    _signed({**GOOD, "running": 0}),                                   # right checksum, a field of the wrong type
    _signed({**GOOD, "last_seq": "17"}),
    _signed({**GOOD, "incarnation": 3.0}),
    _signed({k: v for k, v in GOOD.items() if k != "snapshot_seq"}),   # right checksum, a field missing
    _signed({k: v for k, v in GOOD.items() if k != "running"}),
    b"[1, 2]",
    b'"MANIFEST"',
    b"\xff\xfe",
])
def test_a_damaged_manifest_is_refused_with_its_reason(tmp_path, raw):
    (tmp_path / "MANIFEST").write_bytes(raw)
    with pytest.raises(StateError) as ei:
        read_manifest(tmp_path)
    assert ei.value.reason == "STATE_DAMAGED"
    assert ei.value.message == DAMAGED.format(path=tmp_path / "MANIFEST")
    assert (tmp_path / "MANIFEST").read_bytes() == raw                                  # left as found


def test_a_signed_manifest_written_by_hand_is_read_back(tmp_path):
    """The checksum is over the fields whatever their order in the file (sorted JSON), computed here by hand."""
    (tmp_path / "MANIFEST").write_bytes(_signed(dict(reversed(list(GOOD.items())))))
    assert read_manifest(tmp_path) == json.loads(_signed(GOOD))


def test_fsync_dir_opens_and_closes_the_dir(tmp_path):
    before = open_fds()
    fsync_dir(tmp_path)
    assert open_fds() == before
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")
