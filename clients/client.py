"""Synchronous BlockManager client: deadlines on every call, retries only for calls that change nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvservice.geometry import CacheSpec
from kvservice.pagetable import PageTable, ValidationReport
from kvservice.planner import Sizing
from kvservice.server import MAX_MESSAGE_BYTES
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

from . import codec
from .codec import ClientError, StepResult

T = TypeVar("T")
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE,)
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class BlockManagerClient:
    """Talks to one manager.

    timeout: deadline of each call, seconds. retries: extra attempts for read-only
    calls that failed UNAVAILABLE (exponential backoff from 50 ms). Step,
    CreatePool and DeletePool are never retried: a retry could apply them twice.
    """

    def __init__(self, target: str, timeout: float = 10.0, retries: int = 3,
                 channel: grpc.Channel | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._channel = channel or grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.BlockManagerStub(self._channel)

    def __enter__(self) -> BlockManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel connects; ClientError(UNAVAILABLE) after timeout seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise ClientError(grpc.StatusCode.UNAVAILABLE, f"no manager answered at {self.target} "
                              f"within {timeout:.0f} s") from None

    def _call(self, method: Callable[..., T], request: Any, safe: bool, timeout: float | None) -> T:
        attempts = 1 + (self.retries if safe else 0)
        delay = 0.05
        for attempt in range(attempts):
            try:
                return method(request, timeout=timeout or self.timeout)
            except grpc.RpcError as exc:
                if exc.code() in RETRY_CODES and attempt + 1 < attempts:
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise ClientError.from_rpc(exc) from None
        raise AssertionError("unreachable")

    # ---- read-only (retried) ------------------------------------------------------
    def plan(self, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
             timeout: float | None = None) -> pb.PlanReply:
        return self._call(self._stub.Plan, codec.plan_request(spec, sizing, backends), True, timeout)

    def get_pool(self, pool: str, timeout: float | None = None) -> pb.PoolInfo:
        return self._call(self._stub.GetPool, pb.GetPoolRequest(pool=pool), True, timeout)

    def list_pools(self, timeout: float | None = None) -> list[pb.PoolInfo]:
        return list(self._call(self._stub.ListPools, pb.ListPoolsRequest(), True, timeout).pools)

    def sequences(self, pool: str, limit: int = 0, timeout: float | None = None) -> pb.ListSequencesReply:
        return self._call(self._stub.ListSequences, pb.ListSequencesRequest(pool=pool, limit=limit), True, timeout)

    def stats(self, pool: str = "", timeout: float | None = None) -> dict[str, pb.PoolStats]:
        return dict(self._call(self._stub.GetStats, pb.GetStatsRequest(pool=pool), True, timeout).pools)

    def validate(self, pool: str, layer: int, table: PageTable, max_reports: int = 100,
                 timeout: float | None = None) -> ValidationReport:
        reply = self._call(self._stub.ValidatePageTable, codec.validate_request(pool, layer, table, max_reports),
                           True, timeout)
        return codec.parse_validate(reply)

    def workers(self, pool: str = "", timeout: float | None = None) -> list[pb.WorkerInfo]:
        return list(self._call(self._stub.ListWorkers, pb.ListWorkersRequest(pool=pool), True, timeout).workers)

    def echo(self, payload: bytes = b"", timeout: float | None = None) -> bytes:
        return self._call(self._stub.Echo, pb.EchoRequest(payload=payload), True, timeout).payload

    # ---- mutating (never retried) ---------------------------------------------------
    def create_pool(self, name: str, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
                    timeout: float | None = None, prefix_caching: bool = False) -> pb.PoolInfo:
        req = codec.create_pool_request(name, spec, sizing, backends, prefix_caching)
        return self._call(self._stub.CreatePool, req, False, timeout)

    def delete_pool(self, pool: str, force: bool = False, timeout: float | None = None) -> None:
        self._call(self._stub.DeletePool, pb.DeletePoolRequest(pool=pool, force=force), False, timeout)

    def step(self, pool: str, free: object = None, extend: object = None, extend_tokens: object = None,
             admit: object = None, admit_tokens: object = None, tables: bool = True, block_table: bool = False,
             timeout: float | None = None, **options: object) -> StepResult:
        """One scheduler iteration (see BlockManager.Step). ids: uint64 [n]; token counts int64 [n] or a scalar.

        options: fork=[(parent, child), ...], admit_token_ids=..., salts=[...], extra_keys=[...]
        (see clients.codec.step_request). Returns the batch (extended, admitted, then fork children)
        with slot mappings, page tables per index space, cached token counts and copy-on-write pairs.
        """
        req = codec.step_request(pool, free, extend, extend_tokens, admit, admit_tokens, tables, block_table,
                                 **options)  # type: ignore[arg-type]
        return codec.parse_step(self._call(self._stub.Step, req, False, timeout))

    def register_worker(self, request: pb.RegisterWorkerRequest,
                        timeout: float | None = None) -> pb.RegisterWorkerReply:
        """Join as a worker (a new epoch each time)."""
        return self._call(self._stub.RegisterWorker, request, False, timeout)

    def heartbeat(self, worker_id: str, epoch: int, timeout: float | None = None) -> pb.HeartbeatReply:
        """Renew a lease (safe to retry: it only moves the lease forward)."""
        return self._call(self._stub.Heartbeat, pb.HeartbeatRequest(worker_id=worker_id, epoch=epoch), True, timeout)
