"""Prefix cache: full prompt pages found again by a chained hash, confirmed by their token ids.

Page j of a prompt gets ``h_j = mix(h_{j-1}, namespace, tokens of page j)``, a
deterministic 64-bit hash computed with NumPy over a whole batch of admissions
at once (the same in every process, so a journal replays to the same cache). A
hash hit is only a candidate: it is accepted if the cached page's token ids,
namespace (tenant salt + extra key such as a LoRA id) and parent page (the slot
accepted for page j-1) all match. So two prompts that collide on a hash can
never alias, and tenants never see each other's pages.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .allocator import SlotAllocator

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def page_hashes(pages: np.ndarray, namespaces: np.ndarray) -> np.ndarray:
    """Chained hashes of full pages.

    pages: int64 [A, P, page_size], the token ids of the first P full pages of A prompts
        (rows shorter than P padded with anything: callers ignore their tail).
    namespaces: int64 [A], a small id per (salt, extra key).
    Returns uint64 [A, P], never 0.
    """
    with np.errstate(over="ignore"):
        a, p, ps = pages.shape
        tok = pages.astype(np.uint64)
        page_h = np.full((a, p), _GOLD, dtype=np.uint64)
        for t in range(ps):                                   # hash each page's tokens
            page_h = _mix(page_h ^ (tok[:, :, t] + _GOLD))
        out = np.empty((a, p), dtype=np.uint64)
        h = _mix(namespaces.astype(np.uint64) + _GOLD)
        for j in range(p):                                    # chain page hashes
            h = _mix(h ^ page_h[:, j] ^ (np.uint64(j) * _M2))
            out[:, j] = h
        out[out == 0] = 1
    return out


class PrefixCache:
    """Registered full pages of one layer group's slots.

    Per slot: hash (0 = none), parent slot (-1 = first page), namespace id and the
    page's token ids. ``hash_fn`` is injectable so tests can force collisions.
    """

    def __init__(self, allocator: SlotAllocator, page_size: int,
                 hash_fn: Callable[[np.ndarray, np.ndarray], np.ndarray] = page_hashes) -> None:
        n = allocator.num_slots
        self.allocator = allocator
        self.page_size = page_size
        self.hash_fn = hash_fn
        self.by_hash: dict[int, int] = {}
        self.hash = np.zeros(n, dtype=np.uint64)
        self.parent = np.full(n, -2, dtype=np.int64)
        self.namespace = np.full(n, -1, dtype=np.int64)
        self.tokens = np.zeros((n, page_size), dtype=np.int64)
        self._namespaces: dict[tuple[str, str], int] = {}
        self.hits = 0                   # pages served from the cache
        self.sink = None                # events.GroupEventSource told of every page registered and forgotten
        allocator.on_evict = self.forget
        allocator.caching = True

    def namespace_ids(self, salts: list[str], keys: list[str]) -> tuple[np.ndarray, dict[tuple[str, str], int]]:
        """A small int per (salt, extra key), stable for this cache's life.

        Returns (ids int64 [n], new): pairs seen for the first time get the next ids but are only
        remembered once `add_namespaces(new)` is called, after the step can no longer fail.
        """
        out = np.empty(len(salts), dtype=np.int64)
        new: dict[tuple[str, str], int] = {}
        for i, k in enumerate(zip(salts, keys, strict=True)):
            known = self._namespaces.get(k)
            if known is None:
                known = new.setdefault(k, len(self._namespaces) + len(new))
            out[i] = known
        return out, new

    def add_namespaces(self, new: dict[tuple[str, str], int]) -> None:
        self._namespaces.update(new)

    def match(self, pages: np.ndarray, counts: np.ndarray, ns: np.ndarray,
              hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Longest confirmed cached prefix of each prompt.

        pages: int64 [A, P, page_size] token ids of full pages; counts: int64 [A], how many
        of the P pages each prompt may take from the cache; ns: int64 [A]; hashes: uint64 [A, P]
        from hash_fn. Returns (hits int64 [A], slots int64 [A, P]: the matched slot of page j
        for j < hits; -1 where no candidate).
        """
        a, p, _ = pages.shape
        get = self.by_hash.get
        uniq, inv = np.unique(hashes, return_inverse=True)       # shared prefixes: one lookup each
        found = np.fromiter((get(h, -1) for h in uniq.tolist()), dtype=np.int64, count=len(uniq))
        cand = found[inv.reshape(a, p)]
        safe = np.maximum(cand, 0)
        ok = (cand >= 0) & (np.arange(p) < counts[:, None])
        ok &= self.namespace[safe] == ns[:, None]
        ok &= (self.tokens[safe] == pages).all(axis=2)
        prev = np.concatenate((np.full((a, 1), -1, dtype=np.int64), cand[:, :-1]), axis=1)
        ok &= self.parent[safe] == prev
        hits = np.where(ok.all(axis=1), p, np.argmin(ok, axis=1)) if p else np.zeros(a, dtype=np.int64)
        return hits.astype(np.int64), cand

    def register(self, slots: np.ndarray, parents: np.ndarray, ns: np.ndarray, pages: np.ndarray,
                 hashes: np.ndarray) -> None:
        """Make pages findable: slots/parents/ns int64 [n], pages int64 [n, page_size], hashes uint64 [n].

        A hash already registered (the same content in another slot) keeps its first slot.
        """
        uniq_h, first = np.unique(hashes, return_index=True)        # one slot per new hash
        cand = slots[first]
        by_hash = self.by_hash
        new = np.fromiter((h not in by_hash for h in uniq_h.tolist()), dtype=bool, count=len(uniq_h))
        new &= self.hash[cand] == 0
        s, h = cand[new], uniq_h[new]
        by_hash.update(zip(h.tolist(), s.tolist(), strict=True))
        self.allocator.cacheable[s] = True
        keep = first[new]
        self.hash[s] = h
        self.parent[s] = parents[keep]
        self.namespace[s] = ns[keep]
        self.tokens[s] = pages[keep]
        if self.sink is not None:
            self.sink.stored(slots, parents, hashes, pages, keep, self.hash)

    def forget(self, slot: int) -> None:
        """Drop a slot's page from the cache (it is being reused for something else)."""
        h = int(self.hash[slot])
        if h and self.by_hash.get(h) == slot:
            del self.by_hash[h]
            if self.sink is not None:
                self.sink.removed(h, slot)
        self.hash[slot] = 0
        self.parent[slot] = -2
        self.namespace[slot] = -1
        self.allocator.cacheable[slot] = False
