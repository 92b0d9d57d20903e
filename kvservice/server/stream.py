"""StepStream and EchoStream: one long-lived stream per scheduler (gRPC adapter, like servicer.py).

A stream is named by the call metadata ``kvservice-stream-id`` (the server makes one up when it
is absent; such a stream cannot be resumed) within the namespace of the caller's tenant (the name
of its token, kvservice.contract.auth; "" without tokens): two tenants' streams of the same id are
two streams, and the idempotency keys of their requests never meet (``scoped_request_id``), so no
tenant can apply a Step under another's stream or learn its journal position from an error. Its
server-side :class:`StreamSession` outlives the call, so a client that reconnects with the same id
continues it:

- Each request carries ``stream_seq`` (1, 2, 3, ...). Its idempotency key is
  ``"<stream id>#<stream_seq>"`` unless the request brings its own ``request_id``, and it goes
  through the same Journal hook as a unary Step: a resent request gets its original reply, once
  applied, with no UUID per step. A seq that skips ahead of the stream is refused.
- A refused request gets a reply with ``error`` set (the status a unary Step would have ended with)
  and the stream goes on. Only a broken stream (a failed journal: UNAVAILABLE) ends the call.
- With ``delta_tables`` the reply carries only what changed in the tables (kvservice/manager/delta.py),
  relative to what the session last sent, when the request's ``delta_base`` says the client holds
  exactly that; otherwise full tables.
- Each request is decoded once (kvservice.manager.step_input.decode_step), checked against the Limits
  (server/limits.py's Limits) and the step's cost (ManagerAPI.check_step_cost) from that one decoding, and its
  KV events become visible once it is journaled (events.transaction).

Sessions are bounded (least recently used one dropped past ``max_streams``; idle ones expire), so stream ids
cannot grow the server's memory without bound; a dropped session only costs its client one full reply. What an
open session keeps between requests (the tables its client holds) is charged to its tenant's memory budget
(kvservice/server/budget.py; dropped rather than kept when the budget has no room); when its last call closes,
the session keeps only ``last_seq`` (what a resend after a reconnect needs: its reply comes from the journal's
idempotency window) and the charge is released at once.
Each open stream holds a server thread; ``kvservice serve --max-streams`` caps them
(and adds that many threads), so unary calls are never starved.

Metrics: each stream request is observed in ``kvservice_rpc_duration_seconds`` as ``method="Step"``
(``"Echo"`` for EchoStream): the same operation, so alerts and dashboards cover both transports.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.rpc import code_pb2

from kvservice.contract.auth import current_principal
from kvservice.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    JournalUnavailable,
    KVError,
    NotFound,
    ResourceExhausted,
)
from kvservice.contract.received import unwrap
from kvservice.contract.transport import STREAM_ID_KEY
from kvservice.manager.api import ManagerAPI
from kvservice.manager.delta import HeldTables
from kvservice.manager.step_input import DecodedStep, decode_step
from kvservice.server.budget import BudgetExceeded, Charge
from kvservice.v1 import block_manager_pb2 as pb

log = logging.getLogger("kvservice")
_STREAM_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_CODES = ((InvalidArgument, code_pb2.INVALID_ARGUMENT), (FailedPrecondition, code_pb2.FAILED_PRECONDITION),
          (ResourceExhausted, code_pb2.RESOURCE_EXHAUSTED), (NotFound, code_pb2.NOT_FOUND),
          (AlreadyExists, code_pb2.ALREADY_EXISTS))


class StreamSession:
    """Server-side state of one stream, kept across reconnects. Guard every use with `lock`.

    last_seq: highest stream_seq answered (0 = none yet, or the session is new after a restart).
    held: what the client's mirror holds after the last table-carrying reply (None = nothing known).
    last_used: registry clock at the last request (idle sessions expire).
    calls: StepStream calls open on this session (a reconnect may overlap the call it replaces).
    charge: the memory budget's charge for held (None: no budget).
    """

    def __init__(self, stream_id: str, tenant: str = "") -> None:
        self.stream_id = stream_id
        self.tenant = tenant
        self.lock = threading.Lock()
        self.last_seq = 0
        self.held: HeldTables | None = None
        self.last_used = 0.0
        self.calls = 0
        self.charge: Charge | None = None

    def kept_bytes(self) -> int:
        """Bytes this session keeps between requests: the held tables."""
        h = self.held
        if h is None:
            return 0
        return h.seq_ids.nbytes + h.num_tokens.nbytes

    def forget(self) -> None:
        """Drop what the session keeps for speed (the next reply carries full tables)."""
        self.held = None

    def account(self) -> None:
        """Charge what the session keeps now; past the budget, keep nothing instead. Under `lock`."""
        if self.charge is None:
            return
        try:
            self.charge.resize(self.kept_bytes())
        except BudgetExceeded:
            self.forget()
            self.charge.resize(0)

    def close_call(self) -> None:
        """A call on this session ended; the last one frees what the session keeps (last_seq stays)."""
        with self.lock:
            self.calls -= 1
            if self.calls <= 0:
                self.forget()
                if self.charge is not None:
                    self.charge.release()

    def check_order(self, seq: int) -> None:
        """InvalidArgument for a stream_seq that is 0 or skips ahead of the stream."""
        if seq < 1:
            raise InvalidArgument("stream_seq must be >= 1 on StepStream: number the requests of a stream 1, 2, 3, ...",
                                  reason="STREAM_SEQ")
        if self.last_seq and seq > self.last_seq + 1:
            raise InvalidArgument(f"stream_seq {seq} skips ahead: stream {self.stream_id!r} answered up to "
                                  f"{self.last_seq}; send {self.last_seq + 1} next (or resend an earlier one)",
                                  reason="STREAM_SEQ", expected=self.last_seq + 1)

    def apply(self, api: ManagerAPI, request: pb.StepRequest, step: DecodedStep | None = None) -> pb.StepReply:
        """Run the step and encode its reply, incremental if the client's base allows (ManagerAPI.step_delta: the
        step service); this session keeps what the client then holds. step: the request decoded by the caller;
        None: decoded here."""
        return api.step_delta(request, step if step is not None else decode_step(request), self)


class StreamRegistry:
    """stream id -> StreamSession, at most max_streams (least recently used dropped), idle ones expire.

    max_active: streams open at once (each holds a server thread while open; the server gets that many
    threads on top of its own, so unary calls are never starved). A stream past it is refused.
    """

    def __init__(self, max_streams: int = 4096, idle_seconds: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, max_active: int = 64) -> None:
        self.max_streams = max_streams
        self.idle_seconds = idle_seconds
        self.clock = clock
        self.max_active = max_active
        self.active = 0
        self._sessions: OrderedDict[tuple[str, str], StreamSession] = OrderedDict()
        self._lock = threading.Lock()

    def enter(self) -> bool:
        """Count a stream call opening; False (not counted) if max_active are open already."""
        with self._lock:
            if self.active >= self.max_active:
                return False
            self.active += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.active -= 1

    def __len__(self) -> int:
        return len(self._sessions)

    def session(self, stream_id: str, tenant: str = "") -> StreamSession:
        """The session of a tenant's stream id (a new one if unknown, dropped or expired); drops expired and
        excess ones.

        Sessions are ordered by when their stream last opened; a session's own last_used (set per request)
        keeps an open stream from expiring.
        """
        now = self.clock()
        key = (tenant, stream_id)
        with self._lock:
            s = self._sessions.pop(key, None)
            if s is None or now - s.last_used > self.idle_seconds:
                s = StreamSession(stream_id, tenant)
            s.last_used = now
            self._sessions[key] = s
            while self._sessions:
                oldest = next(iter(self._sessions.values()))
                if len(self._sessions) <= self.max_streams and now - oldest.last_used <= self.idle_seconds:
                    break
                self._sessions.popitem(last=False)
            return s


def stream_id_of(context: grpc.ServicerContext) -> str | None:
    """The stream id from the call metadata, a made-up one if absent, None if malformed."""
    for key, value in context.invocation_metadata() or ():
        if key == STREAM_ID_KEY:
            return value if isinstance(value, str) and _STREAM_ID.match(value) else None
    return f"anon-{uuid.uuid4().hex}"


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The idempotency key of a tenant's request_id: the id itself without tokens (tenant ""), else
    "<len(tenant)>:<tenant>/<id>", which no other tenant's id can equal."""
    return f"{len(tenant)}:{tenant}/{request_id}" if tenant else request_id


