"""Fencing of a worker's memory against pool re-creation (docs/SECURITY.md#fencing).

A worker plans its KV memory from one incarnation of its pool (PoolInfo.incarnation).
Kernel requests carry the incarnation they were planned in (StepReply.pool_incarnation);
one planned in another incarnation is refused before it touches memory. When the manager
says the pool was created again, the heartbeat thread re-plans: kernel calls run under the
gate shared, and the swap of the caches waits for them and runs alone, so no call ever mixes
the layouts of one plan with the buffers of another.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvservice.errors import FailedPrecondition


class MemoryGate:
    """A readers-writer lock: RPCs hold it shared, a re-plan exclusively (writers go first once waiting)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def check_incarnation(identity: dict[str, Any], request: Any) -> None:
    """FailedPrecondition (STALE_INCARNATION) if a request was planned in another incarnation of the pool.

    request.pool_incarnation 0 (or a request without the field) is not checked.
    """
    asked = getattr(request, "pool_incarnation", 0)
    mine = identity.get("incarnation", 0)
    if asked and asked != mine:
        raise FailedPrecondition(
            f"worker {identity['worker_id']} holds memory planned for incarnation {mine} of pool "
            f"{identity['pool']!r}; this request was planned in incarnation {asked}: the pool was created again. "
            "Use the tables of a Step of the current pool, and workers registered with it (ListWorkers)",
            reason="STALE_INCARNATION", pool=identity["pool"], incarnation=mine)
