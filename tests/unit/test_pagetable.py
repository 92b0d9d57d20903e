"""The page-table validator reports every bad entry with its reason, row and position."""

import numpy as np
import pytest

from kvservice.errors import InvalidArgument
from kvservice.geometry import IndexSpace
from kvservice.pagetable import PageTable, validate_page_table

FLAT = IndexSpace(0, 0, 1, 0, 100, (0,))
LATTICE = IndexSpace(1, 0, 4, 2, 400, (1,))


def table(indptr, indices, last):
    return PageTable(np.array(indptr), np.array(indices), np.array(last))


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
    assert [(v.reason, v.row, v.value) for v in r.violations] == [("bad_last_page_len", 0, 0),
                                                                   ("bad_last_page_len", 1, 17)]


def test_bad_indptr():
    r = validate_page_table(table([1, 3, 2], [1, 2, 3], [1, 1]), FLAT, 16)
    reasons = [(v.reason, v.position) for v in r.violations]
    assert ("bad_indptr", 0) in reasons and ("bad_indptr", 2) in reasons
    r = validate_page_table(table([0, 2], [1, 2, 3], [1]), FLAT, 16)      # does not end at nnz
    assert [(v.reason, v.position, v.value) for v in r.violations] == [("bad_indptr", 1, 2)]


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
