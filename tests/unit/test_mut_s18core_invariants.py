"""check_pool_state's release-stamp rule on the busy pool of tests/unit/test_mut_m29k1_invariants.py: a stamp
is an allocator clock value, which starts at 0 (kvservice/core/allocator.py) and only grows, so 0 is a sound
stamp and only a negative one (or a count that differs from the cached slots') is named, per group."""

import dataclasses

import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import check_pool_state
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from tests.unit.test_mut_m29k1_invariants import broken, busy  # noqa: F401  (busy: the module's pool fixture)


def stamp_problem(g: int, stamps: int, cached: int) -> str:
    return f"group {g}: {stamps} release stamps for {cached} cached slots, or a negative one"


def test_zero_stamps_are_sound_negative_or_miscounted_ones_are_named(busy):  # noqa: F811
    a = busy.export_state().arrays
    rng = np.random.default_rng(18)
    groups = [g for g in (0, 1) if len(a[f"cached/{g}"])]
    assert groups == [0, 1], "both groups of the busy pool hold cached free slots"
    for g in groups:
        key, c = f"cached_stamp/{g}", len(a[f"cached/{g}"])

        def zero(m, a, key=key):
            a[key] = np.zeros_like(a[key])
        assert broken(busy, zero) == []

        i = int(rng.integers(0, c))

        def one_zero(m, a, key=key, i=i):
            a[key] = a[key].copy()
            a[key][: i + 1] = 0                          # some at clock 0, the others as they were
        assert broken(busy, one_zero) == []

        j = int(rng.integers(0, c))

        def negative(m, a, key=key, i=j):
            a[key] = np.minimum(a[key], 0)
            a[key][: i + 1] = -1
        assert broken(busy, negative) == [stamp_problem(g, c, c)]

        def short(m, a, key=key):
            a[key] = a[key][1:]
        assert broken(busy, short) == [stamp_problem(g, c - 1, c)]

        def missing(m, a, key=key):
            del a[key]                                   # an older state without stamps: nothing to check
        assert broken(busy, missing) == []


def released_state(pool, f: int):
    """The one sequence's state with its first f pages of the sliding group (group 1) released to the free stack."""
    state = pool.export_state()
    a = {k: v.copy() for k, v in state.arrays.items()}
    a["free_stack/1"] = np.concatenate((a["free_stack/1"], a["slots/1"][:f]))
    a["slots/1"] = a["slots/1"][f:]
    a["first/1"] = np.array([f], dtype=a["first/1"].dtype)
    return dataclasses.replace(state, arrays=a)


@pytest.mark.parametrize(("w", "seed"), [(8, 1), (5, 2), (3, 3), (1, 4), (13, 5)])
def test_released_pages_up_to_the_design_bound_are_sound_one_more_is_named(w, seed):
    """docs/DESIGN.md invariant 3: a sliding group of window w holds pages from `first` on, with
    first * page_size <= n + 1 - w. Every first up to that bound (and up to the held pages) is sound; one page
    more is named: inside the window while pages are held, outside [0, held] past them. Every n from below the
    window to three pages past it, so that n + 1 - w meets each page boundary."""
    ps = 4
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 64, sliding_window=w)), ps, "per_layer")
    rng = np.random.default_rng(seed)
    for n in range(max(1, w - 2), w + 3 * ps + 1):
        pool = Pool("p", plan(spec, Sizing(num_slots=48, max_seq_len=160)))
        pool.step(admit_ids=[int(rng.integers(1, 1000))], admit_tokens=[n])
        held = -(-n // ps)
        bound = min(held, max(0, n + 1 - w) // ps)             # the largest first DESIGN.md allows
        for f in range(bound + 1):
            assert check_pool_state(released_state(pool, f), pool.plan) == [], (n, f)
        if bound < held:
            assert check_pool_state(released_state(pool, bound + 1), pool.plan) == [
                f"group 1: a page still inside the sliding window of {w} tokens was released"], (n, bound + 1)
        state = pool.export_state()
        a = {**state.arrays, "first/1": np.array([held + 1])}
        assert check_pool_state(dataclasses.replace(state, arrays=a), pool.plan) == [
            "group 1: a first held page is outside [0, held]"]


def test_every_page_released_at_window_one_is_sound():
    """Window 1 and n a multiple of the page size: n + 1 - 1 = n, so first may reach held (no page kept)."""
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 64, sliding_window=1)), 4, "per_layer")
    pool = Pool("p", plan(spec, Sizing(num_slots=16, max_seq_len=64)))
    pool.step(admit_ids=[7], admit_tokens=[12])
    assert check_pool_state(released_state(pool, 3), pool.plan) == []


def test_prefix_parent_and_anchor_bounds_are_exact(busy):  # noqa: F811
    """A parent is -1 or a slot of its group ([-1, num_slots)); an anchor is -1 or below the largest group's
    slot count: the last value inside each bound is sound, the first outside is named."""
    from tests.unit.test_mut_m29k1_invariants import NUM_SLOTS, set_at
    largest = busy.plan.num_slots
    assert largest == NUM_SLOTS
    for g in (0, 1):
        named = [f"group {g}: a prefix-cache namespace, parent or anchor slot is out of range"]
        for key, top in ((f"prefix/{g}/parent", NUM_SLOTS), (f"prefix/{g}/anchor", largest)):
            for i in (0, len(busy.export_state().arrays[key]) - 1):
                assert broken(busy, set_at(key, i, -1)) == []
                assert broken(busy, set_at(key, i, top - 1)) == []
                assert broken(busy, set_at(key, i, top)) == named
                assert broken(busy, set_at(key, i, -2)) == named


def test_a_sequence_of_exactly_max_seq_len_tokens_is_sound():
    """The token-count bound is 1..max_seq_len inclusive: a sequence filled to max_seq_len breaks nothing."""
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 64, sliding_window=8)), 4, "per_layer")
    pool = Pool("p", plan(spec, Sizing(num_slots=64, max_seq_len=48)), prefix_caching=True)
    rng = np.random.default_rng(18)
    pool.step(admit_ids=[3], admit_tokens=[40], admit_token_ids=rng.integers(1, 30_000, 40))
    pool.step(extend_ids=[3], extend_tokens=[8])
    assert int(pool.export_state().arrays["num_tokens"][0]) == 48
    assert check_pool_state(pool.export_state(), pool.plan) == []
    state = pool.export_state()
    over = {**state.arrays, "num_tokens": np.array([49])}
    assert check_pool_state(dataclasses.replace(state, arrays=over), pool.plan) == [
        "a sequence holds 49..49 tokens, outside 1..max_seq_len=48"]
    empty = {**state.arrays, "num_tokens": np.array([0])}
    assert check_pool_state(dataclasses.replace(state, arrays=empty), pool.plan) == [
        "a sequence holds 0..0 tokens, outside 1..max_seq_len=48"]


def test_refcounts_off_at_many_slots_name_the_first_five(busy):  # noqa: F811
    """pool_problems on a live copy whose allocator counts one owner too many on seven owned slots of group 0:
    the problem names the five lowest of them."""
    from kvservice.core.invariants import pool_problems
    pool = Pool.from_state(busy.export_state(), busy.plan)
    owned = np.unique(busy.export_state().arrays["slots/0"])
    rng = np.random.default_rng(5)
    off = np.sort(rng.choice(owned, 7, replace=False))
    pool.allocators[0]._refcnt[off] += 1
    assert pool_problems(pool) == [f"group 0: refcount != owners at slot {off[:5].tolist()}"]
