"""Synchronous BlockManager client: deadlines, retries that ride through a manager restart, request ids.

Exactly once: a mutating call (Step, CreatePool, DeletePool) gets one request_id (uuid4 unless
given) that every retry of that call reuses, so the manager applies it at most once and answers
a retry with the original reply. A call is retried on UNAVAILABLE and DEADLINE_EXCEEDED with
exponential backoff and jitter until its overall deadline (RetryPolicy.deadline, 60 s by default:
longer than a manager restart with recovery); each attempt also has its own deadline (`timeout`).
When the deadline passes, the ClientError (reason RETRIES_EXHAUSTED) carries the request_id:
calling again with it later is safe. RegisterWorker has no id: a retried registration just yields
a newer epoch, which is safe.

Position check: mutating replies and pool reads carry the manager's journal position
(incarnation, seq). A reply whose seq is below one this client saw before it sent the call means
the manager came back behind what it acknowledged (its state dir lost changes): the call raises
ManagerBehind (DATA_LOSS) instead of returning state that contradicts earlier replies.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvservice.client import codec
from kvservice.client.codec import ClientError, StepResult, position_of
from kvservice.client.stream import EchoStream, StepStream
from kvservice.contract.pagetable import PageTable, ValidationReport
from kvservice.contract.transport import MAX_MESSAGE_BYTES
from kvservice.core.geometry import CacheSpec
from kvservice.core.planner import Sizing
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

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
    """How one logical call rides through UNAVAILABLE and DEADLINE_EXCEEDED.

    deadline: seconds the whole call may take, every attempt and backoff included; a manager
        restart (recovery included) must fit in it.
    attempts: most tries in all; 0 = as many as the deadline allows, 1 = never retry.
    Backoff before try k+1 is uniform in [d/2, d] seconds, d = min(max_backoff, initial_backoff * multiplier**k).
    """

    deadline: float = 60.0
    attempts: int = 0
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    multiplier: float = 2.0

    def backoff(self, attempt: int) -> float:
        d = min(self.max_backoff, self.initial_backoff * self.multiplier ** attempt)
        return random.uniform(d / 2, d)


class CallBudget:
    """Deadline and backoff bookkeeping of one logical call (shared by the sync and asyncio clients).

    name: the RPC, for messages; request_id: its idempotency key (None for reads).
    """

    def __init__(self, policy: RetryPolicy, timeout: float, name: str, request_id: str | None,
                 codes: tuple[grpc.StatusCode, ...]) -> None:
        self.policy, self.timeout, self.name, self.request_id, self.codes = policy, timeout, name, request_id, codes
        self.start = time.monotonic()
        self.deadline = self.start + policy.deadline
        self.tries = 0

    def attempt_timeout(self) -> float:
        """The deadline of the next attempt: `timeout`, cut to what is left of the call's deadline."""
        self.tries += 1
        return max(0.001, min(self.timeout, self.deadline - time.monotonic()))

    def pause_or_raise(self, exc: grpc.RpcError) -> float:
        """Seconds to wait before the next attempt; raises ClientError if the call must stop now."""
        if exc.code() not in self.codes:
            raise ClientError.from_rpc(exc, self.request_id) from None
        pause = self.policy.backoff(self.tries - 1)
        limit = self.policy.attempts
        if (limit and self.tries >= limit) or time.monotonic() + pause >= self.deadline:
            raise self.gave_up(exc) from None
        return pause

    def gave_up(self, exc: grpc.RpcError) -> ClientError:
        err = ClientError.from_rpc(exc, self.request_id)
        spent = time.monotonic() - self.start
        again = (f"; it may or may not have been applied: call again with request_id={self.request_id!r} (safe: "
                 "the manager answers a retry with the original reply)") if self.request_id else ""
        return ClientError(err.code, f"{self.name} gave up after {self.tries} attempts in {spent:.1f} s (last: "
                           f"{err.message}){again}", "RETRIES_EXHAUSTED",
                           {**err.metadata, "attempts": str(self.tries), "last_reason": err.reason},
                           self.request_id)


class ManagerBehind(ClientError):
    """A reply from a manager whose journal is behind what this client saw earlier (it lost acknowledged changes).

    reply: the reply (its changes were applied by that manager); seen: the highest seq seen before the call.
    """

    def __init__(self, name: str, seen: int, got: tuple[int, int], reply: Any, request_id: str | None) -> None:
        super().__init__(grpc.StatusCode.DATA_LOSS,
                         f"{name}: the manager answered at journal position {got[1]} (incarnation {got[0]}) but this "
                         f"client already saw position {seen}: the manager came back behind what it acknowledged "
                         "(its state dir lost changes). Do not trust its state; resynchronise the scheduler, then "
                         "call reset_position()", "MANAGER_BEHIND",
                         {"seen_seq": str(seen), "seq": str(got[1]), "incarnation": str(got[0])}, request_id)
        self.reply = reply


class PositionTracker:
    """The highest journal position a client has seen (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seq = 0
        self.incarnation = 0

    def seen(self) -> int:
        return self.seq

    def check(self, name: str, reply: Any, seen_before: int, request_id: str | None) -> None:
        """Record a reply's position; ManagerBehind if it is below what was seen before the call was sent."""
        pos = position_of(reply)
        if pos is None:
            return
        if pos[1] < seen_before:
            raise ManagerBehind(name, seen_before, pos, reply, request_id)
        with self._lock:
            if pos[1] >= self.seq:
                self.incarnation, self.seq = pos


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


