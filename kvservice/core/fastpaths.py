"""The fast paths of a Step, each returning exactly what the general path (pool.py: validate -> plan -> commit
-> emit) would, with fewer NumPy calls:

- `decode_step` (Pool._decode_step): the steady decode loop, the last step's batch extended again with nothing
  freed, admitted, shared or released;
- `full_group_step` (Pool._full_group_step): a step without forks of a pool with one full-attention layer
  group. The general path plans every layer group's demand, window releases, copy-on-write and fork sharing;
  this shape needs none of that but the counts, which this function computes, refusing exactly as
  `Pool._plan` does, and commits with the pool's own helpers (release, rows, segments, pages, registration,
  emission).

The reference-model differential test (tests/unit/test_differential.py) drives both and the general path with
the same random op mixes and counts each fast path's answers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvservice.core.emit import NO_CHANGES, NO_COPIES, NO_ROWS, GroupChanges, StepResult, grown_changes
from kvservice.core.stepplan import EMPTY_I64, FEW, StepInput, count_in, distinct_counts, distinct_sorted

#: The kvservice.core.pool.Pool a fast path serves (not imported here: pool.py imports this module).
Pool = Any


def full_group_step(pool: Pool, inp: StepInput, tables: bool, block_table: bool,
                    mappings: bool = True) -> StepResult | None:
    """A step of a pool with one full-attention layer group and no fork in it: frees, extensions and
    admissions (prefix hits included), planned and committed without the general path's per-group plan.

    The same result, the same refusal and the same state as `Pool._plan` + `Pool._commit` (the reference-model
    differential test drives both). Returns None, having changed nothing, when an extended row's partly
    filled last page has other owners (copy-on-write: the general path plans it).
    """
    ps = pool.page_size
    alloc, rs, first = pool.allocators[0], pool._slots[0], pool._first[0]
    rc = alloc._refcnt
    e_rows, f_rows, a_n, prompt = inp.e_rows, inp.f_rows, inp.a_n, inp.prompt
    e_old = pool._num_tokens[e_rows]
    e_held = pool._held[e_rows]
    e_new = e_old + inp.e_k
    e_held_new = (e_new + (ps - 1)) // ps
    a_held = (a_n + (ps - 1)) // ps
    few = len(e_rows) <= FEW
    if pool._sharing and len(e_rows):
        if few:
            if _shares_last_page(rs, rc, ps, e_rows.tolist(), e_old.tolist(), e_held.tolist()):
                return None
        elif len(partial := (e_old % ps).nonzero()[0]):
            last = rs.arena.take(rs.flat(e_rows[partial], e_held[partial] - 1))
            if int(np.maximum.reduce(rc.take(last))) > 1:
                return None
    # ---- plan (nothing changes before the refusal) ----
    need = _pages_needed(e_held, e_held_new, a_held)
    avail = alloc.num_free
    lost = None
    f_slots = None
    distinct = False
    counted = None
    if len(f_rows):
        f_slots = rs.gather(f_rows, first[f_rows], pool._held[f_rows])
        lost = np.sort(f_slots)
        uniq, counts = distinct_counts(lost)
        distinct = counts is None                       # then the free needs no check for repeats
        if counts is not None and len(lost):           # repeats: the free takes them as counted here
            counted = (uniq, counts)
        avail += np.count_nonzero(rc.take(uniq) == (1 if counts is None else counts))
    hits = cand = None
    h0 = 0
    if prompt is not None:
        hits, cands = pool._plan_hits(prompt, len(inp.a_ids))
        cand = cands[0]
        h0 = int(hits[0]) if len(hits) == 1 else -1           # one prompt: its hit is its first h0 pages
        if len(cand):
            taken = cand[:h0].copy() if h0 >= 0 else cand[prompt.col < hits[prompt.row]]   # a fresh array
            if len(taken):
                taken.sort()
                taken = distinct_sorted(taken)
                owners = rc.take(taken)
                if lost is not None:
                    owners = owners - count_in(lost, taken)
                avail -= np.count_nonzero(owners == 0)        # cached pages revived from the free LRU
            need -= int(np.add.reduce(hits))
    if need > avail:
        pool._refuse(0, need, avail)
    # ---- commit ----
    alloc.clock = pool.steps + 1
    pool._release(f_rows, [f_slots], distinct, counted)
    a_rows = pool._take_rows(inp.a_ids)                 # may grow the row arrays
    a_lo = EMPTY_I64
    if len(a_rows):
        rs.reserve(a_rows, pool._first[0][a_rows], a_held)
        a_lo = hits if hits is not None else np.zeros(len(a_rows), dtype=np.int64)
        if h0 > 0:                                      # one prompt: its hit pages are one slice of its segment
            slots = cand[:h0]
            # A confirmed chain (page 0 without a parent, page j's parent the slot of page j - 1) never names a
            # slot twice, so its slots are shared as they are, without counting repeats.
            alloc.share(slots)
            r0 = int(a_rows[0])
            at0 = rs.start.item(r0) - rs.lo.item(r0)
            rs.arena[at0:at0 + h0] = slots
            pool.prefixes[0].hits += h0
        elif h0 < 0 and hits is not None and len(cand):
            mask = prompt.col < hits[prompt.row]
            slots = cand[mask]
            if len(slots):
                uniq, counts = distinct_counts(slots)
                alloc.share(uniq, counts)
                rs.arena[rs.flat(a_rows[prompt.row[mask]], prompt.col[mask])] = slots
                pool.prefixes[0].hits += len(slots)
        g_rows = np.concatenate((e_rows, a_rows))
        g_lo = np.concatenate((e_held, a_lo))
        g_hi = np.concatenate((e_held_new, a_held))
        rows = g_rows
        old = np.concatenate((e_old, np.zeros(len(a_rows), dtype=np.int64)))
        new = np.concatenate((e_new, a_n))
        held_new = g_hi
    else:
        g_rows, g_lo, g_hi = e_rows, e_held, e_held_new
        rows, old, new, held_new = e_rows, e_old, e_new, e_held_new
    changes = _grow_rows(pool, alloc, g_rows, g_lo, g_hi, len(e_rows))
    pool._num_tokens[rows] = new
    pool._held[rows] = held_new
    return pool._finish(inp, rows, old, new, held_new, a_rows, hits, (NO_COPIES,), tables, block_table, (changes,),
                        mappings)


def _pages_needed(e_held: np.ndarray, e_held_new: np.ndarray, a_held: np.ndarray) -> int:
    """New pages of the extended rows (held before, after) and of the admissions (int64 arrays)."""
    if len(e_held) <= FEW and len(a_held) <= FEW:      # a few rows: summed as Python ints
        return sum(e_held_new.tolist()) - sum(e_held.tolist()) + sum(a_held.tolist())
    return int(np.add.reduce(e_held_new - e_held)) + int(np.add.reduce(a_held))


def _grow_rows(pool: Pool, alloc: Any, g_rows: np.ndarray, g_lo: np.ndarray, g_hi: np.ndarray,
               num_extended: int) -> GroupChanges:
    """Fill columns [lo, hi) of the rows (int64 [n] each, hi >= lo; the extended rows first, num_extended of them)
    with new slots of the one group; returns the group's changes (the extended rows' new slots)."""
    if len(g_rows) <= FEW:                              # a few rows: their growth as Python ints
        lo_l, hi_l = g_lo.tolist(), g_hi.tolist()
        grow = [h - lo for h, lo in zip(hi_l, lo_l, strict=True)]
        total = sum(grow)
        if not total:
            return NO_CHANGES
        at = [j for j, k in enumerate(grow) if k]
        rows_l = g_rows.tolist()
        got = _alloc_few(pool, alloc, [rows_l[j] for j in at], [lo_l[j] for j in at], [hi_l[j] for j in at], total)
        return grown_changes(np.array(at, dtype=np.int64), np.array([grow[j] for j in at], dtype=np.int64), got,
                             num_extended)
    else:
        grow = g_hi - g_lo
        nz = grow.nonzero()[0]
        total = int(np.add.reduce(grow)) if len(nz) else 0
        if not total:
            return NO_CHANGES
        counts = grow
        if len(nz) < len(grow):
            g_rows, g_lo, g_hi, counts = g_rows[nz], g_lo[nz], g_hi[nz], grow[nz]
    got = pool._alloc_pages(0, alloc, g_rows, g_lo, g_hi, total)
    return grown_changes(nz, counts, got, num_extended)


def _alloc_few(pool: Pool, alloc: Any, rows: list[int], lo: list[int], hi: list[int], total: int) -> np.ndarray:
    """Pool._alloc_pages for a few distinct rows of the one group (Python ints, each hi > lo): the same segments,
    allocation and arena contents, each row's new columns written as one slice of its segment."""
    rs = pool._slots[0]
    first = pool._first[0].item
    rs.reserve_few(rows, [first(r) for r in rows], hi)
    got = alloc.allocate(total)
    arena, start, col0 = rs.arena, rs.start.item, rs.lo.item
    k = 0
    for r, a, b in zip(rows, lo, hi, strict=True):
        at = start(r) - col0(r) + a
        arena[at:at + b - a] = got[k:k + b - a]
        k += b - a
    return got


