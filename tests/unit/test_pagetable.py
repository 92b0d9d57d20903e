"""The page-table validator reports every bad entry with its reason, row and position.

The same rules run on the worker and in the kernels: tests/kernels/test_one_validator.py
holds the cases that every implementation must answer identically."""

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import IndexSpace
from kvservice.contract.pagetable import (
    OFF_LATTICE,
    OUT_OF_BOUNDS,
    WRONG_INDEX_SPACE,
    PageTable,
    page_reasons,
    validate_page_table,
)

FLAT = IndexSpace(0, 0, 1, 0, 100, (0,))
LATTICE = IndexSpace(1, 0, 4, 2, 400, (1,))
# Two spaces of one pool numbered [0, 100) and [100, 500): the second has base 100.
SECOND = IndexSpace(1, 1, 4, 2, 500, (1,), base=100)


def table(indptr, indices, last):
    return PageTable(np.array(indptr, np.int64), np.array(indices, np.int64), np.array(last, np.int64))


def test_valid_table():
    r = validate_page_table(table([0, 2, 3], [5, 99, 0], [16, 1]), FLAT, 16)
    assert r.ok and r.num_violations == 0 and r.violations == []


def test_out_of_bounds_with_rows_and_positions():
    r = validate_page_table(table([0, 2, 5], [5, 100, 7, -1, 3], [4, 4]), FLAT, 16)
    assert [(v.reason, v.row, v.position, v.value) for v in r.violations] == [
        ("out_of_bounds", 0, 1, 100), ("out_of_bounds", 1, 3, -1)]


def test_off_lattice():
    r = validate_page_table(table([0, 3], [2, 6, 7], [1]), LATTICE, 16)
    assert [(v.reason, v.row, v.position, v.value) for v in r.violations] == [("off_lattice", 0, 2, 7)]
    r = validate_page_table(table([0, 1], [402], [1]), LATTICE, 16)
    assert [v.reason for v in r.violations] == ["out_of_bounds"]


def test_bad_last_page_len():
    r = validate_page_table(table([0, 1, 2, 3], [1, 2, 3], [0, 17, 16]), FLAT, 16)
    assert [(v.reason, v.row, v.position, v.value) for v in r.violations] == [("bad_last_page_len", 0, -1, 0),
                                                                               ("bad_last_page_len", 1, -1, 17)]


def test_empty_rows_last_page_len_is_ignored():
    r = validate_page_table(table([0, 0, 1, 1], [3], [0, 16, -5]), FLAT, 16)
    assert r.ok, r.violations


def test_bad_indptr_is_one_row_level_violation_per_row():
    r = validate_page_table(table([1, 3, 2], [1, 2, 3], [1, 1]), FLAT, 16)
    # row 0 starts at 1 (value a), row 1 ends before it starts (value b); entries are not checked
    assert [(v.reason, v.row, v.position, v.value) for v in r.violations] == [
        ("bad_indptr", 0, -1, 1), ("bad_indptr", 1, -1, 2)]
    r = validate_page_table(table([0, 2], [1, 2, 3], [1]), FLAT, 16)      # does not end at nnz
    assert [(v.reason, v.row, v.position, v.value) for v in r.violations] == [("bad_indptr", 0, -1, 2)]
    r = validate_page_table(table([2], [], []), FLAT, 16)                  # no rows, indptr[0] != 0
    assert [(v.reason, v.row, v.position, v.value) for v in r.violations] == [("bad_indptr", -1, -1, 2)]
    assert validate_page_table(table([0], [], []), FLAT, 16).ok


