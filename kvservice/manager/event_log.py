"""The manager's KV event logs: one bounded ring of numbered batches per pool, and its subscribers.

After every successful Step, ``ManagerAPI`` hands the pool to :meth:`EventHub.after_step` (under
the pool's lock): the step's changes become batch ``seq`` of that pool's :class:`EventLog`.
Subscribers (a gRPC ``WatchEvents`` stream, a ZeroMQ publisher) read batches by sequence number
from the ring, each at its own pace.

Only committed batches are visible. Under ``kvservice serve`` (``deferred``), a batch recorded
while a request is applied is *staged* for the applying thread and becomes visible when the
servicer's :meth:`EventHub.transaction` ends normally, that is after the journal made the
request durable; if the request is not acknowledged it never shows, so a restarted manager,
which regenerates batches by journal replay, never contradicts a batch it published.

A subscriber asking for a batch the ring no longer holds (older than the oldest retained,
e.g. older than the snapshot a restarted manager recovered from) gets a *reset* instead:
AllBlocksCleared and then the pool's whole cache as of some sequence S, followed by the
batches after S. So a consumer's view is exact again, and the reset says that it happened.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvservice.contract.errors import NotFound, ResourceExhausted
from kvservice.core.cache_events import (
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    copy_cached_pages,
    pool_caches,
    stored_events,
)
from kvservice.manager.read_budget import DEFAULT_READ_BURST, DEFAULT_READ_SHARE, ReadBudget


class PoolLocks(Protocol):
    """What the hub needs of the manager: a pool by name, under its lock (BlockManager.locked)."""

    def locked(self, name: str) -> AbstractContextManager[Any]: ...

#: Batches a pool's ring keeps for late or resuming subscribers (vLLM's replay buffer holds 10,000 steps).
DEFAULT_RING_BATCHES = 10_000
#: ... and at most this many bytes of hashes and token ids (memory the manager spends per pool).
DEFAULT_RING_BYTES = 64 << 20


@dataclass(slots=True)
class LoggedBatch:
    """A batch as the ring holds it: the domain batch, when it was recorded, and cached encodings.

    ts: seconds since the epoch when this process recorded it (a replayed batch: when replayed).
    nbytes: bytes of its hashes and token ids. encoded: transport -> cached encoding.
    """

    batch: Batch
    ts: float
    nbytes: int
    encoded: dict[str, object] = field(default_factory=dict)

    @property
    def seq(self) -> int:
        return self.batch.seq


def _nbytes(batch: Batch) -> int:
    n = 0
    for e in batch.events:
        if isinstance(e, BlockStored):
            n += e.block_hashes.nbytes + e.token_ids.nbytes
        elif isinstance(e, BlockRemoved):
            n += e.block_hashes.nbytes
    return n


@dataclass(slots=True)
class Counters:
    """Per pool and transport, for /metrics (monotonic)."""

    sent: int = 0          # batches handed to subscribers (a reset counts once)
    dropped: int = 0       # batches a subscriber could not get from the ring (replaced by a reset)
    resets: int = 0        # resets sent


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV event settings of a manager (``kvservice serve --kv-events-*``).

    ring_batches, ring_bytes: what each pool's ring retains for late or resuming subscribers.
    max_watchers: concurrent WatchEvents streams (each holds a gRPC server thread).
    max_watchers_per_tenant: ... of one tenant (token name); 0 = half of max_watchers, at least 1. Below
        max_watchers, one tenant's streams never take every slot (docs/SECURITY.md#fairness).
    zmq: ZeroMQ publishers (zmq_events.ZmqConfig), one per pool.
    read_share, read_burst: each tenant's CPU for heavy reads (resets, catch-up, ScorePrefix): read_budget.py.
    """

    ring_batches: int = DEFAULT_RING_BATCHES
    ring_bytes: int = DEFAULT_RING_BYTES
    max_watchers: int = 4
    max_watchers_per_tenant: int = 0
    zmq: tuple = ()
    read_share: float = DEFAULT_READ_SHARE
    read_burst: float = DEFAULT_READ_BURST

    def watchers_per_tenant(self) -> int:
        """The per-tenant cap in force (the default derived from max_watchers)."""
        return self.max_watchers_per_tenant or max(1, self.max_watchers // 2)


class EventLog:
    """The ring of one pool. Fields change only under the hub's lock.

    batches: retained batches, seq ascending and consecutive. committed: the last visible seq.
    head: the last seq recorded (staged ones included). closed: the pool was deleted.
    """

    def __init__(self, pool: str, base: int, max_batches: int, max_bytes: int) -> None:
        self.pool = pool
        self.batches: deque[LoggedBatch] = deque()
        self.bytes = 0
        self.committed = base
        self.head = base
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.closed = False
        self.subscribers: set[Subscription] = set()
        self.events_by_type = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.batches_total = 0
        self.counters: dict[str, Counters] = {}

    @property
    def oldest(self) -> int:
        """The oldest seq a subscriber can still read (committed + 1 when the ring is empty)."""
        return self.batches[0].seq if self.batches else self.committed + 1

    def append(self, lb: LoggedBatch) -> None:
        """Add the next batch (seq = head + 1) and drop the oldest committed ones past the ring's bounds."""
        if lb.seq != self.head + 1:      # cannot happen (one numbering per pool); keep serving: readers get a reset
            self.batches.clear()
            self.bytes = 0
            self.committed = self.head = lb.seq - 1
        self.batches.append(lb)
        self.head = lb.seq
        self.bytes += lb.nbytes
        while len(self.batches) > 1 and (len(self.batches) > self.max_batches or self.bytes > self.max_bytes) \
                and self.batches[0].seq <= self.committed:
            self.bytes -= self.batches.popleft().nbytes

    def commit(self, seq: int) -> None:
        """Make batches up to seq visible (and count their events)."""
        for lb in reversed(self.batches):
            if lb.seq <= self.committed:
                break
            if lb.seq <= seq:
                self.batches_total += 1
                for e in lb.batch.events:
                    self.events_by_type[type(e).__name__] += 1
        self.committed = max(self.committed, seq)

    def counter(self, transport: str) -> Counters:
        c = self.counters.get(transport)
        if c is None:
            c = self.counters[transport] = Counters()
        return c


class _Transaction:
    """EventHub.transaction's context manager (a class: a generator-based one costs a decode step ~1%)."""

    __slots__ = ("hub", "staged")

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self.staged: list[tuple[EventLog, int]] = []

    def __enter__(self) -> None:
        self.staged = self.hub._staged()
        self.staged.clear()

    def __exit__(self, kind: object, err: object, tb: object) -> bool:
        self.hub._finish(self.staged, kind is None)
        return False


class EventHub:
    """Every pool's event log. Lock order: a pool's lock, then the hub's (never the other way round).

    deferred: stage batches until :meth:`transaction` ends (set by ``kvservice serve``); False =
    visible at once (recovery replay, in-process use). max_subscribers: concurrent WatchEvents
    streams (each holds a server thread); max_subscribers_per_tenant: ... of one named tenant.
    """

    def __init__(self, manager: PoolLocks, ring_batches: int = DEFAULT_RING_BATCHES,
                 ring_bytes: int = DEFAULT_RING_BYTES, max_subscribers: int = 4,
                 max_subscribers_per_tenant: int = 2) -> None:
        self.manager = manager
        self.ring_batches = ring_batches
        self.ring_bytes = ring_bytes
        self.max_subscribers = max_subscribers
        self.max_subscribers_per_tenant = max_subscribers_per_tenant
        self.read_budget = ReadBudget()          # each tenant's CPU for resets, catch-up and ScorePrefix
        self.deferred = False
        self.cond = threading.Condition(threading.Lock())
        self.logs: dict[str, EventLog] = {}
        self.lookup_pages: dict[tuple[str, int], int] = {}   # (pool, group) -> prompt pages looked up
        self._local = threading.local()

    # ---- writing (under the pool's lock) ---------------------------------------------------
    def after_step(self, pool: object, admit_num_tokens: np.ndarray | None = None,
                   with_token_ids: bool = False) -> None:
        """Record the step's changes of `pool` as its next batch; count the prompt pages it looked up.

        admit_num_tokens: int64 [A], tokens of the step's admissions; with_token_ids: they carried
        token ids (so each full page but the last token's was looked up in the prefix cache).
        """
        caches = pool_caches(pool)
        if with_token_ids and caches and admit_num_tokens is not None and len(admit_num_tokens):
            n = int(((np.asarray(admit_num_tokens, dtype=np.int64) - 1) // pool.page_size).sum())
            for cache in caches:
                key = (pool.name, cache.sink.group)
                with self.cond:
                    self.lookup_pages[key] = self.lookup_pages.get(key, 0) + n
        batch = pool.events.take_batch(caches)
        if batch is None:
            return
        lb = LoggedBatch(batch, time.time(), _nbytes(batch))
        with self.cond:
            log = self._log_locked(pool.name, batch.seq - 1)
            log.append(lb)
            if self.deferred:
                self._staged().append((log, batch.seq))
            else:
                log.commit(batch.seq)
                self.cond.notify_all()

    def pool_deleted(self, name: str) -> None:
        """The pool is gone: its log ends with an AllBlocksCleared batch (staged like any other)."""
        with self.cond:
            log = self.logs.get(name)
            if log is None or log.closed:
                self.logs.pop(name, None)
                return
            lb = LoggedBatch(Batch(log.head + 1, (AllBlocksCleared(),), reset=True), time.time(), 0)
            log.append(lb)
            log.closed = True
            del self.logs[name]
            if self.deferred:
                self._staged().append((log, lb.seq))
            else:
                log.commit(lb.seq)
                self.cond.notify_all()

    def _staged(self) -> list[tuple[EventLog, int]]:
        staged = getattr(self._local, "staged", None)
        if staged is None:
            staged = self._local.staged = []
        return staged

    def transaction(self) -> _Transaction:
        """Around one request's apply + durable commit (a context manager): its batches become visible only if
        it returns."""
        return _Transaction(self)

    def _finish(self, staged: list[tuple[EventLog, int]], ok: bool) -> None:
        """The end of a transaction: commit its staged batches (ok), or drop them. Not acknowledged: a durable
        journal fail-stops then, so they are never seen; a memory-only manager that carries on shows them with
        the next commit, as its memory did change."""
        if ok and staged:
            with self.cond:
                for log, seq in staged:
                    log.commit(seq)
                self.cond.notify_all()
        staged.clear()

    def _log_locked(self, name: str, base: int) -> EventLog:
        log = self.logs.get(name)
        if log is None:
            log = self.logs[name] = EventLog(name, base, self.ring_batches, self.ring_bytes)
        return log

    # ---- reading ----------------------------------------------------------------------------
    def subscribe(self, pool: str, from_seq: int | None, transport: str, limit: bool = True,
                  tenant: str = "") -> Subscription:
        """A reader of `pool`'s batches from from_seq on (None = from the next batch; 0 = reset first).

        NotFound for an unknown pool; ResourceExhausted past max_subscribers, or past
        max_subscribers_per_tenant for a named tenant (when limit). tenant: the caller's token name
        ("" without tokens: every caller is one tenant, held only to the global cap).
        """
        if limit:
            with self.cond:                           # refused before the pool's lock is asked for (a refusal
                self._check_slots(tenant)             # flood must not contend with the owner's Steps)
        with self.manager.locked(pool) as p:          # pool lock, then the hub's
            seq = p.events.seq
            with self.cond:
                log = self._log_locked(pool, seq)
                if limit:
                    self._check_slots(tenant)
                sub = Subscription(self, log, log.head + 1 if from_seq is None else from_seq, transport, limit,
                                   tenant)
                log.subscribers.add(sub)
                log.counter(transport)
        return sub

    def watchers(self, tenant: str | None = None) -> int:
        """Counted (limited) subscribers, of one tenant or (None) of all. Call under self.cond."""
        return sum(s.limited and (tenant is None or s.tenant == tenant)
                   for lg in self.logs.values() for s in lg.subscribers)

    def _check_slots(self, tenant: str) -> None:
        """ResourceExhausted, with what to do, when no watcher slot is left for `tenant` (under self.cond)."""
        mine = self.watchers(tenant)
        cap = self.max_subscribers_per_tenant
        if tenant and cap and mine >= cap:
            raise ResourceExhausted(
                f"token {tenant!r} has {mine} WatchEvents streams open, its limit per tenant "
                f"(--kv-events-max-watchers-per-tenant {cap}); cancel one you no longer read (one stream per pool "
                "is enough: resume with the last sequence received + 1) before opening another",
                reason="LIMIT_EXCEEDED", limit=cap, held=mine)
        if self.watchers() >= self.max_subscribers:
            raise ResourceExhausted(
                f"{self.max_subscribers} WatchEvents streams are open on this manager, its limit "
                f"(--kv-events-max-watchers; {mine} of them yours); retry in a few seconds, or ask the operator to "
                "raise it (with --threads above it)", reason="LIMIT_EXCEEDED", limit=self.max_subscribers, held=mine)

    def pool_seq(self, pool: str) -> int:
        """The pool's last committed batch sequence (0 if none)."""
        with self.cond:
            log = self.logs.get(pool)
            if log is not None:
                return log.committed
        with self.manager.locked(pool) as p:
            return p.events.seq


class Subscription:
    """One reader of one pool's log. `next_seq`: the next batch it wants. Use from one thread."""

    def __init__(self, hub: EventHub, log: EventLog, next_seq: int, transport: str, limited: bool,
                 tenant: str = "") -> None:
        self.hub = hub
        self.log = log
        self.next_seq = next_seq
        self.transport = transport
        self.limited = limited
        self.tenant = tenant
        self.closed = False
        self.token_ids = True       # False: a reset copies no token ids (a consumer that is never sent them)

    @property
    def lag(self) -> int:
        """Committed batches this subscriber has not read yet."""
        return max(0, self.log.committed - (self.next_seq - 1))

    def close(self) -> None:
        with self.hub.cond:
            self.log.subscribers.discard(self)
            self.closed = True

    def poll(self, timeout: float, max_batches: int | None = None) -> list[LoggedBatch] | None:
        """The next visible batches (waiting up to timeout seconds for one), [] if none came, None once the
        pool is gone and everything was read. A reset (a LoggedBatch whose batch.reset is set) comes when
        next_seq is 0, older than the ring's oldest, or ahead of the log (a log that started anew).
        max_batches: at most this many batches (None = every one available)."""
        hub, log = self.hub, self.log
        with hub.cond:
            why = self._reset_reason()
            if why is None:
                if log.committed < self.next_seq and not log.closed:
                    hub.cond.wait(timeout)
                    why = self._reset_reason()
            if why is None:
                if self.next_seq > log.committed:
                    if log.closed and log.committed >= log.head:
                        log.subscribers.discard(self)
                        return None
                    return []
                start = self.next_seq - log.batches[0].seq
                stop = None if max_batches is None else start + max(1, max_batches)
                out = [lb for lb in itertools.islice(log.batches, start, stop) if lb.seq <= log.committed]
                self.next_seq = out[-1].seq + 1
                log.counter(self.transport).sent += len(out)
                return out
            if why == "behind":
                log.counter(self.transport).dropped += log.oldest - self.next_seq
        return self._reset(why)

    def heavy(self, live_from: int) -> bool:
        """Whether the next poll is a reset or reads batches up to live_from (catch-up), not live batches."""
        log = self.log
        return self.next_seq <= live_from or self.next_seq < log.oldest or self.next_seq > log.head + 1

    def _reset_reason(self) -> str | None:
        log = self.log
        if self.next_seq == 0:
            return "requested"
        if self.next_seq < log.oldest:
            return "behind"
        if self.next_seq > log.head + 1:
            return "ahead"
        return None

    def _reset(self, why: str) -> list[LoggedBatch] | None:
        """AllBlocksCleared + the whole cache as of the pool's last batch, labelled with that batch's sequence.

        A deleted pool's subscriber gets AllBlocksCleared alone, then None."""
        log = self.log
        try:
            if log.closed:
                raise NotFound(f"pool {log.pool!r} was deleted")
            with self.hub.manager.locked(log.pool) as pool:      # a copy under the lock (a few array copies) ...
                seq = pool.events.seq
                copies = copy_cached_pages(pool_caches(pool), self.token_ids)
        except NotFound:
            with self.hub.cond:
                if self.next_seq > log.head:
                    log.subscribers.discard(self)
                    return None
                self.next_seq = log.head + 1
            return [LoggedBatch(Batch(log.head, (AllBlocksCleared(),), reset=True), time.time(), 0,
                                {"reset_reason": "the pool was deleted"})]
        batch = Batch(seq, (AllBlocksCleared(), *stored_events(copies)), reset=True)   # ... events built after it
        with self.hub.cond:
            self.next_seq = seq + 1
            c = log.counter(self.transport)
            c.resets += 1
            c.sent += 1
        return [LoggedBatch(batch, time.time(), _nbytes(batch), {"reset_reason": RESET_REASONS[why]})]



RESET_REASONS = {
    "requested": "from_sequence 0: the current cache, then live batches",
    "behind": "the batches asked for are no longer retained (older than the ring, or than the snapshot a "
              "restarted manager recovered from)",
    "ahead": "the sequence asked for is ahead of this pool's log (the pool was re-created or the manager lost "
             "unacknowledged batches)",
}


__all__ = ["DEFAULT_RING_BATCHES", "DEFAULT_RING_BYTES", "EventHub", "EventLog", "EventsConfig", "LoggedBatch",
           "PoolLocks", "Subscription"]
