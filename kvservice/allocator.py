"""Slot allocator of one layer group: a free stack and a refcount per slot, all NumPy.

Allocation pops a contiguous run off the stack (one slice), freeing pushes the
slots whose refcount reached zero back (one slice). A free of a slot that is
already free is an error naming the slot, never a refcount below zero.
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidArgument, ResourceExhausted


class SlotAllocator:
    """Hands out slot ids in [0, num_slots).

    Fields (only this class changes them):
      _stack[:_top]   free slot ids, intp; the next allocation takes the top.
      _refcnt[slot]   number of owners (sequences, later cache pins); 0 = free.
    """

    __slots__ = ("_mark", "_ones", "_refcnt", "_stack", "_top", "num_slots", "peak_used")

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise InvalidArgument(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        # intp (int64) ids: NumPy fancy indexing converts any other dtype first.
        self._stack = np.arange(num_slots - 1, -1, -1, dtype=np.intp)  # slot 0 on top
        self._top = num_slots
        self._refcnt = np.zeros(num_slots, dtype=np.int32)
        self._mark = np.zeros(num_slots, dtype=np.intp)
        self._ones = np.ones(num_slots, dtype=np.int32)
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_slots - self._top

    def allocate(self, n: int) -> np.ndarray:
        """Take n free slots (refcount 1 each); ResourceExhausted if fewer are free."""
        if n < 0:
            raise InvalidArgument(f"cannot allocate a negative number of slots ({n})")
        if n > self._top:
            raise ResourceExhausted(f"needed {n} slots, {self._top} free", needed=n, free=self._top)
        top = self._top - n
        slots = self._stack[top:self._top].copy()
        self._top = top
        self._refcnt[slots] = self._ones[:n]
        used = self.num_slots - top
        if used > self.peak_used:
            self.peak_used = used
        return slots

    def free(self, slots: np.ndarray, unique: bool = False) -> None:
        """Drop one reference from each slot; slots reaching zero become free.

        slots: shape [n], intp. unique=True is the caller's promise that the ids
        are valid and no slot repeats (the pool's own tables); otherwise ids are
        range-checked and repeats counted. Raises
        InvalidArgument (changing nothing) on a double free or a bad id.
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
            if (self._mark[slots] != order).any():
                self._free_repeated(slots)
                return
        rc = self._refcnt.take(slots)
        lo, hi = rc.min(), rc.max()
        if lo <= 0:
            raise InvalidArgument(f"double free of slot {slots[rc <= 0][0]}: it is already free",
                                  reason="DOUBLE_FREE", slot=slots[rc <= 0][0])
        if hi == 1:                          # sole owner everywhere: all slots become free
            self._refcnt[slots] = 0
            self._push(slots)
            return
        rc -= 1
        self._refcnt[slots] = rc
        self._push(slots[rc == 0])

    def _free_repeated(self, slots: np.ndarray) -> None:
        uniq, counts = np.unique(slots, return_counts=True)
        rc = self._refcnt[uniq]
        over = counts > rc
        if over.any():
            raise InvalidArgument(f"double free of slot {uniq[over][0]}: freed more often than it is owned",
                                  reason="DOUBLE_FREE", slot=uniq[over][0])
        rc -= counts.astype(np.int32)
        self._refcnt[uniq] = rc
        self._push(uniq[rc == 0])

    def _push(self, released: np.ndarray) -> None:
        k = len(released)
        self._stack[self._top:self._top + k] = released
        self._top += k

    def refcount(self, slots: np.ndarray) -> np.ndarray:
        """Refcounts of the given slots (a copy)."""
        return self._refcnt[slots].copy()

    def free_slots(self) -> np.ndarray:
        """The free slot ids (a copy, stack order)."""
        return self._stack[:self._top].copy()

    def check(self) -> None:
        """Assert this allocator's own invariants (free stack == slots with refcount 0)."""
        free = self._stack[:self._top]
        assert len(np.unique(free)) == len(free), "a slot is on the free stack twice"
        assert (self._refcnt[free] == 0).all(), "a slot on the free stack has owners"
        assert (self._refcnt >= 0).all(), "negative refcount"
        assert int((self._refcnt == 0).sum()) == self._top, "free count != slots with refcount 0"
