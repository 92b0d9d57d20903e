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


def emit_tables(spaces: tuple[IndexSpace, ...], page_size: int, slot_tables: list[RowSlots],
                firsts: list[np.ndarray], sliding: list[bool], rows: np.ndarray, old: np.ndarray,
                new: np.ndarray, held: np.ndarray, tok_indptr: np.ndarray, tables: bool,
                block_table: bool, allocators: Sequence[SlotAllocator]) -> tuple[SpaceTables, ...]:
    """Slot mappings of the new tokens and the tables of `rows`, for every index space.

    rows: int64 [B] row handles in batch order; old/new: int64 [B] tokens before/after the step;
    held: int64 [B] pages after the step (ceil(new / page_size)); tok_indptr: int64 [B + 1] prefix sum
    of new - old. firsts[g]: int64 [rows] first kept page per row of group g. allocators[g]: group g's
    SlotAllocator (its slot generations are sent beside the pages).
    """
    ps = page_size
    b = len(rows)
    t = int(tok_indptr[-1])
    if t == b and (b == 0 or int((new - old).min()) == 1):     # decode: exactly one new token per row
        tok_rows, pos = rows, old
    else:
        k = new - old
        tok_rows = np.repeat(rows, k)
        pos = np.repeat(old - tok_indptr[:-1], k) + np.arange(t, dtype=np.int64)
    page_of_tok, off_in_page = np.divmod(pos, ps)
    if tables:
        last = (new - (held - 1) * ps).astype(np.int32)
    if block_table:
        bt_width = int(held.max()) if b else 0
        cols = np.arange(bt_width, dtype=np.int64)
    out = []
    gathered: dict[int, tuple] = {}
    for space in spaces:
        g = space.group
        if g not in gathered:
            rs = slot_tables[g]
            first = firsts[g][rows] if sliding[g] else None
            if not t:
                tok_slots = np.zeros(0, dtype=np.int64)
            elif first is not None:
                # A prefix hit's tokens before the window sit in pages this group never held.
                held_tok = page_of_tok >= firsts[g][tok_rows]
                tok_slots = np.full(t, SKIP_SLOT, dtype=np.int64)
                at = np.flatnonzero(held_tok)
                tok_slots[at] = rs.arena.take(rs.flat(tok_rows[at], page_of_tok[at]))
            else:
                tok_slots = rs.arena.take(rs.flat(tok_rows, page_of_tok)).astype(np.int64)
            indptr = idx = sub = None
            if tables:
                lo = first if first is not None else np.zeros(b, dtype=np.int64)
                flat, cnt = rs.span(rows, lo, held)
                indptr = np.zeros(b + 1, dtype=np.int64)
                np.cumsum(cnt, out=indptr[1:])
                idx = rs.arena.take(flat)
            if block_table:
                lo = first if first is not None else np.zeros(b, dtype=np.int64)
                valid = (cols[None, :] >= lo[:, None]) & (cols[None, :] < held[:, None])
                sub = np.full((b, bt_width), -1, dtype=np.int64)
                r_idx, c_idx = np.nonzero(valid)
                sub[r_idx, c_idx] = rs.arena.take(rs.flat(rows[r_idx], c_idx))
            gen = allocators[g].generation
            tok_gen = gen.take(np.maximum(tok_slots, 0))
            if first is not None and t:
                tok_gen[tok_slots == SKIP_SLOT] = 0
            gathered[g] = (tok_slots, indptr, idx, sub, tok_gen, gen.take(idx) if tables else None)
        tok_slots, indptr, idx, sub, tok_gen, idx_gen = gathered[g]
        if (space.scale, space.offset, space.base) == (1, 0, 0):
            mapping = tok_slots * ps + off_in_page
        else:
            mapping = (tok_slots * space.scale + (space.base + space.offset)) * ps + off_in_page
        if sliding[g] and t:
            mapping[tok_slots == SKIP_SLOT] = SKIP_SLOT
        table = PageTable(indptr.astype(space.index_dtype), space.page_indices(idx), last) if tables else None
        bt = None
        if block_table:
            bt = space.page_indices(sub)                  # may be sub itself: its -1 padding stays -1
            bt[sub < 0] = -1
        out.append(SpaceTables(space, mapping, table, bt, tok_gen, idx_gen))
    return tuple(out)
