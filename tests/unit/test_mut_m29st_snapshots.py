"""The snapshot side of the journal (kvservice/state/journal_snapshots.py) once the journal has failed.

docs/DURABILITY.md: a storage failure stops the journal (fail-stop); every later call is refused. An explicit
snapshot is such a call: it is refused the same way, writes nothing, and a clean close writes none either
(what the store holds stays what was acknowledged before the failure).
"""

import numpy as np
import pytest

from kvservice.contract.errors import JournalUnavailable
from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig, MemoryStore
from tests.unit.test_journal import run, setup_pools, step_req


class Counting(MemoryStore):
    """A memory store that counts snapshot writes and can be told to fail its appends (a disk gone bad)."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshot_writes = 0
        self.broken = False

    def write_snapshot(self, seq, encoded):
        self.snapshot_writes += 1
        super().write_snapshot(seq, encoded)

    def append(self, entry):
        if self.broken:
            raise OSError(5, "Input/output error")
        super().append(entry)


def test_a_failed_journal_refuses_an_explicit_snapshot_and_writes_none():
    rng = np.random.default_rng(2931)
    store = Counting()
    store.begin(0)
    j = Journal(BlockManager(), store, JournalConfig(compact_every=1000, background_snapshots=False))
    setup_pools(j)
    n = int(rng.integers(2, 6))
    run(j, "Step", step_req("a", admit=list(range(1, n + 1)), n=list(rng.integers(1, 40, n))))
    j.snapshot()                                          # healthy: written at the journal's position
    assert store.snapshot_writes == 1 and store.load_snapshot()[0] == j.seq == j.snapshot_seq
    held = store.load_snapshot()
    store.broken = True
    with pytest.raises(JournalUnavailable, match="not made durable"):
        run(j, "Step", step_req("a", admit=[n + 1], n=[5]))
    assert j.failed
    for force in (False, True):
        with pytest.raises(JournalUnavailable, match="stopped accepting requests"):
            j.snapshot(force=force)
    j.close()                                             # a close after a failure snapshots nothing either
    assert store.snapshot_writes == 1 and store.load_snapshot() == held and j.snapshots == 1
