"""Phase 3 of a Step: the plan carried out (frees, forks, window releases, prefix hits, copy-on-write, new
pages), and what it changed per layer group.

A base class of kvservice.core.pool.Pool (its state is set up by Pool.__init__; read pool.py first).
"""

from __future__ import annotations

import numpy as np

from kvservice.core import fastpaths
from kvservice.core.allocator import SlotAllocator
from kvservice.core.emit import NO_COPIES, NO_ROWS, GroupChanges, StepResult, grown_changes
from kvservice.core.prefix import register_prompt
from kvservice.core.stepplan import (
    Prompt,
    StepInput,
    StepPlan,
    distinct_counts,
    token_indptr,
)


class CommitPhase:
    """Phase 3 of a Step (part of Pool)."""

    # Reads and writes the attributes Pool.__init__ sets.

    # ---- phase 3: commit ---------------------------------------------------------------
    def _commit(self, inp: StepInput, plan: StepPlan, tables: bool, block_table: bool,
                mappings: bool = True) -> StepResult:
        """Carry out a plan (nothing can fail here), then emit the batch's tables."""
        ps = self.page_size
        for alloc in self.allocators:
            alloc.clock = self.steps + 1          # pages released by this step are stamped with it (eviction order)
        self._release(inp.f_rows, [gp.f_slots for gp in plan.groups])
        c_rows = self._take_rows(inp.c_ids)
        if len(c_rows):
            self._fork(inp.p_rows, c_rows)
        e_rows = inp.e_rows
        moves = {g: self._release_window(g, e_rows, plan.groups[g].new_first) for g in self._sliding}
        a_rows = self._take_rows(inp.a_ids)
        hits = plan.groups[0].hits
        for g, rs in enumerate(self._slots):
            gp = plan.groups[g]
            if gp.a_first is not None:                    # a sliding group never holds pages before the window
                self._first[g][a_rows] = gp.a_first
            rs.reserve(a_rows, self._first[g][a_rows], plan.a_held)
            if hits is not None and np.logical_or.reduce(hits):
                self._share_hits(g, a_rows, hits, gp.cand, gp.a_first, inp.prompt)
        a_lo = hits if hits is not None else np.zeros(len(a_rows), dtype=np.int64)
        grown = [self._grow(g, e_rows, plan, a_rows, a_lo, moves.get(g)) for g in range(len(self.allocators))]
        copies = tuple(c for c, _ in grown)
        rows = np.concatenate((e_rows, a_rows, c_rows)) if len(a_rows) or len(c_rows) else e_rows
        c_tokens = self._num_tokens[c_rows]
        old = np.concatenate((plan.e_old, np.zeros(len(a_rows), dtype=np.int64), c_tokens))
        new = np.concatenate((plan.e_new, inp.a_n, c_tokens))
        held_new = (new + (ps - 1)) // ps
        self._num_tokens[rows] = new
        self._held[rows] = held_new
        return self._finish(inp, rows, old, new, held_new, a_rows, hits, copies, tables, block_table,
                            tuple(ch for _, ch in grown), mappings)

    def _finish(self, inp: StepInput, rows: np.ndarray, old: np.ndarray, new: np.ndarray, held_new: np.ndarray,
                a_rows: np.ndarray, hits: np.ndarray | None, copies: tuple[np.ndarray, ...], tables: bool,
                block_table: bool, changes: tuple[GroupChanges, ...], mappings: bool = True) -> StepResult:
        """The end of a committed step (general path and fastpaths.full_group_step): register the admitted
        prompts, count the step and emit its reply for rows (int64 [B], batch order; old/new/held_new int64 [B]
        tokens before, after and pages after; hits int64 [A] or None; copies and changes per layer group;
        no slot mappings or tables when neither tables nor mappings)."""
        if inp.prompt is not None and len(a_rows):
            self._register(a_rows, inp.prompt)
        self.steps += 1
        self.admitted += len(inp.a_ids)
        self._last_batch = (inp.e_ids.copy(), inp.e_rows) if inp.extend_only else None
        tok_indptr = token_indptr(old, new)
        ps = self.page_size
        cached = hits * ps if hits is not None else (np.zeros(len(a_rows), dtype=np.int64) if len(a_rows) else None)
        spaces = self._emit(rows, old, new, held_new, tok_indptr, tables, block_table) if tables or mappings else ()
        return StepResult(self._seq_ids[rows], new, tok_indptr, spaces, self.num_free_slots, cached, copies, changes,
                          len(inp.e_rows))

    def _decode_step(self, e_ids: np.ndarray, rows: np.ndarray, k: np.ndarray, tables: bool,
                     block_table: bool, mappings: bool = True, new: np.ndarray | None = None) -> StepResult | None:
        """fastpaths.decode_step: the steady decode loop (None: the general path runs, and raises)."""
        return fastpaths.decode_step(self, e_ids, rows, k, tables, block_table, mappings, new)

    def _full_group_step(self, inp: StepInput, tables: bool, block_table: bool,
                         mappings: bool = True) -> StepResult | None:
        """fastpaths.full_group_step: one full-attention group, no forks (None: the general path plans it)."""
        return fastpaths.full_group_step(self, inp, tables, block_table, mappings)

    def _grow(self, g: int, e_rows: np.ndarray, plan: StepPlan, a_rows: np.ndarray, a_lo: np.ndarray,
              moved: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, GroupChanges]:
        """Group g: copy-on-write of the planned rows, then the new pages of extensions and admissions.

        moved: the extended rows whose first kept page the step moved, and where to (_release_window).
        Returns int64 [n, 2] (src, dst) slot pairs, in batch order, and the group's GroupChanges.
        """
        alloc = self.allocators[g]
        rs = self._slots[g]
        gp = plan.groups[g]
        copies = NO_COPIES
        cow = cow_slots = NO_ROWS
        if gp.cow is not None and np.logical_or.reduce(gp.cow):
            cow = gp.cow.nonzero()[0]
            rows = e_rows[cow]
            flat = rs.flat(rows, plan.e_held[cow] - 1)
            src = rs.arena.take(flat).astype(np.int64)
            dst = alloc.allocate(len(rows))
            rs.arena[flat] = dst
            alloc.free(src.astype(np.intp))              # other owners keep src (repeats counted)
            cow_slots = dst.astype(np.int64)
            copies = np.stack((src, cow_slots), axis=1)
        if len(a_rows):
            g_rows = np.concatenate((e_rows, a_rows))
            g_lo = np.concatenate((plan.e_held, a_lo))
            g_hi = np.concatenate((plan.e_held_new, plan.a_held))
        else:
            g_rows, g_lo, g_hi = e_rows, plan.e_held, plan.e_held_new
        nz = (g_hi > g_lo).nonzero()[0]
        counts = got = NO_ROWS
        if len(nz):
            g_rows, g_lo, g_hi = g_rows[nz], g_lo[nz], g_hi[nz]
            counts = g_hi - g_lo
            got = self._alloc_pages(g, alloc, g_rows, g_lo, g_hi, int(np.add.reduce(counts)))
        moved_rows, moved_first = moved if moved is not None else (NO_ROWS, NO_ROWS)
        return copies, grown_changes(nz, counts, got, len(e_rows), cow, cow_slots, moved_rows, moved_first)

    def _alloc_pages(self, g: int, alloc: SlotAllocator, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                     total: int) -> np.ndarray:
        """Fill columns [lo, hi) of distinct rows of group g (each hi > lo) with total = sum(hi - lo) new slots;
        returns them (row by row, columns ascending)."""
        rs = self._slots[g]
        rs.reserve(rows, self._first[g][rows], hi)
        if total == len(rows):                             # every row gains exactly one page (decode)
            flat = rs.flat(rows, lo)
        else:
            flat, _ = rs.span(rows, lo, hi)
        got = alloc.allocate(total)
        rs.arena[flat] = got
        return got

    def _release(self, rows: np.ndarray, slots: list[np.ndarray | None], distinct: bool = False,
                 counted: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Frees: every page of the rows loses an owner; the rows leave the pool. slots[g]: the rows' slots in
        group g as the plan gathered them (GroupPlan.f_slots); distinct: the plan found no slot among them twice;
        counted: one group's slots as the plan counted them (distinct ids ascending, repeats), when some repeat."""
        if not len(rows):
            return
        for g, alloc in enumerate(self.allocators):
            if counted is not None:
                alloc.free_counted(counted[0].astype(np.intp, copy=False), counted[1])
            else:
                alloc.free(slots[g].astype(np.intp, copy=False), unique=distinct or not self._sharing)
            self._slots[g].drop(rows)
            self._first[g][rows] = 0
        for seq_id in self._seq_ids[rows].tolist():
            del self._rows[seq_id]
        self._num_tokens[rows] = 0
        self._held[rows] = 0
        self._free_rows.extend(rows.tolist())
        self._sorted = None
        self._last_batch = None

    def _fork(self, p_rows: np.ndarray, c_rows: np.ndarray) -> None:
        """Each child becomes a copy of its parent (as before this step) sharing its slots."""
        self._sharing = True
        self._num_tokens[c_rows] = self._num_tokens[p_rows]
        held = self._held[p_rows]
        self._held[c_rows] = held
        for g, alloc in enumerate(self.allocators):
            first = self._first[g][p_rows]
            self._first[g][c_rows] = first
            self._slots[g].copy_rows(p_rows, c_rows, first, held)
            shared = self._slots[g].gather(p_rows, first, held)
            uniq, counts = np.unique(shared, return_counts=True)
            alloc.share(uniq, counts)

    def _release_window(self, g: int, e_rows: np.ndarray,
                        new_first: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
        """Sliding group g: the extended rows drop the pages wholly before their window. Returns the batch
        positions of the rows whose first kept page moved (int64 [M]) and where to (int64 [M]), or None."""
        if new_first is None:
            return None
        rs = self._slots[g]
        lo = self._first[g][e_rows]
        moved = (new_first != lo).nonzero()[0]
        flat, _ = rs.span(e_rows, lo, new_first)
        if len(flat):
            self.allocators[g].free(rs.arena.take(flat).astype(np.intp), unique=not self._sharing)
            rs.arena[flat] = -1
        self._first[g][e_rows] = new_first
        return moved, new_first[moved]

    def _share_hits(self, g: int, a_rows: np.ndarray, hits: np.ndarray, cand: np.ndarray, a_first: np.ndarray,
                    prompt: Prompt) -> None:
        """Admissions take their cached pages [first kept, hits) of group g, before any page is allocated."""
        rs = self._slots[g]
        mask = (prompt.col < hits[prompt.row]) & (prompt.col >= a_first[prompt.row])
        slots = cand[mask]
        uniq, counts = distinct_counts(slots)
        self.allocators[g].share(uniq, counts)
        rs.arena[rs.flat(a_rows[prompt.row[mask]], prompt.col[mask])] = slots
        self.prefixes[g].hits += len(slots)

    def _register(self, a_rows: np.ndarray, prompt: Prompt) -> None:
        """Make the admissions' full prompt pages findable by later prompts (after the step)."""
        self.prefix.add_namespaces(prompt.new_ns)
        if not len(prompt.pages):
            return
        register_prompt(self.prefixes, self._register_order, self._is_sliding, self._anchor_group, self._slots,
                        self._first, a_rows, prompt)
