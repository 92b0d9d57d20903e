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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvservice.contract.errors import FailedPrecondition, InvalidArgument
from kvservice.contract.transport import EPOCH_METADATA


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


class LeaderEpochFence:
    """Refuses kernel calls whose page tables come from a deposed leader of a replicated manager (docs/HA.md).

    A replicated manager stamps every reply with its leader epoch; a scheduler stamps every worker call that
    carries manager-issued tables or slots (AppendKV, DecodeAttention, CopyBlocks, UpdateTables) with the
    highest epoch it has seen, in the metadata ``kvservice-leader-epoch``. The worker learns the current
    epoch only from its own manager client (registration, heartbeats: replies the manager vouches for),
    never from a caller's stamp, so a wrong stamp cannot fence the worker off. A call stamped below that
    epoch is refused (FAILED_PRECONDITION, reason STALE_LEADER_EPOCH) before it touches memory: its
    scheduler still follows a manager that has lost the lease. A stamp above it is accepted (the scheduler
    met the successor before the worker's next heartbeat). Once the worker has seen an epoch, an unstamped
    call of those kinds is refused too (reason LEADER_EPOCH_REQUIRED). A worker of an unreplicated manager
    (no epoch ever seen) checks nothing.

    source: returns the highest epoch the worker's manager client has seen (0 = none);
    on_refuse: called with the reason of every refusal (the worker's metric).
    """

    def __init__(self, source: Callable[[], int] | None = None,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self._source = source
        self._on_refuse = on_refuse
        self.refused = 0

    @property
    def seen(self) -> int:
        """The highest leader epoch the worker's manager client has seen (0 = an unreplicated manager)."""
        return self._source() if self._source is not None else 0

    def check(self, metadata: Any, identity: dict[str, Any], method: str) -> None:
        """Raise FailedPrecondition if `metadata` (a call's invocation metadata) names a lower epoch than
        seen, or none once one has been seen; InvalidArgument if it names no valid epoch."""
        stamped: int | None = None
        for key, value in metadata or ():
            if key == EPOCH_METADATA:
                try:
                    stamped = int(value)
                except (TypeError, ValueError):
                    raise InvalidArgument(f"{method}: metadata {EPOCH_METADATA} must be a decimal "
                                          f"epoch, got {value!r}") from None
                if stamped < 1:
                    raise InvalidArgument(f"{method}: metadata {EPOCH_METADATA} must be >= 1, got {stamped}")
        seen = self.seen
        if not seen or (stamped is not None and stamped >= seen):
            return
        self.refused += 1
        reason = "LEADER_EPOCH_REQUIRED" if stamped is None else "STALE_LEADER_EPOCH"
        if self._on_refuse is not None:
            self._on_refuse(reason)
        who = f"worker {identity.get('worker_id', '?')} of pool {identity.get('pool', '?')!r}"
        if stamped is None:
            raise FailedPrecondition(
                f"{method}: {who} serves a replicated manager (leader epoch {seen}) and this call names no "
                f"leader epoch: send the epoch of the manager reply its tables came from in the metadata "
                f"{EPOCH_METADATA} (kvservice.client.worker_client.WorkerClient(leader_epoch=...))",
                reason=reason, epoch=seen)
        raise FailedPrecondition(
            f"{method}: {who} has seen leader epoch {seen}, but this call's tables come from epoch {stamped}: "
            "a deposed manager. Nothing was read or written; take the tables from the current leader "
            "(a LeaderClient retries there) and send the call again",
            reason=reason, epoch=seen, stamped=stamped)
