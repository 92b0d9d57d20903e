"""A vectorised hash -> slot table mirroring a prefix cache's index, for ScorePrefix.

``PrefixCache.by_hash`` is a dict: one lookup costs a Python call, so scoring a 2,048-page prompt
against 64 pools would cost 131,072 of them. This table answers a whole array of hashes with a
few NumPy operations: open addressing with linear probing over a power-of-two array.

Entries are inserted when pages are registered and never deleted: a looked-up slot is a
*candidate*, valid only if the cache still holds that hash in that slot (``cache.hash[slot] == h``,
which the caller checks). Re-registering a hash overwrites its entry, so the table always holds
the latest slot of every hash. When live and stale entries would fill 3/4 of the array, it is
rebuilt from the cache's live pages, at the next lookup (``invalidate``). Its answers are
deterministic (the same registrations and lookups, the same table), so it is part of the pool's
state like the cache itself; a restored pool rebuilds it from the cache.

Insertions are deferred: a Step only appends its (hashes, slots) to a pending list (a Step
admitting one prompt would otherwise pay a probe loop for a table nobody may read), and the
first lookup after it inserts them all, in order, so the table answers exactly as if each
Step had inserted its own.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_MULT = np.uint64(0x9E3779B97F4A7C15)
#: Probe rounds done with NumPy over all keys still unresolved; the rest probe one by one.
VECTOR_ROUNDS = 3


class HashSlots:
    """keys: uint64 [capacity] (0 = empty; page hashes are never 0); slots: int64 [capacity]."""

    __slots__ = ("keys", "mask", "pending", "pending_n", "refill", "shift", "slots", "used")

    def __init__(self, num_slots: int) -> None:
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []   # insertions not applied yet, in order
        self.pending_n = 0
        #: Set by invalidate: the live (keys, slots) to rebuild from at the next lookup (None: the table is current).
        self.refill: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None
        self._alloc(max(16, 1 << int(2 * num_slots - 1).bit_length()))

    def _alloc(self, capacity: int) -> None:
        self.keys = np.zeros(capacity, dtype=np.uint64)
        self.slots = np.full(capacity, -1, dtype=np.int64)
        self.mask = capacity - 1
        self.shift = np.uint64(64 - (capacity.bit_length() - 1))
        self.used = 0

    def _home(self, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((keys * _MULT) >> self.shift).astype(np.int64)

    def full_after(self, n: int) -> bool:
        """Would n more entries (besides the pending ones) fill 3/4 of the table (time to rebuild from the
        live pages)? Never while the table waits for its rebuild (invalidate)."""
        return self.refill is None and self.used + self.pending_n + n > (self.mask + 1) * 3 // 4

    def rebuild(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Start over with exactly these (hash, slot) pairs (distinct keys), at most half full."""
        cap = self.mask + 1
        while len(keys) > cap // 2:
            cap *= 2
        self.pending, self.pending_n = [], 0
        self.refill = None
        self._alloc(cap)
        self._put(keys, slots)

    def invalidate(self, refill: Callable[[], tuple[np.ndarray, np.ndarray]]) -> None:
        """The table is to be rebuilt from the live pages: refill() returns them (distinct keys, their slots) as
        they are when it is called, at the next lookup; insertions until then are dropped (refill covers
        them). A cache registering page after page with nobody looking up rebuilds nothing; a lookup answers
        as after an immediate rebuild, every live key giving its slot (stale entries are only candidates)."""
        self.pending, self.pending_n = [], 0
        self.refill = refill

    def insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Map distinct keys (uint64 [n], non-zero) to slots (int64 [n]); a known key gets its new slot.
        Applied at the next lookup (the arrays are kept, not copied: the caller gives fresh ones)."""
        if len(keys) and self.refill is None:
            self.pending.append((keys, slots))
            self.pending_n += len(keys)

    def flush(self) -> None:
        """Apply the pending insertions, in the order they were made (or the rebuild invalidate asked for)."""
        if self.refill is not None:
            self.rebuild(*self.refill())
            return
        pending, self.pending, self.pending_n = self.pending, [], 0
        for keys, slots in pending:
            self._put(keys, slots)

    def _put(self, keys: np.ndarray, slots: np.ndarray) -> None:
        pos = self._home(keys)
        todo = np.arange(len(keys))
        while len(todo):
            p = pos[todo]
            k = self.keys[p]
            same = k == keys[todo]
            self.slots[p[same]] = slots[todo[same]]              # a key seen before: its latest slot
            free = k == 0
            if free.any():
                fp, ft = p[free], todo[free]
                _, first = np.unique(fp, return_index=True)       # one claim per empty position this round
                win_p, win_t = fp[first], ft[first]
                self.keys[win_p] = keys[win_t]
                self.slots[win_p] = slots[win_t]
                self.used += len(win_t)
                done = same.copy()
                done[np.flatnonzero(free)[first]] = True
            else:
                done = same
            todo = todo[~done]
            pos[todo] = (pos[todo] + 1) & self.mask

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """int64 [n]: the slot last registered for each key, or -1 (a candidate: check the cache's hash).

        Three probe rounds in NumPy settle almost every key; the few in longer clusters finish one by one.
        """
        if self.pending or self.refill is not None:
            self.flush()
        out = np.full(len(keys), -1, dtype=np.int64)
        pos = self._home(keys)
        todo = np.arange(len(keys))
        for _ in range(VECTOR_ROUNDS):
            if not len(todo):
                return out
            p = pos[todo]
            k = self.keys[p]
            hit = k == keys[todo]
            out[todo[hit]] = self.slots[p[hit]]
            todo = todo[~hit & (k != 0)]                         # an empty position ends a probe: absent
            pos[todo] = (pos[todo] + 1) & self.mask
        table, mask = self.keys, self.mask
        for i, p in zip(todo.tolist(), pos[todo].tolist(), strict=True):
            key = keys[i]
            while table[p] != 0:
                if table[p] == key:
                    out[i] = self.slots[p]
                    break
                p = (p + 1) & mask
        return out
