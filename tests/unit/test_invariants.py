"""The one invariant checker (kvservice/core/invariants.py) finds each kind of break, in a state and in a live pool.

A sound pool (random non-zero work on a hybrid, prefix-cached pool) has no problem; then one thing is broken
at a time, on a fresh copy, and the problem must be named: in the state (what recovery and check-state see)
and in the live pool (what only the live allocator, rows and cache hold, and an export would not show).
"""

import dataclasses
import re
from types import SimpleNamespace

import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import assert_invariants, check_pool_state, pool_problems
from kvservice.core.planner import plan
from kvservice.core.pool import Pool

PS = 4
SPEC = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 64, sliding_window=8)), PS, "per_layer")


@pytest.fixture(scope="module")
def busy() -> Pool:
    """A pool after random admissions (with token ids), extensions, forks and frees; some pages cached."""
    pool = Pool("p", plan(SPEC, Sizing(num_slots=96, max_seq_len=256)), prefix_caching=True)
    rng = np.random.default_rng(28)
    shared = rng.integers(1, 50_000, 12)
    for i in range(6):
        n = int(rng.integers(5, 30))
        tokens = np.concatenate((shared, rng.integers(1, 50_000, n)))
        pool.step(admit_ids=[i + 1], admit_tokens=[len(tokens)], admit_token_ids=tokens)
    pool.step(extend_ids=[1, 2, 3], extend_tokens=[9, 1, 14])
    pool.step(fork_parents=[2], fork_children=[20])
    pool.step(free_ids=[4, 5])
    assert pool_problems(pool) == []
    return pool


def fresh(pool: Pool) -> Pool:
    return Pool.from_state(pool.export_state(), pool.plan)


def test_a_sound_pool_and_its_copy_have_no_problem(busy):
    twin = fresh(busy)
    assert pool_problems(twin) == [] and check_pool_state(twin.export_state(), twin.plan) == []
    assert_invariants(twin)
    assert any(len(c.by_hash) for c in twin.prefixes)     # the cache checks below have entries to check


def test_a_refcount_that_disagrees_with_the_owners_is_named(busy):
    pool = fresh(busy)
    slot = int(pool.sequence_slots(1, 0)[0])
    pool.allocators[0]._refcnt[slot] += 1                  # export lists the owners, not the refcount
    assert check_pool_state(pool.export_state(), pool.plan) == []
    with pytest.raises(AssertionError, match=r"group 0: refcount != owners at slot \[" + str(slot)):
        assert_invariants(pool)


def test_rows_that_hold_one_page_too_many_and_too_few_are_found(busy):
    """+1 page on one row and -1 on another keep the total: the rows' slots no longer add up."""
    pool = fresh(busy)
    row_a, row_b = pool._row_of(1), pool._row_of(3)
    pool._held[row_a] += 1
    pool._held[row_b] -= 1
    problems = pool_problems(pool)
    assert problems, "a row holding one page too many and another one too few passed"


def test_a_stale_prefix_cache_entry_is_named(busy):
    pool = fresh(busy)
    cache = pool.prefixes[0]
    h, slot = next(iter(cache.by_hash.items()))
    cache.hash[slot] = np.uint64(h ^ 1)
    with pytest.raises(AssertionError, match=re.escape(f"group 0: cache entry {h:#x} -> slot {slot} is stale")):
        assert_invariants(pool)


def test_a_cacheable_flag_without_an_entry_is_named(busy):
    pool = fresh(busy)
    alloc = pool.allocators[0]
    owned = set(pool.sequence_slots(1, 0).tolist())
    slot = next(s for s in sorted(owned) if not alloc.cacheable[s])
    alloc.cacheable[slot] = True
    assert any("cacheable slots" in p for p in pool_problems(pool))


def test_state_level_breaks_are_found_in_the_live_pool_too(busy):
    """A token count out of range: the state check finds it first, and assert_invariants reports it."""
    pool = fresh(busy)
    pool._num_tokens[pool._row_of(2)] = 0
    problems = pool_problems(pool)
    assert problems and "outside 1..max_seq_len" in problems[0]
    with pytest.raises(AssertionError, match=r"outside 1\.\.max_seq_len"):
        assert_invariants(pool)


