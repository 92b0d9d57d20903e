"""A Step's phases (pool_validate, pool_plan, pool_commit) and fast paths (fastpaths.py) on cases chosen to
reach each of them, against the reference model (tests/refmodel.py through tests/differential.py's replay),
against a twin pool whose fast paths are off, and against refusal messages written out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import AlreadyExists, InvalidArgument, NotFound
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import assert_invariants
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from tests.differential import KINDS, Kind, replay
from tests.refmodel import Step


def _state(pool: Pool) -> tuple:
    ids, toks = pool.sequences()
    slots = [[pool.sequence_slots(i, g).tolist() for g in range(len(pool.allocators))] for i in ids.tolist()]
    return (ids.tolist(), toks.tolist(), slots, [a.num_free for a in pool.allocators],
            [a.free_slots().tolist() for a in pool.allocators], pool.steps, pool.admitted)


def _one_group_pool(fast: bool = True) -> Pool:
    pool = Pool("p", plan(CacheSpec((LayerSpec(2, 64),) * 2, 4, "per_layer"), Sizing(num_slots=64, max_seq_len=40)))
    pool._fast = fast
    return pool


@pytest.mark.parametrize("step, exc, message", [
    ({"fork_parents": [1, 2], "fork_children": [9]}, InvalidArgument,
     "fork_parent_ids has 2 entries, fork_child_ids 1"),
    ({"fork_parents": np.zeros(0, dtype=np.int64), "fork_children": [9, 10, 11]}, InvalidArgument,
     "fork_parent_ids has 0 entries, fork_child_ids 3"),
    ({"extend_ids": [1, 2], "extend_tokens": [1]}, InvalidArgument,
     "extend_num_tokens has 1 entries for 2 sequence ids"),
    ({"admit_ids": [5], "admit_tokens": [0]}, InvalidArgument,
     "admit_num_tokens must be > 0 tokens per sequence, got 0"),
    ({"extend_ids": [1, 1], "extend_tokens": [1, 1]}, InvalidArgument,
     "sequence 1 appears more than once in one step; each sequence may be freed, extended, admitted or created by "
     "a fork once per step"),
    ({"extend_ids": [1, 2], "extend_tokens": [1, 1], "fork_parents": [1, 2], "fork_children": [9, 9]},
     InvalidArgument, "sequence 9 appears more than once in one step; each sequence may be freed, extended, "
     "admitted or created by a fork once per step"),                # the last batch again, with forks
    ({"free_ids": [2], "extend_ids": [2], "extend_tokens": [1]}, InvalidArgument,
     "sequence 2 appears more than once in one step; each sequence may be freed, extended, admitted or created by "
     "a fork once per step"),
    ({"extend_ids": [7], "extend_tokens": [1]}, NotFound, "extend_seq_ids: sequence 7 is not in pool 'p'"),
    ({"free_ids": [8]}, NotFound, "free_seq_ids: sequence 8 is not in pool 'p'"),
    ({"fork_parents": [6], "fork_children": [9]}, NotFound, "fork_parent_ids: sequence 6 is not in pool 'p'"),
    ({"admit_ids": [2], "admit_tokens": [3]}, AlreadyExists, "sequence 2 is already in pool 'p'"),
    ({"fork_parents": [1], "fork_children": [2]}, AlreadyExists, "sequence 2 is already in pool 'p'"),
    ({"free_ids": [1], "fork_parents": [1], "fork_children": [9]}, InvalidArgument,
     "fork parent 1 is freed in the same step"),
    ({"free_ids": [2], "fork_parents": [1, 2], "fork_children": [9, 10]}, InvalidArgument,
     "fork parent 2 is freed in the same step"),
    ({"extend_ids": [2, 1], "extend_tokens": [1, 30]}, InvalidArgument,
     "extend: sequence 1 would hold 41 tokens; pool 'p' takes at most max_seq_len=40"),
    ({"admit_ids": [3, 4], "admit_tokens": [40, 41]}, InvalidArgument,
     "admit: sequence 4 would hold 41 tokens; pool 'p' takes at most max_seq_len=40"),
    ({"admit_ids": [3], "admit_tokens": [4], "admit_token_ids": [1, 2, 3, 4]}, InvalidArgument,
     "pool 'p' was created without prefix caching; admit_token_ids are not accepted"),
    ({"extend_ids": [1], "extend_tokens": [1], "admit_salts": ["x"]}, InvalidArgument,
     "admit_cache_salts given for a step with no admissions; send it only with admit_seq_ids (one entry per "
     "admission, token ids: their sum)"),
])
@pytest.mark.parametrize("fast", [True, False])
def test_refused_steps_name_the_problem_and_change_nothing(step, exc, message, fast):
    pool = _one_group_pool(fast)
    pool.step(admit_ids=[1, 2], admit_tokens=[10, 5])
    pool.step(extend_ids=[1, 2], extend_tokens=[1, 1])      # an extend-only batch: the next may repeat it
    before = _state(pool)
    with pytest.raises(exc) as e:
        pool.step(**step)
    assert e.value.message == message
    assert _state(pool) == before
    assert_invariants(pool)


@pytest.mark.parametrize("kind", ["uniform", "interleaved", "sliding", "hybrid"])
@pytest.mark.parametrize("fast", [True, False])
def test_repeated_permuted_and_shrunk_decode_batches_match_the_model(kind, fast):
    ops = [Step(adm=[(1, 9), (2, 3), (3, 14)]),
           *[Step(ext=[(1, 1), (2, 1), (3, 1)]) for _ in range(6)],          # the same batch again and again
           Step(ext=[(3, 1), (1, 1), (2, 1)]),                               # the same ids in another order
           *[Step(ext=[(3, 2), (1, 1), (2, 5)]) for _ in range(3)],          # repeated, other counts
           Step(ext=[(3, 1), (1, 1)]),                                        # a shorter batch
           Step(ext=[(3, 1), (2, 1)]),                                        # same length, another id
           Step(ext=[(3, 1), (2, 1)], tables=False),
           Step(free=[2], ext=[(3, 1)]),
           Step(ext=[(3, 1), (1, 1)]),
           Step(adm=[(2, 4)], ext=[(3, 1), (1, 1)]),                          # id 2 again, another row maybe
           *[Step(ext=[(3, 1), (1, 1), (2, 1)], block_table=True) for _ in range(3)]]
    replay(KINDS[kind], ops, fast=fast)


@pytest.mark.parametrize("fast", [True, False])
def test_freeing_parents_with_their_forks_in_one_step_matches_the_model(fast):
    # one full-attention group: frees go through the fast path's counted release (slots owned several times)
    ops = [Step(adm=[(1, 10), (2, 7)]),
           Step(forks=[(1, 3), (1, 4)]),
           Step(forks=[(3, 5), (2, 6)]),
           Step(ext=[(2, 3)]),
           Step(free=[1, 3, 5]),                      # every owner of 1's full pages but 4 at once
           Step(free=[4], adm=[(7, 12)]),
           Step(forks=[(7, 8)]),
           Step(free=[7, 8, 6, 2], adm=[(9, 20)]),     # all at once, with an admission
           Step(free=[9])]
    replay(KINDS["uniform"], ops, fast=fast)
    replay(KINDS["interleaved"], ops, fast=fast)
    pool = _one_group_pool(fast)
    pool.step(admit_ids=[1], admit_tokens=[10])
    pool.step(fork_parents=[1, 1], fork_children=[2, 3])
    pool.step(free_ids=[1, 2])
    assert pool.num_free_slots == 64 - 3 and pool.sequence_slots(3).tolist() == pool.sequence_slots(3).tolist()
    pool.step(free_ids=[3])
    assert pool.num_free_slots == 64
    assert_invariants(pool)


def _pools(kind: str) -> tuple[Pool, Pool]:
    k = KINDS[kind]
    a, b = (Pool(k.name, plan(k.spec, k.sizing), prefix_caching=k.prefix_caching) for _ in range(2))
    return a, b


@pytest.mark.parametrize("kind", ["uniform", "sliding", "hybrid", "prefix"])
def test_a_step_without_tables_or_mappings_replies_no_spaces_and_changes_the_same(kind):
    lean, full = _pools(kind)
    rng = np.random.default_rng(len(kind))
    steps = [{"admit_ids": [1, 2, 3], "admit_tokens": [9, 4, 13]},
             {"extend_ids": [1, 2, 3], "extend_tokens": [1, 1, 1]},
             {"extend_ids": [1, 2, 3], "extend_tokens": [1, 1, 1]},          # a repeated batch (decode path)
             {"free_ids": [2], "extend_ids": [3], "extend_tokens": [2], "admit_ids": [4], "admit_tokens": [6]},
             {"fork_parents": [1], "fork_children": [5]},
             {"free_ids": [1, 5], "extend_ids": [3, 4], "extend_tokens": [1, 3]}]
    for st in steps:
        st = {k: np.asarray(v) for k, v in st.items()}
        got = lean.step(**st, tables=False, mappings=False)
        want = full.step(**st)
        assert got.tables == ()
        assert got.seq_ids.tolist() == want.seq_ids.tolist() and got.num_tokens.tolist() == want.num_tokens.tolist()
        assert got.new_token_indptr.tolist() == want.new_token_indptr.tolist()
        assert got.num_free_slots == want.num_free_slots
        assert _state(lean) == _state(full)
        # mappings without tables: the slot mappings are the full reply's
        ids = lean.sequences()[0]
        ext = {"extend_ids": ids, "extend_tokens": rng.integers(1, 3, len(ids))}
        got = lean.step(**ext, tables=False, mappings=True)
        want = full.step(**ext)
        assert len(got.tables) == len(want.tables) > 0
        for gs, ws in zip(got.tables, want.tables, strict=True):
            assert np.array_equal(gs.slot_mapping, ws.slot_mapping)
    assert_invariants(lean)


def _prompt_ops(rng: np.random.Generator, ps: int) -> list:
    """Admissions sharing prefixes (several per step, in and across steps), extended past sliding windows and
    freed, so that hits are found, cut short by a window group's cache, and taken by later prompts of a step."""
    base = [int(x) for x in rng.integers(1, 1000, 12 * ps)]
    other = [int(x) for x in rng.integers(1, 1000, 12 * ps)]

    def adm(ids_lens: list[tuple[int, list[int]]]) -> Step:
        return Step(adm=[(i, len(t)) for i, t in ids_lens], token_ids=[x for _, t in ids_lens for x in t])

    ops = [adm([(1, base[:5 * ps + 1])]),
           adm([(2, base[:3 * ps] + other[:2]), (3, other[:4 * ps]), (4, base[:6 * ps + 2])]),
           Step(ext=[(1, ps * 3), (3, 1)]),
           adm([(5, other[:4 * ps + 3]), (6, base[:2 * ps] + other[:ps]), (7, base[:9 * ps])]),
           Step(free=[1, 4]),
           adm([(8, base[:8 * ps + 1]), (9, other[:3 * ps + 1] + base[:ps])]),
           Step(free=[2, 3, 5, 6]),
           adm([(10, base[:7 * ps]), (11, other[:5 * ps]), (12, base[:ps + 1])]),
           Step(ext=[(10, 2 * ps), (8, 1)]),
           Step(free=[7, 8, 9, 10, 11, 12]),
           adm([(13, other[:6 * ps]), (14, base[:10 * ps + 3]), (15, base[:10 * ps + 3])]),
           Step(free=[13, 14]),
           adm([(16, base[:6 * ps])]),                # one prompt per step: its hit is one slice of cached pages
           adm([(17, other[:5 * ps + 2])]),
           Step(ext=[(16, 1), (17, ps)]),
           adm([(18, base[:11 * ps])]),
           Step(free=[15, 16, 17, 18]),
           adm([(19, base[:3 * ps] + other[:ps])])]
    return ops


