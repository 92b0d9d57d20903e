"""check_pool_state against one break at a time of a sound state: each break is named by exactly the documented
problem line(s) (check-state prints them as they are), and nothing else; the sound state and small pools at the
edge of each bound have no problem. The pool: random admissions with token ids, extensions, a fork and frees on a
full-attention + sliding-window pool with prefix caching (as tests/unit/test_invariants.py builds it)."""

import copy
import dataclasses

import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import _repeats, assert_invariants, check_pool_state, pool_problems
from kvservice.core.planner import plan
from kvservice.core.pool import Pool

PS = 4
SPEC = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 64, sliding_window=8)), PS, "per_layer")
NUM_SLOTS, MAX_LEN = 96, 256


@pytest.fixture(scope="module")
def busy() -> Pool:
    pool = Pool("p", plan(SPEC, Sizing(num_slots=NUM_SLOTS, max_seq_len=MAX_LEN)), prefix_caching=True)
    rng = np.random.default_rng(2929)
    shared = rng.integers(1, 50_000, 12)
    for i in range(6):
        tokens = np.concatenate((shared, rng.integers(1, 50_000, int(rng.integers(5, 30)))))
        pool.step(admit_ids=[i + 1], admit_tokens=[len(tokens)], admit_token_ids=tokens)
    pool.step(extend_ids=[1, 2, 3], extend_tokens=[9, 1, 14])
    pool.step(free_ids=[4, 5])
    assert pool_problems(pool) == []
    return pool


def broken(pool: Pool, change) -> list[str]:
    state = pool.export_state()
    a = {k: v.copy() for k, v in state.arrays.items()}
    m = copy.deepcopy(state.meta)
    change(m, a)
    return check_pool_state(dataclasses.replace(state, arrays=a, meta=m), pool.plan)


def set_at(key, i, value):
    def change(m, a):
        a[key][i] = value
    return change


def test_a_sound_state_has_no_problem(busy):
    assert broken(busy, lambda m, a: None) == []


def test_row_breaks_are_named(busy):
    st = busy.export_state()
    num_rows, num = int(st.meta["num_rows"]), len(st.arrays["seq_ids"])
    free = len(st.arrays["free_rows"])
    assert num >= 2 and free >= 1
    rows_msg = "sequence rows are not distinct, sorted and below num_rows"
    free_msg = "free rows are out of range, repeated, or also live"
    assert broken(busy, set_at("seq_ids", 1, int(st.arrays["seq_ids"][0]))) == ["a sequence id is live twice"]
    assert broken(busy, set_at("rows", 0, -1)) == [rows_msg]
    assert broken(busy, set_at("rows", -1, num_rows)) == [rows_msg]
    assert broken(busy, set_at("rows", 1, int(st.arrays["rows"][0]))) == [rows_msg]
    assert broken(busy, set_at("free_rows", 0, -1)) == [free_msg]
    assert broken(busy, set_at("free_rows", 0, num_rows)) == [free_msg]
    if free >= 2:
        assert broken(busy, set_at("free_rows", 1, int(st.arrays["free_rows"][0]))) == [free_msg]

    def cap(c):
        def change(m, a):
            m["row_capacity"] = c
        return change
    count = f"{num} live + {free} free rows != num_rows {num_rows}, or row capacity "
    top = max(16, 2 * num_rows)
    assert broken(busy, cap(top)) == [] and broken(busy, cap(num_rows)) == []
    assert broken(busy, cap(top + 1)) == [count + f"{top + 1} is off"]
    assert broken(busy, cap(num_rows - 1)) == [count + f"{num_rows - 1} is off"]

    def drop_free(m, a):
        a["free_rows"] = a["free_rows"][1:]
    assert broken(busy, drop_free) == [f"{num} live + {free - 1} free rows != num_rows {num_rows}, or row capacity "
                                       f"{int(st.meta['row_capacity'])} is off"]


