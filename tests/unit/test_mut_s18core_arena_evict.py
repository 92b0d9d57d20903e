"""kvservice/core/arena.py's zeroed at and above MAPPED_BYTES (the mapped path) against np.zeros, and
kvservice/core/evict.py's LruLeaf.victim driven alone (the generic EvictionPolicy.evict rule: victim, then the
caller removes and unlinks it) against the plain-Python model of tests/unit/test_mut_m29k1_evict.py."""

import mmap
import re
import sys

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


def memory_owner(a: np.ndarray) -> object:
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
def test_the_mapped_threshold_is_mapped_bytes_exactly(dtype):
    """The module's rule: arrays of at least MAPPED_BYTES bytes are mapped, one element fewer come from np.zeros
    (an ndarray owning its memory)."""
    item = np.dtype(dtype).itemsize
    at = zeroed((MAPPED_BYTES // item,), dtype)
    below = zeroed((MAPPED_BYTES // item - 1,), dtype)
    assert isinstance(memory_owner(at), mmap.mmap)
    assert isinstance(memory_owner(below), np.ndarray) and memory_owner(below).base is None
    two_d = zeroed((2, MAPPED_BYTES // item // 2), dtype)
    assert isinstance(memory_owner(two_d), mmap.mmap) and two_d.shape == (2, MAPPED_BYTES // item // 2)
    for a in (at, below, two_d):
        assert not a.any()


@pytest.mark.parametrize("shape", [(0,), (0, 512), (7, 0, 3), (), (3, 5), (1031, 3)])
@pytest.mark.parametrize("dtype", [np.int64, np.float32, np.uint8, np.int16])
def test_small_empty_and_scalar_shapes_are_as_np_zeros(shape, dtype):
    a = zeroed(shape, dtype)
    want = np.zeros(shape, dtype=dtype)
    assert a.shape == want.shape and a.dtype == want.dtype and a.size == want.size and not a.any()
    assert a.flags.c_contiguous and a.flags.writeable


@pytest.mark.parametrize("shape", [(4, -1), (-3,), (MAPPED_BYTES, -2)])
def test_a_negative_dimension_is_refused_with_the_shape(shape):
    bad = next(n for n in shape if n < 0)
    with pytest.raises(ValueError, match=re.escape(f"zeroed: negative dimension {bad} in shape {shape}")):
        zeroed(shape, np.int64)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")
def test_the_mapping_is_private_and_anonymous():
    """A private ("p"), writable, anonymous (no file) mapping: nothing another process maps sees its writes."""
    a = zeroed((MAPPED_BYTES // 8 * 2,), np.int64)
    a[len(a) // 2] = 5
    addr = a[len(a) // 2:].ctypes.data
    with open("/proc/self/maps") as f:
        rows = [line.split() for line in f]
    row = next(r for r in rows if int(r[0].split("-")[0], 16) <= addr < int(r[0].split("-")[1], 16))
    assert row[1].startswith("rw") and row[1][3] == "p"
    assert len(row) == 5 or not row[5].startswith("/")   # no backing file


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


@pytest.mark.parametrize(("seed", "num_slots"), [(1, 16), (2, 40), (3, 64), (4, 100), (5, 17), (6, 9), (7, 33)])
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


@pytest.mark.parametrize("k", [1, 3, 4, 6, 10])
def test_the_highest_slot_of_a_pool_just_past_a_power_of_two_keeps_its_own_stamp(k):
    """num_slots = 2^k + 1: slot 2^k released at clock 1 goes before slot 0 released at clock 2, and before
    slot 1 released at clock 1 too (ties: the lower slot, so 1 first); both through victim() and evict()."""
    top = 1 << k
    for take in ("victim", "evict"):
        cached_at = {top: 1, 1: 1, 0: 2}
        pol = LruLeaf(top + 1, cached_at)
        pol.cached([top, 1], 1)
        pol.cached([0], 2)
        assert pol.order() == [1, top, 0]
        got = []
        for _ in range(3):
            s = pol.victim() if take == "victim" else pol.evict(1)[0]
            if take == "victim":
                del cached_at[s]
            got.append(s)
        assert got == [1, top, 0]
