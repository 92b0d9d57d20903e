"""asyncio client of a replicated manager: AsyncLeaderClient follows the leader over several addresses.

The asyncio twin of LeaderClient (kvservice/client/ha.py, whose module doc has the rules); both share
LeaderRoute, so they follow the leader the same way:

- A call goes to the current address. One that breaks with UNAVAILABLE (a dead manager, or a standby's
  refusal) or DEADLINE_EXCEEDED (no reply within ``RetryPolicy.attempt_timeout``: a paused leader) moves
  the client to the next address and is issued again there, within the call's deadline (or its
  ``failover`` bound), under the same request_id: the new leader answers a request the old one applied
  with the original reply. Any other status (a refusal: INVALID_ARGUMENT, ...) is raised as ClientError
  and the client stays where it is.
- Every reply's ``kvservice-leader-epoch`` is checked: one below the highest seen (a deposed leader)
  is refused (StaleLeader, UNAVAILABLE) and the call goes to the next address.
- ``await client.step_stream(pool)`` returns an AsyncStepStream that opens each call at the current
  address, checks the first reply of each call's epoch, and on a break reopens at the next address
  under the same stream id, resending the unanswered request with its original seq and bytes (applied
  exactly once; kvservice/client/stream.py).

When no address answers until the deadline, the call raises UNAVAILABLE (reason RETRIES_EXHAUSTED)
naming every address it tried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from kvservice.client.aio import AsyncBlockManagerClient, make_aio_channel
from kvservice.client.client import SERVICE, TLSOptions
from kvservice.client.deadline import RetryPolicy, client_policy
from kvservice.client.ha import (
    FAILOVER_RETRY,
    HEALTH_RETRY,
    LeaderRoute,
    LeaderStub,
    StaleLeader,
    manager_addresses,
)
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

__all__ = ["AsyncLeaderClient", "StaleLeader"]


class AsyncLeaderClient(LeaderRoute, AsyncBlockManagerClient):
    """An AsyncBlockManagerClient over one or more manager addresses that follows the leader (see the module doc).

    targets: "host:port" or "host:port,host:port" or a sequence. timeout: the deadline of each call, failover
    included. retry: default FAILOVER_RETRY (an attempt left after 3 s, no gRPC-level resend: the client moves
    to the next address instead). failover, tls, token, registry: as AsyncBlockManagerClient. interceptors:
    grpc.aio client interceptors of every address's channel. epoch, leader_node, stale_replies: see LeaderRoute.
    """

    def __init__(self, targets: str | Sequence[str], timeout: float = 10.0, retries: int | None = None, *,
                 tls: TLSOptions | None = None, token: str | None = None, retry: RetryPolicy | None = None,
                 registry: Any = None, failover: float | None = None, interceptors: Sequence[Any] = ()) -> None:
        self.targets = manager_addresses(targets)
        retry = client_policy(retry, retries, failover, FAILOVER_RETRY)
        channels = [make_aio_channel(t, tls, retry.service_config(SERVICE), interceptors) for t in self.targets]
        super().__init__(",".join(self.targets), timeout, tls=tls, token=token, retry=retry, registry=registry,
                         channel=channels[0])
        self._stubs = [pb_grpc.BlockManagerStub(ch) for ch in channels]
        self._stub = LeaderStub(self)             # what AsyncBlockManagerClient's calls go through
        self._follow(channels)
        self._watchers: list[asyncio.Task[None]] = []
        self._health_calls: dict[int, Any] = {}
        self._waiters: set[asyncio.Event] = set()

    def __repr__(self) -> str:
        return f"AsyncLeaderClient({self.target!r}, token={'set' if self._metadata else 'none'})"

    async def close(self) -> None:
        with self._serving:
            self._closed = True
        for ev in list(self._waiters):
            ev.set()
        for task in self._watchers:
            task.cancel()
        for ch in self._channels:
            await ch.close()

    async def _pause(self, seconds: float) -> None:
        """Wait before the next attempt: the backoff, or less once an address reports SERVING after the last break
        (as LeaderClient._pause)."""
        if self._report_due():
            return
        ev = asyncio.Event()
        self._waiters.add(ev)
        try:
            await asyncio.wait_for(ev.wait(), seconds)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(ev)

    def _reported_serving(self, index: int) -> None:
        super()._reported_serving(index)
        for ev in list(self._waiters):
            ev.set()

    def _watch_health(self) -> None:
        """One task per address follows its readiness (as LeaderClient._watch_health), on the loop of the call that
        broke first, until close()."""
        if self._watchers or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:                  # not on a loop: nothing to wake, the backoff alone paces the retries
            return
        self._watchers = [loop.create_task(self._health_loop(i)) for i in range(len(self.targets))]

    async def _health_loop(self, index: int) -> None:
        delay = HEALTH_RETRY[0]
        while not self._closed:
            try:
                async for msg in self._health_watch(index):
                    delay = self._health_report(index, msg)
            except grpc.RpcError:             # the manager died or restarts: watch again
                pass
            await asyncio.sleep(delay)
            delay = min(HEALTH_RETRY[1], 2 * delay)

    async def _invoke(self, name: str, request: Any, timeout: float | None, metadata: Any) -> Any:
        """One attempt at the current address; the reply once its epoch passed (StaleLeader otherwise)."""
        index = self._current
        call = getattr(self._stubs[index], name)(request, timeout=timeout, metadata=metadata)
        try:
            response = await call
        except grpc.RpcError as err:
            self._failed(index, err)
            raise
        self.stream_answered(index, await call.initial_metadata())
        return response