def test_token_counts_out_of_range_stop_the_check_there(busy):
    n = busy.export_state().arrays["num_tokens"]
    lo, hi = int(n[1:].min()), int(n[1:].max())
    assert broken(busy, set_at("num_tokens", 0, MAX_LEN + 1)) == [
        f"a sequence holds {lo}..{MAX_LEN + 1} tokens, outside 1..max_seq_len={MAX_LEN}"]
    assert broken(busy, set_at("num_tokens", 0, 0)) == [
        f"a sequence holds 0..{hi} tokens, outside 1..max_seq_len={MAX_LEN}"]


def test_group_breaks_are_named(busy):
    st = busy.export_state()
    a = st.arrays
    n = a["num_tokens"]
    held = -(-n // PS)
    assert broken(busy, set_at("generation/0", 3, 2**32)) == [
        f"group 0: slot generations are not {NUM_SLOTS} values in [0, 2^32)"]
    assert broken(busy, set_at("generation/1", 0, -1)) == [
        f"group 1: slot generations are not {NUM_SLOTS} values in [0, 2^32)"]
    assert broken(busy, set_at("generation/0", 3, 2**32 - 1)) == []
    assert broken(busy, set_at("first/1", 0, int(held[0]) + 1)) == ["group 1: a first held page is outside [0, held]"]
    assert broken(busy, set_at("first/0", 0, -1)) == ["group 0: a first held page is outside [0, held]"]
    total = int((held - a["first/0"]).sum())
    assert broken(busy, set_at("first/0", 0, 1)) == [
        "group 0: a full-attention group released pages", f"group 0: {total} slots for {total - 1} held pages"]
    assert broken(busy, set_at("slots/0", 0, NUM_SLOTS)) == [f"group 0: a slot id is outside [0, {NUM_SLOTS})"]
    assert broken(busy, set_at("slots/1", 0, -1)) == [f"group 1: a slot id is outside [0, {NUM_SLOTS})"]
    stack = a["free_stack/0"]
    assert len(stack) >= 2

    def free_twice(m, a):
        a["free_stack/0"] = np.concatenate((a["free_stack/0"], a["free_stack/0"][:1]))
    owned = int(np.count_nonzero(np.bincount(a["slots/0"], minlength=NUM_SLOTS)))
    nfree = len(stack) + len(a["cached/0"])
    assert broken(busy, free_twice) == ["group 0: a slot is free twice",
                                        f"group 0: {nfree + 1} free + {owned} owned != {NUM_SLOTS} slots"]
    own = int(a["slots/0"][0])

    def owned_and_free(m, a):
        a["free_stack/0"] = a["free_stack/0"].copy()
        a["free_stack/0"][0] = own
    # the counts still add up (a free slot left the stack); an owned prompt page is registered in the cache
    assert own in a["prefix/0/slot"]
    assert broken(busy, owned_and_free) == [f"group 0: a free slot is also owned (slot {own})",
                                            "group 0: a slot on the plain free stack is registered in the prefix cache"]

    def meta(key, value, g=0):
        def change(m, a):
            m["groups"][g][key] = value
        return change
    used = NUM_SLOTS - nfree
    assert broken(busy, meta("peak_used", used)) == []
    assert broken(busy, meta("peak_used", used - 1)) == ["group 0: peak use or eviction count is impossible"]
    assert broken(busy, meta("evictions", -1)) == ["group 0: peak use or eviction count is impossible"]
    if len(a["cached/0"]):
        assert broken(busy, set_at("cached_stamp/0", 0, -1)) == [
            f"group 0: {len(a['cached/0'])} release stamps for {len(a['cached/0'])} cached slots, or a negative one"]


def test_counters_and_prefix_breaks_are_named(busy):
    a = busy.export_state().arrays
    for counter in ("steps", "admitted", "refused"):
        def neg(m, a, counter=counter):
            m[counter] = -1
        assert broken(busy, neg) == ["a counter is negative"]
    e = len(a["prefix/0/slot"])
    assert e >= 2
    assert broken(busy, set_at("prefix/0/hash", 1, 0)) == [
        "group 0: prefix cache slots out of range or repeated, or hashes zero or repeated"]
    assert broken(busy, set_at("prefix/0/hash", 1, int(a["prefix/0/hash"][0]))) == [
        "group 0: prefix cache slots out of range or repeated, or hashes zero or repeated"]
    assert broken(busy, set_at("prefix/0/namespace", 0, 99)) == [
        "group 0: a prefix-cache namespace, parent or anchor slot is out of range"]
    assert broken(busy, set_at("prefix/0/parent", 0, -3)) == [
        "group 0: a prefix-cache namespace, parent or anchor slot is out of range"]
    assert broken(busy, set_at("prefix/0/parent", 0, -1)) == []

    def short(m, a):
        a["prefix/0/anchor"] = a["prefix/0/anchor"][1:]
    assert broken(busy, short) == ["group 0: prefix cache arrays differ in length or page size"]

    def spaces(m, a):
        m["prefix"]["namespaces"] = [[s, k, i + 1] for s, k, i in m["prefix"]["namespaces"]]
    assert broken(busy, spaces) == ["prefix cache: namespace ids are not 0..K-1"]


def test_repeats_is_any_value_twice():
    rng = np.random.default_rng(5)
    for n in range(6):
        a = rng.permutation(50)[:n]
        assert _repeats(a) is False
        if n:
            assert _repeats(np.concatenate((a, a[-1:]))) is True
    assert _repeats(np.array([7])) is False and _repeats(np.zeros(0, dtype=np.int64)) is False


def test_a_lost_free_slot_and_a_parent_below_minus_one_are_named(busy):
    a = busy.export_state().arrays
    owned = int(np.count_nonzero(np.bincount(a["slots/0"], minlength=NUM_SLOTS)))
    nfree = len(a["free_stack/0"]) + len(a["cached/0"])

    def lose(m, a):
        a["free_stack/0"] = a["free_stack/0"][1:]
    assert broken(busy, lose) == [f"group 0: {nfree - 1} free + {owned} owned != {NUM_SLOTS} slots"]
    assert broken(busy, set_at("prefix/1/parent", 0, -2)) == [
        "group 1: a prefix-cache namespace, parent or anchor slot is out of range"]
    assert broken(busy, set_at("prefix/0/anchor", 0, -2)) == [
        "group 0: a prefix-cache namespace, parent or anchor slot is out of range"]


def test_a_live_cache_entry_on_a_slot_that_is_not_cacheable_is_stale(busy):
    """The entry's hash matches its slot but the allocator does not hold the slot as cacheable: stale, and the
    count of cacheable slots no longer matches the entries."""
    pool = Pool.from_state(busy.export_state(), busy.plan)
    cache, alloc = pool.prefixes[0], pool.allocators[0]
    h, slot = next(iter(cache.by_hash.items()))
    assert int(cache.hash[slot]) == h and alloc.cacheable[slot]
    n = int(alloc.cacheable.sum())
    alloc.cacheable[slot] = False
    assert pool_problems(pool) == [f"group 0: cache entry {h:#x} -> slot {slot} is stale",
                                   f"group 0: {n - 1} cacheable slots, {n} cache entries"]


def test_the_arrays_must_be_exactly_the_expected_names_dtypes_and_ranks(busy):
    def drop(m, a):
        del a["first/1"]

    def extra(m, a):
        a["zz/extra"] = np.zeros(3, dtype=np.int64)

    def narrow(m, a):
        a["rows"] = a["rows"].astype(np.int32)

    def rank2(m, a):
        a["num_tokens"] = a["num_tokens"].reshape(-1, 1)

    def version(m, a):
        m["version"] = 99
    assert broken(busy, drop) == ["arrays ['first/1'] missing or unexpected"]
    assert broken(busy, extra) == ["arrays ['zz/extra'] missing or unexpected"]
    assert broken(busy, narrow) == ["array rows is int32 with 1 dims, expected int64 with 1"]
    assert broken(busy, rank2) == ["array num_tokens is int64 with 2 dims, expected int64 with 1"]
    got = broken(busy, version)
    assert len(got) == 1 and got[0].startswith("pool state version 99 is not one of ")


def test_cached_slots_need_a_registered_page_and_a_prefix_cache(busy):
    a = busy.export_state().arrays
    cached = a["cached/0"]
    assert len(cached)
    gone = int(np.flatnonzero(a["prefix/0/slot"] == cached[0])[0])

    def unregister(m, a):
        for k in [k for k in a if k.startswith("prefix/0/")]:
            a[k] = np.delete(a[k], gone, axis=0)
    assert broken(busy, unregister) == ["group 0: a cached free slot holds no registered page"]

    def no_cache(m, a):
        m["prefix_caching"] = False
        for k in [k for k in a if k.startswith("prefix/")]:
            del a[k]
    want = [f"group {g}: cached free slots without a prefix cache" for g in (0, 1) if len(a[f"cached/{g}"])]
    assert want and broken(busy, no_cache) == want


def test_at_most_twelve_problems_are_listed_in_the_order_checked(busy):
    st = busy.export_state()
    a0 = st.arrays

    def many(m, a):
        a["seq_ids"][1] = a["seq_ids"][0]
        a["rows"][0], a["rows"][1] = a["rows"][1], a["rows"][0]
        a["free_rows"][0] = -1
        m["row_capacity"] = 10**6
        a["generation/0"][0] = -1
        a["first/0"][0] = 1
        a["generation/1"][0] = -1
        a["first/1"][0] = 10**4
        m["prefix"]["namespaces"] = [[s, k, i + 5] for s, k, i in m["prefix"]["namespaces"]]
        m["prefix"]["hits"] = [-1] * len(m["prefix"]["hits"])
        a["prefix/0/hash"][0] = 0
        a["prefix/1/namespace"][0] = 99
        m["steps"] = -1
    got = broken(busy, many)
    num, free, num_rows = len(a0["seq_ids"]), len(a0["free_rows"]), int(st.meta["num_rows"])
    held0 = int((-(-a0["num_tokens"] // PS)).sum())
    assert got == [
        "a sequence id is live twice", "sequence rows are not distinct, sorted and below num_rows",
        "free rows are out of range, repeated, or also live",
        f"{num} live + {free} free rows != num_rows {num_rows}, or row capacity {10**6} is off",
        f"group 0: slot generations are not {NUM_SLOTS} values in [0, 2^32)",
        "group 0: a full-attention group released pages", f"group 0: {held0} slots for {held0 - 1} held pages",
        f"group 1: slot generations are not {NUM_SLOTS} values in [0, 2^32)",
        "group 1: a first held page is outside [0, held]", "prefix cache: namespace ids are not 0..K-1",
        "prefix cache: hit counts per group are missing or negative",
        "group 0: prefix cache slots out of range or repeated, or hashes zero or repeated"]


def test_assert_invariants_names_the_first_problem_and_the_next_two(busy):
    pool = Pool.from_state(busy.export_state(), busy.plan)
    cache, alloc = pool.prefixes[0], pool.allocators[0]
    h, slot = next(iter(cache.by_hash.items()))
    n = int(alloc.cacheable.sum())
    alloc.cacheable[slot] = False
    with pytest.raises(AssertionError) as err:
        assert_invariants(pool)
    assert str(err.value) == (f"group 0: cache entry {h:#x} -> slot {slot} is stale (and 1 more: group 0: {n - 1} "
                              f"cacheable slots, {n} cache entries)")
