"""Journal.reload's whole contract (kvservice/state/journal.py docstring: a standby whose next entry a compaction
purged replaces its whole state with the store's newest snapshot and the entries after it, its idempotency window
included): it returns the entries replayed (also replayed_entries), its position becomes the store's, its manager
equals the writer's, a retried request id gets the writer's reply, and its next snapshot re-exports every pool and
is due snapshot_due_tail entries after the store's snapshot, as after one of its own."""

from __future__ import annotations

import numpy as np

from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.tree import state_tree

from .test_journal import body, run, setup_pools, step_req


def test_reload_takes_the_stores_snapshot_entries_and_window():
    config = JournalConfig(sync="normal", compact_every=40, background_snapshots=False)
    rng = np.random.default_rng(7_207)
    leader = Journal(BlockManager(), config=config)
    setup_pools(leader)
    for i in range(3):
        run(leader, "Step", step_req("a", admit=[i + 1], n=[int(rng.integers(1, 40))], rid=f"early-{i}"))
    leader.snapshot()
    at = leader.snapshot_seq
    assert at == leader.seq
    sent = {}
    for i in range(5):
        req = step_req("b", admit=[i + 10], n=[int(rng.integers(1, 40))], rid=f"late-{i}")
        sent[req.request_id] = (req, run(leader, "Step", req))

    standby = Journal(BlockManager(), leader.store, config)
    standby.seq = 2                                        # a stale position: reload replaces it
    assert standby.reload() == 5
    assert (standby.replayed_entries, standby.seq, standby.snapshot_seq) == (5, leader.seq, at)
    assert state_tree(standby.manager) == state_tree(leader.manager)
    assert set(standby.window.ids) == set(leader.window.ids)
    req, reply = sent["late-3"]
    assert body(run(standby, "Step", req)) == body(reply) and standby.seq == leader.seq   # a retry: not applied
    assert standby._states == {} and standby._dirty == set(leader.manager.pool_names())
    assert standby._compact_at == at + config.snapshot_due_tail
