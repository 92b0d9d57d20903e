"""Request parsing and the copy-on-write rule of kvservice.core.stepplan, against plain-Python references."""

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import MAX_COUNT
from kvservice.core.limits import count_summary
from kvservice.core.stepplan import cow_rows, parse_counts, parse_ids


@pytest.mark.parametrize(("counts", "message"), [
    (np.array([[3, 4]]), "extend_num_tokens must be a 1-D integer array, got shape (1, 2) dtype int64"),
    (np.array([1.0, 2.0]), "extend_num_tokens must be a 1-D integer array, got shape (2,) dtype float64"),
    (np.array([2]), "extend_num_tokens has 1 entries for 2 sequence ids"),
    (np.array([5, 0]), "extend_num_tokens must be > 0 tokens per sequence, got 0"),
    (np.array([5, MAX_COUNT + 1]), f"extend_num_tokens must be at most {MAX_COUNT} tokens per sequence, "
                                   f"got {MAX_COUNT + 1}"),
    # Past 2**63 a uint64 count would wrap negative as int64: it is named as too large, with its true value.
    (np.array([7, 2**63 + 5], dtype=np.uint64), f"extend_num_tokens must be at most {MAX_COUNT} tokens per "
                                                 f"sequence, got {2**63 + 5}"),
])
def test_bad_counts_are_named_with_the_value(counts, message):
    with pytest.raises(InvalidArgument) as e:
        parse_counts("extend_num_tokens", counts, 2)
    assert e.value.message == message
    if counts.ndim == 1 and counts.dtype.kind in "iu" and len(counts) == 2:    # the same from the decoded summary
        known = count_summary(counts)
        with pytest.raises(InvalidArgument) as e:
            parse_counts("extend_num_tokens", counts, 2, known=known[:2])
        assert e.value.message == message


def test_counts_up_to_the_limit_pass_and_int64_input_is_not_copied():
    rng = np.random.default_rng(5)
    counts = rng.integers(1, 1000, 6)
    counts[rng.integers(6)] = MAX_COUNT                   # the limit itself is a valid count
    got = parse_counts("admit_num_tokens", counts, 6)
    assert got.tolist() == counts.tolist() and got.dtype == np.int64
    assert got is counts                                  # the request's array, no per-step copy
    small = parse_counts("admit_num_tokens", np.array([9, 4], dtype=np.uint8), 2, max_value=9)
    assert small.tolist() == [9, 4] and small.dtype == np.int64
    wide = rng.integers(1, 1 << 20, 300).astype(np.int32)                  # as a client sends them: INT32
    assert count_summary(wide) == (int(wide.min()), int(wide.max()), sum(wide.tolist()))
    known = parse_counts("admit_num_tokens", wide, 300, known=count_summary(wide)[:2])
    assert known.tolist() == wide.tolist() and known.dtype == np.int64


def cow_model(last, owners):
    """Plain Python: of c extenders of a slot with r owners, all copy if r > c, else all but the last."""
    out = []
    for i, s in enumerate(last):
        c = sum(1 for x in last if x == s)
        is_last = all(x != s for x in last[i + 1:])
        out.append(bool(owners[i] > c or not is_last))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_cow_rows_against_a_model(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    last = rng.integers(1, 12, n)                          # repeated slots: rows sharing a partial page
    c = np.bincount(last, minlength=12)[last]
    owners = c + rng.integers(0, 2, n) * rng.integers(1, 3, n)   # r >= c: every extender owns the page
    got = cow_rows(last, owners)
    assert got.dtype == np.bool_ and got.shape == (n,)
    assert got.tolist() == cow_model(last.tolist(), owners.tolist())


def test_uint64_ids_are_not_copied_and_signed_ids_convert():
    from kvservice.core.stepplan import parse_ids
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 2**62, 7, dtype=np.uint64)
    assert parse_ids("admit_seq_ids", ids) is ids          # the request's array, no per-step copy
    signed = rng.integers(0, 2**40, 5)
    got = parse_ids("free_seq_ids", signed)
    assert got.dtype == np.uint64 and got.tolist() == signed.tolist()


def test_a_repeated_sequence_is_named_with_the_rule():
    from kvservice.core.stepplan import check_distinct
    with pytest.raises(InvalidArgument) as e:
        check_distinct(np.array([4, 9, 2, 9], dtype=np.uint64))
    assert e.value.message == ("sequence 9 appears more than once in one step; each sequence may be freed, "
                               "extended, admitted or created by a fork once per step")
    assert e.value.metadata == {"seq_id": "9"}


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64])
def test_count_summary_equals_the_plain_python_summary(dtype):
    """(min, max, exact sum or 0 with a negative entry) against Python ints: equal counts (its shortcut), one count
    that differs at each position, a single count, negative and extreme values."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(int(np.dtype(dtype).itemsize))

    def want(a):
        vals = [int(x) for x in a.tolist()]
        return (min(vals), max(vals), sum(vals) if min(vals) >= 0 else 0)

    cases = [np.full(n, v, dtype=dtype) for n in (1, 2, 257) for v in {1, 7, int(info.max), int(info.min)}]
    base = np.full(40, 3, dtype=dtype)
    for at in range(40):
        one = base.copy()
        one[at] = 4 if at % 2 else int(info.min) + (1 if info.min else 0)     # one count differs, anywhere
        cases.append(one)
    cases += [rng.integers(max(int(info.min), -1000), min(int(info.max), 1000), 300, endpoint=True).astype(dtype)
              for _ in range(5)]
    for a in cases:
        assert count_summary(a) == want(a), (a.dtype, a[:5], len(a))
    assert count_summary(np.zeros(0, dtype=dtype)) is None


def _outcome(fn, *args):
    try:
        out = fn(*args)
        return out.dtype, out.tolist()
    except InvalidArgument as err:
        return "refused", str(err)


@pytest.mark.parametrize("seed", range(3))
def test_python_int_lists_parse_as_their_arrays_do(seed):
    """parse_ids/parse_counts take a few valid Python ints without NumPy's checks: every list gives exactly what
    np.asarray of it gives (the same array, or the same refusal), valid or not."""
    rng = np.random.default_rng(seed)
    edge = [[], [0], [-1], [True], [1, 2**63], [2**63], [2**64 - 1, 0], [1.0], [3, 3], [MAX_COUNT], [MAX_COUNT + 1],
            [1, -5], list(range(9)), [2**40, 1]]
    lists = edge + [rng.integers(-3, 2**62, size=int(rng.integers(1, 10))).tolist() for _ in range(50)] \
        + [rng.integers(1, 50, size=int(rng.integers(1, 10))).tolist() for _ in range(50)]
    for v in lists:
        assert _outcome(parse_ids, "ids", v) == _outcome(parse_ids, "ids", np.asarray(v)), v
        assert _outcome(parse_counts, "n", v, len(v)) == _outcome(parse_counts, "n", np.asarray(v), len(v)), v
        assert _outcome(parse_counts, "n", v, len(v) + 1) == _outcome(parse_counts, "n", np.asarray(v), len(v) + 1)