def error_reply(seq: int, err: KVError) -> pb.StepReply:
    """A reply saying the request was refused with `err` (same code, message and ErrorInfo as a unary Step)."""
    code = next((n for cls, n in _CODES if isinstance(err, cls)), code_pb2.INTERNAL)
    return pb.StepReply(stream_seq=seq, error=pb.RequestStatus(code=code, message=err.message, reason=err.reason,
                                                                metadata=err.metadata))


def step_one(servicer: Any, session: StreamSession, request: Any, broken: type[Exception],
             observe: Callable[[float, pb.StepReply | None], None]) -> pb.StepReply:
    """Answer one request of a StepStream; raises `broken` (the journal's JournalUnavailable) only.

    request: a StepRequest, or the server's stand-in for bytes that did not parse.
    observe: records the request's server-side seconds and its reply (None when `broken` was raised).
    """
    start = time.perf_counter()
    reply = None
    request, received = unwrap(request)             # the bytes it arrived as, which the journal appends
    ok = isinstance(request, pb.StepRequest)
    seq = request.stream_seq if ok else 0
    try:
        with session.lock:
            if not ok:
                raise InvalidArgument(f"request is not a valid {getattr(request, 'type_name', 'StepRequest')} "
                                      "message")
            journal = servicer.journal
            if getattr(journal, "failed", None):
                raise broken(f"the manager stopped serving: {journal.failed}")
            session.check_order(seq)
            try:
                step = decode_step(request)             # the one decoding of this request
                if servicer.limits is not None:
                    servicer.limits.check("Step", request, servicer.api.manager, step)
                request.request_id = scoped_request_id(session.tenant,
                                                       request.request_id or f"{session.stream_id}#{seq}")

                apply = functools.partial(servicer.api.step_delta, step=step, holder=session)
                with servicer.api.manager.events.transaction():    # its KV events show once it is journaled
                    reply = journal.execute("Step", request, apply, received) if journal is not None \
                        else apply(request)
            finally:
                session.last_seq = max(session.last_seq, seq)
                session.account()
            if reply.stream_seq != seq:           # a reply rebuilt by journal recovery (a unary Step's)
                reply.stream_seq = seq
            reply.stream_id = session.stream_id   # workers bind persistent tables to it (UpdateTables)
            return reply
    except broken:
        raise
    except KVError as err:
        reply = error_reply(seq, err)
        return reply
    except Exception:
        log.exception("StepStream request %d of stream %r failed", seq, session.stream_id,
                      extra={"pool": getattr(request, "pool", None), "stream_id": session.stream_id})
        reply = pb.StepReply(stream_seq=seq, error=pb.RequestStatus(
            code=code_pb2.INTERNAL, message="internal error in StepStream; see the manager's log", reason="INTERNAL"))
        return reply
    finally:
        observe(time.perf_counter() - start, reply)


