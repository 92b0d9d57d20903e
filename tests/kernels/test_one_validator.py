"""ONE validator semantics (issue #10 item 2): the same table of cases runs against the
manager's validator (kvservice.contract.pagetable), the worker's NumPy ops (validate and decode) and
the emulated kernels (validate, decode, decode split), and every one must give the
hand-written answer: every violation as (reason, row, position, value) in (row, position)
order for the manager, and for each kernel the record (count + first violation), the row
status bits and the poisoned rows. The rules are written once, in kvservice/contract/pagetable.py's
module docstring."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.geometry import IndexSpace
from kvservice.contract.pagetable import REASONS, PageTable, validate_page_table
from kvservice.worker import kernels_cpu, ops_numpy
from kvservice.worker.kernel_api import PageLayout

# The second of three index spaces of a pool: pages [40, 80) of [0, 120), lattice 41 + 4k.
PS, BASE, SCALE, OFFSET, SLOTS, POOL = 16, 40, 4, 1, 10, 120
SPACE = IndexSpace(1, 0, SCALE, OFFSET, BASE + SLOTS * SCALE, (0,), base=BASE)
_PB = 2 * PS * 1 * 32 * 4
LAYOUT = PageLayout.interleaved(SLOTS, SCALE * _PB, OFFSET * _PB, PS, 1, 32, "float32", base=BASE, pool_pages=POOL)
assert (LAYOUT.base, LAYOUT.upper_bound, LAYOUT.scale, LAYOUT.offset) == (SPACE.base, SPACE.upper_bound, 4, 1)

OOB, WRONG, OFF, LPL, PTR = "out_of_bounds", "wrong_index_space", "off_lattice", "bad_last_page_len", "bad_indptr"
# name: (indptr, indices, last_page_len, every violation as (reason, row, position, value))
CASES = {
    "clean, an empty row's last_page_len 0 ignored": ([0, 2, 2, 3], [41, 45, 77], [16, 0, 1], []),
    "only empty rows": ([0, 0, 0], [], [0, -3], []),
    "row 0's first entry past the pool": ([0, 2], [120, 41], [1], [(OOB, 0, 0, 120)]),
    "row 0's first entry in another space": ([0, 1, 2], [5, 41], [1, 1], [(WRONG, 0, 0, 5)]),
    "the space's edges": ([0, 7], [39, 80, 119, -1, 2**31 - 1, 40, 42], [1],
                          [(WRONG, 0, 0, 39), (WRONG, 0, 1, 80), (WRONG, 0, 2, 119), (OOB, 0, 3, -1),
                           (OOB, 0, 4, 2**31 - 1), (OFF, 0, 5, 40), (OFF, 0, 6, 42)]),
    "entries of two rows in order": ([0, 2, 4], [41, 42, 200, 45], [3, 16], [(OFF, 0, 1, 42), (OOB, 1, 2, 200)]),
    "indptr[0] != 0": ([1, 2, 3], [41, 45, 49], [1, 1], [(PTR, 0, -1, 1)]),
    "indptr[B] != nnz": ([0, 1, 2], [41, 45, 49], [1, 1], [(PTR, 1, -1, 2)]),
    "decreasing indptr, the rows around it still checked": (
        [0, 3, 1, 3], [41, 300, 45], [1, 1, 1], [(OOB, 0, 1, 300), (PTR, 1, -1, 1), (OOB, 2, 1, 300)]),
    "indptr past nnz": ([0, 5], [41], [1], [(PTR, 0, -1, 5)]),
    "negative indptr": ([0, -1, 1], [41], [1, 1], [(PTR, 0, -1, -1), (PTR, 1, -1, -1)]),
    "bad last_page_len and a bad entry in one row": ([0, 2], [41, 999], [17], [(LPL, 0, -1, 17), (OOB, 0, 1, 999)]),
    "last_page_len 0 of a non-empty row": ([0, 1], [41], [0], [(LPL, 0, -1, 0)]),
    "a later row's last_page_len after an earlier row's entry": (
        [0, 1, 1, 2], [7, 41], [1, 9, 20], [(WRONG, 0, 0, 7), (LPL, 2, -1, 20)]),
    "no rows, indptr[0] != 0": ([3], [], [], [(PTR, -1, -1, 3)]),
    "no rows, entries left over": ([0], [41], [], [(PTR, -1, -1, 0)]),
    "no rows, clean": ([0], [], [], []),
}


def arrays(case: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ip, idx, lpl, _ = case
    return np.array(ip, np.int32), np.array(idx, np.int32), np.array(lpl, np.int32)


def status_of(expected: list[tuple], batch: int) -> list[int]:
    st = [0] * batch
    for reason, row, *_ in expected:
        if row >= 0:
            st[row] |= 1 << REASONS.index(reason)
    return st


@pytest.fixture(scope="module")
def cache() -> np.ndarray:
    rng = np.random.default_rng(70)
    return rng.uniform(-1, 1, SLOTS * SCALE * LAYOUT.page_elems).astype(np.float32)


@pytest.mark.parametrize("name", list(CASES))
def test_every_implementation_gives_the_same_answer(name: str, cache: np.ndarray) -> None:
    case = CASES[name]
    expected = case[3]
    indptr, indices, lpl = arrays(case)
    batch = len(indptr) - 1
    # the manager: every violation, in (row, position) order
    rep = validate_page_table(PageTable(indptr, indices, lpl), SPACE, PS, pool_pages=POOL)
    assert [(v.reason, v.row, v.position, v.value) for v in rep.violations] == expected
    assert rep.num_violations == len(expected) and rep.ok == (not expected)
    # the worker's NumPy ops (full list) and every kernel's record
    found, _ = ops_numpy.csr_violations(indptr, indices, lpl, LAYOUT)
    assert [(REASONS[c - 1], r, p, v) for r, p, v, c in zip(found.rows.tolist(), found.positions.tolist(),
                                                            found.values.tolist(), found.codes.tolist(),
                                                            strict=True)] == expected
    want = [len(expected), *expected[0][1:], expected[0][0]] if expected else [0, -1, -1, 0, None]
    q = np.random.default_rng(71).uniform(-1, 1, (batch, 2, 32)).astype(np.float32)
    poisoned = [bool(s) for s in status_of(expected, batch)]
    for ops in (ops_numpy, kernels_cpu):
        v = ops.validate_page_table(indptr, indices, lpl, LAYOUT)
        r = v.record
        assert [r.count, r.row, r.position, r.value, r.reason] == want, (ops.__name__, "validate")
        assert np.asarray(v.row_status).tolist() == status_of(expected, batch), ops.__name__
        for split in (0, 1):
            d = ops.decode_attention(q, cache, LAYOUT, indptr, indices, lpl, kv_chunk_pages=split)
            r = d.record
            assert [r.count, r.row, r.position, r.value, r.reason] == want, (ops.__name__, "decode", split)
            assert np.isnan(d.lse).all(axis=1).tolist() == poisoned
            for row in np.flatnonzero(~np.array(poisoned, bool)):      # clean rows: attended, or empty
                empty = indptr[row + 1] == indptr[row]
                assert (np.isneginf(d.lse[row]) if empty else np.isfinite(d.lse[row])).all(), (name, row)


def test_the_cases_cover_every_reason() -> None:
    seen = {v[0] for c in CASES.values() for v in c[3]}
    assert seen == set(REASONS)


@pytest.mark.parametrize(("slot_pages", "offset_pages"), [(4.5, 1), (4, 0.5), (4.5, 0.5), (4, 1)])
def test_an_interleaved_layout_needs_whole_pages_in_its_slot_and_offset(slot_pages, offset_pages):
    """Page bytes of K+V, 16 tokens x 2 heads x 64 dims of float16: 2 * 16 * 2 * 64 * 2 = 8192. A slot size or a
    layer offset that is not a whole number of pages is refused, either one alone; whole pages give
    scale = slot pages and offset = offset pages."""
    pb = 8192
    slot_bytes, byte_offset = int(slot_pages * pb), int(offset_pages * pb)
    if slot_pages % 1 or offset_pages % 1:
        with pytest.raises(ValueError, match=f"must be multiples of page bytes {pb}"):
            PageLayout.interleaved(10, slot_bytes, byte_offset, 16, 2, 64, "float16")
    else:
        lay = PageLayout.interleaved(10, slot_bytes, byte_offset, 16, 2, 64, "float16")
        assert (lay.scale, lay.offset, lay.upper_bound) == (4, 1, 40)
