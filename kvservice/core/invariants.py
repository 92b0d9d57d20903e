"""docs/DESIGN.md's invariants, checked in one place: on a pool's state, and on a live pool.

check_pool_state(state, plan) checks a PoolState (vectorised; it never trusts what it reads): recovery runs
it before a pool is rebuilt from a snapshot, the journal after replay, and `kvservice check-state`.
pool_problems(pool) runs it on a live pool's export and adds what an export cannot show: each allocator's
own bookkeeping (refcounts against the owners the state lists, the cacheable flags), the prefix caches'
entries against their slots, and the page tables the pool emits (inside and on the lattice of their index
space). Tests call assert_invariants(pool) after every operation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvservice.contract.pagetable import validate_page_table
from kvservice.contract.sizing import Plan
from kvservice.core.pool import Pool
from kvservice.core.pool_state import POOL_STATE_VERSION, POOL_STATE_VERSIONS, PoolState

MAX_PROBLEMS = 12


def assert_invariants(pool: Pool) -> None:
    """Raise AssertionError naming the first broken invariant (and how many were found)."""
    problems = pool_problems(pool)
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:3])})" if len(problems) > 1 else ""
        raise AssertionError(problems[0] + more)


def pool_problems(pool: Pool) -> list[str]:
    """The broken invariants of a live pool ([] if sound): its state's, then what only the live pool shows."""
    state = pool.export_state()
    problems = check_pool_state(state, pool.plan)
    if problems:
        return problems
    return _live_problems(pool, state)


def _live_problems(pool: Pool, state: PoolState) -> list[str]:
    """What an export does not show: allocators, prefix caches, emitted tables.

    (Pages held per sequence need no check here: the export gathers each row's slots by its own count, so a
    row that holds too many or too few changes the state's total, its slot ranges or its owners, which
    check_pool_state and the refcount check below see.)
    """
    out: list[str] = []
    geo, a = pool.plan.geometry, state.arrays
    ids = a["seq_ids"]
    for g, alloc in enumerate(pool.allocators):
        try:
            alloc.check()
        except AssertionError as err:
            out.append(f"group {g}: {err}")
        num_slots = geo.groups[g].num_slots
        if alloc.num_slots != num_slots:
            out.append(f"group {g}: allocator of {alloc.num_slots} slots, plan {num_slots}")
            continue
        # 1. refcount == number of owners.
        owners = np.bincount(a[f"slots/{g}"], minlength=num_slots)
        rc = alloc.refcount(np.arange(num_slots))
        if (rc != owners).any():
            out.append(f"group {g}: refcount != owners at slot {np.flatnonzero(rc != owners)[:5].tolist()}")
    for g, cache in enumerate(pool.prefixes or ()):
        alloc = pool.allocators[g]
        if cache.allocator is not alloc:
            out.append(f"group {g}: prefix cache over another group's allocator")
            continue
        for h, slot in cache.by_hash.items():
            if int(cache.hash[slot]) != h or not alloc.cacheable[slot]:
                out.append(f"group {g}: cache entry {h:#x} -> slot {slot} is stale")
                break
        if int(alloc.cacheable.sum()) != len(cache.by_hash):
            out.append(f"group {g}: {int(alloc.cacheable.sum())} cacheable slots, {len(cache.by_hash)} cache entries")
    # 4. every emitted index lies inside and on the lattice of its own space.
    if len(ids) and not out:
        for st in pool.tables_for(ids):
            report = validate_page_table(st.table, st.space, pool.page_size, pool_pages=geo.pool_pages)
            if not report.ok:
                out.append(f"index space {st.space.id}: {report.violations[:3]}")
    return out[:MAX_PROBLEMS]


def check_pool_state(state: PoolState, p: Plan) -> list[str]:
    """docs/DESIGN.md's invariants on a pool's state (vectorised); the problems found, [] if it is sound."""
    m, a = state.meta, state.arrays
    groups = p.geometry.groups
    schema = _check_arrays(m, a, len(groups))
    if schema:
        return schema
    out: list[str] = []

    def bad(msg: str) -> None:
        if len(out) < MAX_PROBLEMS:
            out.append(msg)

    num = len(a["seq_ids"])
    if len(a["rows"]) != num or len(a["num_tokens"]) != num or any(len(a[f"first/{g}"]) != num
                                                                    for g in range(len(groups))):
        return [f"{num} sequence ids but other per-sequence arrays differ in length"]
    if not _check_rows(m, a, p, bad):
        return out
    held = (a["num_tokens"] + (p.page_size - 1)) // p.page_size
    for g, grp in enumerate(groups):
        _check_group(m, a, g, grp, p.page_size, held, bad)
    if m["prefix_caching"]:
        _check_prefix(m, a, groups, p.page_size, p.num_slots, bad)
    if min(int(m["steps"]), int(m["admitted"]), int(m["refused"])) < 0:
        bad("a counter is negative")
    return out