class EventStream:
    """A WatchEvents call: iterate for pb.KVEventBatch messages; errors arrive as ClientError."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[pb.KVEventBatch]:
        try:
            yield from self._call
        except grpc.RpcError as exc:
            raise ClientError.from_rpc(exc) from None

    def cancel(self) -> None:
        self._call.cancel()


class BlockManagerClient:
    """Talks to one manager.

    timeout: deadline of each attempt, seconds. retry: how a call rides through failures (default:
    retried until 60 s have passed). retries: a cap on extra attempts instead (0 = never retry; ignored
    if `retry` is given). tls: TLS / mutual TLS (None = plaintext). token: bearer token for a manager
    started with --tokens-file. position: the highest journal position seen (see the module docstring).
    """

    def __init__(self, target: str, timeout: float = 10.0, retries: int | None = None,
                 channel: grpc.Channel | None = None, *, tls: TLSOptions | None = None, token: str | None = None,
                 retry: RetryPolicy | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy(attempts=0 if retries is None else 1 + max(0, retries))
        self.position = PositionTracker()
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

    def reset_position(self) -> None:
        """Forget the journal positions seen (after resynchronising with a manager that came back behind)."""
        self.position = PositionTracker()

    def _call(self, method: Callable[..., T], request: Any, timeout: float | None,
              codes: tuple[grpc.StatusCode, ...] = RETRY_CODES) -> T:
        """One logical call: attempts under one request_id until it succeeds, fails for good, or the deadline passes."""
        rid = getattr(request, "request_id", None) or None
        name = type(request).__name__.removesuffix("Request")
        budget = CallBudget(self.retry, timeout or self.timeout, name, rid, codes)
        seen = self.position.seen()
        while True:
            try:
                reply = method(request, timeout=budget.attempt_timeout(), metadata=self._metadata)
            except grpc.RpcError as exc:
                time.sleep(budget.pause_or_raise(exc))
                continue
            self.position.check(name, reply, seen, rid)
            return reply

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

    def score_prefix(self, token_ids: object, salt: str = "", extra_key: str = "", pools: tuple[str, ...] = (),
                     model: str = "", timeout: float | None = None) -> pb.ScorePrefixReply:
        """Tokens of a prompt (int [n]; sent as INT32 when every id fits) each pool's prefix cache holds now
        (see BlockManager.ScorePrefix)."""
        req = codec.score_request(token_ids, salt, extra_key, pools, model)
        return self._call(self._stub.ScorePrefix, req, timeout)

    def watch_events(self, pool: str, from_sequence: int = 0, timeout: float | None = None) -> EventStream:
        """The pool's KV event batches (pb.KVEventBatch) from from_sequence on (0 = a reset, then live).

        Iterate the result for batches (a failure raises ClientError), .cancel() it to stop. Not retried:
        to resume, call again with the last sequence received + 1. timeout: for the whole stream (None = none).
        """
        return EventStream(self._stub.WatchEvents(pb.WatchEventsRequest(pool=pool, from_sequence=from_sequence),
                                                  timeout=timeout, metadata=self._metadata))

    def echo(self, payload: bytes = b"", timeout: float | None = None) -> bytes:
        return self._call(self._stub.Echo, pb.EchoRequest(payload=payload), timeout).payload

    # ---- mutating (a request_id makes retries safe) ------------------------------------------
    def create_pool(self, name: str, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] = (),
                    timeout: float | None = None, request_id: str | None = None, **extra: Any) -> pb.PoolInfo:
        req = codec.create_pool_request(name, spec, sizing, backends, **extra)
        req.request_id = request_id or new_request_id()          # one id for every attempt of this call
        return self._call(self._stub.CreatePool, req, timeout)

    def delete_pool(self, pool: str, force: bool = False, timeout: float | None = None,
                    request_id: str | None = None) -> None:
        req = pb.DeletePoolRequest(pool=pool, force=force, request_id=request_id or new_request_id())
        self._call(self._stub.DeletePool, req, timeout)

    def step(self, pool: str, free: object = None, extend: object = None, extend_tokens: object = None,
             admit: object = None, admit_tokens: object = None, tables: bool = True, block_table: bool = False,
             timeout: float | None = None, request_id: str | None = None, **extra: Any) -> StepResult:
        """One scheduler iteration (see BlockManager.Step). ids: uint64 [n]; token counts int64 [n] or a scalar.

        request_id: idempotency key (default: a fresh uuid4, reused by every retry of this call; pass the
            request_id of a ClientError that gave up to learn whether that call was applied).
        extra: further codec.step_request fields.
        Returns the batch (extended, then admitted) with slot mappings and page tables per index space.
        """
        req = codec.step_request(pool, free, extend, extend_tokens, admit, admit_tokens, tables, block_table,
                                 **extra)
        req.request_id = request_id or new_request_id()
        return codec.parse_step(self._call(self._stub.Step, req, timeout))

    def step_stream(self, pool: str, deltas: bool = True, timeout: float | None = None,
                    stream_id: str | None = None) -> StepStream:
        """A StepStream on `pool` (kvservice/client/stream.py): one long-lived stream, incremental tables unless
        deltas=False.

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
