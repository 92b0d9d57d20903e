"""One index of the cached pages of every pool of a manager: hash -> the pools that would serve it.

ScorePrefix asks, for one prompt, how many of its pages each pool's prefix cache would serve
(``PrefixCache.match``'s rule). Asking each pool in turn costs a hash probe and a token comparison per pool and
page; this index answers every pool with one walk along the prompt (one dictionary lookup per page, which also
yields the page's chained hash: the chain is never mixed in Python) and one token comparison per page.

Entries live in one table per (page size, namespace), the namespace being a manager-wide id of
the (salt, extra key) pair (a pool's own namespace ids, which its hashes depend on, differ from
pool to pool). An *entry* per page hash held by at least one pool keeps:

- ``mask``: uint64 words, bit b set when the pool of member bit b *serves* the hash: it
  registered the hash in a slot c that is *linked* (its parent slot is -1 and its registered
  parent hash 0, or its parent slot now holds exactly the page's registered parent hash) and
  whose content equals the entry's canonical content;
- canonical content: (registered parent hash, token ids) of the first page registered under
  the hash (0 = a first page);
- ``holders``: member pools that registered the hash at all; ``stale``: holders whose page is
  neither linked nor surely missed (its parent slot holds another registered hash: a parent
  pointer to a reused slot); ``mixed``: some holder's content differed from the canonical one
  since the entry was made (a 64-bit hash collision; sticky until the entry empties).

Why this is exact: pool p serves the prompt's page j iff p registered h_j in a slot c with the
prompt's namespace and tokens whose parent slot is p's slot of h_{j-1} (-1 for j = 0). If p's
bit is set for h_0..h_{k-1} and each entry's canonical content equals (h_{j-1} (0 for j = 0),
tokens of page j), checked once for all pools, then c_j's parent slot holds h_{j-1}, so it *is*
p's slot of h_{j-1}: k pages are served. Conversely, a page p serves but whose bit is unset has
content other than the canonical (the entry is mixed) or a parent slot holding another hash
than the one registered (the entry has stale holders); a pool whose run of set bits ends on
such an entry is asked itself (routing.py). A parent slot holding nothing registered is a sure
miss. Entries, bits and counts are kept exactly as caches register and forget pages (tests
compare them with an index built from scratch).

Upkeep: a cache's member (:class:`FleetMember`, ``PrefixCache.fleet``) notes the hashes whose state may have changed
(a page registered or forgotten, and the registered pages whose parent slot that was) and :meth:`FleetMember.flush`
re-evaluates them, vectorised, at the end of every Step (``api.flush_fleet``, run by the step service,
``ManagerAPI.run_step``: the pool knows nothing of the index), and before a query when the pool changed outside a
Step and its lock is free. A query reads a member pool as of its last Step, without waiting for one in flight. Only
pools with one prefix cache, of full attention, are members; queries use the index only for members with the default
hash function (hybrid and sliding pools and injected hash functions take the per-pool path).

Locking: a member's notes are changed under its pool's lock; the index under its own lock
(``FleetIndex.lock``), always taken after a pool's lock, never before one.
"""

from __future__ import annotations

import threading
from collections import deque
from itertools import repeat

import numpy as np

from kvservice.core.arena import zeroed

_ONE = np.uint64(1)
_M1_INV = np.uint64(pow(0xBF58476D1CE4E5B9, -1, 1 << 64))
_M2_INV = np.uint64(pow(0x94D049BB133111EB, -1, 1 << 64))
_NS_SHIFT = 40                  # FleetMember.held packs (namespace, row, stale) in one int: rows < 2^39