@pytest.mark.parametrize("kind", ["prefix", "prefix_interleaved", "prefix_hybrid", "prefix_hybrid_interleaved",
                                  "prefix_sliding_only", "prefix_sized_hybrid"])
@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_hits_of_several_prompts_per_step_match_the_model(kind, seed):
    k = KINDS[kind]
    ops = _prompt_ops(np.random.default_rng(seed), k.spec.page_size)
    replay(k, ops, fast=True)
    replay(k, ops, fast=False)


@pytest.mark.parametrize("fast", [True, False])
def test_out_of_slots_refusal_counts_free_and_released_slots_by_hand(fast):
    from kvservice.contract.errors import ResourceExhausted
    pool = _one_group_pool(fast)
    pool.step(admit_ids=[1, 2], admit_tokens=[10, 5])          # 3 + 2 pages of 4 tokens: 59 free
    before = _state(pool)
    with pytest.raises(ResourceExhausted) as e:                # 7 x 10 pages, 59 free + 2 freed by the step
        pool.step(free_ids=[2], admit_ids=list(range(3, 10)), admit_tokens=[40] * 7)
    assert e.value.message == ("pool 'p': this step needs 70 slots in layer group 0 but only 61 are free (59 free + "
                               "2 released by this step) of 64; free or preempt sequences, or plan a bigger pool")
    assert e.value.metadata == {"needed": "70", "free": "61", "num_slots": "64", "group": "0"}
    assert _state(pool) == before and (pool.refused, pool.alloc_failures) == (1, {"out_of_slots": 1})
    pool.step(free_ids=[2], admit_ids=list(range(3, 9)), admit_tokens=[40] * 6)    # 60 of 61: taken
    assert pool.num_free_slots == 1 and pool.refused == 1


