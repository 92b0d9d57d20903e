"""Ragged per-row slot storage of one layer group: memory proportional to the pages held.

Row r keeps the slots of its pages (columns) ``[lo[r], lo[r] + cap[r])`` in one
contiguous segment of a flat arena: column j is ``arena[start[r] + j - lo[r]]``.
A row that outgrows its segment moves to a fresh one at the arena's end with
twice the room it needs; the columns before ``lo`` (pages a sliding window
released) are not carried along, so a sliding row's segment stays as small as
its window. Dead segments are reclaimed by compaction once they outweigh the
live ones, so the arena never holds more than a small multiple of the live
entries (no rows x longest-sequence matrix: one 131,072-token sequence next to
65,535 one-token sequences costs about 2 x (8,192 + 4 x 65,535) entries, not
65,536 x 8,192).

Entries of a row outside the pages it holds are -1. Every operation is a fixed
number of NumPy calls over the rows involved.
"""

from __future__ import annotations

import numpy as np

_MIN_CAP = 4          # columns a new segment holds at least
_FEW = 8              # up to this many rows are reserved on Python ints (stepplan.FEW)


def slot_table_dtype(num_slots: int) -> np.dtype:
    """dtype of the slot tables (RowSlots arenas) of a pool of num_slots slots: int32 while it can hold them."""
    return np.dtype(np.int32 if num_slots <= 2**31 - 1 else np.int64)


