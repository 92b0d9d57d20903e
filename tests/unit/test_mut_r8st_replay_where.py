"""Recovery that meets an entry it cannot apply names where the state lives (Journal._apply's doc: "StateError
naming the entry"), whether the entry is one of the last replay_replies (replayed with its reply rebuilt) or an
earlier one (replayed without a reply). Oracle: the message format in kvservice/state/journal.py's _apply, the
MemoryStore's location ("memory") and remedy from kvservice/state/stores.py, and Journal._load's rule that a
damaged state's message gets the store's remedy appended."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.stores import Entry, MemoryStore, entry_digest

from .test_journal import setup_pools, step_req


def _store_with_an_unreplayable_step(seed: int) -> tuple[MemoryStore, int, int]:
    j = Journal(BlockManager(), config=JournalConfig(sync="normal", compact_every=1000, background_snapshots=False))
    setup_pools(j)
    rng = np.random.default_rng(seed)
    unknown = int(rng.integers(10_000, 1 << 40))
    bad = step_req("a", extend=[unknown], k=1).SerializeToString()  # a sequence pool a never admitted
    seq, at = j.seq + 1, float(rng.uniform(1e9, 2e9))
    j.store.append(Entry(seq, "Step", bad, at, entry_digest(seq, "Step", bad, at)))  # intact: only replay refuses
    return j.store, seq, unknown


@pytest.mark.parametrize("replay_replies", [4096, 0])
def test_an_entry_refused_on_replay_is_named_with_the_stores_location(replay_replies):
    store, seq, unknown = _store_with_an_unreplayable_step(8000 + replay_replies)
    assert store.location == "memory"
    config = JournalConfig(sync="normal", compact_every=1000, background_snapshots=False,
                           replay_replies=replay_replies)
    with pytest.raises(StateError) as err:
        Journal.recover(store, config=config)
    msg = err.value.message
    assert msg == (f"memory: journal entry {seq} (Step) failed on replay: extend_seq_ids: sequence {unknown} is "
                   f"not in pool 'a'; the state and this kvservice disagree. the state is lost with it")
    assert err.value.reason == "STATE_DAMAGED" and err.value.args == (msg,)
