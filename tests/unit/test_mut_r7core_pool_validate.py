"""Pool.step's phase 1 (kvservice/core/pool_validate.py): every refusal that names a request field, compared whole,
on the general path and the fast one, and the pool unchanged after each: each id field malformed (2-D) or negative,
each count field of the wrong length or out of range, each string list of the wrong length, each looked-up id
unknown, an admitted id already live, a freed fork parent. The field names are the request's (block_manager.proto),
the wording stepplan's and pool_validate's documented messages."""

import numpy as np
import pytest

from kvservice.contract.errors import AlreadyExists, InvalidArgument, NotFound
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.planner import plan
from kvservice.core.pool import Pool

BAD_2D = np.ones((1, 2), dtype=np.int64)
CASES = [
    ({"free_ids": BAD_2D}, InvalidArgument, "free_seq_ids must be a 1-D integer array, got shape (1, 2) dtype int64"),
    ({"extend_ids": BAD_2D, "extend_tokens": [1]}, InvalidArgument,
     "extend_seq_ids must be a 1-D integer array, got shape (1, 2) dtype int64"),
    ({"admit_ids": BAD_2D, "admit_tokens": [1]}, InvalidArgument,
     "admit_seq_ids must be a 1-D integer array, got shape (1, 2) dtype int64"),
    ({"fork_parents": BAD_2D, "fork_children": [9]}, InvalidArgument,
     "fork_parent_ids must be a 1-D integer array, got shape (1, 2) dtype int64"),
    ({"fork_parents": [1], "fork_children": BAD_2D}, InvalidArgument,
     "fork_child_ids must be a 1-D integer array, got shape (1, 2) dtype int64"),
    ({"free_ids": [-4]}, InvalidArgument, "free_seq_ids holds a negative sequence id (-4)"),
    ({"extend_ids": [1, 2], "extend_tokens": [1]}, InvalidArgument,
     "extend_num_tokens has 1 entries for 2 sequence ids"),
    ({"admit_ids": [7], "admit_tokens": [1, 2]}, InvalidArgument, "admit_num_tokens has 2 entries for 1 sequence ids"),
    ({"extend_ids": [1], "extend_tokens": [0]}, InvalidArgument,
     "extend_num_tokens must be > 0 tokens per sequence, got 0"),
    ({"admit_ids": [7], "admit_tokens": [0]}, InvalidArgument,
     "admit_num_tokens must be > 0 tokens per sequence, got 0"),
    ({"admit_ids": [7], "admit_tokens": [4], "admit_salts": ["a", "b"]}, InvalidArgument,
     "admit_cache_salts has 2 entries for 1 admissions; give one per admission or none"),
    ({"admit_ids": [7], "admit_tokens": [4], "admit_extra_keys": ["a", "b"]}, InvalidArgument,
     "admit_extra_keys has 2 entries for 1 admissions; give one per admission or none"),
    ({"extend_ids": [1, 55], "extend_tokens": [1, 1]}, NotFound, "extend_seq_ids: sequence 55 is not in pool 'p'"),
    ({"free_ids": [56]}, NotFound, "free_seq_ids: sequence 56 is not in pool 'p'"),
    ({"fork_parents": [57], "fork_children": [9]}, NotFound, "fork_parent_ids: sequence 57 is not in pool 'p'"),
    ({"admit_ids": [2], "admit_tokens": [3]}, AlreadyExists, "sequence 2 is already in pool 'p'"),
    ({"fork_parents": [1], "fork_children": [2]}, AlreadyExists, "sequence 2 is already in pool 'p'"),
    ({"free_ids": [1], "fork_parents": [1], "fork_children": [9]}, InvalidArgument,
     "fork parent 1 is freed in the same step"),
    ({"extend_ids": [2], "extend_tokens": [60]}, InvalidArgument,
     "extend: sequence 2 would hold 65 tokens; pool 'p' takes at most max_seq_len=64"),
    ({"admit_ids": [7, 8], "admit_tokens": [3, 65]}, InvalidArgument,
     "admit: sequence 8 would hold 65 tokens; pool 'p' takes at most max_seq_len=64"),
]