def test_the_group_that_runs_out_first_is_named():
    from kvservice.contract.errors import ResourceExhausted
    k = KINDS["sized_hybrid"]                       # groups: full (40 slots), window 6 (14), window 13 (20)
    pool = Pool(k.name, plan(k.spec, k.sizing))
    with pytest.raises(ResourceExhausted) as e:     # 4 x ceil(16 / 4) pages in every group
        pool.step(admit_ids=[1, 2, 3, 4], admit_tokens=[16] * 4)
    assert e.value.message == (f"pool {k.name!r}: this step needs 16 slots in layer group 1 but only 14 are free "
                               "(14 free + 0 released by this step) of 14; free or preempt sequences, or plan a "
                               "bigger pool")
    assert pool.num_sequences == 0 and pool.steps == 0 and pool.refused == 1


@pytest.mark.parametrize("kw, message", [
    ({"admit_token_ids": np.ones((2, 3), dtype=np.int64)},
     "admit_token_ids must be a 1-D integer array, got shape (2, 3) dtype int64"),
    ({"admit_token_ids": np.ones(6, dtype=np.float32)},
     "admit_token_ids must be a 1-D integer array, got shape (6,) dtype float32"),
    ({"admit_token_ids": np.ones(5, dtype=np.int64)}, "admit_token_ids has 5 ids; admit_num_tokens add up to 6"),
    ({"admit_token_ids": np.ones(6, dtype=np.int64), "admit_salts": ["a"]},
     "admit_cache_salts has 1 entries for 2 admissions; give one per admission or none"),
])
def test_prompt_inputs_are_checked_against_the_admissions(kw, message):
    k = KINDS["prefix"]
    pool = Pool(k.name, plan(k.spec, k.sizing), prefix_caching=True)
    pool.step(admit_ids=[1], admit_tokens=[9], admit_token_ids=np.arange(1, 10))
    before = _state(pool)
    with pytest.raises(InvalidArgument) as e:
        pool.step(admit_ids=[2, 3], admit_tokens=[4, 2], **kw)
    assert e.value.message == message
    assert _state(pool) == before


