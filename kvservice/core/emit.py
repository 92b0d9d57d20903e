"""The last phase of a Step: slot mappings and page tables of the batch, per index space.

Every index space of the pool gets its own arrays, converted from slots with
the space's (base, scale, offset): ``page = base + slot * scale + offset``. A
space's CSR row holds the pages the row still holds in the space's layer group
(a sliding group's row starts at its first kept page). Arrays are gathered once
per layer group with flat takes over the group's `RowSlots` and converted per
space. Beside every page goes its slot's generation (SlotAllocator.generation),
the same in every space of the group: the worker checks it before it reads the page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvservice.contract.geometry import IndexSpace
from kvservice.contract.pagetable import PageTable
from kvservice.core.allocator import SlotAllocator
from kvservice.core.rowslots import RowSlots
from kvservice.core.stepplan import FEW

#: slot_mapping value of a token a layer group does not hold: kernels write nothing for it.
SKIP_SLOT = -1


@dataclass(frozen=True, slots=True)
class SpaceTables:
    """What the kernels of one index space need for a step.

    slot_mapping: shape [num_new_tokens], int64; page_index * page_size + offset_in_page
        for each new token, rows in batch order; -1 (SKIP_SLOT: write nothing, as vLLM's padding
        slot) for a token whose page this space's layer group does not hold: the tokens of a
        prefix hit that lie wholly before a sliding window.
    table: CSR page table of the batch (None if tables were omitted).
    block_table: shape [B, max_pages], index dtype of the space, padded with -1 (None unless asked).
    slot_generations: shape [num_new_tokens], uint32; the generation of each new token's slot (0 for a
        SKIP_SLOT token).
    generations: shape [nnz], uint32, parallel to table.indices: each page's slot generation (None
        when tables were omitted).
    """

    space: IndexSpace
    slot_mapping: np.ndarray
    table: PageTable | None
    block_table: np.ndarray | None
    slot_generations: np.ndarray | None = None
    generations: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class GroupChanges:
    """What one step changed in one layer group's pages of the rows it extended, from its plan.

    An extension changes a row's pages in three ways only, and these are what incremental tables
    (kvservice/manager/delta.py) send for a row the client already holds:

    grown: int64 [R] batch positions of the extended rows that gained pages, ascending;
        counts: int64 [R] the pages each gained; slots: int64 [sum(counts)] their slots, row after row,
        positions ascending: row grown[i]'s pages [held before, held after) of the step.
    cow: int64 [C] batch positions of the extended rows whose last page was copied (copy-on-write: it was
        partly filled and shared), ascending; cow_slots: int64 [C] the slot that now holds that position.
    moved: int64 [M] batch positions of the extended rows whose first kept page moved (a sliding window
        released pages at their front), ascending; moved_first: int64 [M] that row's first kept page now.
    """

    grown: np.ndarray
    counts: np.ndarray
    slots: np.ndarray
    cow: np.ndarray
    cow_slots: np.ndarray
    moved: np.ndarray
    moved_first: np.ndarray


@dataclass(frozen=True, slots=True)
class StepResult:
    """Outcome of one step for the scheduled batch (extended, then admitted, then forked sequences).

    seq_ids: shape [B], uint64.
    num_tokens: shape [B], int64; tokens each sequence holds after the step.
    new_token_indptr: shape [B + 1], int64; row b's new tokens are [indptr[b], indptr[b+1]).
    tables: one entry per index space of the pool, in index-space order.
    num_free_slots: free slots after the step (fewest over the groups).
    cached_tokens: shape [A], int64; tokens of each admission found in the prefix cache.
    copies: per layer group, int64 [n, 2] (src_slot, dst_slot) pairs to copy before the kernels run.
    changes: per layer group, what the step changed in the rows it extended (GroupChanges); the rows
        after them (admitted, forked) are new and described whole by the pool's tables.
    num_extended: E, the extended rows at the front of the batch.
    repeat: the batch is the pool's previous step's batch, in the same order, each row extended and nothing
        shared, freed, admitted or released (the steady decode fast path).
    """

    seq_ids: np.ndarray
    num_tokens: np.ndarray
    new_token_indptr: np.ndarray
    tables: tuple[SpaceTables, ...]
    num_free_slots: int
    cached_tokens: np.ndarray | None = None
    copies: tuple[np.ndarray, ...] = ()
    changes: tuple[GroupChanges, ...] = ()
    num_extended: int = 0
    repeat: bool = False


NO_COPIES = np.zeros((0, 2), dtype=np.int64)    # StepResult.copies of a group that copies nothing
NO_ROWS = np.zeros(0, dtype=np.int64)            # no rows (read-only)
NO_ROWS.flags.writeable = False
NO_CHANGES = GroupChanges(NO_ROWS, NO_ROWS, NO_ROWS, NO_ROWS, NO_ROWS, NO_ROWS, NO_ROWS)   # a group nothing changed in


def grown_changes(nz: np.ndarray, counts: np.ndarray, slots: np.ndarray, num_extended: int,
                  cow: np.ndarray = NO_ROWS, cow_slots: np.ndarray = NO_ROWS, moved: np.ndarray = NO_ROWS,
                  moved_first: np.ndarray = NO_ROWS) -> GroupChanges:
    """GroupChanges of a group whose rows [extended..., others...] at batch positions nz (int64 [R], ascending)
    gained counts (int64 [R]) pages, whose slots (int64 [sum(counts)], row after row) the allocation returned:
    the extended rows' part of it (the others are new rows, described whole)."""
    k = int(nz.searchsorted(num_extended)) if len(nz) and int(nz[-1]) >= num_extended else len(nz)
    if k < len(nz):
        nz, counts = nz[:k], counts[:k]
        slots = slots[:int(np.add.reduce(counts))]
    return GroupChanges(nz, counts, slots.astype(np.int64, copy=False), cow, cow_slots, moved, moved_first)


