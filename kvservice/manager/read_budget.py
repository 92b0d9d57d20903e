"""Each tenant's share of the manager's CPU for heavy reads: KV event resets and catch-up, ScorePrefix.

A read-only token must not slow another tenant's Steps (issue 27). Whatever the tenant does, the
read work it causes is measured in CPU seconds of the thread doing it (``time.thread_time``) and
charged to a token bucket of its own: `share` CPU seconds per second (a fraction of one core),
holding at most `burst` seconds. Work may start while the balance is positive and is charged what
it really cost afterwards, so one large piece (a reset of a big cache) goes through at once and the
tenant then waits until its debt is repaid: over any interval T a tenant gets at most
``burst + share * T`` seconds of read work plus the pieces in flight, of which it has at most
MAX_IN_FLIGHT at once. A WatchEvents stream that may not start waits (holding only its own watcher
slot); a ScorePrefix is refused at once, RESOURCE_EXHAUSTED reason ``RATE_LIMITED`` saying when to
retry (waiting would hold one of the server's threads).

Live event batches (those committed after a stream started) are not charged: their cost follows
the pool owner's own Steps. Tenants are token names ("" without tokens: every caller is one).
docs/SECURITY.md#fairness.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvservice.contract.errors import InvalidArgument, ResourceExhausted

#: Fraction of one core each tenant's heavy reads may use on average, and the CPU seconds of a burst.
DEFAULT_READ_SHARE = 0.05
DEFAULT_READ_BURST = 1.0
#: Tenants remembered (the least recently seen is forgotten first: its bucket starts full again).
MAX_TENANTS = 4096
#: Pieces of heavy read work one tenant may have running at once (each is one CPU-bound thread).
MAX_IN_FLIGHT = 2
#: Seconds a stream waits before asking again while its tenant's pieces are all running.
BUSY_WAIT = 0.05


class ReadBudget:
    """A CPU-seconds token bucket per tenant (share 0 = no limit). Thread-safe."""

    def __init__(self, share: float = DEFAULT_READ_SHARE, burst: float = DEFAULT_READ_BURST,
                 clock: Callable[[], float] = time.monotonic, max_tenants: int = MAX_TENANTS,
                 max_in_flight: int = MAX_IN_FLIGHT) -> None:
        if share < 0 or burst <= 0:
            raise InvalidArgument(f"--tenant-read-share must be >= 0 and --tenant-read-burst > 0, got {share} and "
                                  f"{burst}")
        self.share, self.burst, self.clock = share, burst, clock
        self.max_tenants, self.max_in_flight = max_tenants, max_in_flight
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()    # tenant -> (balance, when)
        self._running: dict[str, int] = {}                                        # tenant -> pieces in flight
        self.refused = 0

    def _balance(self, tenant: str, now: float) -> float:
        balance, when = self._buckets.pop(tenant, (self.burst, now))
        return min(self.burst, balance + (now - when) * self.share)

    def try_start(self, tenant: str) -> float:
        """Start a piece of `tenant`'s read work and return 0, or return the seconds to wait before asking again
        (its balance is spent, or MAX_IN_FLIGHT of its pieces are running). Call finish() after a 0."""
        if not self.share:
            return 0.0
        with self._lock:
            now = self.clock()
            balance = self._balance(tenant, now)
            self._buckets[tenant] = (balance, now)
            while len(self._buckets) > self.max_tenants:
                self._buckets.popitem(last=False)
            if balance <= 0:
                return (1e-3 - balance) / self.share
            running = self._running.get(tenant, 0)
            if running >= self.max_in_flight:
                return BUSY_WAIT
            self._running[tenant] = running + 1
        return 0.0

    def finish(self, tenant: str, seconds: float) -> None:
        """The piece try_start() let `tenant` start took `seconds` of CPU."""
        if not self.share:
            return
        with self._lock:
            running = self._running.pop(tenant, 1) - 1
            if running > 0:
                self._running[tenant] = running
        self.charge(tenant, seconds)

    def charge(self, tenant: str, seconds: float) -> None:
        """`tenant`'s read work took `seconds` of CPU (work that became heavy once started: a reset found late)."""
        if not self.share:
            return
        with self._lock:
            now = self.clock()
            self._buckets[tenant] = (self._balance(tenant, now) - max(0.0, seconds), now)

    @contextmanager
    def piece(self, tenant: str, what: str) -> Iterator[None]:
        """Run the block as one piece of `tenant`'s read work, charged its CPU time (this thread's);
        ResourceExhausted (RATE_LIMITED) at once, before the block, if it may not start now (unary calls)."""
        wait = self.try_start(tenant)
        if wait > 0:
            self.refused += 1
            who = f"token {tenant!r}" if tenant else "this manager's callers"
            raise ResourceExhausted(
                f"{what}: {who} used its share of the manager's CPU for heavy reads (ScorePrefix, KV event resets "
                f"and catch-up: --tenant-read-share {self.share:g} of a core, bursts of --tenant-read-burst "
                f"{self.burst:g} s, {self.max_in_flight} at once); retry in {wait:.2f} s", reason="RATE_LIMITED",
                retry_after_seconds=f"{wait:.3f}")
        start = time.thread_time()
        try:
            yield
        finally:
            self.finish(tenant, time.thread_time() - start)


__all__ = ["BUSY_WAIT", "DEFAULT_READ_BURST", "DEFAULT_READ_SHARE", "MAX_IN_FLIGHT", "MAX_TENANTS", "ReadBudget"]