@pytest.mark.parametrize("fast", [True, False])
def test_refusals_of_wide_batches_name_the_first_offender(fast):
    pool = Pool("w", plan(CacheSpec((LayerSpec(1, 64),), 4, "per_layer"), Sizing(num_slots=256, max_seq_len=50)))
    pool._fast = fast
    ids = list(range(100, 112))
    pool.step(admit_ids=ids, admit_tokens=list(range(20, 32)))       # 12 rows: more than a few
    pool.step(extend_ids=ids, extend_tokens=[5] * 7 + [20] + [1] * 4)      # 107: 27 + 20 = 47 of 50: taken
    before = _state(pool)
    with pytest.raises(InvalidArgument) as e:
        pool.step(extend_ids=ids, extend_tokens=[1] * 7 + [4] + [2] * 4)
    assert e.value.message == "extend: sequence 107 would hold 51 tokens; pool 'w' takes at most max_seq_len=50"
    assert e.value.metadata == {"seq_id": "107", "max_seq_len": "50"}
    with pytest.raises(AlreadyExists) as e:
        pool.step(admit_ids=[1, 2, 3, 4, 5, 6, 7, 111, 8, 103], admit_tokens=[1] * 10)
    assert e.value.message == "sequence 111 is already in pool 'w'"
    with pytest.raises(AlreadyExists) as e:
        pool.step(admit_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9], admit_tokens=[1] * 9, fork_parents=[100], fork_children=[104])
    assert e.value.message == "sequence 104 is already in pool 'w'"
    with pytest.raises(InvalidArgument) as e:
        pool.step(free_ids=ids[:6], extend_ids=ids[5:], extend_tokens=[1] * 7)
    assert "sequence 105 appears more than once in one step" in e.value.message
    assert _state(pool) == before


