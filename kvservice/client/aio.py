"""asyncio BlockManager client with the same calls, deadlines, retries, request ids, position check and security.

Deadlines and retries follow kvservice/client/client.py exactly (``timeout`` is the deadline of a whole
call, each attempt gets what remains, one request_id per logical call, RETRIES_EXHAUSTED carrying it,
the failover bound, StateRolledBack); only the waits are awaited.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from kvservice.client import codec
from kvservice.client.client import (
    SERVICE,
    OneAddress,
    TLSOptions,
    auth_metadata,
    channel_options,
    new_request_id,
    position_tracker,
)
from kvservice.client.codec import StepResult
from kvservice.client.deadline import RETRY_CODES, CallBudget, RetryPolicy, client_policy
from kvservice.client.stream import AsyncStepStream
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.pagetable import PageTable, ValidationReport
from kvservice.contract.sizing import Sizing
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc


def make_aio_channel(target: str, tls: TLSOptions | None = None, service_config: str | None = None,
                     interceptors: Sequence[Any] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel with the options of make_channel (plaintext, or TLS / mutual TLS)."""
    options = channel_options(tls, service_config)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, tls.credentials(), options=options, interceptors=interceptors)


class AsyncBlockManagerClient(OneAddress):
    """asyncio twin of BlockManagerClient (use inside a running event loop); same arguments, and interceptors:
    grpc.aio client interceptors of the channel (tracing; tests read each attempt's deadline with one).
    channel: use this grpc.aio channel (AsyncLeaderClient passes its first address's)."""

    def __init__(self, target: str, timeout: float = 10.0, retries: int | None = None, *,
                 tls: TLSOptions | None = None, token: str | None = None, retry: RetryPolicy | None = None,
                 registry: Any = None, failover: float | None = None, interceptors: Sequence[Any] = (),
                 channel: grpc.aio.Channel | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = client_policy(retry, retries, failover)
        self.position = position_tracker(registry)
        self._metadata = auth_metadata(token)
        self._channel = channel or make_aio_channel(target, tls, self.retry.service_config(SERVICE), interceptors)
        self._stub = pb_grpc.BlockManagerStub(self._channel)

    def __repr__(self) -> str:
        return f"AsyncBlockManagerClient({self.target!r}, token={'set' if self._metadata else 'none'})"

    async def __aenter__(self) -> AsyncBlockManagerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def reset_position(self) -> None:
        """Forget the journal positions seen and refused (after resynchronising with a manager that was rolled back)."""
        self.position.reset()

    async def _pause(self, seconds: float) -> None:
        """The pause before a call is issued again (an AsyncLeaderClient ends it early when a manager starts
        serving)."""
        await asyncio.sleep(seconds)

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        """One logical call: attempts under one request_id until it succeeds, fails for good, or its deadline
        passes; each attempt's gRPC deadline is what remains of it."""
        rid = getattr(request, "request_id", None) or None
        name = type(request).__name__.removesuffix("Request")
        budget = CallBudget(self.retry, timeout or self.timeout, name, rid, RETRY_CODES, self.target)
        seen = self.position.seen()
        while True:
            try:
                reply = await method(request, timeout=budget.attempt_timeout(), metadata=self._metadata)
            except grpc.RpcError as exc:            # AioRpcError, or StaleLeader (an AsyncLeaderClient)
                await self._pause(budget.pause_or_raise(exc))
                continue
            self.position.check(name, reply, seen, rid)
            return reply

    async def plan(self, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
                   timeout: float | None = None) -> pb.PlanReply:
        return await self._call(self._stub.Plan, codec.plan_request(spec, sizing, backends), timeout)

    async def get_pool(self, pool: str, timeout: float | None = None) -> pb.PoolInfo:
        return await self._call(self._stub.GetPool, pb.GetPoolRequest(pool=pool), timeout)

    async def list_pools(self, timeout: float | None = None) -> list[pb.PoolInfo]:
        return list((await self._call(self._stub.ListPools, pb.ListPoolsRequest(), timeout)).pools)

    async def sequences(self, pool: str, limit: int = 0, timeout: float | None = None) -> pb.ListSequencesReply:
        return await self._call(self._stub.ListSequences, pb.ListSequencesRequest(pool=pool, limit=limit), timeout)

    async def stats(self, pool: str = "", timeout: float | None = None) -> dict[str, pb.PoolStats]:
        return dict((await self._call(self._stub.GetStats, pb.GetStatsRequest(pool=pool), timeout)).pools)

    async def validate(self, pool: str, layer: int, table: PageTable, max_reports: int = 100,
                       timeout: float | None = None) -> ValidationReport:
        reply = await self._call(self._stub.ValidatePageTable,
                                 codec.validate_request(pool, layer, table, max_reports), timeout)
        return codec.parse_validate(reply)

    async def echo(self, payload: bytes = b"", timeout: float | None = None) -> bytes:
        return (await self._call(self._stub.Echo, pb.EchoRequest(payload=payload), timeout)).payload

    async def create_pool(self, name: str, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
                          timeout: float | None = None, request_id: str | None = None, **extra: Any) -> pb.PoolInfo:
        req = codec.create_pool_request(name, spec, sizing, backends, **extra)
        req.request_id = request_id or new_request_id()
        return await self._call(self._stub.CreatePool, req, timeout)

    async def delete_pool(self, pool: str, force: bool = False, timeout: float | None = None,
                          request_id: str | None = None) -> None:
        req = pb.DeletePoolRequest(pool=pool, force=force, request_id=request_id or new_request_id())
        await self._call(self._stub.DeletePool, req, timeout)

    async def step(self, pool: str, free: object = None, extend: object = None, extend_tokens: object = None,
                   admit: object = None, admit_tokens: object = None, tables: bool = True,
                   block_table: bool = False, timeout: float | None = None, request_id: str | None = None,
                   **extra: Any) -> StepResult:
        req = codec.step_request(pool, free, extend, extend_tokens, admit, admit_tokens, tables, block_table,
                                 **extra)
        req.request_id = request_id or new_request_id()
        return codec.parse_step(await self._call(self._stub.Step, req, timeout))

    async def step_stream(self, pool: str, deltas: bool = True, timeout: float | None = None,
                          stream_id: str | None = None) -> AsyncStepStream:
        """An AsyncStepStream on `pool` (kvservice/client/stream.py); learns the pool's page size with one GetPool."""
        page_size = (await self.get_pool(pool, timeout)).plan.page_size
        return AsyncStepStream(self, pool, page_size, deltas, timeout, stream_id)
