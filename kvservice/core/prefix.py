"""Prefix cache: full prompt pages found again by a chained hash, confirmed by their token ids.

Page j of a prompt gets a chained hash of its namespace and of every token up
to its end (hashing.py: the default 64-bit chain computed with NumPy over a
whole batch of admissions at once, or vLLM's sha256-cbor block hash), the same
in every process, so a journal replays to the same cache. A hash hit is only a
candidate: it is accepted if the cached page's token ids,
namespace (tenant salt + extra key such as a LoRA id) and parent page (the slot
accepted for page j-1) all match. So two prompts that collide on a hash can
never alias, and tenants never see each other's pages.

Each layer group has its own cache over its own slots (hybrid models). A
sliding-window group keeps only the pages inside its window, so its page j-1
may be gone while page j is still useful: there a candidate is confirmed by its
token ids, namespace and *anchor*, the slot that a full-attention group of the
pool held for the same page when it was registered, which must be exactly the
page that group just confirmed by its own parent chain. So a hit in a sliding
group is as exact as in a full group. A pool with sliding groups only has no
such anchor; there the parent page's 64-bit hash stands in for it (the one
place a hash collision could alias, documented in docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from kvservice.core.allocator import SlotAllocator
from kvservice.core.arena import zeroed
from kvservice.core.hashing import _GOLD, _M1, _M2, _mix, page_hashes, prompt_hashes  # noqa: F401  (re-exported)

#: register takes its Python-int path (_register_run) for at most this many pages without anchors.
RUN_MAX = 128

if TYPE_CHECKING:
    from kvservice.core.rowslots import RowSlots
    from kvservice.core.stepplan import Prompt


class Namespaces:
    """A small int per (tenant salt, extra key), shared by the caches of all groups of a pool."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str], int] = {}
        self._pending: dict[int, tuple[str, str]] = {}     # ids handed out by the last ids() call, not added yet
        self._by_id: dict[int, tuple[str, str]] = {}       # id -> (salt, extra key) of the added ids

    def ids(self, salts: list[str], keys: list[str]) -> tuple[np.ndarray, dict[tuple[str, str], int]]:
        """(ids int64 [n], new): pairs seen for the first time get the next ids but are only
        remembered once `add(new)` is called, after the step can no longer fail."""
        out = np.empty(len(salts), dtype=np.int64)
        new: dict[tuple[str, str], int] = {}
        for i, k in enumerate(zip(salts, keys, strict=True)):
            known = self._ids.get(k)
            if known is None:
                known = new.setdefault(k, len(self._ids) + len(new))
            out[i] = known
        self._pending = {i: k for k, i in new.items()}
        return out, new

    def add(self, new: dict[tuple[str, str], int]) -> None:
        self._ids.update(new)
        self._by_id.update((i, k) for k, i in new.items())
        self._pending = {}

    def name_of(self, i: int) -> tuple[str, str]:
        """(salt, extra key) of id i, the pending ids of the last ids() call included; ("", "") if unknown."""
        got = self._by_id.get(i)
        return got if got is not None else self._pending.get(i, ("", ""))

    def items(self) -> list[list]:
        """[[salt, extra_key, id], ...] (a pool state's namespaces)."""
        return [[salt, key, int(i)] for (salt, key), i in self._ids.items()]

    def restore(self, items: list[list]) -> None:
        """Replace every id by those of items() (a pool state being restored)."""
        self._ids = {(salt, key): int(i) for salt, key, i in items}
        self._by_id = {i: k for k, i in self._ids.items()}

    def names(self) -> dict[int, tuple[str, str]]:
        """id -> (salt, extra key), the pending ids of the last ids() call included (a hash mode reads them)."""
        out = {i: k for k, i in self._ids.items()}
        out.update(self._pending)
        return out