def _pool(fast: bool) -> Pool:
    spec = CacheSpec((LayerSpec(1, 64),) if fast else (LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=8)), 4)
    pool = Pool("p", plan(spec, Sizing(num_slots=64, max_seq_len=64)), prefix_caching=True)
    pool.step(admit_ids=[1, 2], admit_tokens=[9, 5])
    return pool


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(("step", "exc", "message"), CASES)
def test_each_refusal_names_its_field_whole_and_changes_nothing(step, exc, message, fast):
    pool = _pool(fast)
    before = ([a.tolist() for a in pool.sequences()], pool.num_free_slots, pool.steps)
    with pytest.raises(exc) as e:
        pool.step(**step)
    assert e.value.message == message
    assert ([a.tolist() for a in pool.sequences()], pool.num_free_slots, pool.steps) == before


@pytest.mark.parametrize("fast", [True, False])
def test_the_count_checks_read_the_callers_count_ranges(fast):
    """Pool.step(count_ranges=...): the (min, max) of extend_tokens and of admit_tokens the caller computed from the
    same arrays (kvservice.manager.step_input) are what the count checks read, not reduced again: a batch of more
    than FEW counts is refused by the range given for it (and only for it), and stands with no range given."""
    from kvservice.core.stepplan import FEW, MAX_COUNT

    n = FEW + 1
    ext, adm = list(range(100, 100 + n)), list(range(200, 200 + n))
    for i, known in enumerate([(0, 1), (1, MAX_COUNT + 1)]):
        for which, name in ((0, "extend_num_tokens"), (1, "admit_num_tokens")):
            pool = _pool(fast)
            pool.step(admit_ids=ext, admit_tokens=np.full(n, 2))
            ranges = (known, None) if which == 0 else (None, known)
            step = {"extend_ids": ext, "extend_tokens": np.ones(n, dtype=np.int64)} if which == 0 else \
                {"admit_ids": adm, "admit_tokens": np.ones(n, dtype=np.int64)}
            with pytest.raises(InvalidArgument) as e:
                pool.step(**step, count_ranges=ranges)
            assert e.value.message == (f"{name} must be > 0 tokens per sequence, got 0" if i == 0 else
                                       f"{name} must be at most {MAX_COUNT} tokens per sequence, got {MAX_COUNT + 1}")
            other = (None, known) if which == 0 else (known, None)        # the other field's range: not read
            assert pool.step(**step, count_ranges=other).num_tokens.tolist() == ([3] * n if which == 0 else [1] * n)


def test_two_prompts_with_a_hit_fit_a_pool_to_the_last_slot():
    """A step admitting two prompts (one full-attention group, prefix caching: the fast path's several-prompt case)
    needs each prompt's pages less its hit pages; cached free pages count as free, except the hit pages it revives.
    Prompt A (8 tokens, 2 pages) was cached by an earlier sequence: its hit is page 0 only (a prompt's last token is
    always computed), so page 1 is taken anew although its cached copy is still findable; prompt B takes 8 pages.
    In a pool of 10 slots (all free, 2 of them cached) the step needs 1 + 8 = 9 slots of the 10 - 1 left after
    reviving page 0: it fits exactly, leaving none free; with one more page for B it is refused."""
    from kvservice.contract.errors import ResourceExhausted

    rng = np.random.default_rng(77)
    a = rng.integers(1, 50_000, 8)
    for extra, fits in ((0, True), (1, False)):
        pool = Pool("p", plan(CacheSpec((LayerSpec(1, 64),), 4), Sizing(num_slots=10, max_seq_len=40)),
                    prefix_caching=True)
        pool.step(admit_ids=[1], admit_tokens=[8], admit_token_ids=a)
        pool.step(free_ids=[1])
        assert pool.num_free_slots == 10
        b = rng.integers(50_000, 90_000, 32 + 4 * extra)
        kw = {"admit_ids": [2, 3], "admit_tokens": [8, len(b)], "admit_token_ids": np.concatenate((a, b))}
        if fits:
            r = pool.step(**kw)
            assert r.num_tokens.tolist() == [8, 32] and pool.num_free_slots == 0
            assert r.cached_tokens.tolist() == [4, 0]
        else:
            with pytest.raises(ResourceExhausted) as e:
                pool.step(**kw)
            assert e.value.metadata == {"needed": "10", "free": "9", "num_slots": "10", "group": "0"}