class RowSlots:
    """Slot of page j of row r, for one layer group.

    arena:  slot ids, dtype ``dtype`` (int32 while slots fit), -1 = no page.
    start:  int64 [rows] first arena position of the row's segment.
    lo:     int64 [rows] column stored at ``start`` (the row's first kept page).
    cap:    int64 [rows] columns the segment holds (0 = no segment).
    """

    __slots__ = ("_iota", "arena", "cap", "dead", "dtype", "live", "lo", "start", "used")

    def __init__(self, dtype: np.dtype, rows: int = 16) -> None:
        self.dtype = np.dtype(dtype)
        self.arena = np.full(64, -1, dtype=self.dtype)
        self.used = 0                     # arena[:used] is taken by segments, live or dead
        self.live = 0                     # sum of cap over rows
        self.dead = 0                     # arena entries of abandoned segments
        self.start = np.zeros(rows, dtype=np.int64)
        self.lo = np.zeros(rows, dtype=np.int64)
        self.cap = np.zeros(rows, dtype=np.int64)
        self._iota = np.arange(1024, dtype=np.int64)

    # ---- sizing ------------------------------------------------------------------------
    def grow_rows(self, n: int) -> None:
        """Room for row handles [0, n)."""
        have = len(self.start)
        if n <= have:
            return
        extra = max(n, 2 * have) - have
        z = np.zeros(extra, dtype=np.int64)
        self.start = np.concatenate((self.start, z))
        self.lo = np.concatenate((self.lo, z))
        self.cap = np.concatenate((self.cap, z))

    def iota(self, n: int) -> np.ndarray:
        if len(self._iota) < n:
            self._iota = np.arange(max(n, 2 * len(self._iota)), dtype=np.int64)
        return self._iota[:n]

    # ---- addressing --------------------------------------------------------------------
    def flat(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Arena positions of (row, column) pairs the rows' segments hold (int64, same shape)."""
        return self.start[rows] + (cols - self.lo[rows])

    def span(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Arena positions of columns [lo, hi) of each row, concatenated, and the counts per row."""
        cnt = np.maximum(hi - lo, 0)
        total = int(np.add.reduce(cnt))
        if not total:
            return np.zeros(0, dtype=np.int64), cnt
        starts = cnt.cumsum() - cnt
        flat = (self.start[rows] + (lo - self.lo[rows]) - starts).repeat(cnt) + self.iota(total)
        return flat, cnt

    def gather(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Slots of columns [lo, hi) of each row, concatenated (int64)."""
        flat, _ = self.span(rows, lo, hi)
        return self.arena.take(flat).astype(np.int64)

    # ---- changes -----------------------------------------------------------------------
    def reserve(self, rows: np.ndarray, first: np.ndarray, hi: np.ndarray) -> None:
        """Make each row's segment hold columns [first, hi); rows must be distinct.

        A row whose segment is too small moves to a new one of 2 x (hi - first) columns
        (at least _MIN_CAP); its entries in [first, old end) come along, the rest are -1.
        """
        if not len(rows):
            return
        if len(rows) <= _FEW:
            self.reserve_few(rows.tolist(), first.tolist(), hi.tolist())
            return
        lo, cap = self.lo[rows], self.cap[rows]
        move = (hi > lo + cap) | (first < lo)
        if not np.logical_or.reduce(move):
            return
        if not np.logical_and.reduce(move):
            rows, first, hi, lo, cap = rows[move], first[move], hi[move], lo[move], cap[move]
        new_cap = np.maximum(2 * (hi - first), _MIN_CAP)
        need = int(np.add.reduce(new_cap))
        self._make_room(need)
        new_start = self.used + new_cap.cumsum() - new_cap
        self.arena[self.used:self.used + need] = -1
        # Carry columns [max(first, lo), lo + cap) of the old segments.
        keep_lo = np.maximum(first, lo)
        keep_hi = lo + cap
        src, cnt = self.span(rows, keep_lo, keep_hi)
        if len(src):
            starts = cnt.cumsum() - cnt
            dst = (new_start + (keep_lo - first) - starts).repeat(cnt) + self.iota(len(src))
            self.arena[dst] = self.arena[src]
        self.dead += int(np.add.reduce(cap))
        self.live += need - int(np.add.reduce(cap))
        self.used += need
        self.start[rows] = new_start
        self.lo[rows] = first
        self.cap[rows] = new_cap

    def reserve_few(self, rows: list[int], first: list[int], hi: list[int]) -> None:
        """reserve for a few distinct rows, on Python ints: the same segments, moves and arena contents, each
        row's columns carried by one slice copy."""
        lo_of, cap_of = self.lo.item, self.cap.item
        moves = []
        for r, f, h in zip(rows, first, hi, strict=True):
            lo, cap = lo_of(r), cap_of(r)
            if h > lo + cap or f < lo:
                moves.append((r, f, lo, cap, max(2 * (h - f), _MIN_CAP)))
        if not moves:
            return
        need = sum(m[4] for m in moves)
        self._make_room(need)                        # may compact: segment starts are read after it
        arena, start_of, at = self.arena, self.start.item, self.used
        arena[at:at + need] = -1
        old_caps = 0
        for r, f, lo, cap, new_cap in moves:
            keep_lo, keep_hi = max(f, lo), lo + cap
            if keep_hi > keep_lo:
                src = start_of(r) + keep_lo - lo
                dst = at + keep_lo - f
                arena[dst:dst + keep_hi - keep_lo] = arena[src:src + keep_hi - keep_lo]
            self.start[r] = at
            self.lo[r] = f
            self.cap[r] = new_cap
            at += new_cap
            old_caps += cap
        self.dead += old_caps
        self.live += need - old_caps
        self.used += need

    def drop(self, rows: np.ndarray) -> None:
        """Forget the rows' segments (the rows leave the pool)."""
        if not len(rows):
            return
        freed = int(np.add.reduce(self.cap[rows]))
        self.dead += freed
        self.live -= freed
        self.cap[rows] = 0
        self.lo[rows] = 0
        self.start[rows] = 0

    def copy_rows(self, src: np.ndarray, dst: np.ndarray, first: np.ndarray, hi: np.ndarray) -> None:
        """Give each dst row the entries of its src row in columns [first, hi) (dst rows are new)."""
        self.reserve(dst, first, hi)
        s, _ = self.span(src, first, hi)
        d, _ = self.span(dst, first, hi)
        self.arena[d] = self.arena[s]

    def nbytes(self) -> int:
        return self.arena.nbytes + self.start.nbytes + self.lo.nbytes + self.cap.nbytes

    # ---- arena management --------------------------------------------------------------
    def _make_room(self, need: int) -> None:
        if self.used + need <= len(self.arena):
            return
        if self.dead > self.live:
            self._compact()
            if self.used + need <= len(self.arena):
                return
        size = max(self.used + need, 2 * (self.live + need), 64)
        arena = np.full(size, -1, dtype=self.dtype)
        arena[:self.used] = self.arena[:self.used]
        self.arena = arena

    def _compact(self) -> None:
        """Pack the live segments at the arena's start (same order, same capacities)."""
        rows = self.cap.nonzero()[0]
        cap = self.cap[rows]
        total = int(np.add.reduce(cap))
        new_start = cap.cumsum() - cap
        src, _ = self.span(rows, self.lo[rows], self.lo[rows] + cap)
        arena = np.full(max(2 * total, 64), -1, dtype=self.dtype)
        arena[:total] = self.arena[src]
        self.arena = arena
        self.start[rows] = new_start
        self.used = total
        self.live = total
        self.dead = 0
