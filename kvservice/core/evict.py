"""Which cached page an allocation evicts: a small policy interface, leaves first by default.

A cached page is *free* (no sequence owns it) but still findable in the prefix cache, so a later
prompt can revive it. When an allocation finds no clean free slot it evicts one of them. A hit
needs every earlier page of the prompt (page j is confirmed through the page j-1 it was chained
to), so evicting the head of a cached prompt makes its whole tail unreachable. The default policy
therefore evicts a page only when no cached page depends on it any more (a *leaf*: no registered
page names it as its parent), the least recently released leaf first, ties by the lower slot id.
A prompt's pages released together thus leave tail first, and a system prompt shared by many
conversations outlives every conversation's own pages (SGLang's radix cache evicts leaves only;
vLLM frees a request's blocks tail first for the same reason).

The prefix cache tells the policy which pages depend on which (``link`` when a page is registered
under a registered parent, ``unlink`` when it is forgotten); the allocator tells it when a page
becomes a cached free page (``cached``, with the allocator's clock: the pool's step number) and
asks it for victims (``victim``). A page revived by a hit simply stops being a candidate (the
allocator's ``cached`` map no longer holds it), so the policy keeps stale entries and skips them.

In a sliding-window group a page can be released while a page that depends on it is still in use
(it left the window). There a free page may have no free leaf below it; if every cached free page
is such an inner page, the least recently released one is evicted all the same (its dependants
are unlinked: they are now leaves of their own).
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict

import numpy as np

__all__ = ["POLICIES", "EvictionPolicy", "Lru", "LruLeaf", "make_policy"]


class EvictionPolicy:
    """Base: the dependency counts every policy keeps, and the interface the allocator calls.

    children[slot]: int32 [num_slots], registered pages whose parent page is in this slot.
    parent_of[slot]: int64 [num_slots], the slot this page was linked under (-1 = not linked).
    cached_at: the allocator's map of cached free slots -> clock value when released (read only here).
    """

    name = "base"

    def __init__(self, num_slots: int, cached_at: dict[int, int]) -> None:
        # One buffer each, seen two ways: NumPy arrays for the vectorised links, array.array for the
        # per-page steps of an eviction (indexing one yields a plain int, with no NumPy scalar made).
        self._children = array("i", bytes(4 * num_slots))
        self._parent_of = array("q", [-1]) * num_slots
        self.children = np.frombuffer(self._children, dtype=np.int32)
        self.parent_of = np.frombuffer(self._parent_of, dtype=np.int64)
        self.cached_at = cached_at

    def __getstate__(self) -> dict:
        """Pickled and copied without the NumPy views: __setstate__ makes them again over the copied buffers."""
        state = self.__dict__.copy()
        del state["children"], state["parent_of"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.children = np.frombuffer(self._children, dtype=np.int32)
        self.parent_of = np.frombuffer(self._parent_of, dtype=np.int64)

    # ---- dependencies (told by the prefix cache) ---------------------------------------------
    def link(self, slots: np.ndarray, parents: np.ndarray, distinct: bool = False) -> None:
        """Pages just registered in `slots` (int64 [n]) depend on the registered pages in `parents` (int64 [n]);
        distinct: the caller knows no parent is named twice (a chain of one prompt's pages)."""
        if len(slots):
            self.parent_of[slots] = parents
            if distinct:
                self.children[parents] += 1
                return
            srt = np.sort(parents)
            if len(srt) > 1 and not np.logical_and.reduce(srt[1:] != srt[:-1]):
                np.add.at(self.children, parents, 1)         # a parent named twice (np.add.at counts repeats)
            else:
                self.children[srt] += 1

    def unlink(self, slot: int) -> None:
        """The page in `slot` is forgotten: its parent loses a dependant, its own dependants are orphaned."""
        children, parent_of = self._children, self._parent_of
        p = parent_of[slot]
        if p >= 0:
            parent_of[slot] = -1
            children[p] -= 1
            if not children[p] and p in self.cached_at:
                self._became_leaf(p, self.cached_at[p])
        if children[slot]:                          # an inner page evicted (sliding groups only)
            self._orphan(slot)

    def _orphan(self, slot: int) -> None:
        """The pages linked under `slot` (being forgotten) lose their parent: leaves now if nothing depends on them."""
        orphans = np.flatnonzero(self.parent_of == slot)
        self.parent_of[orphans] = -1
        self._children[slot] = 0
        for c in orphans.tolist():
            if c in self.cached_at and not self._children[c]:
                self._became_leaf(c, self.cached_at[c])

    def evict(self, n: int) -> list[int]:
        """Take n victims, one after the other (each may make its parent the next leaf): removed from cached_at
        and unlinked, in eviction order. cached_at holds at least n slots."""
        cached, victim, unlink = self.cached_at, self.victim, self.unlink
        out = []
        for _ in range(n):
            s = victim()
            del cached[s]
            unlink(s)                                # its parent may become a leaf for the next victim
            out.append(s)
        return out

    def is_leaf(self, slot: int) -> bool:
        return self.children[slot] == 0

    # ---- the allocator's side ----------------------------------------------------------------
    def cached(self, slots: list[int], stamp: int) -> None:
        """Slots became cached free pages at clock `stamp` (already in cached_at)."""
        raise NotImplementedError

    def victim(self) -> int:
        """The cached free slot to evict next (cached_at is not empty); the caller removes it from cached_at."""
        raise NotImplementedError

    def order(self) -> list[int]:
        """Every cached free slot in the order this policy would evict them now, without changing anything."""
        raise NotImplementedError

    def rebuild(self) -> None:
        """Start over from cached_at and the dependency counts (after a restore)."""
        raise NotImplementedError

    def _became_leaf(self, slot: int, stamp: int) -> None:
        """A cached free page lost its last dependant."""


class LruLeaf(EvictionPolicy):
    """Leaves first: the least recently released cached page that no cached page depends on, lower slot first.

    A heap of (stamp, slot) candidates with lazy deletion: an entry is valid while the slot is still
    cached with that stamp and is a leaf. O(log n) per eviction and per release. Each entry is one int,
    ``stamp << shift | slot`` (slots < 2^shift, stamps >= 0): ordered as the pair, compared faster than a tuple.
    """

    name = "lru-leaf"

    def __init__(self, num_slots: int, cached_at: dict[int, int]) -> None:
        super().__init__(num_slots, cached_at)
        self._shift = max(1, (num_slots - 1).bit_length())
        self._low = (1 << self._shift) - 1
        self._heap: list[int] = []

    def cached(self, slots: list[int], stamp: int) -> None:
        heap, children = self._heap, self._children
        top = stamp << self._shift
        for s in slots:
            if not children[s]:
                heapq.heappush(heap, top | s)
        if len(heap) > 4 * len(self.cached_at) + 64:
            self.rebuild()

    def _became_leaf(self, slot: int, stamp: int) -> None:
        heapq.heappush(self._heap, stamp << self._shift | slot)

    def evict(self, n: int) -> list[int]:
        """EvictionPolicy.evict with victim and unlink inlined for the usual case (a leaf, no dependants)."""
        heap, cached, children, parent_of = self._heap, self.cached_at, self._children, self._parent_of
        pop, push = heapq.heappop, heapq.heappush
        shift, low = self._shift, self._low
        out = []
        while len(out) < n:
            while heap:
                e = pop(heap)
                s = e & low
                if cached.get(s) == e >> shift and not children[s]:
                    break
            else:                                      # no cached leaf (sliding groups): the general rule
                s = self.victim()
            del cached[s]
            p = parent_of[s]
            if p >= 0:
                parent_of[s] = -1
                children[p] -= 1
                if not children[p] and p in cached:
                    push(heap, cached[p] << shift | p)         # _became_leaf
            if children[s]:                            # an inner page (sliding groups only)
                self._orphan(s)
            out.append(s)
        return out

    def victim(self) -> int:
        heap, cached, children, shift, low = self._heap, self.cached_at, self._children, self._shift, self._low
        while heap:
            e = heapq.heappop(heap)
            s = e & low
            if cached.get(s) == e >> shift and not children[s]:
                return s
        # No cached leaf: every cached free page has a dependant still in use (sliding groups).
        return min(cached.items(), key=lambda kv: (kv[1], kv[0]))[0]

    def order(self) -> list[int]:
        """Leaves by (stamp, slot), each parent entering when its last cached dependant has left."""
        children, parent_of = self.children.copy(), self.parent_of.copy()
        cached = self.cached_at
        heap = [(t, s) for s, t in cached.items() if not children[s]]
        heapq.heapify(heap)
        out: list[int] = []
        left = dict(cached)
        while left:
            if heap:
                t, s = heapq.heappop(heap)
                if left.get(s) != t or children[s]:
                    continue
            else:
                s, t = min(left.items(), key=lambda kv: (kv[1], kv[0]))
            del left[s]
            out.append(s)
            p = int(parent_of[s])
            if p >= 0:
                children[p] -= 1
                if children[p] == 0 and p in left:
                    heapq.heappush(heap, (left[p], p))
            if children[s]:                           # an inner page: its dependants no longer count
                for c in np.flatnonzero(parent_of == s).tolist():
                    parent_of[c] = -1
                    if c in left and not children[c]:
                        heapq.heappush(heap, (left[c], c))
                children[s] = 0
        return out

    def rebuild(self) -> None:
        shift, children = self._shift, self._children
        self._heap = [t << shift | s for s, t in self.cached_at.items() if not children[s]]
        heapq.heapify(self._heap)


class Lru(EvictionPolicy):
    """The order before leaves-first, kept for comparison: cached pages in release order, whatever depends on
    them (within one release, in the order the pages were released: a prompt's head first)."""

    name = "lru"

    def __init__(self, num_slots: int, cached_at: dict[int, int]) -> None:
        super().__init__(num_slots, cached_at)
        self._queue: OrderedDict[int, int] = OrderedDict()     # slot -> stamp, in release order

    def cached(self, slots: list[int], stamp: int) -> None:
        queue = self._queue
        for s in slots:
            queue[s] = stamp
            queue.move_to_end(s)

    def victim(self) -> int:
        queue = self._queue
        while queue:
            s, stamp = queue.popitem(last=False)
            if self.cached_at.get(s) == stamp:
                return s
        raise AssertionError("no cached slot to evict")

    def order(self) -> list[int]:
        return [s for s, t in self._queue.items() if self.cached_at.get(s) == t]

    def rebuild(self) -> None:
        self._queue = OrderedDict(sorted(self.cached_at.items(), key=lambda kv: kv[1]))


POLICIES: dict[str, type[EvictionPolicy]] = {LruLeaf.name: LruLeaf, Lru.name: Lru}


def make_policy(name: str, num_slots: int, cached_at: dict[int, int]) -> EvictionPolicy:
    """A policy by name ("lru-leaf", the default, or "lru"); ValueError naming the known ones."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")
    return cls(num_slots, cached_at)