def _check_arrays(m: dict, a: dict, num_groups: int) -> list[str]:
    """The state's version, and its arrays: exactly the expected names, each of its dtype and rank."""
    i8, u8 = np.dtype("<i8"), np.dtype("<u8")
    want = {"seq_ids": (u8, 1), "rows": (i8, 1), "num_tokens": (i8, 1), "free_rows": (i8, 1)}
    for g in range(num_groups):
        want |= {f"first/{g}": (i8, 1), f"slots/{g}": (i8, 1), f"free_stack/{g}": (i8, 1), f"cached/{g}": (i8, 1)}
    if m.get("prefix_caching"):
        for g in range(num_groups):
            want |= {f"prefix/{g}/hash": (u8, 1), f"prefix/{g}/slot": (i8, 1), f"prefix/{g}/parent": (i8, 1),
                     f"prefix/{g}/parent_hash": (u8, 1), f"prefix/{g}/anchor": (i8, 1),
                     f"prefix/{g}/namespace": (i8, 1), f"prefix/{g}/tokens": (i8, 2)}
    if m.get("version") not in POOL_STATE_VERSIONS:
        return [f"pool state version {m.get('version')} is not one of {POOL_STATE_VERSIONS} (this release writes "
                f"{POOL_STATE_VERSION})"]
    if m["version"] >= 3:
        want |= {f"generation/{g}": (i8, 1) for g in range(num_groups)}
    optional = {f"cached_stamp/{g}": (i8, 1) for g in range(num_groups)}     # absent in older snapshots
    if m.get("prefix_caching"):
        optional |= {f"prefix/{g}/linked": (i8, 1) for g in range(num_groups)}
    want |= {k: v for k, v in optional.items() if k in a}
    if set(a) != set(want):
        return [f"arrays {sorted(set(a) ^ set(want))} missing or unexpected"]
    for k, (dt, nd) in want.items():
        if a[k].dtype != dt or a[k].ndim != nd:
            return [f"array {k} is {a[k].dtype} with {a[k].ndim} dims, expected {dt} with {nd}"]
    return []


def _check_rows(m: dict, a: dict, p: Plan, bad: Callable[[str], None]) -> bool:
    """Sequence ids, rows, free rows and token counts; False when the token counts make the rest unreadable."""
    ids, rows, n, free_rows = a["seq_ids"], a["rows"], a["num_tokens"], a["free_rows"]
    num, cap, num_rows = len(ids), int(m["row_capacity"]), int(m["num_rows"])
    if _repeats(ids):
        bad("a sequence id is live twice")
    if num and ((np.diff(rows) <= 0).any() or rows[0] < 0 or rows[-1] >= num_rows):
        bad("sequence rows are not distinct, sorted and below num_rows")
    if len(free_rows) and ((free_rows < 0).any() or (free_rows >= num_rows).any()
                           or _repeats(free_rows) or np.isin(free_rows, rows).any()):
        bad("free rows are out of range, repeated, or also live")
    if num + len(free_rows) != num_rows or not num_rows <= cap <= max(16, 2 * num_rows):
        bad(f"{num} live + {len(free_rows)} free rows != num_rows {num_rows}, or row capacity {cap} is off")
    if num and (n.min() <= 0 or n.max() > p.max_seq_len):
        bad(f"a sequence holds {int(n.min())}..{int(n.max())} tokens, outside 1..max_seq_len={p.max_seq_len}")
        return False
    return True


def _check_group(m: dict, a: dict, g: int, grp: object, ps: int, held: np.ndarray,
                 bad: Callable[[str], None]) -> None:
    """One layer group: slot generations, first kept pages (windows), then its slots."""
    n = a["num_tokens"]
    num_slots = grp.num_slots                                          # type: ignore[attr-defined]
    first, slots = a[f"first/{g}"], a[f"slots/{g}"]
    gen = a.get(f"generation/{g}")
    if gen is not None and (len(gen) != num_slots or (len(gen) and (gen.min() < 0 or gen.max() >= 2**32))):
        bad(f"group {g}: slot generations are not {num_slots} values in [0, 2^32)")
    if (first < 0).any() or (first > held).any():
        bad(f"group {g}: a first held page is outside [0, held]")
        return
    w = grp.sliding_window                                             # type: ignore[attr-defined]
    if not w and first.any():
        bad(f"group {g}: a full-attention group released pages")
    elif w and ((first > 0) & (first * ps > np.maximum(0, n + 1 - w))).any():
        bad(f"group {g}: a page still inside the sliding window of {w} tokens was released")
    if len(slots) != int((held - first).sum()):
        bad(f"group {g}: {len(slots)} slots for {int((held - first).sum())} held pages")
        return
    _check_group_slots(m, a, g, num_slots, bad)


