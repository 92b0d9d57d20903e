"""HashSlots: the NumPy hash -> slot table answers like a dict holding the latest slot of every hash."""

import numpy as np

from kvservice.core import hash_index
from kvservice.core.hash_index import HashSlots


def test_lookup_matches_a_dict_through_overwrites_and_rebuilds():
    rng = np.random.default_rng(0)
    t = HashSlots(64)
    ref: dict[int, int] = {}
    pool = rng.integers(1, 2**64 - 1, 400, dtype=np.uint64)          # reused keys: re-registrations
    for _ in range(60):
        keys = np.unique(rng.choice(pool, int(rng.integers(1, 40)), replace=False))
        slots = rng.integers(0, 64, len(keys)).astype(np.int64)
        if t.full_after(len(keys)):
            ref.update(zip(keys.tolist(), slots.tolist(), strict=True))
            live = dict(list(ref.items())[-100:])                    # the cache's live pages only
            ref = live
            t.rebuild(np.array(list(live), dtype=np.uint64), np.array(list(live.values()), dtype=np.int64))
        else:
            t.insert(keys, slots)
            ref.update(zip(keys.tolist(), slots.tolist(), strict=True))
        probe = np.concatenate((rng.choice(pool, 50), rng.integers(1, 2**64 - 1, 20, dtype=np.uint64)))
        want = np.array([ref.get(k, -1) for k in probe.tolist()], dtype=np.int64)
        assert np.array_equal(t.lookup(probe), want)
    assert t.used <= (t.mask + 1) * 3 // 4


def test_long_clusters_finish_one_by_one(monkeypatch):
    """Keys that all land on one home position probe past the vectorised rounds and are still found."""
    monkeypatch.setattr(HashSlots, "_home", lambda self, k: np.zeros(len(k), dtype=np.int64))
    t = HashSlots(32)                                                 # 64 positions
    keys = np.arange(1, 30, dtype=np.uint64)
    t.insert(keys, np.arange(29, dtype=np.int64) * 10)
    assert t.lookup(keys).tolist() == list(range(0, 290, 10))
    assert t.lookup(np.array([999], dtype=np.uint64)).tolist() == [-1]
    monkeypatch.setattr(hash_index, "VECTOR_ROUNDS", 0)
    assert t.lookup(keys[::-1]).tolist() == list(range(280, -10, -10))


def test_invalidated_table_rebuilds_from_the_live_pages_at_the_next_lookup():
    """invalidate: nothing is rebuilt or inserted until a lookup, which answers from refill() as it is then
    (registrations after the invalidation included, pages forgotten since gone), like a dict of the live pages."""
    rng = np.random.default_rng(3)
    t = HashSlots(64)
    live: dict[int, int] = {}
    pool = rng.integers(1, 2**64 - 1, 300, dtype=np.uint64)
    calls = []

    def refill():
        calls.append(len(live))
        return np.array(list(live), dtype=np.uint64), np.array(list(live.values()), dtype=np.int64)

    for step in range(80):
        keys = np.unique(rng.choice(pool, int(rng.integers(1, 30)), replace=False))
        slots = rng.integers(0, 64, len(keys)).astype(np.int64)
        live.update(zip(keys.tolist(), slots.tolist(), strict=True))
        ks = list(live)
        for i in rng.permutation(len(ks))[:max(0, len(ks) - 60)].tolist():
            del live[ks[i]]                                          # forgotten: a stale entry at most
        if t.full_after(len(keys)):
            t.invalidate(refill)
            assert not t.full_after(len(keys)) and not t.pending     # waiting: insertions are dropped
        t.insert(keys, slots)
        if step % 3 == 0:
            never = rng.integers(1, 2**64 - 1, 20, dtype=np.uint64)
            never = never[~np.isin(never, pool)]
            probe = np.concatenate((np.array(list(live), dtype=np.uint64), never))
            want = [live.get(k, -1) for k in probe.tolist()]          # live: its latest slot; never seen: -1
            assert t.lookup(probe).tolist() == want
            assert t.refill is None
    assert calls and all(n <= 90 for n in calls)                  # rebuilt, from the pages live at the time


def test_full_after_counts_three_quarters_and_never_while_a_rebuild_waits():
    """docs: full at more than 3/4 of the table; never while an invalidated table waits for its rebuild."""
    t = HashSlots(16)                                   # 2*16-1 = 31 -> 32 positions, 3/4 = 24
    assert t.mask + 1 == 32
    assert not t.full_after(24) and t.full_after(25)
    t.insert(np.array([5, 9], dtype=np.uint64), np.array([1, 2], dtype=np.int64))
    assert not t.full_after(22) and t.full_after(23)    # 2 pending count
    t.invalidate(lambda: (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)))
    assert not t.full_after(1) and not t.full_after(1000)
