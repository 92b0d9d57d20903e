"""Synchronous BlockManager client: deadlines, retries with backoff, request ids, TLS and bearer tokens.

Every call has a deadline per attempt and is retried on UNAVAILABLE and DEADLINE_EXCEEDED
(exponential backoff with jitter, bounded attempts). Mutating calls (Step, CreatePool,
DeletePool) carry a request_id (uuid4 unless given) that stays the same across retries, so
the manager applies each at most once and answers a retry with the original reply.
RegisterWorker has no id: a retried registration just yields a newer epoch, which is safe.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
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
from .stream import EchoStream, StepStream

T = TypeVar("T")
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   # reconnect quickly after a manager restart (gRPC's default backoff grows to 120 s)
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000)]


def _read(path: str | Path | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True, slots=True)
class TLSOptions:
    """Channel security (PEM bytes).

    ca: CA bundle that signed the server's certificate (None = the system roots).
    cert, key: this client's certificate chain and key, for mutual TLS.
    server_name: name to check the server's certificate against, if not the target's host.
    """

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None

    @classmethod
    def from_files(cls, ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None,
                   server_name: str | None = None) -> TLSOptions:
        return cls(_read(ca), _read(cert), _read(key), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """attempts: tries in all (1 = never retry); backoff before try k+1 is uniform in [d/2, d] seconds,
    d = min(max_backoff, initial_backoff * multiplier**k)."""

    attempts: int = 4
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0

    def backoff(self, attempt: int) -> float:
        d = min(self.max_backoff, self.initial_backoff * self.multiplier ** attempt)
        return random.uniform(d / 2, d)


def new_request_id() -> str:
    """A fresh idempotency key (uuid4, 32 hex digits)."""
    return uuid.uuid4().hex


def channel_options(tls: TLSOptions | None = None) -> list[tuple[str, Any]]:
    extra = [("grpc.ssl_target_name_override", tls.server_name)] if tls is not None and tls.server_name else []
    return CHANNEL_OPTIONS + extra


def make_channel(target: str, tls: TLSOptions | None = None) -> grpc.Channel:
    """A plaintext channel, or a TLS one (mutual TLS if tls has a cert)."""
    if tls is None:
        return grpc.insecure_channel(target, options=channel_options())
    return grpc.secure_channel(target, tls.credentials(), options=channel_options(tls))


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying a bearer token (never logged by the client or the server)."""
    return (("authorization", f"Bearer {token}"),) if token else None