def step_stream(servicer: Any, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[pb.StepReply]:
    """The StepStream handler: one reply per request, in order."""

    stream_id = stream_id_of(context)
    if stream_id is None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"metadata {STREAM_ID_KEY} must be 1-64 characters of "
                      "[A-Za-z0-9_.:-]")
    registry = servicer.streams
    _enter(registry, context)
    session = None
    try:
        session = registry.session(stream_id, current_principal())
        with session.lock:
            session.calls += 1
            budget = getattr(servicer, "budget", None)
            if session.charge is None and budget is not None:
                session.charge = budget.charge(session.tenant, 0, "StepStream session")
        metrics = servicer.metrics

        def observe(seconds: float, reply: pb.StepReply | None) -> None:      # a stream request is a Step: same alerts
            if reply is None:
                metrics.observe("Step", seconds, "UNAVAILABLE")
            else:
                metrics.observe_reply("Step", seconds, reply)
        for request in requests:
            try:
                reply = step_one(servicer, session, request, JournalUnavailable, observe)
            except JournalUnavailable as err:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
            session.last_used = registry.clock()
            yield reply
            request = reply = None      # an answered request is not kept while the stream waits for the next
    finally:
        if session is not None:
            session.close_call()
        registry.leave()


def _enter(registry: StreamRegistry, context: grpc.ServicerContext) -> None:
    if not registry.enter():
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this manager has {registry.max_active} streams open, its "
                      "limit (kvservice serve --max-streams); close one, or use unary calls")


def echo_stream(servicer: Any, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[pb.EchoReply]:
    """The EchoStream handler: each payload back, in order (the transport floor of StepStream)."""
    registry = servicer.streams
    _enter(registry, context)
    try:
        observe = servicer.metrics.rpc_duration.labels("Echo", "OK").observe
        for request in requests:
            start = time.perf_counter()
            if not isinstance(request, pb.EchoRequest):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request is not a valid kvservice.v1.EchoRequest "
                              "message")
            reply = pb.EchoReply(payload=request.payload)
            observe(time.perf_counter() - start)
            yield reply
    finally:
        registry.leave()
