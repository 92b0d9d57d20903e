"""A fresh Journal's whole observable state (kvservice/state/journal.py, Journal.__init__ and its class docstring):
every counter it exports starts at zero, nothing has failed, no hooks are set; without a store it starts its own
MemoryStore (incarnation 1: begun once); with one, it takes the store's incarnation as it is (the store is begun by
recovery, not here); a manager already holding pools when the journal starts without a store gets a baseline
snapshot at position 0, and one given a store does not. Each snapshot counter then moves as its name says."""

from __future__ import annotations

import secrets

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.startup import create_request
from kvservice.state.stores import MemoryStore


def _counters(j: Journal) -> tuple:
    return (j.seq, j.snapshot_seq, j.recovery_seconds, j.replayed_entries, j.commits, j.snapshots, j.resyncs,
            j.snapshot_pause_seconds, j.snapshot_pause_max_seconds, j.snapshot_seconds, j.snapshot_bytes,
            j.snapshot_waits, j.tail_bytes, j.window.hits)


def _manager_with_a_pool() -> BlockManager:
    m = BlockManager()
    ManagerAPI(m).CreatePool(create_request("p", CacheSpec.uniform(2, 1, 64, page_size=16),
                                            Sizing(num_slots=32, max_seq_len=256), ()))
    return m


def test_a_journal_without_a_store_starts_empty_on_a_memory_store_of_its_own():
    j = Journal(BlockManager(), config=JournalConfig(compact_every=8))
    assert isinstance(j.store, MemoryStore) and j.store.incarnation == 1 and j.incarnation == 1
    assert _counters(j) == (0, 0, 0.0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0)
    assert (j.failed, j.on_fail, j.observe_commit, j.state_dir) == (None, None, None, None)
    assert j.lineage == j.store.lineage != 0 and j.store.load_snapshot() is None
    assert j.wait_for_snapshot(0) and not j._tail_full()


def test_a_journal_given_a_store_takes_its_incarnation_without_beginning_it():
    store = MemoryStore()
    store.incarnation = 2 + secrets.randbelow(100)
    store.state_dir = "/some/dir"
    j = Journal(_manager_with_a_pool(), store, JournalConfig())
    assert j.incarnation == store.incarnation and j.store is store
    assert store.load_snapshot() is None and j.snapshots == 0              # no baseline for a given store
    assert j.state_dir == "/some/dir"
    assert _counters(j) == (0, 0, 0.0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0)


def test_a_manager_filled_outside_the_journal_gets_a_baseline_snapshot_at_zero():
    j = Journal(_manager_with_a_pool(), config=JournalConfig(background_snapshots=False))
    seq, blob = j.store.load_snapshot()
    assert seq == 0 and j.snapshots == 1 and j.snapshot_seq == 0 and j.seq == 0
    assert j.snapshot_bytes == len(blob) > 0 and j.snapshot_seconds > 0
    assert j.snapshot_pause_max_seconds == j.snapshot_pause_seconds > 0
    assert j.wait_for_snapshot(0)
