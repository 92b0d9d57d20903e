"""kvservice/server/ha.py HAController._take_over: a takeover whose listing of the store's snapshots fails still
takes over, and says so with the store's message: "newest snapshot not listed at takeover (<message>); the next
one is due early" (the next snapshot is then due after the journal's own, not the store's newest).

A fake store and lease stand in for NATS (only what _take_over and _fence read of them); the journal is a real
in-memory Journal. Oracles: the warning text in the source's contract (the module's log lines are pinned word for
word), the fence rule of docs/HA.md (epoch = max(the store's highest fenced epoch, the holder's) + 1).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np

from kvservice.manager.pools import BlockManager
from kvservice.server.ha import HAController
from kvservice.state.journal import Journal
from kvservice.state.nats.journal import StoreError
from tests.unit.test_mut_d5hm_ha import _Lease


def test_a_takeover_whose_snapshot_listing_fails_warns_with_the_stores_message_and_still_leads(caplog) -> None:
    rng = np.random.default_rng(88)
    max_epoch = int(rng.integers(2, 50))
    why = f"bucket KV_r{int(rng.integers(1, 999))} unreachable"
    fenced: list[int] = []

    def listing() -> int:
        raise StoreError(why)
    store = SimpleNamespace(guard=None, readonly=True, newest_snapshot_seq=listing, catch_up=lambda: [],
                            stop_reading=lambda: None, fence=fenced.append, max_epoch=max_epoch)
    promoted: list[int] = []
    lease = _Lease()
    journal = Journal(BlockManager(3600.0))
    snapshot_seq = journal.snapshot_seq
    serving: list[bool] = []
    ha = HAController(journal, store, lease, SimpleNamespace(promote=promoted.append), set_serving=serving.append)
    with caplog.at_level(logging.WARNING, logger="kvservice"):
        ha._take_over()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"newest snapshot not listed at takeover ({why}); the next one is due early"]
    assert (ha.role, ha.failed, fenced, promoted, serving) == ("leader", None, [max_epoch + 1], [max_epoch + 1],
                                                               [True])
    assert (lease.epoch, journal.incarnation, journal.snapshot_seq) == (max_epoch + 1, max_epoch + 1, snapshot_seq)
    assert store.readonly is False and lease.lost == []


def test_configured_pools_that_cannot_be_created_at_takeover_are_logged_and_the_manager_still_leads(
        caplog, monkeypatch) -> None:
    """ensure_pools refusing after the fence (e.g. a configured pool that no longer fits): one ERROR line names
    it, "configured pools not created after takeover: <message>", and the manager serves as leader anyway."""
    from kvservice.contract.errors import InvalidArgument
    from kvservice.server import ha as ha_mod

    why = "pools.yaml: pool 'big': 9000 pages do not fit the memory budget"
    asked: list[list] = []

    def refuse(journal, pools):
        asked.append(pools)
        raise InvalidArgument(why)
    monkeypatch.setattr(ha_mod, "ensure_pools", refuse)
    store = SimpleNamespace(guard=None, readonly=True, newest_snapshot_seq=lambda: 0, catch_up=lambda: [],
                            stop_reading=lambda: None, fence=lambda epoch: None, max_epoch=4)
    serving: list[bool] = []
    ha = HAController(Journal(BlockManager(3600.0)), store, _Lease(), SimpleNamespace(promote=lambda e: None),
                      set_serving=serving.append)
    with caplog.at_level(logging.WARNING, logger="kvservice"):
        ha._take_over()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"configured pools not created after takeover: {why}"] and len(asked) == 1
    assert (ha.role, ha.failed, serving) == ("leader", None, [True])
