"""Page tables (FlashInfer CSR form) and the validator every emitted table passes.

A page table for a batch of B sequences in one index space:

- ``indptr``: shape [B + 1], int32 or int64; ``indptr[0] == 0``, non-decreasing,
  ``indptr[B] == nnz``. Row b's pages are ``indices[indptr[b]:indptr[b + 1]]``.
- ``indices``: shape [nnz], int32 or int64; page indices of the index space:
  ``base <= page < upper_bound`` and ``(page - base - offset) % scale == 0``.
  A page of another index space of the same pool (``0 <= page < pool_pages``
  but outside ``[base, upper_bound)``) is ``wrong_index_space``; anything else
  outside the range is ``out_of_bounds`` (geometry.py: disjoint index spaces).
- ``last_page_len``: shape [B], int32; tokens in each row's last page, in
  ``(0, page_size]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidArgument
from .geometry import IndexSpace

REASONS = ("out_of_bounds", "off_lattice", "bad_last_page_len", "bad_indptr", "wrong_index_space")


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
    """One bad entry: reason (one of REASONS), batch row (-1 if none), position in its array, value."""

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


def _int_1d(name: str, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must be a 1-D integer array, got shape {a.shape} dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def validate_page_table(table: PageTable, space: IndexSpace, page_size: int,
                        max_reports: int = 100, pool_pages: int | None = None) -> ValidationReport:
    """Check a table against one index space; report every bad entry with its position.

    pool_pages: end of the pool's page numbering (Geometry.pool_pages); pages of the
    pool outside this space's range are reported as ``wrong_index_space``. None: the
    space's own upper bound (everything outside the range is ``out_of_bounds``).

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
    report = ValidationReport()
    nnz = len(indices)

    def add(reason: str, mask: np.ndarray, rows: np.ndarray, values: np.ndarray, detail: str) -> None:
        pos = np.flatnonzero(mask)
        report.num_violations += len(pos)
        room = max_reports - len(report.violations)
        for p in pos[:max(room, 0)].tolist():
            report.violations.append(Violation(reason, int(rows[p]), p, int(values[p]), detail))

    # indptr: starts at 0, non-decreasing, ends at nnz, never past nnz.
    rows_of_ptr = np.arange(-1, batch, dtype=np.int64)
    bad_ptr = np.zeros(batch + 1, dtype=bool)
    bad_ptr[0] = indptr[0] != 0
    bad_ptr[1:] |= np.diff(indptr) < 0
    bad_ptr |= (indptr < 0) | (indptr > nnz)
    bad_ptr[-1] |= indptr[-1] != nnz
    add("bad_indptr", bad_ptr, np.maximum(rows_of_ptr, 0) if batch else rows_of_ptr, indptr,
        f"indptr must start at 0, never decrease and end at nnz={nnz}")
    add("bad_last_page_len", (lpl <= 0) | (lpl > page_size), np.arange(batch), lpl,
        f"last_page_len must be in (0, {page_size}]")
    # Row of each index position (robust to a broken indptr: clamp to a monotone envelope).
    envelope = np.maximum.accumulate(np.clip(indptr, 0, nnz))
    rows = np.searchsorted(envelope, np.arange(nnz), side="right") - 1
    rows = np.where(rows >= batch, -1, rows)
    end = space.upper_bound if pool_pages is None else pool_pages
    oob = (indices < 0) | (indices >= end)
    add("out_of_bounds", oob, rows, indices,
        f"page index must be in [{space.base}, {space.upper_bound}) for index space {space.id}; "
        f"the pool has pages [0, {end})")
    outside = ~oob & ((indices < space.base) | (indices >= space.upper_bound))
    add("wrong_index_space", outside, rows, indices,
        f"page index belongs to another index space of this pool; index space {space.id} has pages "
        f"[{space.base}, {space.upper_bound}): was this table converted for another layer?")
    if space.scale != 1:
        off = ~oob & ~outside & ((indices - space.base - space.offset) % space.scale != 0)
        add("off_lattice", off, rows, indices,
            f"page index must be {space.base + space.offset} + k * {space.scale} in index space {space.id}")
    return report