def _shares_last_page(rs: Any, rc: np.ndarray, ps: int, rows: list[int], old: list[int], held: list[int]) -> bool:
    """Whether one of a few extended rows (Python ints: row, tokens and pages before the step) writes into a partly
    filled last page that other sequences own too (refcount rc > 1: copy-on-write, for the general path)."""
    arena, start, lo, owners = rs.arena.item, rs.start.item, rs.lo.item, rc.item
    return any(o % ps and owners(arena(start(r) + h - 1 - lo(r))) > 1 for r, o, h in zip(rows, old, held, strict=True))


def decode_step(pool: Pool, e_ids: np.ndarray, rows: np.ndarray, k: np.ndarray, tables: bool,
                block_table: bool, mappings: bool = True, new: np.ndarray | None = None) -> StepResult | None:
    """The steady decode loop: the last step's batch grows again, nothing freed, admitted, shared or released.

    Same result as the general path with fewer NumPy calls. Returns None (the general path then
    runs, and raises) if the step would fail. new: int64 [B] the rows' tokens after the step, if the
    caller has them (validation computed them); else computed here.
    """
    ps = pool.page_size
    if new is None:
        new = pool._num_tokens[rows] + k
    held_old = pool._held[rows]
    held_new = (new + (ps - 1)) // ps
    need = held_new - held_old
    total = int(np.add.reduce(need))
    if total > pool.num_free_slots:
        return None
    changes: tuple[GroupChanges, ...] = tuple(NO_CHANGES for _ in pool.allocators)
    if total:
        nz = need.nonzero()[0]
        g_rows, g_lo, g_hi = rows[nz], held_old[nz], held_new[nz]
        counts = g_hi - g_lo
        changes = tuple(GroupChanges(nz, counts, pool._alloc_pages(g, alloc, g_rows, g_lo, g_hi, total),
                                     NO_ROWS, NO_ROWS, NO_ROWS, NO_ROWS) for g, alloc in enumerate(pool.allocators))
    pool._num_tokens[rows] = new
    pool._held[rows] = held_new
    pool.steps += 1
    b = len(rows)
    tok_indptr = np.zeros(b + 1, dtype=np.int64)
    k.cumsum(out=tok_indptr[1:])
    spaces = pool._emit(rows, new - k, new, held_new, tok_indptr, tables, block_table) if tables or mappings else ()
    return StepResult(pool._seq_ids[rows], new, tok_indptr, spaces, pool.num_free_slots, None,
                      tuple(NO_COPIES for _ in pool.allocators), changes, b, True)