class BlockManagerClient:
    """Talks to one manager.

    timeout: deadline of each attempt, seconds. retries: extra attempts after UNAVAILABLE or
    DEADLINE_EXCEEDED (ignored if `retry` is given). tls: TLS / mutual TLS (None = plaintext).
    token: bearer token for a manager started with --tokens-file.
    """

    def __init__(self, target: str, timeout: float = 10.0, retries: int = 3, channel: grpc.Channel | None = None,
                 *, tls: TLSOptions | None = None, token: str | None = None,
                 retry: RetryPolicy | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy(attempts=1 + max(0, retries))
        self._metadata = auth_metadata(token)
        self._channel = channel or make_channel(target, tls)
        self._stub = pb_grpc.BlockManagerStub(self._channel)

    def __repr__(self) -> str:
        return f"BlockManagerClient({self.target!r}, token={'set' if self._metadata else 'none'})"

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

    def _call(self, method: Callable[..., T], request: Any, timeout: float | None,
              codes: tuple[grpc.StatusCode, ...] = RETRY_CODES) -> T:
        attempts = max(1, self.retry.attempts)
        for attempt in range(attempts):
            try:
                return method(request, timeout=timeout or self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() in codes and attempt + 1 < attempts:
                    time.sleep(self.retry.backoff(attempt))
                    continue
                raise ClientError.from_rpc(exc) from None
        raise AssertionError("unreachable")

    # ---- read-only ----------------------------------------------------------------------
    def plan(self, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
             timeout: float | None = None) -> pb.PlanReply:
        return self._call(self._stub.Plan, codec.plan_request(spec, sizing, backends), timeout)

    def get_pool(self, pool: str, timeout: float | None = None) -> pb.PoolInfo:
        return self._call(self._stub.GetPool, pb.GetPoolRequest(pool=pool), timeout)

    def list_pools(self, timeout: float | None = None) -> list[pb.PoolInfo]:
        return list(self._call(self._stub.ListPools, pb.ListPoolsRequest(), timeout).pools)

    def sequences(self, pool: str, limit: int = 0, timeout: float | None = None) -> pb.ListSequencesReply:
        return self._call(self._stub.ListSequences, pb.ListSequencesRequest(pool=pool, limit=limit), timeout)

    def stats(self, pool: str = "", timeout: float | None = None) -> dict[str, pb.PoolStats]:
        return dict(self._call(self._stub.GetStats, pb.GetStatsRequest(pool=pool), timeout).pools)

    def validate(self, pool: str, layer: int, table: PageTable, max_reports: int = 100,
                 timeout: float | None = None) -> ValidationReport:
        reply = self._call(self._stub.ValidatePageTable, codec.validate_request(pool, layer, table, max_reports),
                           timeout)
        return codec.parse_validate(reply)

    def workers(self, pool: str = "", timeout: float | None = None) -> list[pb.WorkerInfo]:
        return list(self._call(self._stub.ListWorkers, pb.ListWorkersRequest(pool=pool), timeout).workers)

    def echo(self, payload: bytes = b"", timeout: float | None = None) -> bytes:
        return self._call(self._stub.Echo, pb.EchoRequest(payload=payload), timeout).payload

    # ---- mutating (a request_id makes retries safe) ------------------------------------------
    def create_pool(self, name: str, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
                    timeout: float | None = None, request_id: str | None = None, **extra: Any) -> pb.PoolInfo:
        req = codec.create_pool_request(name, spec, sizing, backends, **extra)
        req.request_id = request_id or new_request_id()
        return self._call(self._stub.CreatePool, req, timeout)

    def delete_pool(self, pool: str, force: bool = False, timeout: float | None = None,
                    request_id: str | None = None) -> None:
        req = pb.DeletePoolRequest(pool=pool, force=force, request_id=request_id or new_request_id())
        self._call(self._stub.DeletePool, req, timeout)

    def step(self, pool: str, free: object = None, extend: object = None, extend_tokens: object = None,
             admit: object = None, admit_tokens: object = None, tables: bool = True, block_table: bool = False,
             timeout: float | None = None, request_id: str | None = None, **extra: Any) -> StepResult:
        """One scheduler iteration (see BlockManager.Step). ids: uint64 [n]; token counts int64 [n] or a scalar.

        request_id: idempotency key (default: a fresh uuid4); extra: further codec.step_request fields.
        Returns the batch (extended, then admitted) with slot mappings and page tables per index space.
        """
        req = codec.step_request(pool, free, extend, extend_tokens, admit, admit_tokens, tables, block_table,
                                 **extra)
        req.request_id = request_id or new_request_id()
        return codec.parse_step(self._call(self._stub.Step, req, timeout))

    def step_stream(self, pool: str, deltas: bool = True, timeout: float | None = None,
                    stream_id: str | None = None) -> StepStream:
        """A StepStream on `pool` (clients/stream.py): one long-lived stream, incremental tables unless deltas=False.

        timeout: seconds each reply may take (default: this client's timeout); stream_id: only to resume one.
        """
        return StepStream(self, pool, deltas, timeout, stream_id)

    def echo_stream(self) -> EchoStream:
        """An EchoStream: round trips with nothing to do, the transport floor of step_stream."""
        return EchoStream(self)

    def register_worker(self, request: pb.RegisterWorkerRequest,
                        timeout: float | None = None) -> pb.RegisterWorkerReply:
        """Join as a worker (a new epoch each time; a retried registration yields a newer one, which is safe)."""
        return self._call(self._stub.RegisterWorker, request, timeout)

    def heartbeat(self, worker_id: str, epoch: int, timeout: float | None = None) -> pb.HeartbeatReply:
        """Renew a lease. Retried on UNAVAILABLE only: after a deadline the next heartbeat is due anyway."""
        return self._call(self._stub.Heartbeat, pb.HeartbeatRequest(worker_id=worker_id, epoch=epoch), timeout,
                          (grpc.StatusCode.UNAVAILABLE,))