def test_wrong_index_space_between_out_of_bounds_and_off_lattice():
    # SECOND: pages [100, 500) of a 500-page pool, lattice 102 + 4k
    r = validate_page_table(table([0, 6], [102, 5, 99, 500, -1, 103], [1]), SECOND, 16, pool_pages=500)
    assert [(v.reason, v.position, v.value) for v in r.violations] == [
        ("wrong_index_space", 1, 5), ("wrong_index_space", 2, 99), ("out_of_bounds", 3, 500),
        ("out_of_bounds", 4, -1), ("off_lattice", 5, 103)]
    assert "[100, 500)" in r.violations[0].detail
    # the FIRST space of the same pool: the second space's pages are another space's
    r = validate_page_table(table([0, 2], [102, 99], [1]), FLAT, 16, pool_pages=500)
    assert [(v.reason, v.value) for v in r.violations] == [("wrong_index_space", 102)]
    # without pool_pages the space's own end is the pool's end
    r = validate_page_table(table([0, 1], [102], [1]), FLAT, 16)
    assert [v.reason for v in r.violations] == ["out_of_bounds"]


def test_violations_are_listed_by_row_then_position():
    r = validate_page_table(table([0, 2, 4], [1, 200, 300, 2], [16, 0]), FLAT, 16)
    assert [(v.reason, v.row, v.position) for v in r.violations] == [
        ("out_of_bounds", 0, 1), ("bad_last_page_len", 1, -1), ("out_of_bounds", 1, 2)]


def test_counts_past_max_reports():
    r = validate_page_table(table([0, 50], np.full(50, 1000), [1]), FLAT, 16, max_reports=5)
    assert r.num_violations == 50 and len(r.violations) == 5


@pytest.mark.parametrize(("t", "match"), [
    (PageTable(np.array([0, 1]), np.array([1]), np.array([1, 1])), "last_page_len has 2 entries"),
    (PageTable(np.array([], np.int64), np.array([1]), np.array([], np.int64)), "B \\+ 1 >= 1"),
    (PageTable(np.array([[0, 1]]), np.array([1]), np.array([1])), "1-D integer"),
    (PageTable(np.array([0.0, 1.0]), np.array([1]), np.array([1])), "1-D integer"),
])
def test_malformed_tables_raise(t, match):
    with pytest.raises(InvalidArgument, match=match):
        validate_page_table(t, FLAT, 16)


@pytest.mark.parametrize(("field", "message"), [
    ("indptr", "indptr must be a 1-D integer array, got shape (1, 2) dtype int64"),
    ("indices", "indices must be a 1-D integer array, got shape (1,) dtype float32"),
    ("last_page_len", "last_page_len must be a 1-D integer array, got shape () dtype int64"),
])
def test_malformed_table_message_names_the_array(field, message):
    """The whole message: the array's name, its shape and dtype are what a caller fixes."""
    good = {"indptr": np.array([0, 1]), "indices": np.array([7]), "last_page_len": np.array([3])}
    bad = {"indptr": np.array([[0, 1]]), "indices": np.array([7.0], np.float32), "last_page_len": np.array(3)}
    with pytest.raises(InvalidArgument) as e:
        validate_page_table(PageTable(**{**good, field: bad[field]}), FLAT, 16)
    assert e.value.message == message


@pytest.mark.parametrize("scale", [1, 2, 3])
def test_page_reasons_against_a_plain_python_rule(scale):
    """Each page's int8 reason: out of the pool, else outside [base, upper_bound), else off the lattice
    base + offset + k * scale (checked for every scale, 2 included), else 0."""
    rng = np.random.default_rng(40 + scale)
    base, offset, pool_pages = 7, scale - 1, 60
    upper = base + 12 * scale
    pages = rng.integers(-3, pool_pages + 4, (5, 40))

    def rule(q):
        if q < 0 or q >= pool_pages:
            return OUT_OF_BOUNDS
        if q < base or q >= upper:
            return WRONG_INDEX_SPACE
        return OFF_LATTICE if (q - base - offset) % scale else 0

    got = page_reasons(pages, base=base, upper_bound=upper, scale=scale, offset=offset, pool_pages=pool_pages)
    assert got.dtype == np.int8 and got.shape == pages.shape
    assert got.tolist() == [[rule(q) for q in row] for row in pages.tolist()]
    assert (got == OFF_LATTICE).any() == (scale > 1)
