"""Slot allocator of one layer group: a free stack, the cached free slots, a refcount per slot.

Allocation pops a contiguous run off the stack (one slice); freeing pushes the
slots whose refcount reached zero back (one slice). With prefix caching, a freed
slot that still holds a reusable page (``cacheable[slot]``) becomes a *cached*
free slot instead, stamped with the allocator's clock (the pool's step number),
where a later prefix hit can revive it (O(1)) until an allocation that finds the
stack empty evicts it. Which cached page goes first is the eviction policy's
choice (evict.py; default: leaves first, least recently released, lower slot
first; O(log n) per page). A free of a slot that is already free is an error
naming the slot, never a refcount below zero.

Every slot has a generation (``generation[slot]``, uint32): it counts the slot's
allocations, so it changes exactly when the slot passes to a new owner whose pages
are written afresh (an allocation off the stack, an eviction from the cache, a
copy-on-write target) and stays when owners are added to what it holds (a fork, a
prefix-cache hit). Workers record it beside every page they write and kernels
refuse a page whose generation is not the one their table expects (a table that
outlived the page: docs/ARCHITECTURE.md, "Page generations"). It starts at 0, or at
a pool's seed (`generation_seed` of its incarnation, so two incarnations of a pool
hand out unrelated generations), and skips 0 when it wraps: 0 is never handed out.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.core.evict import EvictionPolicy, make_policy

_ONE_U32 = np.uint32(1)


def generation_seed(incarnation: int) -> int:
    """The generation a pool's slots start at (the first allocation hands out seed + 1): the low 32 bits of the
    incarnation XOR its high 32 bits (incarnations are random 63-bit numbers)."""
    return (incarnation ^ (incarnation >> 32)) & 0xFFFFFFFF


class SlotAllocator:
    """Hands out slot ids in [0, num_slots).

    Fields (only this class changes them, except ``cacheable``, set by the prefix cache):
      _stack[:_top]   free slot ids holding nothing reusable, intp; the next allocation takes the top.
      _cached         free slots holding a reusable page -> clock value when they were released.
      _refcnt[slot]   owners (sequences); 0 = free (on the stack or in _cached).
      cacheable[slot] True while the slot's page is registered in the prefix cache.
      on_evict(slots) called with the cached slots (intp [k]) an allocation takes for new pages.
      clock           stamp of the slots released now (the pool sets it to its step number; only grows).
      policy          which cached slot an allocation evicts (evict.py), told of the prefix cache's links.
      generation[slot] uint32: its start (0, or the pool's seed) plus the slot's allocations so far, wrapping
                      past 2^32 - 1 to 1.
    """

    __slots__ = ("_cached", "_mark", "_ones", "_refcnt", "_stack", "_top", "cacheable", "caching", "clock",
                 "evictions", "generation", "num_slots", "on_evict", "peak_used", "policy")

    def __init__(self, num_slots: int, policy: str = "lru-leaf") -> None:
        if num_slots <= 0:
            raise InvalidArgument(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        # intp (int64) ids: NumPy converts any other index dtype before a fancy index.
        self._stack = np.arange(num_slots - 1, -1, -1, dtype=np.intp)  # slot 0 on top
        self._top = num_slots
        self._refcnt = np.zeros(num_slots, dtype=np.int32)
        self._mark = np.zeros(num_slots, dtype=np.intp)
        self._ones = np.ones(num_slots, dtype=np.int32)
        self._cached: dict[int, int] = {}
        self.clock = 0
        self.policy: EvictionPolicy = make_policy(policy, num_slots, self._cached)
        self.cacheable = np.zeros(num_slots, dtype=bool)
        self.generation = np.zeros(num_slots, dtype=np.uint32)
        self.caching = False                 # set by a prefix cache: released slots may be cacheable
        self.on_evict: Callable[[np.ndarray], None] | None = None
        self.peak_used = 0
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Slots an allocation can take: the stack plus the evictable cached slots."""
        return self._top + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def allocate(self, n: int) -> np.ndarray:
        """Take n free slots (refcount 1 each), evicting cached pages only when the stack runs out."""
        if n < 0:
            raise InvalidArgument(f"cannot allocate a negative number of slots ({n})")
        if n > self.num_free:
            raise ResourceExhausted(f"needed {n} slots, {self.num_free} free", needed=n, free=self.num_free)
        take = min(n, self._top)
        top = self._top - take
        slots = self._stack[top:self._top].copy()
        self._top = top
        if take < n:
            evicted = self.policy.evict(n - take)    # out of _cached, unlinked, in eviction order
            ev = np.array(evicted, dtype=np.intp)
            self.cacheable[ev] = False
            if self.on_evict is not None:
                self.on_evict(ev)                # the prefix cache forgets them
            self.evictions += len(evicted)
            slots = np.concatenate((slots, ev))
        self._refcnt[slots] = self._ones[:n]
        self._bump(slots)
        used = self.num_slots - self._top - len(self._cached)
        if used > self.peak_used:
            self.peak_used = used
        return slots

    def _bump(self, slots: np.ndarray) -> None:
        """The slots pass to a new owner: next generation (never 0)."""
        gen = self.generation[slots] + _ONE_U32              # uint32 arithmetic: wraps to 0 ...
        if len(gen) and not np.minimum.reduce(gen):          # (no bool reduction: it casts, through a buffer)
            gen[gen == 0] = 1                                # ... which is never handed out
        self.generation[slots] = gen

    def share(self, slots: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Add counts[i] (default 1) owners to slots[i] (ids distinct). Free cached slots leave the LRU."""
        if not len(slots):
            return
        rc = self._refcnt[slots]
        for s in slots[rc == 0].tolist():
            if s not in self._cached:
                raise InvalidArgument(f"slot {s} is free and holds no cached page; it cannot be shared",
                                      slot=s)
            del self._cached[s]
        self._refcnt[slots] = rc + (1 if counts is None else counts.astype(np.int32))
        used = self.num_used
        if used > self.peak_used:
            self.peak_used = used

    def free(self, slots: np.ndarray, unique: bool = False) -> None:
        """Drop one reference from each slot; slots reaching zero become free (or cached).

        slots: shape [n], intp. unique=True is the caller's promise that the ids
        are valid and no slot repeats (one sequence's own slots); otherwise ids are
        range-checked and repeats counted. Raises InvalidArgument (changing
        nothing) on a double free or a bad id.
        """
        n = len(slots)
        if n == 0:
            return
        if not unique:
            slots = np.asarray(slots, dtype=np.intp)
            if slots.ndim != 1 or slots.view(np.uintp).max() >= self.num_slots:
                bad = slots[(slots < 0) | (slots >= self.num_slots)][0]
                raise InvalidArgument(f"slot {bad} does not exist (num_slots={self.num_slots})", slot=bad)
            order = np.arange(n)
            self._mark[slots] = order
            if np.logical_or.reduce(self._mark[slots] != order):
                self._free_repeated(slots)
                return
        rc = self._refcnt.take(slots)
        lo, hi = np.minimum.reduce(rc), np.maximum.reduce(rc)
        if lo <= 0:
            raise InvalidArgument(f"double free of slot {slots[rc <= 0][0]}: it is already free",
                                  reason="DOUBLE_FREE", slot=slots[rc <= 0][0])
        if hi == 1:                          # sole owner everywhere: all slots become free
            self._refcnt[slots] = 0
            self._release(slots)
            return
        rc -= 1
        self._refcnt[slots] = rc
        self._release(slots[rc == 0])

    def _free_repeated(self, slots: np.ndarray) -> None:
        self.free_counted(*np.unique(slots, return_counts=True))

    def free_counted(self, uniq: np.ndarray, counts: np.ndarray) -> None:
        """free of slots given as their distinct ids (intp [k], ascending, valid) and how often each is freed
        (int64 [k]): what free does with repeated ids, without finding the repeats again."""
        rc = self._refcnt[uniq]
        over = counts > rc
        if np.logical_or.reduce(over):
            raise InvalidArgument(f"double free of slot {uniq[over][0]}: freed more often than it is owned",
                                  reason="DOUBLE_FREE", slot=uniq[over][0])
        rc -= counts.astype(np.int32)
        self._refcnt[uniq] = rc
        self._release(uniq[rc == 0])

    def _release(self, released: np.ndarray) -> None:
        keep = self.cacheable[released] if self.caching else None
        if keep is not None and np.logical_or.reduce(keep):
            cached = released[keep].tolist()
            clock = self.clock
            self._cached.update(dict.fromkeys(cached, clock))
            self.policy.cached(cached, clock)
            released = released[~keep]
        k = len(released)
        self._stack[self._top:self._top + k] = released
        self._top += k

    def refcount(self, slots: np.ndarray) -> np.ndarray:
        """Refcounts of the given slots: int32 [len(slots)], owners per slot (a copy)."""
        return self._refcnt[slots].copy()

    def free_slots(self) -> np.ndarray:
        """Every free slot id: the stack (top last), then cached slots in the order the policy evicts them."""
        order = self.policy.order()
        return np.concatenate((self._stack[:self._top], np.array(order, dtype=np.intp)))

    def cached_stamps(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots int64 [C], stamps int64 [C]): the cached free slots in eviction order and their release clocks."""
        order = self.policy.order()
        return (np.array(order, dtype=np.int64),
                np.array([self._cached[s] for s in order], dtype=np.int64))

    def restore_cached(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """Set the cached free slots (int64 [C]) and their release clocks (int64 [C]) (a snapshot being restored;
        the prefix cache's links must be restored first)."""
        self._cached.clear()
        self._cached.update(zip(slots.tolist(), stamps.tolist(), strict=True))
        self.clock = max(self.clock, int(stamps.max()) if len(stamps) else 0)
        self.policy.rebuild()

    def export_state(self) -> dict:
        """This allocator's part of a PoolState (copies; call under the pool's lock):

        free_stack: the free slots holding nothing, bottom to top, as pool_state.copy_ids keeps them (IdRuns
        or int64 [F]); cached, cached_stamp: int64 [C] each, cached_stamps(); generation: int64 [num_slots];
        peak_used, evictions: ints. Refcounts are not exported: they are the slots' owners, counted again.
        """
        from kvservice.core.pool_state import copy_ids
        cached, stamps = self.cached_stamps()
        return {"free_stack": copy_ids(self._stack[:self._top]), "cached": cached, "cached_stamp": stamps,
                "generation": self.generation.astype(np.int64), "peak_used": int(self.peak_used),
                "evictions": int(self.evictions)}

    def restore_state(self, free_stack: np.ndarray, held_slots: np.ndarray, peak_used: int, evictions: int,
                      generation: np.ndarray | None) -> None:
        """Set a fresh allocator to an exported state (the cached slots follow with restore_cached, once the
        prefix cache's links are in). free_stack: int64 [F] bottom to top; held_slots: int64 [H], every
        slot every sequence holds (a slot held by k sequences k times: its refcount); generation: int64
        [num_slots] or None (a state from before generations: all 0)."""
        self._stack[:len(free_stack)] = free_stack
        self._top = len(free_stack)
        self._refcnt[:] = np.bincount(held_slots, minlength=self.num_slots).astype(np.int32)
        self.peak_used, self.evictions = int(peak_used), int(evictions)
        self.generation[:] = 0 if generation is None else generation

    def check(self) -> None:
        """Assert this allocator's own invariants (free slots == slots with refcount 0)."""
        stack = self._stack[:self._top]
        free = self.free_slots()
        assert len(np.unique(free)) == len(free), "a slot is free twice (stack and cache, or twice in one)"
        assert (self._refcnt[free] == 0).all(), "a free slot has owners"
        assert (self._refcnt >= 0).all(), "negative refcount"
        assert int((self._refcnt == 0).sum()) == len(free), "free count != slots with refcount 0"
        assert not self.cacheable[stack].any(), "a slot on the plain free stack is marked cacheable"
        cached = free[len(stack):]
        assert self.cacheable[cached].all(), "a cached free slot is not marked cacheable"
