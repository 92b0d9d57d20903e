"""Journal edges the recovery tests do not reach: the baseline snapshot of a manager filled outside the journal,
the counters of a fresh journal, a failed stop's log line, and a snapshot write that fails (the journal keeps
serving and tries again half a compact_every later, docs/DURABILITY.md)."""

from __future__ import annotations

import logging

from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.stores import MemoryStore
from kvservice.state.tree import state_tree

from .test_journal import run, setup_pools, step_req

COMPACT = 20


class FailingSnapshots(MemoryStore):
    """A memory store whose first `fail` snapshot writes raise (a full disk), later ones are stored."""

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.fail, self.tried = fail, []

    def write_snapshot(self, seq, encoded):
        self.tried.append(seq)
        if len(self.tried) <= self.fail:
            raise OSError(28, "No space left on device")
        super().write_snapshot(seq, encoded)


def one_entry(j: Journal, i: int) -> None:
    if i % 2:
        run(j, "Step", step_req("a", admit=[i], n=[3]))
    else:
        run(j, "Step", step_req("a", free=[i - 1]))


def test_a_fresh_journal_over_an_empty_manager_has_no_snapshot_and_zero_counters():
    j = Journal(BlockManager())
    assert j.store.load_snapshot() is None and j.snapshots == 0 and j.snapshot_seq == 0
    timings = (j.snapshot_pause_seconds, j.snapshot_pause_max_seconds, j.snapshot_seconds, j.snapshot_bytes)
    assert timings == (0, 0, 0, 0)
    assert (j.commits, j.resyncs, j.seq) == (0, 0, 0)
    j.close(snapshot=False)


def test_a_manager_filled_outside_the_journal_gets_a_baseline_snapshot():
    filler = Journal(BlockManager())
    setup_pools(filler)
    manager = filler.manager
    j = Journal(manager)                                  # no store: a fresh MemoryStore, the manager already filled
    assert j.snapshots == 1 and j.store.load_snapshot() is not None
    expected = state_tree(manager)
    assert state_tree(Journal.recover(j.store).manager) == expected


def test_a_failed_journal_logs_why(caplog):
    j = Journal(BlockManager())
    stops = []
    j.on_fail = stops.append
    with caplog.at_level(logging.CRITICAL, logger="kvservice.state.journal"):
        j._fail("disk 7 is gone")
        j._fail("a second reason is not logged")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvservice.state.journal"]
    assert lines == ["journal failed, stopping: disk 7 is gone"] and stops == ["disk 7 is gone"]


def test_a_failed_snapshot_write_keeps_serving_and_is_tried_again_half_a_compact_every_later():
    config = JournalConfig(sync="normal", compact_every=COMPACT, background_snapshots=False)
    store = FailingSnapshots(fail=1)
    j = Journal.recover(store, config=config)
    setup_pools(j)                                        # 4 entries
    i = 1
    while j.seq < config.snapshot_due_tail:
        one_entry(j, i)
        i += 1
    assert store.tried == [15] and j.snapshots == 0 and j.snapshot_seq == 0 and j.failed is None
    while j.seq < 15 + COMPACT // 2 - 1:                  # served meanwhile, nothing tried before 25
        one_entry(j, i)
        i += 1
    assert store.tried == [15]
    one_entry(j, i)
    assert j.seq == 25 and store.tried == [15, 25] and j.snapshots == 1 and j.snapshot_seq == 25
    expected = state_tree(j.manager)
    j.close(snapshot=False)
    again = Journal.recover(store, config=config)
    assert again.replayed_entries == 0 and state_tree(again.manager) == expected
