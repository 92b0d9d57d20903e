"""kvservice/core/pool_codec.py and pool_state.py: a pool as plain data, checked against PoolState's documented
layout (pool_state.py's docstring) and against what was done to the pool (counted here), and a rebuilt pool
that must behave exactly as the original from then on, prefix-cache hits included.

copy_ids: the documented IdRuns form (element i of run k is tops[k] - i) checked against runs found here by a
plain Python scan, on arrays that cross its 1 M-element chunks.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import assert_invariants
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.core.pool_state import IdRuns, as_array, copy_ids

PS = 4
SPEC = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=6), LayerSpec(2, 32)), PS, "per_layer")


def _pool(mode: str, seed: str) -> Pool:
    return Pool("p", plan(SPEC, Sizing(num_slots=80, max_seq_len=64)), prefix_caching=True, model="m-1",
                prefix_hash=mode, prefix_hash_seed=seed)


def _drive(pool: Pool, rng: np.random.Generator) -> tuple[int, int, list[np.ndarray]]:
    """Random steps with prompts, extensions, a fork and frees; (steps done, admissions, prompts admitted)."""
    steps = admitted = 0
    prompts = []
    base = rng.integers(1, 50_000, 40)
    live: list[int] = []
    next_id = 1000
    for i in range(12):
        n = int(rng.integers(PS + 1, 24))
        toks = np.concatenate((base[:n // 2], rng.integers(1, 50_000, n - n // 2))) if i % 2 else base[:n]
        ext = [s for s in live if rng.random() < 0.5]
        kw = {"admit_ids": [next_id], "admit_tokens": [n], "admit_token_ids": toks}
        if ext:
            kw |= {"extend_ids": ext, "extend_tokens": [int(k) for k in rng.integers(1, 3, len(ext))]}
        pool.step(**kw)
        prompts.append(toks)
        live.append(next_id)
        next_id += 1
        steps += 1
        admitted += 1
        if i == 5:
            pool.step(fork_parents=[live[0]], fork_children=[next_id])
            live.append(next_id)
            next_id += 1
            steps += 1
        if i in (3, 8):
            pool.step(free_ids=[live.pop(1)])
            steps += 1
    pool.step(free_ids=[live.pop(2), live.pop(4), live.pop(5)])      # rows left free, reused in order later
    steps += 1
    return steps, admitted, prompts


@pytest.mark.parametrize("mode", ["kvservice", "vllm-sha256-cbor"])
def test_export_holds_the_documented_fields_and_a_rebuilt_pool_behaves_the_same(mode):
    rng = np.random.default_rng(2828)
    seed = f"seed-{int(rng.integers(1, 10**9))}"
    pool = _pool(mode, seed)
    steps, admitted, prompts = _drive(pool, rng)
    with pytest.raises(ResourceExhausted):
        pool.step(admit_ids=list(range(9990, 9996)), admit_tokens=[64] * 6)          # 96 pages of 80
    pool.incarnation = inc = int(rng.integers(1, 10**6))
    pool.events.seq = ev = int(rng.integers(1, 10**6))
    st = pool.export_state()
    m, a = st.meta, st.arrays
    assert (m["incarnation"], m["events_seq"], m["row_capacity"], m["num_rows"]) == \
        (inc, ev, len(pool._num_tokens), pool._num_rows)
    assert (m["steps"], m["admitted"], m["refused"], m["alloc_failures"]) == (steps, admitted, 1, {"out_of_slots": 1})
    assert (m["name"], m["model"], m["prefix_caching"], m["prefix_hash"], m["prefix_hash_seed"], m["sharing"]) == \
        ("p", "m-1", True, mode, seed, True)
    assert (m["num_slots"], m["group_slots"], m["max_seq_len"]) == (80, [80, 80], 64)
    ids, toks = pool.sequences()
    order = np.argsort(a["rows"])
    assert np.array_equal(a["rows"], np.sort(a["rows"]))                  # row order
    assert sorted(a["seq_ids"].tolist()) == ids.tolist()
    by_id = dict(zip(ids.tolist(), toks.tolist(), strict=True))
    assert a["num_tokens"].tolist() == [by_id[s] for s in a["seq_ids"].tolist()]
    for g in range(2):
        want = [pool.sequence_slots(s, g) for s in a["seq_ids"][order].tolist()]
        assert a[f"slots/{g}"].tolist() == np.concatenate(want).tolist()
        assert a[f"first/{g}"].tolist() == [pool.first_page(s, g) for s in a["seq_ids"].tolist()]
        assert sorted(a[f"free_stack/{g}"].tolist() + a[f"cached/{g}"].tolist()) == \
            sorted(pool.allocators[g].free_slots().tolist())
    assert any(int(x) > 0 for x in a["first/1"])                          # the window released pages

    twin = Pool.from_state(st, pool.plan)
    assert (twin.prefix_hash, twin.prefix_hash_seed, twin.model, twin.steps, twin.admitted, twin.refused) == \
        (mode, seed, "m-1", steps, admitted, 1)
    assert (twin.incarnation, twin.events.seq, twin.alloc_failures, twin.name) == (inc, ev, {"out_of_slots": 1}, "p")
    assert_invariants(twin)
    # the same prompts again: the rebuilt pool must find the same cached pages (its hashes are the original's)
    again = {"admit_ids": [5000, 5001], "admit_tokens": [len(prompts[0]), len(prompts[3])],
             "admit_token_ids": np.concatenate((prompts[0], prompts[3]))}
    want, got = pool.step(**again), twin.step(**again)
    assert want.cached_tokens.tolist() == got.cached_tokens.tolist()
    assert int(want.cached_tokens[0]) >= PS
    for ws, gs in zip(want.tables, got.tables, strict=True):
        assert np.array_equal(ws.slot_mapping, gs.slot_mapping)
        assert np.array_equal(ws.table.indices, gs.table.indices)
    ids = pool.sequences()[0]
    nxt = {"free_ids": ids[:1], "extend_ids": ids[1:], "extend_tokens": np.full(len(ids) - 1, 3)}
    want, got = pool.step(**nxt), twin.step(**nxt)
    for ws, gs in zip(want.tables, got.tables, strict=True):
        assert np.array_equal(ws.slot_mapping, gs.slot_mapping)
    mine, theirs = pool.export_state(), twin.export_state()
    assert theirs.meta == mine.meta
    assert sorted(theirs.arrays) == sorted(mine.arrays)
    for key, arr in mine.arrays.items():                   # rows reused in the same order: the same arrays
        assert np.array_equal(as_array(theirs.arrays[key]), as_array(arr)), key


@pytest.mark.parametrize("fast", [True, False])
def test_cached_pages_are_stamped_with_the_step_that_released_them(fast):
    rng = np.random.default_rng(44)
    pool = Pool("c", plan(CacheSpec((LayerSpec(1, 64),), 4, "per_layer"), Sizing(num_slots=64, max_seq_len=64)),
                prefix_caching=True)
    pool._fast = fast                                      # the one-full-group fast path, or the general path
    prompts = [rng.integers(1, 10**6, n) for n in (13, 8, 21)]
    pool.step(admit_ids=[1], admit_tokens=[13], admit_token_ids=prompts[0])             # step 1
    pool.step(admit_ids=[2, 3], admit_tokens=[8, 21], admit_token_ids=np.concatenate(prompts[1:]))   # step 2
    pool.step(extend_ids=[1, 2, 3], extend_tokens=[1, 1, 1])                            # step 3 (no release)
    s2 = pool.sequence_slots(2).tolist()
    pool.step(free_ids=[2])                                                             # step 4
    s1, s3 = pool.sequence_slots(1).tolist(), pool.sequence_slots(3).tolist()
    pool.step(extend_ids=[1], extend_tokens=[2])                                        # step 5
    pool.step(free_ids=[3, 1])                                                          # step 6
    a = pool.export_state().arrays
    # full prompt pages stay cached (the pages past the prompt's full pages are freed outright)
    stamp = dict(zip(a["cached/0"].tolist(), a["cached_stamp/0"].tolist(), strict=True))
    assert {s: stamp[s] for s in s2[:2]} == {s2[0]: 4, s2[1]: 4}
    assert {s: stamp[s] for s in s1[:3] + s3[:5]} == {s: 6 for s in s1[:3] + s3[:5]}
    assert sorted(stamp) == sorted(s2[:2] + s1[:3] + s3[:5])
    assert a["cached_stamp/0"].tolist() == sorted(a["cached_stamp/0"].tolist())           # eviction order: oldest first


def _runs(a: list[int]) -> list[int]:
    """Start index of every run of consecutive descending ids, by a plain scan."""
    return [i for i in range(len(a)) if i == 0 or a[i] != a[i - 1] - 1]


@pytest.mark.parametrize("n", [2**20 + 1, 2**20 + 2**19, 2 * 2**20 + 3])
def test_copy_ids_finds_the_runs_of_a_long_free_stack_across_chunks(n):
    rng = np.random.default_rng(n)
    # a few runs, breaks placed at and around the 1 M chunk edges
    cuts = sorted({int(c) for c in rng.integers(1, n, 5)} | {c for c in (2**20 - 1, 2**20, 2**20 + 1) if c < n})
    a = np.empty(n, dtype=np.int32)
    lo = 0
    for hi in [*cuts, n]:
        a[lo:hi] = int(rng.integers(hi - lo, 10**8)) - np.arange(hi - lo)
        lo = hi
    got = copy_ids(a)
    assert isinstance(got, IdRuns)                      # > 1 M ids, few breaks: kept as runs, not copied
    assert got.n == n and got.starts.dtype == np.int64 and got.tops.dtype == np.int64
    want_starts = _runs(a.tolist())
    assert want_starts == [0, *cuts]
    assert got.starts.tolist() == want_starts
    assert got.tops.tolist() == [int(a[s]) + s for s in want_starts]
    assert np.array_equal(as_array(got), a.astype(np.int64))


def test_copy_ids_copies_short_or_broken_stacks():
    rng = np.random.default_rng(5)
    short = np.arange(2**20, 0, -1, dtype=np.int64)      # one run, but not longer than a chunk
    got = copy_ids(short)
    assert not isinstance(got, IdRuns) and np.array_equal(got, short) and got is not short
    shuffled = rng.permutation(2**20 + 100).astype(np.int32)   # > n / 64 breaks: a plain copy
    got = copy_ids(shuffled)
    assert not isinstance(got, IdRuns) and got.dtype == np.int64 and np.array_equal(got, shuffled)
    assert as_array(got) is got


def test_spec_runs_group_equal_consecutive_layers_and_mark_k_only_runs():
    from kvservice.core.pool_state import spec_runs
    a, b = LayerSpec(1, 64), LayerSpec(1, 576, "bfloat16", k_only=True)
    c, d = LayerSpec(2, 32, sliding_window=13), LayerSpec(1, 576, "bfloat16")      # d: b's shape, not K-only
    spec = CacheSpec((a, a, b, b, b, a, c, c, d, d, b), 4, "per_layer")
    assert spec_runs(spec) == [[1, 64, "float16", 0, 2], [1, 576, "bfloat16", 0, 3, True], [1, 64, "float16", 0, 1],
                               [2, 32, "float16", 13, 2], [1, 576, "bfloat16", 0, 2], [1, 576, "bfloat16", 0, 1, True]]
    pool = Pool("s", plan(spec, Sizing(num_slots=8, max_seq_len=16)))
    assert pool.export_state().meta["spec"] == {"page_size": 4, "layout": "per_layer", "layers": spec_runs(spec)}


@pytest.mark.parametrize("extra", [0, 1])
def test_copy_ids_keeps_runs_up_to_one_break_in_64_ids(extra):
    n = 2**20 + 640
    k = n // 64 + extra                                   # breaks: at most n // 64 are kept as runs
    starts = np.linspace(0, n, k + 1, endpoint=False).astype(np.int64)[1:]
    assert len(set(starts.tolist())) == k
    a = np.empty(n, dtype=np.int64)
    bounds = [0, *starts.tolist(), n]
    for j, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        a[lo:hi] = (j + 1) * 10**7 - np.arange(hi - lo)     # each run far from the next: every start a break
    got = copy_ids(a)
    assert np.array_equal(as_array(got), a)
    assert isinstance(got, IdRuns) == (extra == 0)
    if not extra:
        assert got.starts.tolist() == bounds[:-1]


def test_a_state_from_before_event_numbers_and_hash_seeds_restores_their_defaults():
    pool = _pool("kvservice", "vllm-none-hash")
    pool.step(admit_ids=[1], admit_tokens=[9], admit_token_ids=np.arange(1, 10))
    st = pool.export_state()
    for key in ("events_seq", "prefix_hash", "prefix_hash_seed", "incarnation", "model"):
        del st.meta[key]
    twin = Pool.from_state(st, pool.plan)
    assert (twin.events.seq, twin.prefix_hash, twin.prefix_hash_seed, twin.incarnation, twin.model) == \
        (0, "kvservice", "vllm-none-hash", 0, "")
    assert_invariants(twin)