class _Table:
    """The entries of one (page size, namespace). Rows are reused; key -> row in a dict.

    rows: key -> row, the key of a page hash h being unmix(h) (the value the chain mixed into h).
    mask: uint64 [rows, words]; holders, stale: int64 [rows]; mixed: bool [rows];
    hash, parent_hash: uint64 [rows]; tokens: int64 [rows, page_size].
    """

    def __init__(self, page_size: int, words: int) -> None:
        self.page_size = page_size
        self.rows: dict[int, int] = {}
        self.free = np.zeros(8, dtype=np.int64)      # released rows, a stack: free[:num_free]
        self.num_free = 0
        self._alloc(8, words)                 # one table per tenant namespace: start small

    def _alloc(self, cap: int, words: int) -> None:
        self.mask = np.zeros((cap, words), dtype=np.uint64)
        self.holders = np.zeros(cap, dtype=np.int64)
        self.stale = np.zeros(cap, dtype=np.int64)
        self.mixed = np.zeros(cap, dtype=bool)
        self.parent_hash = np.zeros(cap, dtype=np.uint64)
        self.hash = np.zeros(cap, dtype=np.uint64)
        self.tokens = zeroed((cap, self.page_size), np.int64)   # lazily committed (core/arena.py)
        self.used = 0

    def grow(self, cap: int, words: int) -> None:
        """At least cap rows and words mask words (contents kept)."""
        old = (self.mask, self.holders, self.stale, self.mixed, self.parent_hash, self.hash, self.tokens)
        used = self.used
        cap = max(cap, len(self.holders))
        self._alloc(cap, words)
        self.used = used
        self.mask[:used, :old[0].shape[1]] = old[0][:used]
        for new, o in zip((self.holders, self.stale, self.mixed, self.parent_hash, self.hash, self.tokens),
                          old[1:], strict=True):
            new[:used] = o[:used]

    def row_of(self, block_hash: int) -> int:
        """The row of a page hash, -1 if none."""
        return self.rows.get(int(unmix(np.array([block_hash], dtype=np.uint64))[0]), -1)

    def rows_of(self, hashes: list[int]) -> np.ndarray:
        """int64 [n]: the row of each key, -1 if none."""
        return np.fromiter(map(self.rows.get, hashes, repeat(-1)), dtype=np.int64, count=len(hashes))

    def take_rows(self, hashes: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(rows int64 [n], new bool [n]): the row of each (distinct) key, new rows made for the unknown."""
        rows = self.rows_of(hashes)
        new = rows < 0
        k = int(new.sum())
        if k:
            reuse = min(k, self.num_free)
            fresh = k - reuse
            if self.used + fresh > len(self.holders):
                self.grow(max(2 * len(self.holders), self.used + fresh), self.mask.shape[1])
            self.num_free -= reuse
            got = np.concatenate((self.free[self.num_free:self.num_free + reuse],
                                  np.arange(self.used, self.used + fresh, dtype=np.int64)))
            self.used += fresh
            rows[new] = got
            at = np.flatnonzero(new).tolist()
            self.rows.update(zip([hashes[i] for i in at], got.tolist(), strict=True))
        return rows, new

    def release(self, rows: np.ndarray, hashes: list[int]) -> None:
        """Rows whose last holder left: forget them (hashes: their keys)."""
        deque(map(self.rows.__delitem__, hashes), maxlen=0)
        self.mask[rows] = 0
        self.mixed[rows] = False
        if self.num_free + len(rows) > len(self.free):
            self.free = np.concatenate((self.free[:self.num_free], np.zeros(self.num_free + 2 * len(rows),
                                                                            dtype=np.int64)))
        self.free[self.num_free:self.num_free + len(rows)] = rows
        self.num_free += len(rows)


class FleetIndex:
    """The entries of all member caches of one manager, by page size (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tables: dict[tuple[int, int], _Table] = {}     # (page_size, namespace) -> entries
        self.words = 1
        self._bits: list[FleetMember | None] = []
        self._ns: dict[tuple[str, str], int] = {}

    def namespace_id(self, key: tuple[str, str]) -> int:
        """Manager-wide id of a (salt, extra key) pair (call under self.lock)."""
        got = self._ns.get(key)
        if got is None:
            got = self._ns[key] = len(self._ns)
        return got

    def known_namespace(self, key: tuple[str, str]) -> int:
        """Id of a pair, -1 if no member ever registered a page in it (call under self.lock)."""
        return self._ns.get(key, -1)

    def table(self, page_size: int, namespace: int) -> _Table:
        t = self.tables.get((page_size, namespace))
        if t is None:
            t = self.tables[(page_size, namespace)] = _Table(page_size, self.words)
        return t

    def attach(self, cache: object) -> FleetMember:
        """Make a cache a member: its registered pages enter the index now and as they change."""
        member = FleetMember(self, cache)
        with self.lock:
            try:
                bit = self._bits.index(None)
            except ValueError:
                bit = len(self._bits)
                self._bits.append(None)
            if bit >= 64 * self.words:
                self.words += 1
                for t in self.tables.values():
                    t.grow(len(t.holders), self.words)
            self._bits[bit] = member
            member.bit = bit
        cache.fleet = member
        member.note_all()
        member.flush()
        return member

    def detach(self, member: FleetMember) -> None:
        """Take a member's pages out of the index and free its bit (a deleted or replaced pool)."""
        with self.lock:
            if member.bit is None:
                return
            member._drop(list(member.held))
            self._bits[member.bit] = None
            member.bit = None
        if getattr(member.cache, "fleet", None) is member:
            member.cache.fleet = None

    def served_pages(self, page_size: int, seed: int, terms: list[int], pages: np.ndarray,
                     namespace: tuple[str, str], members: list[FleetMember],
                     only_members: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Pages of a prompt each of `members` serves, from the index alone (call under self.lock).

        The prompt's chained hashes are not computed: entries are keyed by the value the chain mixes
        (the previous page's hash ^ terms[j], see unmix), so the prompt is walked from entry to entry,
        each giving the next page's hash, as far as one of `members` serves them: what other pools hold
        is never read, so the answer's time does not depend on other tenants' caches (only_members
        False, for a caller that may read every pool: as far as any pool holds them, a little faster,
        the same answers). seed: the chain's
        value before page 0 in the members' namespace id; terms: one per page the prompt may take from a
        cache (P); pages: int64 [>= P, page_size], its token ids; members: all with that namespace id.
        Returns (served int64 [len(members)], check bool [len(members)]): check = the member's run ends on
        an entry it holds stale or that is mixed (or on the one chain value the Step stores as another),
        so the member must be asked itself (the per-pool path); a member that left the index: 0, check.
        """
        n = len(members)
        t = self.tables.get((page_size, self._ns.get(namespace, -1)))
        bits = [-1 if m.bit is None or self._bits[m.bit] is not m else m.bit for m in members]
        if t is None or not terms or not n:
            return np.zeros(n, dtype=np.int64), np.array([b < 0 for b in bits], dtype=bool)
        want = [(w, sum(1 << (b & 63) for b in bits if b >= 0 and b >> 6 == w))
                for w in sorted({b >> 6 for b in bits if b >= 0})]
        stored, mask = t.hash, t.mask
        found, end, odd = _walk(t, seed, terms, want if only_members else None)
        k = len(found)
        rows = np.array(found, dtype=np.int64)
        hashes = stored[rows]
        prev = np.zeros(k, dtype=np.uint64)
        prev[1:] = hashes[:-1]
        ok = (t.parent_hash[rows] == prev) & (t.tokens[rows] == pages[:k]).all(axis=1)
        stop = int(np.argmin(ok)) if not ok.all() else k          # no member serves past a page nobody serves
        served = _runs(mask[rows[:stop]], [max(b, 0) for b in bits])
        ends = [found[e] if e < k else end if e == k and not odd else -1 for e in served.tolist()]
        check = _own_checks(t, self._ns[namespace], members, ends)
        check |= odd & (served == k)
        gone = np.array([b < 0 for b in bits], dtype=bool)
        served[gone], check[gone] = 0, True
        return served, check

    def snapshot(self) -> dict[tuple[int, tuple[str, str]], dict[int, tuple[int, frozenset[int], int, bool]]]:
        """(page size, (salt, extra key)) -> hash -> (holders, bits of the members serving it, stale, mixed):
        for tests (call under self.lock)."""
        names = {i: key for key, i in self._ns.items()}
        out: dict[tuple[int, tuple[str, str]], dict[int, tuple[int, frozenset[int], int, bool]]] = {}
        for (ps, ns), t in self.tables.items():
            d = {}
            for r in t.rows.values():
                h = int(t.hash[r])
                bits = frozenset(64 * w + i for w in range(t.mask.shape[1]) for i in range(64)
                                 if int(t.mask[r, w]) >> i & 1)
                d[h] = (int(t.holders[r]), bits, int(t.stale[r]), bool(t.mixed[r]))
            if d:
                out[(ps, names[ns])] = d
        return out


class FleetMember:
    """One prefix cache's part of a FleetIndex (``PrefixCache.fleet``).

    held: hash -> namespace << _NS_SHIFT | 2 * the row this cache counts as a holder of | 1 if it counts as
    stale there;
    children: parent slot -> registered slots whose parent it is; dirty (hashes) and dirty_slots
    (slots, read as the hashes they hold then): what to re-evaluate at the next flush.
    """

    def __init__(self, index: FleetIndex, cache: object) -> None:
        self.index = index
        self.cache = cache
        self.bit: int | None = None
        self.held: dict[int, int] = {}
        self.children: dict[int, set[int]] = {}
        self.dirty: set[int] = set()
        self.dirty_slots: set[int] = set()           # registered slots whose parent slot changed: their hashes
        self._ns_ids = np.zeros(0, dtype=np.int64)       # the cache's namespace id -> manager-wide id

    def __deepcopy__(self, memo: dict) -> None:
        return None                     # a copied or pickled pool is nobody's member (a manager attaches it)

    def __reduce__(self) -> tuple:
        return (_detached, ())

    # ---- notes (under the pool's lock) ------------------------------------------------------
    def note_all(self) -> None:
        """Re-evaluate every registered page (after attach)."""
        c = self.cache
        self.children.clear()
        slots = np.fromiter(c.by_hash.values(), dtype=np.int64, count=len(c.by_hash))
        self.registered(slots, c.parent[slots])
        self.dirty.update(self.held)

    def registered(self, slots: np.ndarray, parents: np.ndarray) -> None:
        """The cache registered pages in slots (int64 [n]) whose parent slots are parents (int64 [n])."""
        c, children = self.cache, self.children
        self.dirty.update(c.hash[slots].tolist())
        sl = slots.tolist()
        for s in children.keys() & sl:                # pages registered earlier with one of these slots as parent
            self.dirty_slots.update(children[s])
        get = children.get
        for s, p in zip(sl, parents.tolist(), strict=True):
            if p >= 0:
                kids = get(p)
                if kids is None:
                    children[p] = {s}
                else:
                    kids.add(s)
        if len(self.dirty) + len(self.dirty_slots) > 4 * len(c.hash) + 1024:
            self.flush()

    def forgotten(self, slot: int, block_hash: int) -> None:
        """The cache is forgetting the page in slot (still described by the cache's arrays)."""
        children = self.children
        p = self.cache.parent.item(slot)
        kids = children.get(p)
        if kids is not None:
            kids.discard(slot)
            if not kids:
                del children[p]
        self.dirty.add(block_hash)
        kids = children.get(slot)
        if kids:
            self.dirty_slots.update(kids)

    # ---- flush (under the pool's lock) ------------------------------------------------------
    def flush(self) -> None:
        """Bring the index up to date with the cache for every noted hash."""
        c = self.cache
        if self.dirty_slots:
            h = c.hash[np.fromiter(self.dirty_slots, dtype=np.int64, count=len(self.dirty_slots))]
            self.dirty.update(h[h != 0].tolist())     # those forgotten since were noted by hash then
            self.dirty_slots = set()
        if not self.dirty:
            return
        dirty, self.dirty = self.dirty, set()
        gone = list(self.held.keys() & dirty)
        hashes = [h for h in dirty if h in c.by_hash]
        slots = np.fromiter(map(c.by_hash.__getitem__, hashes), dtype=np.int64, count=len(hashes))
        with self.index.lock:
            if self.bit is None:
                return
            self._drop(gone)
            if hashes:
                self._add(hashes, slots)

    def _namespaces(self, local: np.ndarray) -> np.ndarray:
        """Manager-wide ids of the cache's namespace ids (int64 [n])."""
        ids = self.cache.namespaces._ids
        if len(self._ns_ids) < len(ids):
            table = np.full(len(ids), -1, dtype=np.int64)
            for key, i in ids.items():
                table[i] = self.index.namespace_id(key)
            self._ns_ids = table
        return self._ns_ids[local]

    def _drop(self, hashes: list[int]) -> None:
        """This cache no longer counts for these hashes (under the index's lock)."""
        if not hashes:
            return
        code = np.fromiter(map(self.held.pop, hashes), dtype=np.int64, count=len(hashes))
        ns, enc = code >> _NS_SHIFT, code & ((1 << _NS_SHIFT) - 1)
        w, b = self.bit >> 6, np.uint64(1) << np.uint64(self.bit & 63)
        for n in np.unique(ns).tolist():
            at = np.flatnonzero(ns == n)
            t = self.index.table(self.cache.page_size, n)
            rows = enc[at] >> 1
            t.mask[rows, w] &= ~b
            t.holders[rows] -= 1
            t.stale[rows] -= enc[at] & 1
            gone = np.flatnonzero(t.holders[rows] == 0)
            if len(gone):
                t.release(rows[gone], unmix(t.hash[rows[gone]]).tolist())
                if not t.rows:                         # a namespace nobody caches any more: its table goes
                    del self.index.tables[(self.cache.page_size, n)]

    def _add(self, hashes: list[int], slots: np.ndarray) -> None:
        """This cache holds these hashes in these slots now (under the index's lock)."""
        c = self.cache
        par = c.parent[slots]
        parent_hash = c.parent_hash[slots]                    # as registered (0 for a first page)
        now = np.where(par >= 0, c.hash[np.maximum(par, 0)], np.uint64(0))    # what the parent slot holds now
        linked = np.where(par >= 0, (now != 0) & (now == parent_hash), (par == -1) & (parent_hash == 0))
        stale = ~linked & ~((par >= 0) & (now == 0))         # neither served nor surely missed: ask the pool
        ns = self._namespaces(c.namespace[slots])
        tok = c.tokens[slots]
        bit_word, bit = self.bit >> 6, np.uint64(1) << np.uint64(self.bit & 63)
        for n in np.unique(ns).tolist():
            at = np.flatnonzero(ns == n)
            t = self.index.table(c.page_size, n)
            if t.mask.shape[1] < self.index.words:
                t.grow(len(t.holders), self.index.words)
            keys = hashes if len(at) == len(hashes) else [hashes[i] for i in at.tolist()]
            h = np.array(keys, dtype=np.uint64)
            rows, new = t.take_rows(unmix(h).tolist())
            fresh = rows[new]
            t.hash[fresh] = h[new]
            t.parent_hash[fresh] = parent_hash[at[new]]
            t.tokens[fresh] = tok[at[new]]
            t.holders[rows] += 1
            t.stale[rows] += stale[at]
            same = (t.parent_hash[rows] == parent_hash[at]) & (t.tokens[rows] == tok[at]).all(axis=1)
            t.mixed[rows[~same]] = True
            t.mask[rows[same & linked[at]], bit_word] |= bit
            self.held.update(zip(keys, ((n << _NS_SHIFT) + 2 * rows + stale[at]).tolist(), strict=True))


def unmix(h: np.ndarray) -> np.ndarray:
    """The inverse of prefix._mix (splitmix64's finaliser is a bijection): uint64 [n] -> uint64 [n].

    A page's chained hash is mix(previous page's hash ^ its own term), so unmix(hash) is what a
    walk along a prompt computes without mixing anything (FleetIndex.served_pages).
    """
    with np.errstate(over="ignore"):
        x = h.astype(np.uint64)
        x = x ^ (x >> np.uint64(31)) ^ (x >> np.uint64(62))
        x = x * _M2_INV
        x = x ^ (x >> np.uint64(27)) ^ (x >> np.uint64(54))
        x = x * _M1_INV
        return x ^ (x >> np.uint64(30)) ^ (x >> np.uint64(60))


#: The value whose mix is 0: a page hashed to 0 is stored as 1 by the Step (prefix.page_hashes).
_X0 = int(unmix(np.zeros(1, dtype=np.uint64))[0])


def _detached() -> None:
    """What a pickled member becomes: nothing (the cache's fleet attribute is None until a manager attaches it)."""
    return None


def _walk(t: _Table, seed: int, terms: list[int],
          want: list[tuple[int, int]] | None) -> tuple[list[int], int, bool]:
    """The prompt's entries from page 0 while one of the asked members serves them (want: (word, bits) of their
    mask; None = while any pool holds them): (rows, the row where a restricted walk ended on an entry others
    hold (-1 = none), whether it ended on the chain value 0)."""
    get, stored, mask = t.rows.get, t.hash, t.mask
    found: list[int] = []
    h = seed
    w0, m0 = want[0] if want and len(want) == 1 else (0, 0)      # one word of members (<= 64 pools): no inner loop
    for c in terms:                          # the chain's values, read from the entries (mix not computed)
        x = h ^ c
        if x == _X0:                         # the chain's value is 0, which the Step stores as 1: ask the pools
            return found, -1, True
        r = get(x, -1)
        if r < 0:
            return found, -1, False
        if want is not None and not (mask.item(r, w0) & m0 if m0 else any(mask.item(r, w) & m for w, m in want)):
            return found, r, False           # none of ours serves it: the walk ends
        found.append(r)
        h = stored.item(r)
    return found, -1, False


def _own_checks(t: _Table, ns: int, members: list[FleetMember], ends: list[int]) -> np.ndarray:
    """bool [len(members)]: whether each member must be asked itself: it holds the entry its run ended on (row
    ends[i]; -1 = none) stale, or that entry is mixed. Only the member's own notes are read."""
    check = np.zeros(len(members), dtype=bool)
    for i, (m, r) in enumerate(zip(members, ends, strict=True)):
        if r >= 0:
            code = m.held.get(t.hash.item(r))
            check[i] = code is not None and code >> _NS_SHIFT == ns and bool(code & 1 or t.mixed[r])
    return check


def _runs(mask: np.ndarray, bits: list[int]) -> np.ndarray:
    """int64 [len(bits)]: for each bit, how many leading rows of mask (uint64 [k, words]) have it set.

    The running AND of the rows only loses bits, at most 64 per word, so the rows where it changes
    are few: each bit's run ends at the first change that clears it.
    """
    b = np.asarray(bits, dtype=np.int64)
    out = np.full(len(b), len(mask), dtype=np.int64)
    if not len(mask):
        return out
    acc = np.bitwise_and.accumulate(mask, axis=0)
    word, bit = b >> 6, (b & 63).astype(np.uint64)
    ends = np.flatnonzero((acc[1:] != acc[:-1]).any(axis=1)) + 1             # acc[i] lost bits of acc[i - 1]
    have = ((acc[np.concatenate(([0], ends))][:, word] >> bit) & _ONE).astype(bool)   # [changes + 1, n]
    first_off = np.argmin(have, axis=0)                                      # first change that clears the bit
    lost = ~have.all(axis=0)
    out[lost] = np.concatenate(([0], ends))[first_off[lost]]
    return out


def rebuilt(members: list[FleetMember]) -> FleetIndex:
    """A new index of these members' caches built from scratch, same bits (the tests' reference)."""
    idx = FleetIndex()
    for m in members:
        if m.bit is None:
            continue
        while m.bit >= 64 * idx.words:
            idx.words += 1
        idx._bits.extend([None] * (m.bit + 1 - len(idx._bits)))
        copy = FleetMember(idx, m.cache)
        copy.bit = m.bit
        idx._bits[m.bit] = copy
        copy.note_all()
        copy.dirty.update(m.cache.by_hash)
        copy.flush()
    return idx


__all__ = ["FleetIndex", "FleetMember", "rebuilt", "unmix"]

