"""A hot standby (docs/HA.md): Journal.follow applies the entries another manager journaled with the same checks
as recovery, so afterwards its pools hold exactly the primary's state, its position is the primary's, and a retry
of a request the primary answered is answered from the standby's rebuilt idempotency window with the same reply
(no new entry)."""

from __future__ import annotations

import secrets

import numpy as np

from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal

from .test_journal import FAST, body, setup_pools, step_req


def test_a_standby_following_the_primarys_entries_ends_in_its_state_and_answers_its_retries():
    rng = np.random.default_rng(19_0028)
    primary = Journal(BlockManager(), config=FAST)
    setup_pools(primary)
    replies = {}
    for k in range(6):
        ids = [int(x) for x in rng.choice(np.arange(1, 500), size=int(rng.integers(1, 4)), replace=False) + 1000 * k]
        n = [int(x) for x in rng.integers(1, 120, size=len(ids))]
        rid = f"t/{secrets.token_hex(5)}"
        req = step_req("a", admit=ids, n=n, rid=rid)
        replies[rid] = (req, primary.execute("Step", req, primary.api.Step))
    standby = Journal(BlockManager(), config=FAST)
    applied = standby.follow(list(primary.store.entries_after(standby.seq)))
    assert applied == primary.seq and standby.seq == primary.seq
    assert sorted(standby.manager.pool_names()) == sorted(primary.manager.pool_names()) == ["a", "b", "c"]
    for name in primary.manager.pool_names():
        with standby.manager.locked(name) as pool:
            mine = pool.export_state()
        with primary.manager.locked(name) as pool:
            theirs = pool.export_state()
        assert mine.meta == theirs.meta, name
        assert mine.arrays.keys() == theirs.arrays.keys()
        for key, value in theirs.arrays.items():
            assert np.array_equal(mine.arrays[key], value), (name, key)
    with primary.manager.locked("a") as pool:
        assert len(pool.export_state().arrays["seq_ids"]) > 6          # the steps admitted random sequences
    before = standby.seq
    for rid, (req, reply) in replies.items():
        again = standby.execute("Step", req, standby.api.Step)
        assert body(again) == body(reply), rid
    assert standby.seq == before
