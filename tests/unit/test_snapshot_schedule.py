"""Snapshots on schedule whatever the restarts: the next snapshot follows the newest one in the store.

Issue 20: each process set its next snapshot point to its own recovery position + compact_every,
so under leader churn faster than that no snapshot was ever written and recoveries replayed
ever longer tails. Here a journal restarts (as a new leader would) every few entries, and the
store's tail after its newest snapshot must never exceed compact_every.
"""

from __future__ import annotations

import pytest

from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.stores import MemoryStore

from .test_journal import run, setup_pools, step_req

COMPACT = 20


def one_entry(j: Journal, i: int) -> None:
    """One journaled Step: admit sequence i, or free the one admitted before it."""
    if i % 2:
        run(j, "Step", step_req("a", admit=[i], n=[3]))
    else:
        run(j, "Step", step_req("a", free=[i - 1]))


def tail(store: MemoryStore, j: Journal) -> int:
    """Entries the store holds after its newest snapshot: what a recovery replays."""
    return sum(1 for _ in store.entries_after(j.snapshot_seq))


@pytest.mark.parametrize("term", [3, 7, 19])
def test_restarts_faster_than_compact_every_still_snapshot_on_schedule(term):
    config = JournalConfig(sync="normal", compact_every=COMPACT, background_snapshots=False)
    store = MemoryStore()
    j = Journal.recover(store, config=config)
    setup_pools(j)
    longest, replays, i = 0, [], 1
    for _ in range(30):                          # 30 leaders, each serving `term` entries, then killed
        for _ in range(term):
            one_entry(j, i)
            i += 1
            longest = max(longest, tail(store, j))
        j.close(snapshot=False)                  # a kill: no snapshot on the way out
        j = Journal.recover(store, config=config)
        replays.append(j.replayed_entries)
    assert j.seq >= 30 * term
    assert longest <= COMPACT and max(replays) <= COMPACT, (longest, replays)
    assert j.snapshot_seq >= j.seq - COMPACT
    j.close(snapshot=False)


def test_the_snapshot_is_due_a_quarter_early_so_recovery_stays_within_compact_every():
    assert JournalConfig(compact_every=10_000).snapshot_due_tail == 7_500
    assert JournalConfig(compact_every=1).snapshot_due_tail == 1
    config = JournalConfig(sync="normal", compact_every=COMPACT, background_snapshots=False)
    store = MemoryStore()
    j = Journal.recover(store, config=config)
    setup_pools(j)
    for i in range(1, 16):
        one_entry(j, i)
    assert j.snapshots == 1 and j.snapshot_seq == config.snapshot_due_tail     # 15 = 3/4 of 20
    j.close(snapshot=False)


def test_a_snapshot_written_by_another_writer_moves_the_next_one():
    """A standby that took over learns the store's newest snapshot (kvservice/server/ha.py) and snapshots
    compact_every after it, not after the one it recovered from."""
    config = JournalConfig(sync="normal", compact_every=COMPACT, background_snapshots=False)
    store = MemoryStore()
    j = Journal.recover(store, config=config)
    setup_pools(j)
    for i in range(1, 10):
        one_entry(j, i)
    j.snapshot_stored(j.seq)                      # as if the leader it followed had just stored one here
    j.snapshot_stored(j.seq - 5)                  # an older one changes nothing
    assert j.snapshot_seq == j.seq and j.snapshots == 0
    for i in range(10, 10 + config.snapshot_due_tail - 1):
        one_entry(j, i)
    assert j.snapshots == 0
    one_entry(j, 10 + config.snapshot_due_tail - 1)
    assert j.snapshots == 1
    j.close(snapshot=False)
