"""ACKED byte by byte against ackmark.py's documented layout, and what recovery concludes from it.

Layout (the module docstring): 1024 bytes, records at offsets 0 and 512 chosen by position parity;
record = magic b"KVACKED1", lineage u64 LE, seq u64 LE, blake2b-128 of those 24 bytes. Records are
built here with struct and hashlib.
"""

import hashlib
import struct
import threading

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.state.ackmark import Acked, AckMark, check_recovery, torn_tail_note
from kvservice.state.sqlite.store import SqliteStore


def rec(lineage: int, seq: int, magic: bytes = b"KVACKED1") -> bytes:
    head = struct.pack("<8sQQ", magic, lineage, seq)
    return head + hashlib.blake2b(head, digest_size=16).digest()


def file_of(*records: tuple[int, bytes]) -> bytes:
    out = bytearray(1024)
    for at, r in records:
        out[at:at + len(r)] = r
    return bytes(out)


@pytest.mark.parametrize("sync", [False, True])
def test_advance_writes_each_record_in_its_parity_slot(tmp_path, sync):
    rng = np.random.default_rng(7 + sync)
    lin = int(rng.integers(1, 2**63)) * 2 + 1
    path = tmp_path / "ACKED-m28e-parity"                # a name no other test's writer thread carries
    m = AckMark(path, sync=sync)
    m.reset(lin, 10)
    assert path.read_bytes() == file_of((0, rec(lin, 10)), (512, rec(lin, 9)))
    assert m.found == Acked(lin, 10)
    for seq in range(11, 11 + int(rng.integers(3, 8))):
        m.advance(lin, seq)
        if sync:
            m.flush()
        data = path.read_bytes()                     # without sync: written in place before advance returns
        assert data[(seq & 1) * 512:(seq & 1) * 512 + 40] == rec(lin, seq)
        assert data[(1 - (seq & 1)) * 512:(1 - (seq & 1)) * 512 + 40] == rec(lin, seq - 1)
        assert data == file_of((0, data[:40]), (512, data[512:552]))           # nothing else written
    assert m.writes == seq - 10
    writer = [t for t in threading.enumerate() if t.name == f"ackmark-{path.name}"]
    assert len(writer) == sync                       # only a synced mark writes on a thread of its own
    m.close()
    m.close()                                           # twice: nothing left to do
    with pytest.raises(StateError, match="open read-only or closed"):
        m.advance(lin, seq + 1)
    assert AckMark(path, writable=False).found == Acked(lin, seq)


def test_reset_at_zero_writes_zero_in_both_slots(tmp_path):
    m = AckMark(tmp_path / "ACKED", sync=False)
    m.reset(5, 0)
    m.close()
    assert (tmp_path / "ACKED").read_bytes() == file_of((0, rec(5, 0)), (512, rec(5, 0)))


@pytest.mark.parametrize(("content", "found", "damaged", "slot0"), [
    (b"", None, False, None),
    (bytes(1024), None, False, None),
    (file_of((0, rec(3, 8))), Acked(3, 8), False, Acked(3, 8)),
    (file_of((512, rec(3, 9))), Acked(3, 9), False, None),
    (file_of((0, rec(3, 8)), (512, rec(3, 7))), Acked(3, 8), False, Acked(3, 8)),
    (file_of((0, rec(3, 8)), (512, rec(4, 11))), Acked(4, 11), False, Acked(3, 8)),   # the higher position wins
    (file_of((0, rec(3, 8, b"KVACKED2")), (512, rec(3, 7))), Acked(3, 7), False, None),
    (file_of((0, rec(3, 8)[:39] + b"\0"), (512, rec(3, 7))), Acked(3, 7), False, None),
    (file_of((0, rec(3, 8, b"KVACKED2"))), None, True, None),
    (rec(3, 8)[:39], None, True, None),                                              # cut short
    (b"\x01", None, True, None),
])
def test_reading_a_mark(tmp_path, content, found, damaged, slot0):
    path = tmp_path / "ACKED"
    path.write_bytes(content)
    m = AckMark(path, writable=False)
    assert (m.found, m.damaged) == (found, damaged)
    assert AckMark.decode(content[:40]) == slot0
    assert AckMark.record(3, 8) == rec(3, 8)


def test_a_read_only_mark_creates_nothing_and_refuses_writes(tmp_path):
    m = AckMark(tmp_path / "ACKED", writable=False)
    assert m.found is None and not (tmp_path / "ACKED").exists()
    for call in (lambda: m.advance(1, 1), lambda: m.reset(1, 1)):
        with pytest.raises(StateError) as ei:
            call()
        assert ei.value.message == f"{tmp_path / 'ACKED'}: the high-water mark is open read-only or closed"
    m.close()