WIDE = Kind("wide", CacheSpec((LayerSpec(2, 64),) * 2, 4, "per_layer"), 160, 64)
WIDE_HYBRID = Kind("wide_hybrid", CacheSpec((LayerSpec(1, 64), LayerSpec(1, 32, sliding_window=9)), 4, "per_layer"),
                   200, 64)


@pytest.mark.parametrize("kind", [WIDE, WIDE_HYBRID], ids=lambda k: k.name)
@pytest.mark.parametrize("fast", [True, False])
def test_wide_batches_sharing_partly_filled_pages_copy_them_as_the_model_does(kind, fast):
    ids = list(range(1, 13))
    ops = [Step(adm=[(i, 4 * (i % 3) + 1 + i % 2) for i in ids]),        # every last page partly filled
           Step(ext=[(i, 1) for i in ids]),                                # 12 rows, none gains a page
           Step(forks=[(i, 100 + i) for i in ids[::2]]),                   # 6 children share their parents' pages
           Step(ext=[(i, 1) for i in ids]),                                # > 8 rows: copy-on-write of shared pages
           Step(ext=[(100 + i, 2) for i in ids[::2]] + [(i, 3) for i in ids[1::2]]),
           Step(forks=[(i, 200 + i) for i in ids[1::2]]),
           Step(ext=[(i, 1) for i in ids[1::2]] + [(200 + i, 1) for i in ids[1::2]]),
           Step(free=ids[:9], ext=[(100 + i, 1) for i in ids[::2]]),
           Step(free=[100 + i for i in ids[::2]] + [200 + i for i in ids[1::2]] + ids[9:])]
    replay(kind, ops, fast=fast)


@pytest.mark.parametrize("fast", [True, False])
def test_a_repeated_batch_that_needs_more_pages_than_are_free_is_refused_unchanged(fast):
    ops = [Step(adm=[(1, 4), (2, 8), (3, 12)]),
           Step(ext=[(1, 1), (2, 1), (3, 1)]),
           *[Step(ext=[(1, 4), (2, 4), (3, 4)]) for _ in range(12)],          # the last ones run out of slots
           Step(ext=[(1, 1), (2, 1), (3, 1)]),
           Step(free=[2], ext=[(1, 1), (3, 1)])]
    replay(KINDS["uniform"], ops, fast=fast)


@pytest.mark.parametrize("prefix_kind", ["prefix", "prefix_hybrid"])
@pytest.mark.parametrize("fast", [True, False])
def test_admissions_reviving_cached_pages_are_refused_exactly_past_the_free_slots(prefix_kind, fast):
    base = KINDS[prefix_kind]
    k = Kind("tight", base.spec, 20, 80, prefix_caching=True)
    ps = k.spec.page_size
    rng = np.random.default_rng(3)
    a = [int(x) for x in rng.integers(1, 900, 20 * ps)]
    b = [int(x) for x in rng.integers(1, 900, 20 * ps)]
    # A's 10 pages are cached when it leaves; B takes them and needs 10 more: exactly the 20 slots
    ops = [Step(adm=[(1, 10 * ps)], token_ids=a[:10 * ps]),
           Step(free=[1]),
           Step(adm=[(2, 20 * ps)], token_ids=a[:20 * ps]),
           Step(free=[2]),
           Step(adm=[(3, 1)], token_ids=b[:1]),                                  # holds one slot
           Step(adm=[(4, 20 * ps)], token_ids=a[:20 * ps]),                      # one page short: refused
           Step(adm=[(4, 19 * ps)], token_ids=a[:19 * ps]),
           Step(free=[3, 4]),
           Step(adm=[(5, 8 * ps), (6, 12 * ps)], token_ids=a[:8 * ps] + a[:12 * ps]),
           Step(free=[5, 6]),
           Step(adm=[(7, 1), (8, 20 * ps)], token_ids=b[:1] + a[:20 * ps]),      # two prompts: 21 pages
           Step(adm=[(8, 20 * ps)], token_ids=a[:20 * ps])]
    replay(k, ops, fast=fast)


