"""The acknowledged high-water mark (kvservice/state/ackmark.py): its file format, its ordering promise
against the journal, and its failure paths."""

import os

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.state.ackmark import Acked, AckMark
from kvservice.state.journal import Journal, JournalConfig

from .test_journal import run, setup_pools, step_req, workload


def on_disk(path) -> Acked | None:
    """What a restart would read (a separate, read-only open of the file)."""
    return AckMark(path, writable=False).found


def test_records_round_trip_and_a_damaged_one_falls_back_to_the_other(tmp_path):
    path = tmp_path / "ACKED"
    assert AckMark(path, writable=False).found is None and not path.exists()
    m = AckMark(path, sync=False)
    assert m.found is None and not m.damaged and path.stat().st_size == 0
    m.reset(0xABCDEF0123456789, 40)
    for seq in range(41, 46):
        m.advance(0xABCDEF0123456789, seq)
    m.close()
    assert path.stat().st_size == AckMark.SIZE and on_disk(path) == Acked(0xABCDEF0123456789, 45)
    data = bytearray(path.read_bytes())
    data[(45 & 1) * AckMark.SLOT + 20] ^= 0x04          # the newest record's seq: its digest no longer matches
    path.write_bytes(bytes(data))
    assert on_disk(path) == Acked(0xABCDEF0123456789, 44)
    data[(44 & 1) * AckMark.SLOT + 3] ^= 0x80            # the other one's magic too: nothing valid left
    path.write_bytes(bytes(data))
    damaged = AckMark(path, writable=False)
    assert damaged.found is None and damaged.damaged


def test_reset_replaces_both_records_whatever_the_file_held(tmp_path):
    path = tmp_path / "ACKED"
    m = AckMark(path)
    m.reset(7, 0)
    for seq in range(1, 30):
        m.advance(7, seq)
    m.reset(9, 12)                                       # a new lineage (a repair) at a lower position
    m.close()
    assert on_disk(path) == Acked(9, 12)
    records = [AckMark.decode(path.read_bytes()[i:i + 40]) for i in (0, AckMark.SLOT)]
    assert sorted(r.seq for r in records) == [11, 12] and {r.lineage for r in records} == {9}


def test_a_synced_mark_is_never_more_than_one_behind_when_advance_returns(tmp_path):
    """advance(N) returns with N - 1 on disk (what the reply of N is sent after); flush() with N."""
    path = tmp_path / "ACKED"
    m = AckMark(path, sync=True)
    m.reset(5, 0)
    for seq in range(1, 200):
        m.advance(5, seq)
        assert on_disk(path).seq >= seq - 1
    m.flush()
    assert on_disk(path) == Acked(5, 199)
    m.close()


def test_a_failed_write_is_reported_by_the_next_advance(tmp_path):
    m = AckMark(tmp_path / "ACKED", sync=True)
    m.reset(5, 0)
    m.advance(5, 1)
    m.flush()
    os.close(m._fd)                                      # the file goes away under the writer (EBADF, a real error)
    m._fd = os.open(tmp_path / "ACKED", os.O_RDONLY)     # a descriptor it cannot write
    m.advance(5, 2)                                      # handed to the writer, which fails
    with pytest.raises(StateError, match="could not be written"):
        m.advance(5, 3)
    with pytest.raises(StateError):
        m.flush()
    os.close(m._fd)
    m._fd = None
    with pytest.raises(StateError, match="read-only or closed"):
        m.advance(5, 4)


@pytest.mark.parametrize("sync", ["full", "normal"])
def test_the_journal_advances_the_mark_before_each_reply_and_closes_it_exact(tmp_path, sync):
    d = tmp_path / "state"
    j = Journal.open(d, config=JournalConfig(sync=sync, compact_every=25, background_snapshots=False))
    setup_pools(j)
    lineage = j.lineage
    assert lineage and on_disk(d / "ACKED").lineage == lineage
    for i in range(60):
        reply = run(j, "Step", step_req("a", admit=[10_000 + i], n=[5], rid=f"r{i}"))
        assert reply.position.lineage == lineage and reply.position.seq == j.seq
        got = on_disk(d / "ACKED")
        assert got.lineage == lineage and j.seq - (sync == "full") <= got.seq <= j.seq
    workload(j, np.random.default_rng(3), 20)
    seq = j.seq
    j.close()
    assert on_disk(d / "ACKED") == Acked(lineage, seq)
    again = Journal.open(d, config=JournalConfig(sync=sync))
    try:
        assert (again.lineage, again.seq) == (lineage, seq)    # the lineage is kept across restarts
    finally:
        again.close()


def test_a_new_mark_is_not_required_until_the_store_says_so(tmp_path):
    """AckMark's documented fields on a dir that never had one: nothing found, not damaged, not required (only
    the store sets `required`, from its MANIFEST's acked_mark), no record written; a writable one creates it."""
    mark = AckMark(tmp_path / "ACKED", sync=False)
    try:
        assert (mark.found, mark.damaged, mark.required, mark.writes) == (None, False, False, 0)
        assert (tmp_path / "ACKED").exists()
    finally:
        mark.close()