def emit_tables(spaces: tuple[IndexSpace, ...], page_size: int, slot_tables: list[RowSlots],
                firsts: list[np.ndarray], sliding: list[bool], rows: np.ndarray, old: np.ndarray,
                new: np.ndarray, held: np.ndarray, tok_indptr: np.ndarray, tables: bool,
                block_table: bool, allocators: Sequence[SlotAllocator]) -> tuple[SpaceTables, ...]:
    """Slot mappings of the new tokens and the tables of `rows`, for every index space.

    rows: int64 [B] row handles in batch order; old/new: int64 [B] tokens before/after the step;
    held: int64 [B] pages after the step (ceil(new / page_size)); tok_indptr: int64 [B + 1] prefix sum
    of new - old. firsts[g]: int64 [rows] first kept page per row of group g. allocators[g]: group g's
    SlotAllocator (its slot generations are sent beside the pages).

    The new tokens of a page are consecutive positions of it, so their slot mapping is one run
    ``page * page_size + offset, offset + 1, ...``: everything is gathered and converted per page (of
    the new tokens) and only expanded to tokens at the end (a repeat and an add per array), whatever
    the number of tokens. A decode step (one token per row) has one page per row and skips the expansion.
    """
    if not (tables or block_table or any(sliding)) and len(rows) <= FEW:
        return few_row_mappings(spaces, page_size, slot_tables, rows, old, new, held, allocators)
    ps = page_size
    b = len(rows)
    t = int(tok_indptr[-1])
    pg = _NewPages.of(ps, rows, old, new, held, tok_indptr, t)
    if tables:
        last = (new - (held - 1) * ps).astype(np.int32)
    if block_table:
        bt_width = int(np.maximum.reduce(held)) if b else 0
        cols = np.arange(bt_width, dtype=np.int64)
    out = []
    gathered: dict[int, tuple] = {}
    for space in spaces:
        g = space.group
        if g not in gathered:
            rs = slot_tables[g]
            first = firsts[g][rows] if sliding[g] else None
            pg_slots, skip = pg.slots(rs, firsts[g] if first is not None else None)
            indptr = idx = sub = None
            if tables:
                lo = first if first is not None else np.zeros(b, dtype=np.int64)
                flat, cnt = rs.span(rows, lo, held)
                indptr = np.zeros(b + 1, dtype=np.int64)
                cnt.cumsum(out=indptr[1:])
                idx = rs.arena.take(flat)
            if block_table:
                lo = first if first is not None else np.zeros(b, dtype=np.int64)
                valid = (cols[None, :] >= lo[:, None]) & (cols[None, :] < held[:, None])
                sub = np.full((b, bt_width), -1, dtype=np.int64)
                r_idx, c_idx = np.nonzero(valid)
                sub[r_idx, c_idx] = rs.arena.take(rs.flat(rows[r_idx], c_idx))
            gen = allocators[g].generation
            pg_gen = gen.take(np.maximum(pg_slots, 0) if skip is not None else pg_slots)
            if skip is not None:
                pg_gen[skip] = 0
            gathered[g] = (pg_slots, skip, indptr, idx, sub, pg.expand(pg_gen),
                           gen.take(idx) if tables else None)
        pg_slots, skip, indptr, idx, sub, tok_gen, idx_gen = gathered[g]
        if (space.scale, space.offset, space.base) == (1, 0, 0):
            pg_base = pg_slots * ps
        else:
            pg_base = (pg_slots * space.scale + (space.base + space.offset)) * ps
        mapping = pg.runs(pg_base)
        if skip is not None:
            mapping[pg.expand(skip)] = SKIP_SLOT
        table = PageTable(indptr.astype(space.index_dtype), space.page_indices(idx), last) if tables else None
        bt = None
        if block_table:
            bt = space.page_indices(sub)                  # may be sub itself: its -1 padding stays -1
            bt[sub < 0] = -1
        out.append(SpaceTables(space, mapping, table, bt, tok_gen, idx_gen))
    return tuple(out)


