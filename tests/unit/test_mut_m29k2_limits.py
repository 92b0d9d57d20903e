"""kvservice/core/limits.py's count checks against plain Python integers (which never wrap).

count_summary's contract (its docstring): (min, max, exact sum) of a 1-D integer array, the sum 0 when an
entry is < 0, None when absent, empty or not 1-D integers. check_step_counts: a count over max_seq_len is
refused naming the field, index and value; a step whose least page demand (sum of floor(count / page_size))
is over the pool's slots is refused when its sums could wrap, and accepted when it is exactly the slots.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.core.limits import check_step_counts, count_summary

DTYPES = (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)


def _model(values: list[int]) -> tuple[int, int, int]:
    return min(values), max(values), sum(values) if min(values) >= 0 else 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_count_summary_is_exact_for_every_integer_dtype_and_size(dtype):
    rng = np.random.default_rng(DTYPES.index(dtype))
    info = np.iinfo(dtype)
    for n in (1, 2, 3, 7, 64, 1000):
        for lo, hi in ((1, min(info.max, 50)), (info.max // 2, info.max), (info.max - 3, info.max),
                       (max(info.min, -20), min(info.max, 20))):
            a = rng.integers(lo, hi, n, dtype=dtype, endpoint=True)
            assert count_summary(a) == _model([int(x) for x in a.tolist()]), (dtype, n, lo, hi)
        same = np.full(n, info.max, dtype=dtype)
        assert count_summary(same) == (int(info.max), int(info.max), int(info.max) * n)
    if info.min < 0:
        a = np.array([5, info.min, 9], dtype=dtype)
        assert count_summary(a) == (int(info.min), 9, 0)
        assert count_summary(np.full(4, -2, dtype=dtype)) == (-2, -2, 0)


def test_count_summary_int64_sums_past_2_63_stay_exact():
    # top x len in [2^63, 2^64): the array's own int64 sum would wrap
    for values in ([2**62, 2**62, 2**62], [2**62 + 5, 2**62 + 1, 3], [2**63 - 1, 2**62, 7, 0]):
        a = np.array(values, dtype=np.int64)
        assert count_summary(a) == _model(values)
    # just under 2^63 in all: exact in int64
    a = np.array([2**61, 2**61, 2**61, 2**61 - 1], dtype=np.int64)
    assert count_summary(a) == _model(a.tolist()) and count_summary(a)[2] == 2**63 - 1
    a = np.array([2**63 - 1] * 3 + [1], dtype=np.uint64)
    assert count_summary(a) == _model([int(x) for x in a.tolist()])


def test_count_summary_refuses_what_is_not_a_1d_integer_array():
    assert count_summary(None) is None
    assert count_summary(np.zeros(0, dtype=np.int64)) is None
    assert count_summary(np.ones((2, 3), dtype=np.int64)) is None
    assert count_summary(np.ones(3, dtype=np.float64)) is None
    assert count_summary(np.ones(3, dtype=bool)) is None
    assert count_summary(np.array([4], dtype=np.int32)) == (4, 4, 4)


def test_check_step_counts_returns_the_summaries_and_refuses_counts_over_max_seq_len():
    rng = np.random.default_rng(7)
    e = rng.integers(1, 500, 40, dtype=np.int64)
    a = rng.integers(1, 500, 9, dtype=np.int32)
    out = check_step_counts("p", 500, 10_000, 16, [("extend_num_tokens", e), ("admit_num_tokens", a)])
    assert out == [_model(e.tolist()), _model(a.tolist())]
    assert check_step_counts("p", 500, 10_000, 16, [("extend_num_tokens", None), ("admit_num_tokens", a)]) == \
        [None, _model(a.tolist())]
    bad = a.copy()
    bad[5] = 501
    with pytest.raises(InvalidArgument) as exc:
        check_step_counts("pool-x", 500, 10_000, 16, [("extend_num_tokens", e), ("admit_num_tokens", bad)])
    assert exc.value.message == ("admit_num_tokens[5] = 501 tokens: pool 'pool-x' takes at most max_seq_len=500 "
                                 "tokens per sequence")
    assert exc.value.reason == "OVER_MAX_SEQ_LEN"
    # summaries given by the caller are used as they are (and returned)
    given = [(1, 2, 3), None]
    assert check_step_counts("p", 500, 10_000, 16, [("extend_num_tokens", e), ("admit_num_tokens", a)],
                             summaries=given) == given


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_a_step_whose_sums_could_wrap_is_refused_exactly_past_the_pools_slots(page_size):
    big = 2**63 - 12345                     # two of them: an int64 sum of the counts (and of their pages) wraps
    counts = np.array([big, 4 * page_size - 1, big - 1, 0, -4], dtype=np.int64)   # <= 0 left to the pool
    least = big // page_size + 3 + (big - 1) // page_size                          # floor(count / ps), negatives 0
    args = ("p", 2**63, None, page_size, [("extend_num_tokens", counts), ("admit_num_tokens", None)])
    for slots in (least, least + 1, 2**66):                                   # exactly enough, and more
        out = check_step_counts(*args[:2], slots, *args[3:])
        assert out == [(-4, big, 0), None]
    with pytest.raises(ResourceExhausted) as exc:
        check_step_counts(*args[:2], least - 1, *args[3:])
    assert exc.value.message == (f"pool 'p': this step needs at least {least} slots, the pool has {least - 1}; "
                                 "split the step")
    # the same demand spread over two fields is summed over both
    e, a = np.array([big, 1, big - 7], dtype=np.int64), np.array([big - 3, big - 5, 2], dtype=np.int64)
    both = sum(x // page_size for x in (big, 1, big - 7, big - 3, big - 5, 2))
    assert check_step_counts("p", 2**63, both, page_size, [("e", e), ("a", a)]) == \
        [(1, big, 2 * big - 6), (2, big - 3, 2 * big - 6)]
    with pytest.raises(ResourceExhausted):
        check_step_counts("p", 2**63, both - 1, page_size, [("e", e), ("a", a)])


def test_the_wrap_check_starts_exactly_at_2_62_and_max_seq_len_itself_is_allowed():
    # (top // page_size + 2) x len = 2^62: summed exactly, and refused past the slots
    at = np.array([2**62 - 2], dtype=np.int64)
    with pytest.raises(ResourceExhausted):
        check_step_counts("p", 2**63, 2**62 - 3, 1, [("e", at), ("a", None)])
    assert check_step_counts("p", 2**63, 2**62 - 2, 1, [("e", at), ("a", None)]) == [(2**62 - 2,) * 3, None]
    # one below: no sum can wrap, the pool itself refuses what does not fit
    below = np.array([2**62 - 3], dtype=np.int64)
    assert check_step_counts("p", 2**63, 5, 1, [("e", below), ("a", None)]) == [(2**62 - 3,) * 3, None]
    # a count of exactly max_seq_len is taken, one more is not
    counts = np.array([3, 500, 7], dtype=np.int64)
    assert check_step_counts("p", 500, 100, 16, [("e", counts), ("a", counts)]) == [(3, 500, 510)] * 2
    with pytest.raises(InvalidArgument):
        check_step_counts("p", 499, 100, 16, [("e", counts), ("a", None)])