def _check_group_slots(m: dict, a: dict, g: int, num_slots: int, bad: Callable[[str], None]) -> None:
    """One layer group's slots: in range, owned or free (never both, never free twice), cached ones stamped."""
    slots, stack, cached = a[f"slots/{g}"], a[f"free_stack/{g}"], a[f"cached/{g}"]
    every = np.concatenate((slots, stack, cached))
    if len(every) and (every.min() < 0 or every.max() >= num_slots):
        bad(f"group {g}: a slot id is outside [0, {num_slots})")
        return
    owners = np.bincount(slots, minlength=num_slots)
    if not m["sharing"] and owners.max(initial=0) > 1:
        bad(f"group {g}: slots have several owners in a pool that never shared")
    free = np.concatenate((stack, cached))
    times_free = np.bincount(free, minlength=num_slots)
    if times_free.max(initial=0) > 1:
        bad(f"group {g}: a slot is free twice")
    both = np.flatnonzero((owners > 0) & (times_free > 0))
    if len(both):
        bad(f"group {g}: a free slot is also owned (slot {int(both[0])})")
    if len(free) + int(np.count_nonzero(owners)) != num_slots:
        bad(f"group {g}: {len(free)} free + {int(np.count_nonzero(owners))} owned != {num_slots} slots")
    stamps = a.get(f"cached_stamp/{g}")
    if stamps is not None and (len(stamps) != len(cached) or (len(stamps) and stamps.min() < 0)):
        bad(f"group {g}: {len(stamps)} release stamps for {len(cached)} cached slots, or a negative one")
    if not m["prefix_caching"] and len(cached):
        bad(f"group {g}: cached free slots without a prefix cache")
    if int(m["groups"][g]["peak_used"]) < num_slots - len(free) or int(m["groups"][g]["evictions"]) < 0:
        bad(f"group {g}: peak use or eviction count is impossible")


def _check_prefix(m: dict, a: dict, groups: Sequence, ps: int, largest: int, bad: Callable[[str], None]) -> None:
    """The prefix caches: namespaces, hit counts, and each group's entries against its free slots."""
    spaces = m["prefix"]["namespaces"]
    if sorted(int(i) for _, _, i in spaces) != list(range(len(spaces))):
        bad("prefix cache: namespace ids are not 0..K-1")
    if len(m["prefix"]["hits"]) != len(groups) or min(m["prefix"]["hits"], default=0) < 0:
        bad("prefix cache: hit counts per group are missing or negative")
    for g in range(len(groups)):
        num_slots = groups[g].num_slots
        k = f"prefix/{g}/"
        slot, h, tokens = a[k + "slot"], a[k + "hash"], a[k + "tokens"]
        ns, parent, anchor = a[k + "namespace"], a[k + "parent"], a[k + "anchor"]
        e = len(slot)
        linked = a.get(k + "linked", np.zeros(e, dtype=np.int64))
        if {len(h), len(ns), len(parent), len(anchor), len(a[k + "parent_hash"]), len(tokens), len(linked)} != {e} \
                or (e and tokens.shape[1] != ps):
            bad(f"group {g}: prefix cache arrays differ in length or page size")
            continue
        if e and (slot.min() < 0 or slot.max() >= num_slots or _repeats(slot) or (h == 0).any() or _repeats(h)):
            bad(f"group {g}: prefix cache slots out of range or repeated, or hashes zero or repeated")
            continue
        if e and ((ns < 0).any() or (ns >= len(spaces)).any() or ((parent < -1) | (parent >= num_slots)).any()
                  or ((anchor < -1) | (anchor >= largest)).any()):
            bad(f"group {g}: a prefix-cache namespace, parent or anchor slot is out of range")
        if not np.isin(a[f"cached/{g}"], slot).all():
            bad(f"group {g}: a cached free slot holds no registered page")
        if np.isin(a[f"free_stack/{g}"], slot).any():
            bad(f"group {g}: a slot on the plain free stack is registered in the prefix cache")


def _repeats(a: np.ndarray) -> bool:
    """True if a value occurs twice in a (sort-based: no hashing of millions of values)."""
    if len(a) < 2:
        return False
    s = np.sort(a)
    return bool((s[1:] == s[:-1]).any())