_IOTA = np.arange(4096, dtype=np.int64)


def _iota(n: int) -> np.ndarray:
    """int64 [n] = 0, 1, ..., n - 1 (a read-only view of a shared array grown as needed)."""
    global _IOTA
    if len(_IOTA) < n:
        _IOTA = np.arange(max(n, 2 * len(_IOTA)), dtype=np.int64)
        _IOTA.flags.writeable = False
    return _IOTA[:n]


_IOTA.flags.writeable = False


@dataclass(frozen=True, slots=True)
class _NewPages:
    """The pages the new tokens of a step land in, P of them, in batch order (a row's pages ascending).

    row: int64 [P] batch index of each page's row; col: int64 [P] the page (column) in its row;
    first_off: int64 [P] offset in the page of its first new token; count: int64 [P] new tokens in it
    (None for a decode step: one page per row, one token each); t: new tokens in all.
    """

    rows: np.ndarray
    col: np.ndarray
    first_off: np.ndarray
    count: np.ndarray | None
    t: int

    @staticmethod
    def of(ps: int, rows: np.ndarray, old: np.ndarray, new: np.ndarray, held: np.ndarray,
           tok_indptr: np.ndarray, t: int) -> _NewPages:
        b = len(rows)
        if t == b and (b == 0 or int(np.minimum.reduce(new - old)) == 1):     # decode: exactly one new token per row
            col, off = np.divmod(old, ps)
            return _NewPages(rows, col, off, None, t)
        k = new - old
        p0 = old // ps
        c = np.where(k > 0, held - p0, 0)                   # pages holding new tokens, per row
        n = int(np.add.reduce(c))
        at = np.arange(b, dtype=np.int64).repeat(c)
        starts = c.cumsum() - c
        col = (p0 - starts).repeat(c) + _iota(n)
        lo = col * ps
        first_off = np.maximum(old[at] - lo, 0)
        count = np.minimum(new[at] - lo, ps) - first_off
        return _NewPages(rows[at], col, first_off, count, t)

    def slots(self, rs: RowSlots, first: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(int64 [P] the slot of each page, bool [P] pages wholly before a sliding group's first kept page
        (their slot -1), or None when the group holds every page: first is None)."""
        if first is None:
            return rs.arena.take(rs.flat(self.rows, self.col)).astype(np.int64), None
        skip = self.col < first[self.rows]
        out = np.full(len(self.col), SKIP_SLOT, dtype=np.int64)
        at = (~skip).nonzero()[0]
        out[at] = rs.arena.take(rs.flat(self.rows[at], self.col[at]))
        return out, skip

    def expand(self, per_page: np.ndarray) -> np.ndarray:
        """One value per page -> one per new token ([t])."""
        return per_page if self.count is None else per_page.repeat(self.count)

    def runs(self, base: np.ndarray) -> np.ndarray:
        """int64 [t]: each page's new tokens numbered base + first_off, base + first_off + 1, ...
        (base: int64 [P], the page's first slot-mapping value)."""
        v = base + self.first_off
        if self.count is None:
            return v
        v -= self.count.cumsum() - self.count             # minus the tokens before the page ...
        out = v.repeat(self.count)
        out += _iota(self.t)                                 # ... plus the token's index: consecutive runs
        return out


def few_row_mappings(spaces: tuple[IndexSpace, ...], page_size: int, slot_tables: list[RowSlots], rows: np.ndarray,
                     old: np.ndarray, new: np.ndarray, held: np.ndarray,
                     allocators: Sequence[SlotAllocator]) -> tuple[SpaceTables, ...]:
    """emit_tables(..., tables=False, block_table=False) for a batch of a few rows (stepplan.FEW) in a pool without
    sliding groups: the same slot mappings and generations, with the pages of the new tokens listed by a loop
    over the rows' Python ints and each row's slots taken as one slice of its segment (a handful of NumPy
    calls in all, where the vectorised path makes some thirty on arrays of a few elements)."""
    ps = page_size
    spans: list[tuple[int, int, int]] = []          # (row, first page, end page) of each row with new tokens
    cnt: list[int] = []                              # new tokens per page
    adj: list[int] = []                              # per page: offset of its first new token - new tokens before it
    before = 0
    for r, o, n, h in zip(rows.tolist(), old.tolist(), new.tolist(), held.tolist(), strict=True):
        if n <= o:
            continue
        p0 = o // ps
        spans.append((r, p0, h))
        fo = o - p0 * ps                             # the first page's first new token; later pages start at 0
        adj.append(fo - before)
        if h - p0 == 1:
            cnt.append(n - o)
        else:                                        # full pages between a partial first and a last page
            cnt.append(ps - fo)
            cnt.extend([ps] * (h - p0 - 2))
            cnt.append(n - (h - 1) * ps)
            after = before + ps - fo
            adj.extend(range(-after, -after - (h - p0 - 1) * ps, -ps))
        before += n - o
    counts = np.array(cnt, dtype=np.int64)
    shift = np.array(adj, dtype=np.int64)
    out = []
    gathered: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for space in spaces:
        g = space.group
        if g not in gathered:
            rs = slot_tables[g]
            arena, start, lo_col = rs.arena, rs.start, rs.lo
            parts = [arena[int(start[r] - lo_col[r]) + p0:int(start[r] - lo_col[r]) + h] for r, p0, h in spans]
            if len(parts) == 1:
                pg_slots = parts[0].astype(np.int64)
            else:
                pg_slots = np.concatenate(parts).astype(np.int64, copy=False) if parts else \
                    np.zeros(0, dtype=np.int64)
            gathered[g] = (pg_slots, allocators[g].generation.take(pg_slots).repeat(counts))
        pg_slots, tok_gen = gathered[g]
        if (space.scale, space.offset, space.base) == (1, 0, 0):
            v = pg_slots * ps
        else:
            v = (pg_slots * space.scale + (space.base + space.offset)) * ps
        v += shift
        mapping = v.repeat(counts)
        mapping += _iota(before)
        out.append(SpaceTables(space, mapping, None, None, tok_gen, None))
    return tuple(out)