TIGHT = Kind("tight_one_group", CacheSpec((LayerSpec(1, 64),) * 2, 4, "per_layer"), 16, 64, prefix_caching=True)
TIGHT_HYBRID = Kind("tight_hybrid", CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=30)), 4,
                                              "per_layer"), 16, 64, prefix_caching=True)


@pytest.mark.parametrize("kind", [TIGHT, TIGHT_HYBRID], ids=lambda k: k.name)
@pytest.mark.parametrize("fast", [True, False])
def test_steps_at_the_exact_slot_boundary_match_the_model(kind, fast):
    rng = np.random.default_rng(16)
    p = [int(x) for x in rng.integers(1, 900, 64)]
    ops = [
        # (a) a freed sequence's cached pages taken back by an admission of the same step
        Step(adm=[(1, 17)], token_ids=p[:17]),                    # 5 pages, 4 of them full (cached when freed)
        Step(adm=[(2, 44)]),                                      # the other 11 slots
        Step(free=[1], adm=[(3, 21)], token_ids=p[:21]),          # 4 revived + 2 new of 5 released: refused
        Step(free=[1], adm=[(3, 20)], token_ids=p[:20]),          # 4 revived + 1 new: exactly fits
        Step(free=[2, 3]),
        # (b) a parent and its fork freed together (each slot owned twice) with an admission at the boundary
        Step(adm=[(4, 9)]),                                       # 3 pages
        Step(forks=[(4, 5)]),
        Step(adm=[(6, 52)]),                                      # 13 pages: nothing left
        Step(free=[4, 5], adm=[(7, 13)]),                         # 4 pages, 3 released: refused
        Step(free=[4, 5], adm=[(7, 12)]),                         # 3 pages: exactly fits
        Step(free=[6, 7]),
        # (c) more than a few admissions at the boundary
        Step(adm=list(zip(range(10, 19), [4] * 7 + [16, 21], strict=True))),   # 7 + 4 + 6 = 17 pages: refused
        Step(adm=list(zip(range(10, 19), [3] * 7 + [16, 20], strict=True))),   # 7 + 4 + 5 = 16 pages: fits
        Step(adm=[(30, 1)]),                                                    # nothing left: refused
        Step(free=[10], adm=list(zip(range(31, 40), [1] * 9, strict=True))),   # 9 pages, 1 released: refused
        Step(free=[17, 18], adm=list(zip(range(31, 40), [1] * 9, strict=True))),   # 9 of 9 released: fits
    ]
    replay(kind, ops, fast=fast)


@pytest.mark.parametrize("kind", ["uniform", "hybrid", "prefix_hybrid"])
@pytest.mark.parametrize("fast", [True, False])
def test_a_parent_extended_in_the_step_that_forks_it_copies_its_shared_last_page(kind, fast):
    ops = [Step(adm=[(1, 6), (2, 8), (3, 13)]),
           Step(ext=[(1, 1), (2, 1), (3, 3)]),
           Step(forks=[(1, 4), (3, 5)], ext=[(1, 1), (2, 1), (3, 3)]),     # the last batch again, forking 1 and 3
           Step(ext=[(4, 1), (5, 2), (1, 1)]),
           Step(forks=[(2, 6)], ext=[(2, 1)], free=[4]),
           Step(ext=[(6, 1), (2, 1)]),
           Step(free=[1, 2, 3, 5, 6])]
    replay(KINDS[kind], ops, fast=fast)
