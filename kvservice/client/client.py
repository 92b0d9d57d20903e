"""Synchronous BlockManager client: deadlines, retries inside them, request ids.

Deadlines (kvservice/client/deadline.py): a call's ``timeout`` is its whole deadline, every retry
included; each attempt gets what remains. UNAVAILABLE (no manager answered) is retried within it,
by gRPC (the channel's service config) and then by the client; ``RetryPolicy.failover`` is the
separate, opt-in bound of a call that keeps trying across a failover or restart.

Exactly once: a mutating call (Step, CreatePool, DeletePool) gets one request_id (uuid4 unless
given) that every attempt of that call reuses, so the manager applies it at most once and answers
a retry with the original reply. When a call gives up, the ClientError (reason RETRIES_EXHAUSTED)
carries the request_id: calling again with it later is safe. RegisterWorker has no id: a retried
registration just yields a newer epoch, which is safe.

Position check (kvservice/client/position.py): replies of mutating calls and state reads carry the
manager's journal position (lineage, incarnation, seq). A reply whose seq is below one this client saw
in the same lineage before it sent the call means the manager's state was rolled back (it lost changes
it acknowledged): the call raises StateRolledBack (DATA_LOSS, reason STATE_ROLLED_BACK) instead of
returning state that contradicts earlier replies, and counts it (``registry``: a prometheus_client
registry that gets kvservice_client_state_rollbacks_total). A reply of a new lineage is accepted and
reported (logged, counted).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvservice.client import codec
from kvservice.client.codec import ClientError, StepResult
from kvservice.client.deadline import RETRY_CODES, CallBudget, RetryPolicy, client_policy
from kvservice.client.position import ClientMetrics, PositionTracker, StateRolledBack
from kvservice.client.stream import EchoStream, StepStream
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.pagetable import PageTable, ValidationReport
from kvservice.contract.sizing import Sizing
from kvservice.contract.transport import MAX_MESSAGE_BYTES
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

T = TypeVar("T")
SERVICE = pb.DESCRIPTOR.services_by_name["BlockManager"]
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


#: The name StateRolledBack had before lineages (reason MANAGER_BEHIND then, STATE_ROLLED_BACK now).
ManagerBehind = StateRolledBack


def position_tracker(registry: Any = None) -> PositionTracker:
    """A PositionTracker whose refusals and lineage changes count in `registry` (a prometheus_client
    CollectorRegistry; None = not exported: the counts stay on the tracker and in each error)."""
    tracker = PositionTracker()
    if registry is not None:
        ClientMetrics.of(registry).attach(tracker)
    return tracker


def new_request_id() -> str:
    """A fresh idempotency key (uuid4, 32 hex digits)."""
    return uuid.uuid4().hex


def channel_options(tls: TLSOptions | None = None, service_config: str | None = None) -> list[tuple[str, Any]]:
    """Options of a client channel: message limits, quick reconnects, TLS name, the retry service config."""
    extra = [("grpc.ssl_target_name_override", tls.server_name)] if tls is not None and tls.server_name else []
    if service_config:
        extra.append(("grpc.service_config", service_config))
    return CHANNEL_OPTIONS + extra


def make_channel(target: str, tls: TLSOptions | None = None, service_config: str | None = None) -> grpc.Channel:
    """A plaintext channel, or a TLS one (mutual TLS if tls has a cert); service_config: RetryPolicy.service_config."""
    options = channel_options(tls, service_config)
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=options)


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


class OneAddress:
    """Where a StepStream (sync or asyncio) opens its calls, for a client of one address: its one channel.

    A LeaderClient or AsyncLeaderClient (kvservice/client/ha.py, aio_ha.py) overrides these three hooks to follow
    the leader over several addresses.
    """

    _channel: Any

    def stream_channel(self) -> tuple[int, Any]:
        """(address index, channel: grpc.Channel or grpc.aio.Channel) a stream opens its next call on."""
        return 0, self._channel

    def stream_answered(self, index: int, metadata: Any) -> None:
        """A new stream call on address `index` got its first reply, with this initial metadata (raise a
        grpc.RpcError of code UNAVAILABLE to refuse it: the stream then reconnects)."""

    def stream_failed(self, index: int) -> None:
        """A stream call on address `index` broke (UNAVAILABLE or DEADLINE_EXCEEDED)."""


class BlockManagerClient(OneAddress):
    """Talks to one manager.

    timeout: the deadline of each call, seconds, every retry included (a call may pass its own).
    retry: how a call is retried within it (kvservice/client/deadline.py; RetryPolicy(failover=S) keeps a
    call that meets no manager trying for S seconds, across a failover or restart). retries: a cap on
    extra attempts instead (0 = never retry; ignored if `retry` is given). failover: seconds a call that
    meets no manager (UNAVAILABLE: a restart, a failover) keeps trying, even past timeout (replaces the
    policy's; 0 = never past timeout, the default). tls: TLS / mutual TLS (None = plaintext). token:
    bearer token for a manager started with --tokens-file. registry: a prometheus_client registry to count
    refused (rolled-back) replies and lineage changes in. position: the journal positions seen (see the module
    docstring).
    """

    def __init__(self, target: str, timeout: float = 10.0, retries: int | None = None,
                 channel: grpc.Channel | None = None, *, tls: TLSOptions | None = None, token: str | None = None,
                 retry: RetryPolicy | None = None, registry: Any = None, failover: float | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = client_policy(retry, retries, failover)
        self.position = position_tracker(registry)
        self._metadata = auth_metadata(token)
        self._channel = channel or make_channel(target, tls, self.retry.service_config(SERVICE))
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
        """Forget the journal positions seen and refused (after resynchronising with a manager that was rolled back)."""
        self.position.reset()

    def _pause(self, seconds: float) -> None:
        """The pause before a call is issued again (a LeaderClient ends it early when a manager starts serving)."""
        time.sleep(seconds)

    def _call(self, method: Callable[..., T], request: Any, timeout: float | None,
              codes: tuple[grpc.StatusCode, ...] = RETRY_CODES) -> T:
        """One logical call: attempts under one request_id until it succeeds, fails for good, or its deadline
        (timeout, or the client's) passes; each attempt's gRPC deadline is what remains of it."""
        rid = getattr(request, "request_id", None) or None
        name = type(request).__name__.removesuffix("Request")
        budget = CallBudget(self.retry, timeout or self.timeout, name, rid, codes, self.target)
        seen = self.position.seen()
        while True:
            try:
                reply = method(request, timeout=budget.attempt_timeout(), metadata=self._metadata)
            except grpc.RpcError as exc:
                self._pause(budget.pause_or_raise(exc))
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
        """Renew a lease. Retried on UNAVAILABLE only, within timeout: then the next heartbeat is due anyway."""
        return self._call(self._stub.Heartbeat, pb.HeartbeatRequest(worker_id=worker_id, epoch=epoch), timeout,
                          (grpc.StatusCode.UNAVAILABLE,))
