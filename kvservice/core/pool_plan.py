"""Phase 2 of a Step: every layer group's slot demand and changes, planned without changing anything
(`StepPlan`); the refusal of a step that does not fit.

A base class of kvservice.core.pool.Pool (its state is set up by Pool.__init__; read pool.py first).
"""

from __future__ import annotations

import numpy as np

from kvservice.contract.errors import ResourceExhausted
from kvservice.core.prefix import run_ending_at
from kvservice.core.stepplan import (
    EMPTY_I64,
    GroupPlan,
    Prompt,
    StepInput,
    StepPlan,
    count_in,
    cow_rows,
    distinct_sorted,
)


class PlanPhase:
    """Phase 2 of a Step (part of Pool)."""

    # Reads and writes the attributes Pool.__init__ sets.

    # ---- phase 2: plan (pure) ------------------------------------------------------------
    def _plan(self, inp: StepInput) -> StepPlan:
        """Every group's slot demand and changes, computed before anything changes; ResourceExhausted if short."""
        ps = self.page_size
        e_old = self._num_tokens[inp.e_rows]
        e_new = e_old + inp.e_k
        e_held = self._held[inp.e_rows]
        e_held_new = (e_new + (ps - 1)) // ps
        a_held = (inp.a_n + (ps - 1)) // ps
        hits, cands = self._plan_hits(inp.prompt, len(inp.a_ids)) if inp.prompt is not None else (None, [])
        groups = tuple(self._plan_group(g, inp, e_old, e_held, e_held_new, a_held, hits, cands)
                       for g in range(len(self.allocators)))
        for g, gp in enumerate(groups):
            if gp.need > gp.avail:
                self._refuse(g, gp.need, gp.avail)
        return StepPlan(e_old, e_new, e_held, e_held_new, a_held, groups)

    def _refuse(self, g: int, need: int, avail: int) -> None:
        """Count and raise the refusal of a step that needs more slots of group g than it has."""
        self.refused += 1
        self.alloc_failures["out_of_slots"] = self.alloc_failures.get("out_of_slots", 0) + 1
        free_now = self.allocators[g].num_free
        raise ResourceExhausted(
            f"pool {self.name!r}: this step needs {need} slots in layer group {g} but only {avail} "
            f"are free ({free_now} free + {avail - free_now} released by this step) of "
            f"{self.allocators[g].num_slots}; free or preempt sequences, or plan a bigger pool",
            needed=need, free=avail, num_slots=self.allocators[g].num_slots, group=g)

    def _plan_hits(self, prompt: Prompt, num_admits: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Cached pages each admission takes (hits int64 [A], the same in every group) and each group's
        candidate slot per prompt page (int64 [N]).

        A hit of h pages needs, in every full-attention group, pages 0..h-1 confirmed along the parent
        chain, and in a sliding group of window w only the pages the first computed token attends:
        [first_kept(h), h). The hit is the longest h every group can serve, at most `limit`.
        """
        caches = self.prefixes
        pr = prompt
        cands: list[np.ndarray] = [EMPTY_I64] * len(caches)
        if not len(pr.pages):
            return np.zeros(num_admits, dtype=np.int64), cands
        hits = pr.limit.copy()
        for g, cache in enumerate(caches):
            if not self.windows[g]:
                h, cands[g] = cache.match(pr.pages, pr.row, pr.col, pr.limit, pr.ns, pr.hashes)
                np.minimum(hits, h, out=hits)
        if not self._sliding:
            return hits, cands
        ok_len = (pr.col + 1) <= hits[pr.row]              # h = col + 1 allowed by the full groups and limit
        anchor = self._anchor_group
        for g in self._sliding:
            cand, ok = caches[g].candidates(pr.pages, pr.row, pr.ns, pr.hashes)
            safe = np.maximum(cand, 0)
            if anchor is not None:                          # the very page the full group confirmed
                ok &= caches[g].anchor[safe] == cands[anchor]
            else:                                           # sliding groups only: the parent page's hash
                prev_h = np.zeros(len(cand), dtype=np.uint64)
                inner = (pr.col > 0).nonzero()[0]
                prev_h[inner] = pr.hashes[inner - 1]
                ok &= caches[g].parent_hash[safe] == prev_h
            needed = (pr.col + 1) - self._first_kept(g, pr.col + 1)
            ok_len &= run_ending_at(ok, pr.col) >= needed
            cands[g] = cand
        out = np.zeros(num_admits, dtype=np.int64)
        at = ok_len.nonzero()[0]
        np.maximum.at(out, pr.row[at], pr.col[at] + 1)
        return out, cands

    def _first_kept(self, g: int, tokens_pages: np.ndarray) -> np.ndarray:
        """First page a sequence needs in group g once its first h pages are cached (0 in full groups).

        tokens_pages: int64 [...] h, cached pages. The first computed token (position h * page_size)
        attends tokens from h * page_size + 1 - window on, so pages wholly before that are not needed.
        """
        w = self.windows[g]
        if not w:
            return np.zeros_like(tokens_pages)
        return np.maximum(tokens_pages * self.page_size + 1 - w, 0) // self.page_size

    def _plan_group(self, g: int, inp: StepInput, e_old: np.ndarray, e_held: np.ndarray,
                    e_held_new: np.ndarray, a_held: np.ndarray, hits_all: np.ndarray | None,
                    cands: list[np.ndarray]) -> GroupPlan:
        alloc = self.allocators[g]
        first = self._first[g]
        rs = self._slots[g]
        need = int(np.add.reduce(e_held_new - e_held)) + int(np.add.reduce(a_held))
        # Owners lost (frees, window releases) and gained (fork children) before any allocation.
        f_slots = rs.gather(inp.f_rows, first[inp.f_rows], self._held[inp.f_rows]) if len(inp.f_rows) else None
        dropped = [f_slots] if f_slots is not None else []
        new_first = None
        if self.windows[g] and len(inp.e_rows):
            lo = first[inp.e_rows]
            new_first = np.minimum(np.maximum(lo, (e_old + 1 - self.windows[g]) // self.page_size), e_held)
            dropped.append(rs.gather(inp.e_rows, lo, new_first))
        lost = EMPTY_I64
        if dropped:
            lost = np.concatenate(dropped)
            lost.sort()                               # a fresh array: sorted in place
        gained = np.sort(rs.gather(inp.p_rows, first[inp.p_rows], self._held[inp.p_rows])) \
            if len(inp.p_rows) else EMPTY_I64
        rc = alloc._refcnt

        def owners_after(slots: np.ndarray) -> np.ndarray:
            return rc[slots].astype(np.int64) - count_in(lost, slots) + count_in(gained, slots)

        freed = distinct_sorted(lost)
        freed = freed[owners_after(freed) == 0] if len(freed) else freed
        avail = alloc.num_free + len(freed)
        hits = cand = a_first = None
        if hits_all is not None:
            pr = inp.prompt
            hits, cand = hits_all, cands[g]
            a_first = self._first_kept(g, hits)
            taken = cand[(pr.col < hits[pr.row]) & (pr.col >= a_first[pr.row])]     # a fresh array
            taken.sort()
            taken = distinct_sorted(taken)
            avail -= int((owners_after(taken) == 0).sum())      # cached pages revived from the free LRU
            need -= int(np.add.reduce(hits))
        cow = None
        if (self._sharing or len(inp.p_rows)) and len(inp.e_rows):
            partial = (e_old % self.page_size != 0).nonzero()[0]
            if len(partial):
                rows = inp.e_rows[partial]
                last = rs.arena.take(rs.flat(rows, e_held[partial] - 1)).astype(np.int64)
                owners = owners_after(last)
                if np.logical_or.reduce(owners > 1):
                    cow = np.zeros(len(inp.e_rows), dtype=bool)
                    cow[partial] = cow_rows(last, owners)
                    need += int(np.add.reduce(cow))
        return GroupPlan(need, avail, new_first, cow, hits, cand, a_first, f_slots)
