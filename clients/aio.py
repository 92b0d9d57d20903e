"""asyncio BlockManager client with the same calls, deadlines and retry rules as the sync one."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from kvservice.geometry import CacheSpec
from kvservice.pagetable import PageTable, ValidationReport
from kvservice.planner import Sizing
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

from . import codec
from .client import CHANNEL_OPTIONS, RETRY_CODES
from .codec import ClientError, StepResult


class AsyncBlockManagerClient:
    """asyncio twin of BlockManagerClient (use inside a running event loop)."""

    def __init__(self, target: str, timeout: float = 10.0, retries: int = 3) -> None:
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.BlockManagerStub(self._channel)

    async def __aenter__(self) -> AsyncBlockManagerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: Any, request: Any, safe: bool, timeout: float | None) -> Any:
        attempts = 1 + (self.retries if safe else 0)
        delay = 0.05
        for attempt in range(attempts):
            try:
                return await method(request, timeout=timeout or self.timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in RETRY_CODES and attempt + 1 < attempts:
                    await asyncio.sleep(delay)
                    delay *= 2
                    continue
                raise ClientError.from_rpc(exc) from None
        raise AssertionError("unreachable")

    async def plan(self, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
                   timeout: float | None = None) -> pb.PlanReply:
        return await self._call(self._stub.Plan, codec.plan_request(spec, sizing, backends), True, timeout)

    async def get_pool(self, pool: str, timeout: float | None = None) -> pb.PoolInfo:
        return await self._call(self._stub.GetPool, pb.GetPoolRequest(pool=pool), True, timeout)

    async def list_pools(self, timeout: float | None = None) -> list[pb.PoolInfo]:
        return list((await self._call(self._stub.ListPools, pb.ListPoolsRequest(), True, timeout)).pools)

    async def stats(self, pool: str = "", timeout: float | None = None) -> dict[str, pb.PoolStats]:
        return dict((await self._call(self._stub.GetStats, pb.GetStatsRequest(pool=pool), True, timeout)).pools)

    async def validate(self, pool: str, layer: int, table: PageTable, max_reports: int = 100,
                       timeout: float | None = None) -> ValidationReport:
        reply = await self._call(self._stub.ValidatePageTable,
                                 codec.validate_request(pool, layer, table, max_reports), True, timeout)
        return codec.parse_validate(reply)

    async def echo(self, payload: bytes = b"", timeout: float | None = None) -> bytes:
        return (await self._call(self._stub.Echo, pb.EchoRequest(payload=payload), True, timeout)).payload

    async def create_pool(self, name: str, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
                          timeout: float | None = None, prefix_caching: bool = False) -> pb.PoolInfo:
        req = codec.create_pool_request(name, spec, sizing, backends, prefix_caching)
        return await self._call(self._stub.CreatePool, req, False, timeout)

    async def step(self, pool: str, free: object = None, extend: object = None, extend_tokens: object = None,
                   admit: object = None, admit_tokens: object = None, tables: bool = True,
                   block_table: bool = False, timeout: float | None = None, **options: object) -> StepResult:
        req = codec.step_request(pool, free, extend, extend_tokens, admit, admit_tokens, tables, block_table,
                                 **options)  # type: ignore[arg-type]
        return codec.parse_step(await self._call(self._stub.Step, req, False, timeout))