def store_with(tmp_path, name: str, acked: bytes | None, repair: bool = False):
    """A real state dir whose ACKED holds `acked` (None: removed), reopened (with repair if asked)."""
    d = tmp_path / name
    st = SqliteStore.open(d, sync="normal")
    st.begin(0)
    lin = st.lineage
    st.close(clean=True, seq=0)
    if acked is None:
        (d / "ACKED").unlink()
    else:
        (d / "ACKED").write_bytes(acked(lin) if callable(acked) else acked)
    return SqliteStore.open(d, sync="normal", repair=repair), lin


def test_check_recovery_refuses_each_way_a_mark_can_disagree(tmp_path):
    st, lin = store_with(tmp_path, "ok", lambda lin: file_of((0, rec(lin, 6)), (512, rec(lin, 5))))
    check_recovery(st, 6, 2)                             # reaches the mark
    check_recovery(st, 9, 2)                             # passes it
    with pytest.raises(StateError) as ei:
        check_recovery(st, 5, 2)
    err = ei.value
    where = f"{tmp_path / 'ok'}: the acknowledged high-water mark (ACKED)"
    assert err.reason == "STATE_ROLLBACK" and err.metadata == {"acknowledged": "6", "recovered": "5"}
    assert err.message == (
        f"{where} says position 6 was acknowledged, but the journal holds only 5 (snapshot at 2, then 3 entries): "
        "acknowledged change 6 is lost (the tail of the journal was cut: a write-ahead log truncated or replaced by an "
        "older copy, or storage that lost writes it had confirmed). Serving this state would roll its clients back. "
        'Restore the state dir from a backup (see docs/DURABILITY.md, "Damaged state"), or run `kvservice '
        "check-state DIR --repair` to accept the loss (the state then starts a new lineage)")
    with pytest.raises(StateError) as ei:
        check_recovery(st, 3, 1)
    assert "holds only 3 (snapshot at 1, then 2 entries): acknowledged changes 4..6 are lost" in ei.value.message
    st.close(clean=True, seq=6)

    st, lin = store_with(tmp_path, "other", lambda lin: file_of((0, rec(lin ^ 0x5A5A, 2))))
    other = lin ^ 0x5A5A
    with pytest.raises(StateError) as ei:
        check_recovery(st, 9, 0)
    assert ei.value.reason == "STATE_DAMAGED"
    assert ei.value.message.startswith(f"{tmp_path / 'other'}: the acknowledged high-water mark (ACKED) belongs to "
                                       f"lineage {other:016x} but the state to {lin:016x}: parts of two state dirs")
    st.close(clean=True, seq=9)

    st, _ = store_with(tmp_path, "gone", None)
    assert st.mark.required                              # the MANIFEST says the dir keeps a mark
    with pytest.raises(StateError) as ei:
        check_recovery(st, 0, 0)
    assert ei.value.reason == "STATE_DAMAGED" and " (ACKED) is missing, so whether" in ei.value.message
    st.close(clean=True, seq=0)

    st, _ = store_with(tmp_path, "garbled", b"\x07" * 1024)
    with pytest.raises(StateError) as ei:
        check_recovery(st, 0, 0)
    assert " (ACKED) is damaged, so whether" in ei.value.message
    st.close(clean=True, seq=0)

    st, _ = store_with(tmp_path, "repaired", lambda lin: file_of((0, rec(lin, 6))), repair=True)
    check_recovery(st, 4, 4)                             # under repair: recorded, not raised
    assert len(st.overridden) == 1 and "acknowledged changes 5..6 are lost" in st.overridden[0]
    st.close(clean=True, seq=4)


def test_torn_tail_note_says_what_the_mark_proves(tmp_path):
    head = ("state.db-wal: the last 3 frames are an incomplete commit (a write cut short by a crash, or a log cut in "
            "the middle of a frame); dropped.")
    unknown = f"{head} No acknowledged high-water mark vouches for position 9: whether it was acknowledged is not known"
    assert torn_tail_note("state.db-wal", 3, 9, None, True) == unknown
    m = AckMark(tmp_path / "A", sync=True)
    assert torn_tail_note("state.db-wal", 3, 9, m, True) == unknown          # nothing found
    m.reset(1, 9)
    assert torn_tail_note("state.db-wal", 3, 9, m, False) == unknown         # a repaired state vouches for nothing
    reach = f"{head} The recovered position 9 reaches the acknowledged high-water mark (9)"
    assert torn_tail_note("state.db-wal", 3, 9, m, True) == (
        f"{reach}, so it was never acknowledged unless the machine stopped within one fdatasync of its reply (the "
        "mark trails the last reply by at most one position); a client that got such a reply refuses this state "
        "(STATE_ROLLED_BACK)")
    m.reset(1, 8)
    assert torn_tail_note("state.db-wal", 3, 9, m, True) == (
        f"{head} The recovered position 9 reaches the acknowledged high-water mark (8) and passes it, so it was "
        "never acknowledged")
    m.close()
    n = AckMark(tmp_path / "B", sync=False)
    n.reset(1, 9)
    assert torn_tail_note("state.db-wal", 3, 9, n, True) == (
        f"{reach}, so it was never acknowledged, unless the machine itself crashed (with --sync normal that can "
        "lose acknowledged commits)")
    n.close()
