"""Page tables (FlashInfer CSR form) and THE validator: the one definition of a valid table.

A page table for a batch of B sequences in one index space:

- ``indptr``: shape [B + 1], int32 or int64; ``indptr[0] == 0``, non-decreasing,
  every entry in ``[0, nnz]``, ``indptr[B] == nnz``. Row b's pages are
  ``indices[indptr[b]:indptr[b + 1]]``.
- ``indices``: shape [nnz], int32 or int64; page indices of the index space:
  ``base <= page < upper_bound`` and ``(page - base - offset) % scale == 0``.
- ``last_page_len``: shape [B], int32; tokens in each non-empty row's last page, in
  ``(0, page_size]``. An empty row has no last page: its value is ignored (as
  FlashInfer's ``get_length`` does), never checked.

The rules, checked row by row (the manager here, the worker's NumPy ops through
``table_violations``, and ``kvservice/worker/kernels/validate_page_table.cu`` + every CSR kernel,
identically; tests/kernels/test_one_validator.py runs one table of cases on all three):

1. Row r's ``indptr`` pair ``a = indptr[r]``, ``b = indptr[r + 1]`` is ``bad_indptr`` when
   ``a < 0``, ``a > nnz``, ``r == 0 and a != 0``, ``b < a``, ``b > nnz`` or
   ``r == B - 1 and b != nnz``; value ``a`` if ``a`` broke a rule, else ``b``. A batch of
   0 rows is ``bad_indptr`` (row -1, value ``indptr[0]``) unless ``indptr == [0]`` and nnz == 0.
2. Otherwise a non-empty row's ``last_page_len`` outside ``(0, page_size]`` is ``bad_last_page_len``.
3. Every entry of a row whose indptr pair is good gets one reason, in this order:
   ``out_of_bounds`` (``p < 0`` or ``p >= pool_pages``: no page of this pool),
   ``wrong_index_space`` (a page of another index space of the pool),
   ``off_lattice`` (in the range, not on the space's lattice). Entries of a row with a
   bad indptr pair are not checked (the row's range is unknown).

A violation is (reason, row, position, value): position is the index into ``indices``,
or -1 for a row-level field (rules 1 and 2). Violations are ordered by (row, position),
so the first one is the kernels' violation record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import IndexSpace

#: Reasons of a bad entry; reason code = index + 1 (the kernels' KV_* codes in
#: kvservice/worker/kernels/paged.cuh; 0 means ok there).
REASONS = ("out_of_bounds", "off_lattice", "bad_last_page_len", "bad_indptr", "wrong_index_space")
OUT_OF_BOUNDS, OFF_LATTICE, BAD_LAST_PAGE_LEN, BAD_INDPTR, WRONG_INDEX_SPACE = range(1, 6)
#: Reasons a worker's kernels report: those above, then stale_page (code 6), an entry whose page passes
#: every rule above but was written under another generation than the table expects. Only a worker can
#: tell (it needs the generations it recorded when it wrote its pages: docs/KERNELS.md, "Page generations").
STALE_PAGE = 6
WORKER_REASONS = (*REASONS, "stale_page")
ROW_FIELD = -1  # position of a row-level violation (indptr pair / last_page_len of the row)


@dataclass(frozen=True, slots=True)
class PageTable:
    """CSR page table of one index space (see module docstring for shapes and rules)."""

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray

    @property
    def batch_size(self) -> int:
        return len(self.indptr) - 1

    def row(self, b: int) -> np.ndarray:
        """Page indices of row b."""
        return self.indices[self.indptr[b]:self.indptr[b + 1]]


@dataclass(frozen=True, slots=True)
class Violation:
    """One bad entry: reason (one of REASONS); batch row (-1 only for a batch of 0 rows); position in
    ``indices``, or -1 for a row-level field (indptr pair, last_page_len); the offending value."""

    reason: str
    row: int
    position: int
    value: int
    detail: str = ""


@dataclass(slots=True)
class ValidationReport:
    num_violations: int = 0
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.num_violations == 0

    def counts(self) -> dict[str, int]:
        """Reported violations per reason (only those listed)."""
        out: dict[str, int] = {}
        for v in self.violations:
            out[v.reason] = out.get(v.reason, 0) + 1
        return out


def page_reasons(pages: np.ndarray, *, base: int, upper_bound: int, scale: int, offset: int,
                 pool_pages: int) -> np.ndarray:
    """Reason code per page index (0 ok, else OUT_OF_BOUNDS, WRONG_INDEX_SPACE or OFF_LATTICE).

    pages: any shape, any integer dtype (compared as int64). The space is
    ``[base, upper_bound)`` with lattice ``base + offset + k * scale`` inside a pool
    numbered ``[0, pool_pages)``.
    """
    p = np.asarray(pages).astype(np.int64, copy=False)
    out = np.zeros(p.shape, dtype=np.int8)
    oob = (p < 0) | (p >= pool_pages)
    other = ~oob & ((p < base) | (p >= upper_bound))
    out[oob] = OUT_OF_BOUNDS
    out[other] = WRONG_INDEX_SPACE
    if scale != 1:
        out[~oob & ~other & ((p - base - offset) % scale != 0)] = OFF_LATTICE
    return out


@dataclass(frozen=True, slots=True)
class TableViolations:
    """Every violation of one table, ordered by (row, position): four parallel int64 arrays
    (``codes``: reason codes 1..5, see REASONS) of length = the number of violations."""

    rows: np.ndarray
    positions: np.ndarray
    values: np.ndarray
    codes: np.ndarray

    def __len__(self) -> int:
        return int(self.codes.shape[0])


def table_violations(indptr: np.ndarray, indices: np.ndarray, last_page_len: np.ndarray, page_size: int, *,
                     base: int, upper_bound: int, scale: int, offset: int, pool_pages: int) -> TableViolations:
    """Apply the rules of the module docstring to a table (1-D integer arrays, len(last_page_len)
    == len(indptr) - 1 >= 0, checked by the caller). Vectorised: O(B + nnz)."""
    ip = np.asarray(indptr).astype(np.int64, copy=False)
    lpl = np.asarray(last_page_len).astype(np.int64, copy=False)
    nnz = int(np.asarray(indices).shape[0])
    batch = ip.shape[0] - 1
    if batch == 0:
        if ip[0] == 0 and nnz == 0:
            return _violations([], [], [], [])
        return _violations([-1], [ROW_FIELD], [int(ip[0])], [BAD_INDPTR])
    a, b = ip[:-1], ip[1:]
    r = np.arange(batch, dtype=np.int64)
    bad_a = (a < 0) | (a > nnz) | ((r == 0) & (a != 0))
    bad_b = (b < a) | (b > nnz) | ((r == batch - 1) & (b != nnz))
    bad_ptr = bad_a | bad_b
    bad_lpl = ~bad_ptr & (b > a) & ((lpl <= 0) | (lpl > page_size))
    # Entries of the rows with a good indptr pair (their ranges are in [0, nnz] and ordered).
    length = np.where(bad_ptr, 0, b - a)
    row_of = np.repeat(r, length)
    pos = np.arange(row_of.shape[0], dtype=np.int64) + np.repeat(np.where(bad_ptr, 0, a) - (np.cumsum(length) - length),
                                                                 length)
    vals = np.asarray(indices)[pos].astype(np.int64, copy=False)
    codes = page_reasons(vals, base=base, upper_bound=upper_bound, scale=scale, offset=offset,
                         pool_pages=pool_pages)
    bad = np.flatnonzero(codes)
    rows = np.concatenate([r[bad_ptr], r[bad_lpl], row_of[bad]])
    positions = np.concatenate([np.full(int(bad_ptr.sum() + bad_lpl.sum()), ROW_FIELD, np.int64), pos[bad]])
    values = np.concatenate([np.where(bad_a, a, b)[bad_ptr], lpl[bad_lpl], vals[bad]])
    reasons = np.concatenate([np.full(int(bad_ptr.sum()), BAD_INDPTR, np.int64),
                              np.full(int(bad_lpl.sum()), BAD_LAST_PAGE_LEN, np.int64), codes[bad].astype(np.int64)])
    order = np.lexsort((positions, rows))
    return TableViolations(rows[order], positions[order], values[order], reasons[order])


def _violations(rows: list, positions: list, values: list, codes: list) -> TableViolations:
    return TableViolations(*(np.asarray(x, dtype=np.int64) for x in (rows, positions, values, codes)))


def _int_1d(name: str, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must be a 1-D integer array, got shape {a.shape} dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def validate_page_table(table: PageTable, space: IndexSpace, page_size: int,
                        max_reports: int = 100, *, pool_pages: int | None = None) -> ValidationReport:
    """Check a table against one index space; report every bad entry (the rules of the module
    docstring), the first ``max_reports`` of them listed in (row, position) order.

    pool_pages: end of the pool's page numbering (``Geometry.pool_pages``), which tells
    ``wrong_index_space`` from ``out_of_bounds``; None = ``space.upper_bound`` (every page
    outside the space is then ``out_of_bounds`` or, below ``space.base``, ``wrong_index_space``).
    Raises InvalidArgument only for arrays that are not a table at all (wrong
    rank or dtype, len(last_page_len) != len(indptr) - 1, empty indptr).
    """
    indptr = _int_1d("indptr", table.indptr)
    indices = _int_1d("indices", table.indices)
    lpl = _int_1d("last_page_len", table.last_page_len)
    if len(indptr) == 0:
        raise InvalidArgument("indptr must have B + 1 >= 1 entries, got 0")
    batch = len(indptr) - 1
    if len(lpl) != batch:
        raise InvalidArgument(f"last_page_len has {len(lpl)} entries, indptr says batch {batch}")
    end = space.upper_bound if pool_pages is None else pool_pages
    found = table_violations(indptr, indices, lpl, page_size, base=space.base, upper_bound=space.upper_bound,
                             scale=space.scale, offset=space.offset, pool_pages=end)
    nnz = len(indices)
    detail = {
        BAD_INDPTR: f"indptr must start at 0, never decrease, stay in [0, {nnz}] and end at nnz={nnz}",
        BAD_LAST_PAGE_LEN: f"last_page_len of a non-empty row must be in (0, {page_size}]",
        OUT_OF_BOUNDS: f"page index must be in [0, {end}) (the pool's pages)",
        WRONG_INDEX_SPACE: f"page index of another index space of this pool (was this table converted for another "
                           f"layer?); index space {space.id} has pages "
                           f"[{space.base}, {space.upper_bound})",
        OFF_LATTICE: f"page index must be {space.base + space.offset} + k * {space.scale} in index space {space.id}",
    }
    report = ValidationReport(num_violations=len(found))
    n = min(len(found), max(max_reports, 0))
    for row, pos, value, code in zip(found.rows[:n].tolist(), found.positions[:n].tolist(),
                                     found.values[:n].tolist(), found.codes[:n].tolist(), strict=True):
        report.violations.append(Violation(REASONS[code - 1], row, pos, value, detail[code]))
    return report