class PrefixCache:
    """Registered full pages of one layer group's slots.

    Per slot: hash (0 = none), parent slot (-1 = first page or not kept), parent page's
    hash (0 = first page), anchor (the full group's slot of the same page; -1 = none),
    namespace id and the page's token ids. ``hash_fn`` is injectable so tests can force
    collisions.
    """

    def __init__(self, allocator: SlotAllocator, page_size: int,
                 hash_fn: Callable[..., np.ndarray] = page_hashes, namespaces: Namespaces | None = None,
                 group: int = 0) -> None:
        n = allocator.num_slots
        self.allocator = allocator
        self.page_size = page_size
        self.hash_fn = hash_fn
        self.group = group
        self.namespaces = namespaces if namespaces is not None else Namespaces()
        self.by_hash: dict[int, int] = {}
        self.hash = np.zeros(n, dtype=np.uint64)
        self.parent = np.full(n, -2, dtype=np.int64)
        self.parent_hash = np.zeros(n, dtype=np.uint64)
        self.anchor = np.full(n, -1, dtype=np.int64)
        self.namespace = np.full(n, -1, dtype=np.int64)
        self.tokens = zeroed((n, page_size), np.int64)   # page tokens, lazily committed (core/arena.py)
        self.hits = 0                   # pages served from the cache
        self.sink = None                # events.GroupEventSource told of every page registered and forgotten
        self.fleet = None               # fleet_index.FleetMember told of the same (the manager's ScorePrefix index)
        allocator.on_evict = self.forget_many
        allocator.caching = True

    def export_state(self) -> dict[str, np.ndarray]:
        """This group's cache entries in by_hash order (copies; call under the pool's lock), E entries:
        hash uint64 [E]; slot, parent, anchor, namespace int64 [E]; parent_hash uint64 [E]; tokens int64
        [E, page_size]; linked int64 [E] (1 = counted as a dependant of its parent page for eviction)."""
        slots = np.fromiter(self.by_hash.values(), dtype=np.int64, count=len(self.by_hash))
        return {"hash": np.fromiter(self.by_hash.keys(), dtype=np.uint64, count=len(self.by_hash)), "slot": slots,
                "parent": self.parent[slots], "parent_hash": self.parent_hash[slots], "anchor": self.anchor[slots],
                "namespace": self.namespace[slots], "tokens": self.tokens[slots],
                "linked": (self.allocator.policy.parent_of[slots] >= 0).astype(np.int64)}

    def restore_state(self, e: dict[str, np.ndarray], hits: int) -> None:
        """Register an exported state's entries in a fresh cache (its allocator's stack and refcounts restored,
        its cached slots not yet: restore_cached orders them by the links made here). e: export_state's
        arrays; linked may be absent (older snapshots: an entry is linked under any registered parent)."""
        slots, hashes = e["slot"], e["hash"]
        self.by_hash = dict(zip(hashes.tolist(), slots.tolist(), strict=True))
        self.hash[slots] = hashes
        for k in ("parent", "parent_hash", "anchor", "namespace", "tokens"):
            getattr(self, k)[slots] = e[k]
        self.hits = int(hits)
        self.allocator.cacheable[slots] = True
        par = self.parent[slots]
        dep = (e["linked"] != 0) if e.get("linked") is not None else par >= 0
        dep &= par >= 0
        dep[dep] = self.hash[par[dep]] != 0
        self.allocator.policy.link(slots[dep], par[dep])
        if self.sink is not None:                       # the event source's view of the same cache
            self.sink.parent_hash[slots] = e["parent_hash"]
            self.sink.index.rebuild(hashes, slots)

    def namespace_ids(self, salts: list[str], keys: list[str]) -> tuple[np.ndarray, dict[tuple[str, str], int]]:
        return self.namespaces.ids(salts, keys)

    def add_namespaces(self, new: dict[tuple[str, str], int]) -> None:
        self.namespaces.add(new)

    def candidates(self, pages: np.ndarray, row: np.ndarray, ns: np.ndarray,
                   hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The cached slot of each page (-1 = none) and whether its namespace and token ids match.

        pages: int64 [N, page_size]; row: int64 [N] prompt of each page; ns: int64 [A]; hashes: uint64 [N].
        Returns (cand int64 [N], ok bool [N]).
        """
        n = len(hashes)
        cand = np.fromiter(map(self.by_hash.get, hashes.tolist(), repeat(-1, n)), dtype=np.int64, count=n)
        ok = cand >= 0
        at = ok.nonzero()[0]                        # only pages the index knows are compared
        if len(at):
            slots = cand[at]
            good = self.namespace[slots] == ns[row[at]]
            good &= self._same_tokens(slots, pages.take(at, axis=0))
            ok[at] = good
        return cand, ok

    def _same_tokens(self, slots: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """bool [n]: whether the page cached in each slot holds exactly the token ids of pages (int64 [n, ps])."""
        return (self.tokens.take(slots, axis=0) == pages).all(axis=1)

    def match(self, pages: np.ndarray, row: np.ndarray, col: np.ndarray, limit: np.ndarray, ns: np.ndarray,
              hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Longest confirmed cached prefix of each of A prompts (pages stored ragged, see page_hashes).

        Confirmation follows the parent chain: page j's cached parent must be the slot confirmed
        for page j-1. pages: int64 [N, page_size]; row, col: int64 [N] prompt and position of each
        page; limit: int64 [A] pages each prompt may take from the cache; ns: int64 [A]; hashes: uint64 [N].
        Returns (hits int64 [A], cand int64 [N]: the cached slot of each page, valid where col < hits[row]).
        """
        if len(limit) == 1:
            return self._match_one(pages, int(limit[0]), int(ns[0]), hashes)
        cand, ok = self.candidates(pages, row, ns, hashes)
        ok &= col < limit[row]
        prev = np.full(len(cand), -1, dtype=np.int64)
        inner = (col > 0).nonzero()[0]
        prev[inner] = cand[inner - 1]
        ok &= self.parent[np.maximum(cand, 0)] == prev
        return leading_run(ok, row, col, len(limit)), cand

    def _match_one(self, pages: np.ndarray, limit: int, ns: int, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """match for one prompt: its hit ends at the first page the index does not know (or at limit), so only
        the pages before it are confirmed, as one slice (none: no NumPy call at all). The same result."""
        n = len(hashes)
        found = list(map(self.by_hash.get, hashes.tolist(), repeat(-1, n)))
        cand = np.array(found, dtype=np.int64)
        m = found.index(-1) if -1 in found else n
        if limit < m:
            m = limit
        if m <= 0:
            return np.zeros(1, dtype=np.int64), cand
        slots = cand[:m]
        good = self.namespace[slots] == ns
        good &= self._same_tokens(slots, pages[:m])
        prev = np.empty(m, dtype=np.int64)
        prev[0] = -1
        prev[1:] = slots[:-1]
        good &= self.parent[slots] == prev
        h = m if np.logical_and.reduce(good) else int(good.argmin())
        return np.array([h], dtype=np.int64), cand

    def register(self, slots: np.ndarray, parents: np.ndarray, ns: np.ndarray, pages: np.ndarray,
                 hashes: np.ndarray, parent_hashes: np.ndarray | None = None,
                 anchors: np.ndarray | None = None, chain: bool = False) -> None:
        """Make pages findable: slots/parents/ns int64 [n], pages int64 [n, page_size], hashes uint64 [n],
        parent_hashes uint64 [n] (0 for a first page), anchors int64 [n] (-1 = none). chain: the pages are
        one prompt's pages 0..n-1 in distinct slots, parents[j] = slots[j - 1] (parents[0] = -1).

        A hash already registered (the same content in another slot) keeps its first slot.
        """
        if anchors is None and parent_hashes is not None and len(hashes) <= RUN_MAX:
            self._register_run(slots, parents, ns, pages, hashes, parent_hashes, chain)
            return
        uniq_h, first = first_of_each(hashes)                      # one slot per new hash
        cand = slots[first]
        by_hash = self.by_hash
        new = ~np.fromiter(map(by_hash.__contains__, uniq_h.tolist()), dtype=bool, count=len(uniq_h))
        new &= self.hash[cand] == 0
        s, h = cand[new], uniq_h[new]
        by_hash.update(zip(h.tolist(), s.tolist(), strict=True))
        self.allocator.cacheable[s] = True
        keep = first[new]
        par = parents[keep]
        self.hash[s] = h
        self.parent[s] = par
        self.parent_hash[s] = parent_hashes[keep] if parent_hashes is not None else 0
        self.anchor[s] = anchors[keep] if anchors is not None else -1
        self.namespace[s] = ns[keep]
        self.tokens[s] = pages[keep]
        dep = par >= 0
        dep[dep] = self.hash[par[dep]] != 0                 # under a registered page: it now has a dependant
        self.allocator.policy.link(s[dep], par[dep])
        if self.sink is not None:
            self.sink.stored(slots, parents, hashes, pages, keep, self.hash, parent_hashes, self._names(ns))
        if self.fleet is not None:
            self.fleet.registered(s, par)

    def _register_run(self, slots: np.ndarray, parents: np.ndarray, ns: np.ndarray, pages: np.ndarray,
                      hashes: np.ndarray, parent_hashes: np.ndarray, chain: bool = False) -> None:
        """register for a few distinct slots (one prompt's pages, no anchors), its choice made on Python ints.

        The same state, events and by_hash order as register: the new hashes enter by_hash in ascending hash
        order (np.unique's, the first page of each), every per-slot array is written in page order (the slots
        are distinct, so the order of writes changes nothing), and a run of consecutive new pages (the usual
        case: the pages after the prompt's hit) is written from slices, with no gathered copy of its tokens."""
        hl = hashes.tolist()
        sl = slots.tolist()
        by_hash, slot_hash = self.by_hash, self.hash.item
        order = sorted(range(len(hl)), key=hl.__getitem__)      # a stable argsort
        keep: list[int] = []                                    # new pages, ascending hash
        last = None
        for j in order:
            h = hl[j]
            if h != last:
                last = h
                if h not in by_hash and not slot_hash(sl[j]):
                    keep.append(j)
        if not keep:
            if self.fleet is not None:                      # told of nothing, as register tells it
                self.fleet.registered(slots[:0], parents[:0])
            return
        by_hash.update([(hl[j], sl[j]) for j in keep])
        kp = sorted(keep)                                       # page order
        a, b = kp[0], kp[-1] + 1
        at: slice | np.ndarray = slice(a, b) if b - a == len(kp) else np.array(kp, dtype=np.intp)
        s = slots[at]
        par = parents[at]
        self.allocator.cacheable[s] = True
        self.hash[s] = hashes[at]
        self.parent[s] = par
        self.parent_hash[s] = parent_hashes[at]
        self.anchor[s] = -1
        self.namespace[s] = ns[at]
        self.tokens[s] = pages[at]
        dep = par >= 0
        dep[dep] = self.hash[par[dep]] != 0                 # under a registered page: it now has a dependant
        # One prompt's chain: each page's parent is the page before it, in distinct slots: no parent named twice.
        self.allocator.policy.link(s[dep], par[dep], distinct=chain)
        if self.sink is not None:                           # fresh arrays: the event index and events keep them
            names = self._names(ns)
            run = isinstance(at, slice)
            self.sink.stored_kept(s.copy() if run else s, hashes[at].copy() if run else hashes[at],
                                  parent_hashes[at], pages[at].copy() if run else pages[at], self.hash,
                                  [names[k] for k in kp] if names is not None else None)
        if self.fleet is not None:                          # told in register's order (ascending hash)
            hk = np.array(keep, dtype=np.int64)
            self.fleet.registered(slots[hk], parents[hk])

    def _names(self, ns: np.ndarray) -> list[tuple[str, str]] | None:
        """(salt, extra key) per page of namespaces ns (int64 [n]); None when all are ("", "") (the common case)."""
        ids = ns.tolist()
        name_of = self.namespaces.name_of
        pairs = {i: name_of(i) for i in set(ids)}
        if all(p == ("", "") for p in pairs.values()):
            return None
        return [pairs[i] for i in ids]

    def forget(self, slot: int) -> None:
        """Drop a slot's page from the cache (it is being reused for something else)."""
        self.allocator.policy.unlink(slot)
        self.forget_many(np.array([slot], dtype=np.intp))

    def forget_many(self, slots: np.ndarray) -> None:
        """Drop the pages of slots (intp [k], distinct; already unlinked in the eviction policy), in order."""
        by_hash, fleet, sink = self.by_hash, self.fleet, self.sink
        gone_h, gone_s = [], []
        for s, h in zip(slots.tolist(), self.hash[slots].tolist(), strict=True):
            if h and by_hash.get(h) == s:
                if fleet is not None:
                    fleet.forgotten(s, h)
                del by_hash[h]
                gone_h.append(h)
                gone_s.append(s)
        if sink is not None and gone_h:
            sink.removed_many(gone_h, gone_s)
        self.hash[slots] = 0
        self.parent[slots] = -2
        self.parent_hash[slots] = 0
        self.anchor[slots] = -1
        self.namespace[slots] = -1
        self.allocator.cacheable[slots] = False


def register_prompt(caches: Sequence[PrefixCache], order: Sequence[int], sliding: Sequence[bool],
                    anchor_group: int | None, slot_tables: Sequence[RowSlots], firsts: Sequence[np.ndarray],
                    a_rows: np.ndarray, prompt: Prompt) -> None:
    """Register a step's admitted prompt pages in every layer group's cache (Pool._register, after the commit).

    caches, slot_tables, firsts: per layer group, its PrefixCache, RowSlots and first kept page per row (int64
    [rows]); order: the groups, full ones first (their slots anchor the sliding groups' pages); anchor_group:
    that full group (None: none); a_rows: int64 [A] the admissions' rows; prompt: their pages (stepplan.Prompt).
    """
    row, col = prompt.row, prompt.col
    one = len(a_rows) == 1                       # one prompt: page j's parent is page j - 1, for every j > 0
    if one:
        inner = None
        parent_hashes = np.empty(len(col), dtype=np.uint64)
        parent_hashes[0] = 0
        parent_hashes[1:] = prompt.hashes[:-1]
    else:
        inner = (col > 0).nonzero()[0]
        parent_hashes = np.zeros(len(col), dtype=np.uint64)
        parent_hashes[inner] = prompt.hashes[inner - 1]
    seq_rows = a_rows[row] if not one or any(sliding) else None
    anchors = None
    for g in order:
        rs = slot_tables[g]
        if one and not sliding[g]:                               # the row's pages 0..n-1: one run of its segment
            r = int(a_rows[0])
            at0 = int(rs.start[r] - rs.lo[r])
            slots = rs.arena[at0:at0 + len(col)].astype(np.int64)
            parents = np.empty(len(slots), dtype=np.int64)
            parents[0] = -1
            parents[1:] = slots[:-1]
            if g == anchor_group:
                anchors = slots
            caches[g].register(slots, parents, prompt.ns[row], prompt.pages, prompt.hashes, parent_hashes, None,
                               chain=True)
            continue
        if inner is None:
            inner = (col > 0).nonzero()[0]
        if sliding[g]:
            at = (col >= firsts[g][seq_rows]).nonzero()[0]     # a sliding group holds no page before its window
            slots = np.full(len(col), -1, dtype=np.int64)
            slots[at] = rs.arena.take(rs.flat(seq_rows[at], col[at]))
        else:                                                    # a full group holds every page
            slots = rs.arena.take(rs.flat(seq_rows, col)).astype(np.int64)
            at = None
        parents = np.full(len(slots), -1, dtype=np.int64)
        parents[inner] = slots[inner - 1]                        # page j-1 of the same prompt precedes page j
        if g == anchor_group:
            anchors = slots
        args = (slots, parents, prompt.ns[row], prompt.pages, prompt.hashes, parent_hashes, None)
        if at is not None:                                       # a sliding group: its kept pages, anchored
            args = (*(a[at] for a in args[:-1]), anchors[at] if anchors is not None else None)
        caches[g].register(*args)


def leading_run(ok: np.ndarray, row: np.ndarray, col: np.ndarray, num_rows: int) -> np.ndarray:
    """Per prompt, how many of its first pages are all ok (pages stored ragged: prompt after prompt, row
    non-decreasing, col 0.. ascending within each row)."""
    hits = np.bincount(row, minlength=num_rows).astype(np.int64)   # every page ok ...
    bad = (~ok).nonzero()[0]
    if len(bad):                                                     # ... up to the first that is not
        rb = row[bad]
        first = np.empty(len(bad), dtype=bool)                        # a row's first bad page comes first
        first[0] = True
        np.not_equal(rb[1:], rb[:-1], out=first[1:])
        hits[rb[first]] = col[bad[first]]
    return hits


def run_ending_at(ok: np.ndarray, col: np.ndarray) -> np.ndarray:
    """int64 [N]: length of the run of ok pages that ends at each page, within its prompt (0 if not ok)."""
    n = len(ok)
    idx = np.arange(n, dtype=np.int64)
    # Index of the last page before or at i that breaks a run (not ok, or the first page of a prompt - 1).
    breaks = np.where(~ok, idx, -1)
    starts = np.where(col == 0, idx - 1, -1)
    last_break = np.maximum.accumulate(np.maximum(breaks, starts)) if n else breaks
    return np.where(ok, idx - last_break, 0)


def first_of_each(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values sorted, index of each one's first occurrence): np.unique(values, return_index=True)
    for a 1-D array, with one stable sort."""
    order = np.argsort(values, kind="stable")
    srt = values[order]
    if len(srt) < 2:
        return srt, order
    head = np.empty(len(srt), dtype=bool)
    head[0] = True
    np.not_equal(srt[1:], srt[:-1], out=head[1:])
    if np.logical_and.reduce(head):                                     # distinct (the usual case): nothing to drop
        return srt, order
    return srt[head], order[head]
