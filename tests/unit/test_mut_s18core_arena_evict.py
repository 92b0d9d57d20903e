"""kvservice/core/arena.py's zeroed at and above MAPPED_BYTES (the mapped path) against np.zeros, and
kvservice/core/evict.py's LruLeaf.victim driven alone (the generic EvictionPolicy.evict rule: victim, then the
caller removes and unlinks it) against the plain-Python model of tests/unit/test_mut_m29k1_evict.py."""

import numpy as np
import pytest

from kvservice.core.arena import MAPPED_BYTES, zeroed
from kvservice.core.evict import LruLeaf
from tests.unit.test_mut_m29k1_evict import Model


@pytest.mark.parametrize(("shape", "dtype"), [((MAPPED_BYTES // 8,), np.int64), ((3, 1 << 20), np.int32),
                                              ((5, 7, 1 << 15), np.float32), ((1 << 21, 2), np.uint8)])
def test_mapped_store_is_a_writable_zero_array_of_the_shape_and_dtype(shape, dtype):
    want_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert want_bytes >= MAPPED_BYTES                     # the mapped path, not np.zeros
    a = zeroed(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.nbytes == want_bytes
    assert a.flags.c_contiguous and a.flags.writeable
    assert not a.any()
    rng = np.random.default_rng(18)
    idx = tuple(int(rng.integers(0, n)) for n in shape)
    a[idx] = 7
    assert int(a[idx]) == 7 and int(np.count_nonzero(a)) == 1
    b = zeroed(shape, dtype)                              # a fresh mapping: the write above is not seen
    assert not b.any()


def drive_victims(seed: int, num_slots: int) -> int:
    """Random chains registered under in-use pages and released at shared stamps (a parent and its dependant
    released in one step: equal stamps, any slot order), then victims taken one by one as the model says."""
    rng = np.random.default_rng(seed)
    cached_at: dict[int, int] = {}
    pol = LruLeaf(num_slots, cached_at)
    model = Model()
    registered: set[int] = set()
    clock, taken = 0, 0
    for _ in range(200):
        clock += int(rng.integers(0, 2))
        op = int(rng.integers(0, 4))
        in_use = sorted(registered - set(cached_at))
        free = [s for s in range(num_slots) if s not in registered]
        if op == 0 and free:
            chain = [int(s) for s in rng.choice(free, int(rng.integers(1, min(4, len(free)) + 1)), replace=False)]
            root = int(rng.choice(in_use)) if in_use and rng.random() < 0.5 else -1
            links = [(c, p) for c, p in zip(chain, [root, *chain[:-1]], strict=True) if p >= 0]
            if links:
                pol.link(np.array([c for c, _ in links], dtype=np.int64),
                         np.array([p for _, p in links], dtype=np.int64))
                model.parent.update(links)
            registered.update(chain)
        elif op == 1 and in_use:
            rel = [int(s) for s in rng.choice(in_use, int(rng.integers(1, min(6, len(in_use)) + 1)), replace=False)]
            for s in rel:
                cached_at[s] = model.cached[s] = clock
                model.queue.append(s)
            pol.cached(rel, clock)
        elif op == 2 and cached_at:
            for _ in range(int(rng.integers(1, min(3, len(cached_at)) + 1))):
                assert pol.order() == model.order_leaf()
                s = pol.victim()
                assert s == model.victim_leaf()
                del cached_at[s]
                pol.unlink(s)
                del model.cached[s]
                model.queue.remove(s)
                model.forget(s)
                registered.discard(s)
                taken += 1
        elif op == 3 and cached_at:                      # a hit revives a cached page
            s = int(rng.choice(sorted(cached_at)))
            del cached_at[s]
            del model.cached[s]
            model.queue.remove(s)
    return taken


@pytest.mark.parametrize(("seed", "num_slots"), [(1, 16), (2, 40), (3, 64), (4, 100)])
def test_lru_leaf_victim_alone_takes_the_models_leaf(seed, num_slots):
    assert drive_victims(seed, num_slots) > 20


def test_victim_skips_an_older_parent_for_its_leaf_and_falls_back_when_no_leaf_is_cached():
    """Hand-computed: slots 1 <- 5 <- 9 released together at stamp 3, slot 12 at stamp 4: the leaf 9 goes
    first (not 1, the lowest slot of stamp 3), then 5, then 1, then 12. With only a parent cached (its dependant
    in use), the least recently released cached page goes."""
    cached_at: dict[int, int] = {}
    pol = LruLeaf(16, cached_at)
    pol.link(np.array([5, 9], dtype=np.int64), np.array([1, 5], dtype=np.int64))
    cached_at.update({1: 3, 5: 3, 9: 3, 12: 4})
    pol.cached([1, 5, 9], 3)
    pol.cached([12], 4)
    got = []
    for _ in range(4):
        s = pol.victim()
        got.append(s)
        del cached_at[s]
        pol.unlink(s)
    assert got == [9, 5, 1, 12]
    pol.link(np.array([7], dtype=np.int64), np.array([2], dtype=np.int64))   # 7 stays in use under 2
    cached_at.update({2: 6, 11: 8})
    pol.cached([2], 6)
    pol.cached([11], 8)
    assert pol.victim() == 11                            # a leaf first, though 2 is older
    del cached_at[11]
    assert pol.victim() == 2                             # no cached leaf: the oldest cached page
