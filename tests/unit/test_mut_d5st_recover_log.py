"""Journal.recover's one INFO line, read back whole: where the state came from (the store's location), the
snapshot position it started from, how many entries it replayed and in how long, the lineage as 16 hex digits,
the new incarnation and the pools it holds ("none" if it holds none). The positions are counted by hand here:
each accepted request is one journal entry."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.state.journal import Journal, JournalConfig
from tests.unit.test_journal import crash, run, setup_pools, step_req


def recovery_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvservice.state.journal" and r.getMessage().startswith("recovered ")]


def line_re(where, snap, replayed, lineage, incarnation, pools) -> str:
    return (f"recovered {re.escape(str(where))}: snapshot at {snap}, {replayed} entries replayed in "
            rf"\d+\.\d{{3}} s, lineage {lineage:016x}, incarnation {incarnation}, pools: {re.escape(pools)}")


def test_recovery_logs_its_source_position_replay_lineage_incarnation_and_pools(tmp_path, caplog):
    """A fresh dir: snapshot at 0, 0 entries, incarnation 1, pools none. After 4 setup entries, a forced snapshot
    and k more Steps, a crash and a restart: snapshot at 4, k entries replayed, incarnation 2, pools a, b, c."""
    caplog.set_level(logging.INFO, logger="kvservice.state.journal")
    cfg = JournalConfig(sync="normal", compact_every=10_000, background_snapshots=False)
    j = Journal.open(tmp_path, config=cfg)
    lines = recovery_lines(caplog)
    assert len(lines) == 1
    assert re.fullmatch(line_re(tmp_path, 0, 0, j.lineage, 1, "none"), lines[0]), lines[0]
    assert (j.replayed_entries, j.incarnation) == (0, 1)
    setup_pools(j)                         # 3 CreatePool + 1 RegisterWorker: 4 entries
    assert j.seq == 4
    j.snapshot(force=True)
    k = int(np.random.default_rng(55).integers(3, 9))
    for i in range(k):
        run(j, "Step", step_req("a", admit=[100 + i], n=[5]))
    assert j.seq == 4 + k
    lineage = j.lineage
    crash(j)
    caplog.clear()
    t0 = time.perf_counter()
    j2 = Journal.open(tmp_path, config=cfg)
    spent = time.perf_counter() - t0
    try:
        assert j2.config == cfg and 0 <= j2.recovery_seconds <= spent
        lines = recovery_lines(caplog)
        assert len(lines) == 1
        assert re.fullmatch(line_re(tmp_path, 4, k, lineage, 2, "a, b, c"), lines[0]), lines[0]
        assert (j2.snapshot_seq, j2.replayed_entries, j2.incarnation, j2.seq) == (4, k, 2, 4 + k)
        assert j2.recovery_seconds >= 0
    finally:
        crash(j2)


def test_a_recovered_state_that_breaks_invariants_is_refused_naming_four_problems_and_leaves_the_dir_as_found(
        tmp_path, monkeypatch):
    """Pools rebuilt from the snapshot are checked as they load; after replay only the pools the replayed entries
    changed are checked (here a and b, not c). Problems found: StateError STATE_INVARIANTS (check-state's exit 1),
    "<location>: recovered state breaks invariants: " and the first four joined by "; ", every problem kept in
    .problems; the store is released without starting an incarnation (a later start gets incarnation 2)."""
    cfg = JournalConfig(sync="normal", compact_every=10_000, background_snapshots=False)
    j = Journal.open(tmp_path, config=cfg)
    setup_pools(j)
    j.snapshot(force=True)
    run(j, "Step", step_req("b", admit=[7], n=[9]))
    run(j, "Step", step_req("a", admit=[5], n=[3]))
    crash(j)
    asked = []

    def verdict(pools, names):
        asked.append((sorted(pools), set(names)))
        return [f"pool {n!r}: broken {i}" for n in sorted(names) for i in range(3)]
    monkeypatch.setattr("kvservice.state.journal.snap.verify_pools", verdict)
    with pytest.raises(StateError) as err:
        Journal.open(tmp_path, config=cfg)
    want = [f"pool {n!r}: broken {i}" for n in "ab" for i in range(3)]
    assert asked == [(["a", "b", "c"], {"a", "b"})]
    assert err.value.reason == "STATE_INVARIANTS"
    assert err.value.message == f"{tmp_path}: recovered state breaks invariants: {'; '.join(want[:4])}"
    assert err.value.problems == want
    monkeypatch.undo()
    j2 = Journal.open(tmp_path, config=cfg)           # the lock was released, nothing was begun
    try:
        assert (j2.seq, j2.snapshot_seq, j2.replayed_entries, j2.incarnation) == (6, 4, 2, 2)
    finally:
        crash(j2)


def test_the_next_snapshot_after_a_recovery_is_due_a_tail_after_the_stores_newest_snapshot(tmp_path):
    """compact_every 8: a snapshot is due once the tail reaches 8 - 8 // 4 = 6 entries, counted from the newest
    snapshot in the store (4), not from the recovered position (6): the restarted journal writes its next one
    at position 10, after 4 more entries, not 6."""
    cfg = JournalConfig(sync="normal", compact_every=8, background_snapshots=False)
    j = Journal.open(tmp_path, config=cfg)
    setup_pools(j)
    j.snapshot(force=True)
    for i in range(2):
        run(j, "Step", step_req("a", admit=[10 + i], n=[4]))
    assert (j.seq, j.snapshot_seq) == (6, 4)
    crash(j)
    j2 = Journal.open(tmp_path, config=cfg)
    try:
        assert (j2.seq, j2.snapshot_seq) == (6, 4)
        for i in range(3):
            run(j2, "Step", step_req("a", admit=[20 + i], n=[4]))
            assert j2.snapshot_seq == 4
        run(j2, "Step", step_req("a", admit=[30], n=[4]))
        assert (j2.seq, j2.snapshot_seq) == (10, 10)
    finally:
        crash(j2)


def test_a_background_snapshot_is_written_on_a_daemon_thread_named_kvservice_snapshot(tmp_path, monkeypatch):
    """compact_every 8 with background snapshots: the snapshot due after 6 entries is written on its own daemon
    thread, named "kvservice-snapshot" (the name a thread dump or py-spy shows), not inline."""
    import threading

    from kvservice.state import journal as jmod

    made = []

    class Spy(threading.Thread):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
    monkeypatch.setattr(jmod.threading, "Thread", Spy)
    j = Journal.open(tmp_path, config=JournalConfig(sync="normal", compact_every=8))
    try:
        setup_pools(j)
        for i in range(2):
            run(j, "Step", step_req("a", admit=[10 + i], n=[4]))
        snaps = [t for t in made if t.name == "kvservice-snapshot"]
        assert len(snaps) == 1 and snaps[0].daemon
        snaps[0].join(60)
        assert not snaps[0].is_alive() and j.snapshot_seq == 6
    finally:
        crash(j)