def test_a_released_page_inside_the_window_is_named(busy):
    pool = fresh(busy)
    row = pool._row_of(6)
    n = int(pool._num_tokens[row])
    first = (n + 1 - 8) // PS + 1                          # the first page the window of 8 tokens still reads
    assert pool._first[1][row] < first <= -(-n // PS)
    pool._first[1][row] = first                            # pages 0..first-1 released: the last one too soon
    problems = pool_problems(pool)
    assert any("inside the sliding window of 8 tokens" in p for p in problems), problems


def test_a_registered_page_on_the_plain_free_stack_is_named(busy):
    """A cached free slot (registered in the prefix cache) moved onto the plain free stack: the free count and
    every other check still hold, the one that says a stacked slot must hold no registered page names it."""
    state = busy.export_state()
    a = dict(state.arrays)
    cached = a["cached/0"]
    assert len(cached) and np.isin(cached, a["prefix/0/slot"]).all()
    moved = int(cached[-1])
    a["cached/0"] = cached[:-1]
    if "cached_stamp/0" in a:
        a["cached_stamp/0"] = a["cached_stamp/0"][:-1]
    a["free_stack/0"] = np.concatenate((a["free_stack/0"], [moved])).astype(np.int64)
    assert check_pool_state(dataclasses.replace(state, arrays=a), busy.plan) == [
        "group 0: a slot on the plain free stack is registered in the prefix cache"]


def test_a_cache_over_another_allocator_does_not_hide_the_next_groups_problems(busy):
    """Each group's prefix cache is checked on its own: group 0's cache wired to group 1's allocator is named,
    and a stale entry of group 1 is still named after it."""
    pool = fresh(busy)
    pool.prefixes[0].allocator = pool.allocators[1]
    cache = pool.prefixes[1]
    h, slot = next(iter(cache.by_hash.items()))
    cache.hash[slot] = np.uint64(h ^ 1)
    problems = pool_problems(pool)
    assert problems[0] == "group 0: prefix cache over another group's allocator"
    assert f"group 1: cache entry {h:#x} -> slot {slot} is stale" in problems


def test_a_free_row_that_is_also_live_is_named(busy):
    """A live sequence's row put on the free rows in place of a free one: the counts still add up, the check
    that free rows are distinct from live ones names it (check-state prints these lines as they are)."""
    state = busy.export_state()
    a = dict(state.arrays)
    assert len(a["free_rows"]) and len(a["rows"])
    a["free_rows"] = a["free_rows"].copy()
    a["free_rows"][0] = a["rows"][1]
    assert check_pool_state(dataclasses.replace(state, arrays=a), busy.plan) == [
        "free rows are out of range, repeated, or also live"]


@pytest.mark.parametrize("hits", ["negative", "missing"])
def test_prefix_hit_counts_that_are_negative_or_missing_are_named(busy, hits):
    """One hit count per group, none negative: a right-length list with a negative count is named too."""
    pool = fresh(busy)
    state = pool.export_state()
    counts = list(state.meta["prefix"]["hits"])
    assert len(counts) == len(pool.plan.geometry.groups)
    if hits == "negative":
        counts[-1] = -7
    else:
        counts = counts[:-1]
    state.meta["prefix"]["hits"] = counts
    assert "prefix cache: hit counts per group are missing or negative" in check_pool_state(state, pool.plan)


def _tables_spy(pool: Pool, bad: bool = False, fail: bool = False) -> SimpleNamespace:
    """Replace pool.tables_for on this pool object; returns what it saw: `ids` of each call and, with `bad`, the
    `spaces` whose first index it moved one page past the pool (an emitter bug the state cannot show); `fail`:
    raise instead (an emitter over a broken pool)."""
    seen, real = SimpleNamespace(ids=[], spaces=[]), pool.tables_for

    def spy(ids, block_table=False):
        seen.ids.append(sorted(np.asarray(ids).tolist()))
        if fail:
            raise IndexError("emitting from a broken pool")
        out = real(ids, block_table)
        if bad:
            out[0].table.indices[0] = pool.plan.geometry.pool_pages + 1
            seen.spaces.append(out[0].space.id)
        return out
    pool.tables_for = spy
    return seen


def test_an_emitted_index_outside_its_space_is_named_when_nothing_else_is_wrong(busy):
    pool = fresh(busy)
    seen = _tables_spy(pool, bad=True)
    problems = pool_problems(pool)
    assert seen.ids == [[1, 2, 3, 6, 20]] and len(seen.spaces) == 1
    assert len(problems) == 1
    assert problems[0].startswith(f"index space {seen.spaces[0]}: [Violation(reason='out_of_bounds', row=")
    assert f"value={pool.plan.geometry.pool_pages + 1}" in problems[0]


def test_emitted_tables_are_not_read_once_another_problem_is_found_nor_for_an_empty_pool(busy):
    """A pool already found broken is not asked for tables (emitting from it may itself fail); a pool with no
    live sequence has none to check."""
    pool = fresh(busy)
    slot = int(pool.sequence_slots(1, 0)[0])
    pool.allocators[0]._refcnt[slot] += 1
    seen = _tables_spy(pool, fail=True)
    assert pool_problems(pool) == [f"group 0: refcount != owners at slot [{slot}]"] and seen.ids == []
    empty = Pool("e", busy.plan, prefix_caching=True)
    seen = _tables_spy(empty, fail=True)
    assert pool_problems(empty) == [] and seen.ids == []
