"""The snapshot side of the journal (kvservice/state/journal_snapshots.py): refused once the journal has failed,
the tail it bounds (counted from the entries the store holds), a failed write retried with what it captured.

docs/DURABILITY.md: a storage failure stops the journal (fail-stop); every later call is refused. An explicit
snapshot is such a call: it is refused the same way, writes nothing, and a clean close writes none either
(what the store holds stays what was acknowledged before the failure).
"""

import numpy as np
import pytest

from kvservice.contract.errors import JournalUnavailable
from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig, MemoryStore
from kvservice.state.tree import state_tree
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


def _requests(rng, n):
    """The same Step requests (fixed ids) for every journal they are run on: pools a and b of setup_pools."""
    out, live = [], {"a": [], "b": []}
    for k in range(n):
        p = "ab"[k % 2]
        if live[p] and rng.random() < 0.3:
            out.append(step_req(p, free=live[p], rid=f"f{k}"))
            live[p] = []
        else:
            sid = 100 + k
            out.append(step_req(p, extend=live[p], k=int(rng.integers(1, 4)), admit=[sid],
                                n=[int(rng.integers(1, 30))], rid=f"s{k}"))
            live[p].append(sid)
    return out


def test_the_tail_is_counted_in_journaled_bytes_and_compact_bytes_is_reached_exactly():
    """tail_bytes: the request bytes of the entries after the newest snapshot (read back from the store); a
    snapshot is due the moment the tail reaches compact_bytes (>=), not one entry later."""
    rng = np.random.default_rng(2941)
    reqs = _requests(rng, 16)
    base = Journal(BlockManager(), config=JournalConfig(compact_every=10**6, background_snapshots=False))
    setup_pools(base)
    first = base.seq
    cum = []
    for r in reqs:
        run(base, "Step", r)
        assert base.tail_bytes == sum(len(e.request) for e in base.store.entries_after(base.snapshot_seq))
        cum.append(base.tail_bytes)
    base.snapshot()
    assert base.tail_bytes == 0 and base.snapshot_seq == base.seq
    run(base, "Step", step_req("a", admit=[9999], n=[3], rid="after"))
    assert base.tail_bytes == len(next(iter(base.store.entries_after(base.snapshot_seq))).request) > 0
    k = 9                                                  # the 10th Step's entry reaches compact_bytes exactly
    for extra, at in ((0, k), (1, k + 1)):
        j = Journal(BlockManager(), config=JournalConfig(compact_every=10**6, compact_bytes=cum[k] + extra,
                                                         background_snapshots=False))
        setup_pools(j)
        for i, r in enumerate(reqs[:at + 1]):
            run(j, "Step", r)
            assert j.snapshot_seq == (first + at + 1 if i == at else 0), (extra, i)
        assert j.snapshots == 1 and j.tail_bytes == 0


class FlakySnapshots(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.fail_next = False

    def write_snapshot(self, seq, encoded):
        if self.fail_next:
            self.fail_next = False
            raise OSError(28, "No space left on device")
        super().write_snapshot(seq, encoded)


def test_a_failed_snapshot_write_leaves_its_pools_to_be_exported_again():
    """A pool captured by a snapshot whose write failed is exported anew by the next one (not taken from the
    older snapshot, which lacks its change): recovery from the next snapshot alone gives the live state."""
    rng = np.random.default_rng(2942)
    store = FlakySnapshots()
    store.begin(0)
    j = Journal(BlockManager(), store, JournalConfig(compact_every=10**6, background_snapshots=False))
    setup_pools(j)
    for r in _requests(rng, 6):
        run(j, "Step", r)
    j.snapshot()
    held, done = store.load_snapshot(), j.snapshots
    run(j, "Step", step_req("a", admit=[777], n=[int(rng.integers(5, 40))], rid="changes-a"))
    store.fail_next = True
    j.snapshot()                                           # logged, the journal goes on
    assert (j.snapshots, store.load_snapshot(), j.failed) == (done, held, None)
    assert j.snapshot_seq == held[0] and j.tail_bytes > 0
    run(j, "Step", step_req("b", admit=[778], n=[int(rng.integers(5, 40))], rid="changes-b"))
    j.snapshot()
    assert j.snapshots == done + 1 and store.load_snapshot()[0] == j.seq
    assert list(store.entries_after(0)) == []             # the snapshot covers everything: recovery reads it alone
    back = Journal.recover(store, config=JournalConfig(compact_every=10**6, background_snapshots=False))
    assert state_tree(back.manager) == state_tree(j.manager)


def test_the_largest_pause_is_the_largest_of_every_snapshot_taken():
    rng = np.random.default_rng(2943)
    j = Journal(BlockManager(), config=JournalConfig(compact_every=10**6, background_snapshots=False))
    setup_pools(j)
    pauses = []
    for r in _requests(rng, 8):
        run(j, "Step", r)
        j.snapshot()
        pauses.append(j.snapshot_pause_seconds)
    assert j.snapshots == 8 and j.snapshot_pause_max_seconds == max(pauses) > 0
