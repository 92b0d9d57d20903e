"""AckMark's opening (kvservice/state/ackmark.py): the file it creates, and what it takes as already on disk.

Records are built here with struct and hashlib from the layout in the module docstring: magic b"KVACKED1",
lineage u64 LE, seq u64 LE, blake2b-128 of those 24 bytes, at offsets 0 and 512 by position parity.
"""

import hashlib
import os
import stat
import struct

import numpy as np
import pytest

from kvservice.state.ackmark import Acked, AckMark


def rec(lineage: int, seq: int) -> bytes:
    head = struct.pack("<8sQQ", b"KVACKED1", lineage, seq)
    return head + hashlib.blake2b(head, digest_size=16).digest()


def file_of(*records: tuple[int, bytes]) -> bytes:
    out = bytearray(1024)
    for at, r in records:
        out[at:at + len(r)] = r
    return bytes(out)


@pytest.mark.parametrize("sync", [False, True])
def test_a_new_mark_file_is_private_to_its_owner(tmp_path, sync):
    """The file is created read-write for its owner only (mode 0600), whatever the process umask lets through."""
    path = tmp_path / f"ACKED-m29st-mode-{int(sync)}"
    old = os.umask(0)
    try:
        m = AckMark(path, sync=sync)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_bytes() == b""                  # opening writes nothing
        assert (m.found, m.damaged, m.writes) == (None, False, 0)
    finally:
        m.close()


def test_opening_takes_the_found_position_as_already_on_disk(tmp_path):
    """A synced mark never writes a record at or below the position it found on disk (it is there already);
    the first position above it is written into its parity slot, the other slot left as found."""
    rng = np.random.default_rng(2929)
    lin = int(rng.integers(1, 2**62)) * 2 + 1
    top = int(rng.integers(10, 2**40))
    path = tmp_path / "ACKED-m29st-found"
    start = file_of(((top & 1) * 512, rec(lin, top)), ((1 - (top & 1)) * 512, rec(lin, top - 1)))
    path.write_bytes(start)
    m = AckMark(path, sync=True)
    assert m.found == Acked(lin, top)
    for seq in (top - 1, top):                           # already durable: nothing to write
        m.advance(lin, seq)
        m.flush()
    assert m.writes == 0 and path.read_bytes() == start
    m.advance(lin, top + 1)
    m.flush()
    want = bytearray(start)
    at = ((top + 1) & 1) * 512
    want[at:at + 40] = rec(lin, top + 1)
    assert m.writes == 1 and path.read_bytes() == bytes(want)
    m.close()
    assert AckMark(path, writable=False).found == Acked(lin, top + 1)
