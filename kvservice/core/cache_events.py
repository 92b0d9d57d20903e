"""KV events of a pool: which cached pages appeared and disappeared, in vLLM's vocabulary.

A router that keeps an index of what each replica has cached (llm-d's kv-cache indexer,
Dynamo's KV router) follows a stream of three events: ``BlockStored`` (pages became findable
by their hash), ``BlockRemoved`` (their hashes are gone) and ``AllBlocksCleared``. Here they
are derived from the prefix cache itself: the cache calls its ``sink`` (a
:class:`GroupEventSource`) when it registers pages and when it forgets one, so the events
are exactly the changes of the index ``PrefixCache.by_hash``, in order.

The sources of one pool share one :class:`PoolEvents`, which belongs to the pool's state
(snapshotted with it, rebuilt by journal replay, since replay runs the same steps): it holds
the changes of the step in progress and the number of the last batch. After every Step the
manager takes the step's changes as one batch numbered ``seq + 1`` (:meth:`take_batch`); a
restarted manager therefore numbers the batches it regenerates by replay exactly as the first
run did. Transport (the gRPC stream, ZeroMQ) is elsewhere (``manager/event_log.py``, ``events/zmq.py``).

Layer groups: every source names its group, the group's kind ("full_attention" or
"sliding_window") and window, so a hybrid pool whose groups cache prefixes only adds sources.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import pairwise

import numpy as np

from kvservice.core.hash_index import HashSlots

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
#: Pending changes (pages) a pool keeps when nobody takes its batches (a pool used without a
#: manager); past this it drops them and the next batch is a reset (AllBlocksCleared + the cache).
MAX_PENDING_PAGES = 1 << 16
_NO_HASHES = np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Pages that became findable, a chain: each page's parent is the page before it.

    block_hashes: uint64 [n], the pages' chained hashes (never 0).
    parent_block_hash: hash of the first page's parent page; 0 = the first page starts a prompt.
    token_ids: int64 [n * block_size], the pages' tokens in order.
    block_size: tokens per page. group: layer group; kind, sliding_window: the group's attention
    (window 0 for full attention).
    extra_keys: None, or one entry per page: () or the page's keys besides its tokens, as vLLM publishes
    them: the extra key (a LoRA name) on every page, then the cache salt on a prompt's first page.
    """

    group: int
    block_hashes: np.ndarray
    parent_block_hash: int
    token_ids: np.ndarray
    block_size: int
    kind: str = FULL_ATTENTION
    sliding_window: int = 0
    extra_keys: tuple[tuple[str, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages no longer findable: block_hashes uint64 [n] of layer group `group`."""

    group: int
    block_hashes: np.ndarray


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Forget everything known about this pool's cache (a reset or a deleted pool)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


def event_pages(ev: Event) -> int:
    """Pages an event names (0 for AllBlocksCleared)."""
    return 0 if isinstance(ev, AllBlocksCleared) else len(ev.block_hashes)


class _Pending:
    """Changes recorded since the last batch: events in order, pages named, and whether any were dropped."""

    __slots__ = ("events", "overflowed", "pages")

    def __init__(self) -> None:
        self.events: list[Event | list] = []   # a list = hashes of a BlockRemoved still growing: [group, [h, ...]]
        self.pages = 0
        self.overflowed = False

    def add(self, n: int) -> bool:
        """Count n more pages; False (and everything dropped) once MAX_PENDING_PAGES is passed."""
        if self.overflowed:
            return False
        self.pages += n
        if self.pages > MAX_PENDING_PAGES:
            self.events.clear()
            self.pages = 0
            self.overflowed = True
            return False
        return True


class GroupEventSource:
    """The event sink of one layer group's prefix cache (``PrefixCache.sink``).

    parent_hash[slot]: uint64 [num_slots], hash of the parent page of the page registered in slot
    (0 = none), kept so that the cache's whole state can be described again (:func:`state_events`).
    index: the cache's hashes -> slots as a NumPy table (hash_index.py), for ScorePrefix.
    """

    __slots__ = ("group", "index", "kind", "parent_hash", "pending", "sliding_window")

    def __init__(self, pending: _Pending, group: int, sliding_window: int, num_slots: int) -> None:
        self.pending = pending
        self.group = group
        self.sliding_window = sliding_window
        self.kind = SLIDING_WINDOW if sliding_window else FULL_ATTENTION
        self.parent_hash = np.zeros(num_slots, dtype=np.uint64)
        self.index = HashSlots(num_slots)

    def stored(self, slots: np.ndarray, parents: np.ndarray, hashes: np.ndarray, pages: np.ndarray,
               keep: np.ndarray, slot_hash: np.ndarray, parent_hashes: np.ndarray | None = None,
               names: list[tuple[str, str]] | None = None) -> None:
        """Pages the cache just registered.

        slots, parents: int64 [n], the slot of each offered page and of its parent page (-1 = none);
        hashes: uint64 [n]; pages: int64 [n, page_size] token ids; keep: int64 [k], which of the n
        were registered (each a new hash); slot_hash: uint64 [num_slots], the cache's hash per slot;
        parent_hashes: uint64 [n], the hash of each page's parent page (0 = none) when the caller
        knows it (a sliding group's first kept page has a parent it does not hold); names: (salt, extra
        key) of each offered page, None when every page has neither.
        Consecutive registered pages of one prompt become one BlockStored chain.
        """
        if not len(keep):
            return
        keep = np.sort(keep)
        if parent_hashes is not None:
            parent_h = parent_hashes[keep].astype(np.uint64, copy=False)
        else:
            par = parents[keep]
            prev = np.maximum(keep - 1, 0)
            same_prompt = (keep > 0) & (slots[prev] == par)
            parent_h = np.where(same_prompt, hashes[prev], np.where(par >= 0, slot_hash[np.maximum(par, 0)], 0))
            parent_h = parent_h.astype(np.uint64)
        names_kept = [names[k] for k in keep.tolist()] if names is not None else None
        self.stored_kept(slots[keep], hashes[keep], parent_h, pages[keep], slot_hash, names_kept)

    def stored_kept(self, kept: np.ndarray, h: np.ndarray, parent_h: np.ndarray, tok: np.ndarray,
                    slot_hash: np.ndarray, names: list[tuple[str, str]] | None = None) -> None:
        """stored for the registered pages alone, in page order (n >= 1 of them): kept int64 [n] their slots and
        tok int64 [n, page_size] their token ids (both fresh arrays: the index and the events keep them), h and
        parent_h uint64 [n] their hashes and their parents' (0 = none), names their (salt, extra key) or None."""
        n = len(kept)
        self.parent_hash[kept] = parent_h
        if self.index.full_after(n):                    # rebuilt from the live pages when next looked up
            self.index.invalidate(partial(live_pairs, slot_hash))
        else:
            self.index.insert(h, kept if kept.dtype == np.int64 else kept.astype(np.int64))
        if not self.pending.add(n):
            return
        cuts = (parent_h[1:] != h[:-1]).nonzero()[0] + 1        # a new chain where the parent is not the last page
        ps = tok.shape[1]
        extra = None
        if names is not None:
            first = (parent_h == 0).tolist()
            extra = tuple(page_keys(*nm, f) for nm, f in zip(names, first, strict=True))
        bounds = [0, *cuts.tolist(), n]
        for lo, hi in pairwise(bounds):
            self.pending.events.append(BlockStored(self.group, h[lo:hi], int(parent_h[lo]),
                                                   tok[lo:hi].reshape(-1), ps, self.kind,
                                                   self.sliding_window, extra[lo:hi] if extra else None))

    def removed_many(self, hashes: list[int], slots: list[int]) -> None:
        """Pages the cache forgot, in order (hashes and slots of each): one BlockRemoved with the last if it is ours."""
        self.parent_hash[slots] = 0
        p = self.pending
        if not p.add(len(hashes)):
            return
        last = p.events[-1] if p.events else None
        if isinstance(last, list) and last[0] == self.group:
            last[1].extend(hashes)
        else:
            p.events.append([self.group, list(hashes)])

    def removed(self, block_hash: int, slot: int) -> None:
        """A page the cache forgot (its slot is being reused); runs of removals become one BlockRemoved."""
        self.parent_hash[slot] = 0
        p = self.pending
        if not p.add(1):
            return
        last = p.events[-1] if p.events else None
        if isinstance(last, list) and last[0] == self.group:
            last[1].append(block_hash)
        else:
            p.events.append([self.group, [block_hash]])


@dataclass(frozen=True, slots=True)
class Batch:
    """The events of one step of a pool (or a reset), numbered.

    seq: the batch's sequence number, from 1, one per step that changed the cache.
    events: in the order the changes happened.
    reset: the batch starts with AllBlocksCleared and then describes the whole cache as of seq.
    """

    seq: int
    events: tuple[Event, ...]
    reset: bool = False

    @property
    def num_pages(self) -> int:
        return sum(event_pages(e) for e in self.events)


class PoolEvents:
    """Event state of one pool (part of the pool, so part of its durable state).

    seq: number of the last batch taken (0 = none yet); sources: one per layer group that caches.
    """

    def __init__(self) -> None:
        self.seq = 0
        self.pending = _Pending()
        self.sources: dict[int, GroupEventSource] = {}

    def source(self, group: int, sliding_window: int, num_slots: int) -> GroupEventSource:
        """The sink for layer group `group`'s prefix cache (created once per group)."""
        src = self.sources.get(group)
        if src is None:
            src = self.sources[group] = GroupEventSource(self.pending, group, sliding_window, num_slots)
        return src

    def take_batch(self, caches: list) -> Batch | None:
        """The changes since the last call as batch seq + 1, or None if nothing changed.

        caches: the pool's prefix caches (for a reset after dropped changes).
        """
        p = self.pending
        if not p.events and not p.overflowed:
            return None
        self.seq += 1
        if p.overflowed:
            batch = Batch(self.seq, (AllBlocksCleared(), *state_events(caches)), reset=True)
        else:
            batch = Batch(self.seq, tuple(
                BlockRemoved(e[0], np.array(e[1], dtype=np.uint64)) if isinstance(e, list) else e for e in p.events))
        p.events = []
        p.pages = 0
        p.overflowed = False
        return batch


def live_pairs(slot_hash: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, slots) of the pages a cache holds now (slot_hash: its hash per slot, 0 = none)."""
    live = slot_hash.nonzero()[0]
    return slot_hash[live], live


def pool_caches(pool: object) -> list:
    """The prefix caches of a pool that publish events: one per layer group, when prefix caching is on."""
    caches = getattr(pool, "prefixes", None) or ()
    return [c for c in caches if getattr(c, "sink", None) is not None]


def page_keys(salt: str, extra_key: str, first: bool) -> tuple[str, ...]:
    """A page's extra keys as vLLM's events list them: the extra key, then the salt on a prompt's first page."""
    keys = (extra_key,) if extra_key else ()
    return (*keys, salt) if first and salt else keys


def parents_first(hashes: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """int64 [n]: an order of n pages (hashes, parent hashes uint64 [n]) in which every page whose parent is
    among them comes after its parent (pages whose parent is not among them first, in their given order)."""
    index = {h: i for i, h in enumerate(hashes.tolist())}
    children: dict[int, list[int]] = {}
    order: list[int] = []
    for i, p in enumerate(parents.tolist()):
        at = index.get(p) if p else None
        if at is None or at == i:
            order.append(i)
        else:
            children.setdefault(at, []).append(i)
    k = 0
    while k < len(order):                            # breadth first from the roots
        order.extend(children.pop(order[k], ()))
        k += 1
    for rest in children.values():                   # a cycle cannot happen (a parent is registered first); keep all
        order.extend(rest)
    return np.array(order, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class CachedPages:
    """A copy of one group's cached pages, taken under the pool's lock, from which events are built after it.

    hashes, parents: uint64 [n]; tokens: int64 [n, page_size] (or [n, 0] without token ids); namespace: the pages'
    (salt, extra key) ids int64 [n], names: id -> (salt, extra key); the rest: the group's source.
    """

    group: int
    hashes: np.ndarray
    parents: np.ndarray
    tokens: np.ndarray
    namespace: np.ndarray
    names: dict
    page_size: int
    kind: str
    sliding_window: int


def copy_cached_pages(caches: list, token_ids: bool = True) -> list[CachedPages]:
    """What :func:`stored_events` needs of the caches, copied (vectorized: a few array copies, O(pages));
    token_ids False leaves the tokens out. Call under the pool's lock; build the events after it."""
    out = []
    for cache in caches:
        src: GroupEventSource = cache.sink
        slots = cache.hash.nonzero()[0]
        tokens = cache.tokens[slots] if token_ids else np.zeros((len(slots), 0), dtype=np.int64)
        out.append(CachedPages(src.group, cache.hash[slots], src.parent_hash[slots], tokens,
                               cache.namespace[slots].astype(np.int64), cache.namespaces.names(),
                               cache.page_size, src.kind, src.sliding_window))
    return out


def stored_events(copies: list[CachedPages]) -> list[BlockStored]:
    """The copied pages as BlockStored events, one per page, every parent page before its children (no lock
    needed: it reads only the copies)."""
    out: list[BlockStored] = []
    for c in copies:
        order = parents_first(c.hashes, c.parents)
        hashes, parents, tokens = c.hashes[order], c.parents[order], c.tokens[order]
        ns = c.namespace[order].tolist()
        for i in range(len(order)):
            keys = page_keys(*c.names.get(ns[i], ("", "")), parents[i] == 0)
            out.append(BlockStored(c.group, hashes[i:i + 1].copy(), int(parents[i]), tokens[i].copy(),
                                   c.page_size, c.kind, c.sliding_window, (keys,) if keys else None))
    return out


def state_events(caches: list) -> list[BlockStored]:
    """The caches' whole content as BlockStored events, one per page, every parent page before its children.

    A consumer that applies AllBlocksCleared and then these holds exactly the caches' indexes (and an
    indexer that links each page under its parent finds the parent already there).
    """
    return stored_events(copy_cached_pages(caches))


def indexed_hashes(caches: list) -> dict[int, set[int]]:
    """group -> the set of hashes the caches can find now (what a consumer of the events must hold)."""
    return {cache.sink.group: set(cache.by_hash) for cache in caches}


def apply_events(index: dict[int, set[int]], events: tuple[Event, ...] | list[Event]) -> None:
    """Apply events to a consumer's view group -> set of hashes (the reference of the tests and tools)."""
    for e in events:
        if isinstance(e, AllBlocksCleared):
            index.clear()
        elif isinstance(e, BlockStored):
            index.setdefault(e.group, set()).update(e.block_hashes.tolist())
        else:
            index.setdefault(e.group, set()).difference_update(e.block_hashes.tolist())


__all__ = ["FULL_ATTENTION", "SLIDING_WINDOW", "AllBlocksCleared", "Batch", "BlockRemoved", "BlockStored",
           "CachedPages", "Event", "GroupEventSource", "PoolEvents", "apply_events", "copy_cached_pages",
           "indexed_hashes", "pool_caches", "state_events", "stored_events"]
