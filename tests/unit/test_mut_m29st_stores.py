"""kvservice/state/stores.py byte by byte: journaled request bytes, entry checksums, lineages, the memory store.

Oracles: the protobuf wire format as protobuf itself writes it (a message holding only request_id serializes to
exactly that field: tag, length varint, UTF-8 bytes), the checksum layout of entry_digest's docstring and
docs/DURABILITY.md (blake2b-128 over position int64 LE, time float64 LE, method, NUL, request), written here with
struct and hashlib.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.state.stores import (
    Entry,
    MemoryStore,
    continued_lineage,
    entry_digest,
    entry_request,
    lineage_hex,
    new_lineage,
)
from kvservice.v1 import block_manager_pb2 as pb

TYPES = tuple(c for c in (pb.StepRequest, pb.CreatePoolRequest, pb.DeletePoolRequest, pb.RegisterWorkerRequest)
              if "request_id" in c.DESCRIPTOR.fields_by_name)


def id_field(cls, rid: str) -> bytes:
    """The request_id field alone on the wire, as protobuf writes it (an empty one written by hand: tag, 0)."""
    if rid:
        return cls(request_id=rid).SerializeToString()
    tag = cls(request_id="x").SerializeToString()[:-2]             # tag, then length 1, then "x"
    return tag + b"\x00"


@pytest.mark.parametrize("cls", TYPES)
def test_an_entry_is_the_received_bytes_then_the_request_id_field(cls):
    rng = np.random.default_rng(2938)
    ascii_, wide = "abcxyz019-/:#", "üé🙂"
    for n, alphabet in [(n, ascii_) for n in (0, 1, 2, 63, 127, 128, 129, 255, 300, 16383, 16384, 16385, 70000)] + \
            [(n, ascii_ + wide) for n in (1, 40, 127, 5000)]:
        rid = "".join(alphabet[int(i)] for i in rng.integers(0, len(alphabet), n))             # n characters
        req = cls(request_id=rid)
        received = rng.bytes(int(rng.integers(0, 50)))
        entry = entry_request(req, received)
        assert entry == received + id_field(cls, rid), n
        if n:
            assert cls.FromString(entry[len(received):]).request_id == rid
    plain = cls(request_id="plain-" + str(int(rng.integers(1 << 30))))
    assert entry_request(plain) == plain.SerializeToString(deterministic=True)


def test_an_entry_checksum_is_blake2b_over_the_documented_layout():
    rng = np.random.default_rng(2939)
    for _ in range(30):
        seq, created = int(rng.integers(-2**40, 2**62)), float(rng.uniform(-1e3, 4e9))
        method = ["Step", "CreatePool", "DeletePool", "RegisterWorker", "é"][int(rng.integers(5))]
        request = rng.bytes(int(rng.integers(0, 300)))
        want = hashlib.blake2b(struct.pack("<q", seq) + struct.pack("<d", created) + method.encode() + b"\0" + request,
                               digest_size=16).digest()
        assert entry_digest(seq, method, request, created) == want
        e = Entry.make(seq, method, request, created)
        assert e.checksum is None and e.digest == want and e.checksum == want      # computed once, then kept
        assert Entry(seq, method, request, created, checksum=b"\1" * 16).digest == b"\1" * 16   # as stored
        assert Entry(seq, method, request, created, checksum=b"\1" * 16) == e     # not part of equality


def test_lineages_are_nonzero_64_bit_and_written_as_16_hex_digits():
    seen = {new_lineage() for _ in range(200)}
    assert len(seen) == 200 and all(0 < x < 2**64 for x in seen)
    assert any(x >= 2**63 for x in seen)                 # the whole 64 bits are drawn (chance 2**-200 to fail)
    assert lineage_hex(0xAB) == "00000000000000ab" and lineage_hex(2**64 - 1) == "f" * 16
    with pytest.raises(StateError) as ei:
        continued_lineage(0x10, "0000000000000011", "ACKED")
    assert ei.value.message == ("ACKED belongs to lineage 0000000000000011, the state to 0000000000000010: parts of "
                                "two different states (damaged)")
    assert continued_lineage(0, "00000000000000ff", "x") == 255 and continued_lineage(0, 0, "x") == 0
    assert continued_lineage(7, 0, "x") == 7 and continued_lineage(7, None, "x") == 7


def test_the_memory_store_keeps_what_a_snapshot_does_not_cover():
    rng = np.random.default_rng(2940)
    st = MemoryStore()
    assert st.lineage != 0 and st.incarnation == 0 and st.load_snapshot() is None and not st.durable
    assert (st.begin(0), st.begin(0)) == (1, 2)
    es = [Entry.make(s, "Step", rng.bytes(int(rng.integers(1, 40))), float(s)) for s in range(1, 11)]
    for e in es:
        st.append(e)
    assert list(st.entries_after(0)) == es and list(st.entries_after(4)) == es[4:]
    assert list(st.entries_after(10)) == []

    class Enc:
        def __init__(self) -> None:
            self.chunks = [memoryview(b"head"), b"-", bytearray(b"body")]
    st.write_snapshot(6, Enc())
    assert st.load_snapshot() == (6, b"head-body")
    assert list(st.entries_after(0)) == es[6:]          # the entries the snapshot covers are dropped
    st.check_position(10**9)                             # no witness: nothing to refuse
    err = StateError("x")
    with pytest.raises(StateError) as ei:
        st.override(err)                                 # without repair, a failed check is raised
    assert ei.value is err
    st.close(clean=True, seq=10)
