"""gRPC adapter of the BlockManager: maps each RPC onto ManagerAPI, errors onto statuses, times it.

Requests are first checked against the server's Limits (batch and pool caps). The server
stamps what a client may not choose into two requests before they are journaled: the
incarnation of a new pool (CreatePool) and the name of the token that registers a worker
(RegisterWorker.registered_by). Mutating RPCs
go through the journal when one is configured, which makes them durable before the reply
and idempotent by request_id; reads of pool state go through it too, so they only see
committed state and nothing once the journal failed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from kvservice.contract.auth import current_pools, current_principal
from kvservice.contract.errors import JournalUnavailable, KVError
from kvservice.contract.received import unwrap
from kvservice.contract.status import to_status
from kvservice.manager.api import ManagerAPI, derived_incarnation
from kvservice.manager.pools import new_incarnation
from kvservice.manager.step_input import decode_step
from kvservice.server.budget import MemoryBudget
from kvservice.server.limits import Limits
from kvservice.server.metrics import ManagerMetrics
from kvservice.server.stream import StreamRegistry, echo_stream, scoped_request_id, step_stream
from kvservice.server.watch import watch_events
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

log = logging.getLogger("kvservice")

#: RPCs that change state: journaled and, with a request_id, idempotent.
MUTATING = frozenset({"CreatePool", "DeletePool", "Step", "RegisterWorker"})
#: Reads of pool state: they wait for an in-flight commit and are refused once the journal failed.
STATE_READS = frozenset({"GetPool", "ListPools", "ListSequences", "GetStats"})
#: Other reads whose replies carry the journal position (they do not wait for commits): a client or worker
#: checks it against what it saw before (kvservice/client/position.py).
POSITIONED = frozenset({"Heartbeat", "ListWorkers", "ScorePrefix"})
#: Requests the server stamps before they are journaled (_stamp).
STAMPED = frozenset({"CreatePool", "RegisterWorker"})
METHODS = tuple(pb.DESCRIPTOR.services_by_name["BlockManager"].methods_by_name)
#: Streaming RPCs: handlers of their own (kvservice/server/stream.py), not the unary adapter below.
STREAMING = frozenset(m.name for m in pb.DESCRIPTOR.services_by_name["BlockManager"].methods
                      if m.client_streaming or m.server_streaming)


class Journal(Protocol):
    """Durability hook: run `apply` and make its effect durable before the reply is sent.

    apply(request) -> reply performs the domain change. An implementation may
    return a stored reply instead (a retried request_id) without calling apply.
    """

    def execute(self, method: str, request: Message, apply: Callable[[Message], Message],
                received: bytes | None = None) -> Message: ...


class BlockManagerServicer(pb_grpc.BlockManagerServicer):
    def __init__(self, api: ManagerAPI, metrics: ManagerMetrics, journal: Journal | None = None,
                 limits: Limits | None = None, max_streams: int = 64, budget: MemoryBudget | None = None) -> None:
        self.api = api
        self.metrics = metrics
        self.journal = journal
        self.limits = limits
        self.budget = budget        # memory budget of stream sessions (requests: kvservice/server/admission.py)
        self.streams = StreamRegistry(max_active=max_streams)     # open StepStream / EchoStream calls

    def StepStream(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        return step_stream(self, request_iterator, context)

    def EchoStream(self, request_iterator: Any, context: grpc.ServicerContext) -> Any:
        return echo_stream(self, request_iterator, context)

    def WatchEvents(self, request: pb.WatchEventsRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from watch_events(self.api.manager.events, request, context, self.metrics)

    def _score_prefix(self, request: pb.ScorePrefixRequest) -> pb.ScorePrefixReply:
        """Only the pools the caller's token may read, on its tenant's read budget (refused while it is in debt)."""
        with self.api.manager.events.read_budget.piece(current_principal(), "ScorePrefix"):
            return self.api.ScorePrefix(request, readable=current_pools())


def _serve(self: BlockManagerServicer, name: str, request: Any, context: grpc.ServicerContext) -> Any:
    """One unary RPC `name`: decode, check limits, stamp, journal (mutations) or position (reads), observe.

    A module-level function that every unary method calls by name at call time (functools.partialmethod below),
    so the test-time mutation tool can switch its body; a closure built at import could not be.
    """
    start = time.perf_counter()
    code, reason = "OK", ""
    request, received = unwrap(request)         # Step: the bytes it arrived as, which the journal appends
    try:
        apply = self._score_prefix if name == "ScorePrefix" else getattr(self.api, name)
        if getattr(self.journal, "failed", None):
            raise JournalUnavailable(f"the manager stopped serving: {self.journal.failed}")  # type: ignore[union-attr]
        step = None
        if name == "Step":              # decoded here, once: Limits, the cost check and Pool.step read it
            step = decode_step(request)
            apply = functools.partial(self.api.Step, step=step)
        if self.limits is not None:
            self.limits.check(name, request, self.api.manager, step)
        if name in STAMPED:
            _stamp(name, request)
        if name in MUTATING and getattr(request, "request_id", ""):     # one idempotency namespace per tenant
            request.request_id = scoped_request_id(current_principal(), request.request_id)
        if self.journal is not None and name in MUTATING:
            with self.api.manager.events.transaction():    # its KV events show once it is durable
                return self.journal.execute(name, request, apply, received)
        if name in STATE_READS and hasattr(self.journal, "read"):
            return self.journal.read(request, apply)  # type: ignore[union-attr]
        reply = apply(request)
        if name in POSITIONED and hasattr(self.journal, "stamp"):
            self.journal.stamp(reply)                 # type: ignore[union-attr]
        return reply
    except JournalUnavailable as err:
        code = "UNAVAILABLE"
        context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
    except KVError as err:
        status = to_status(err)
        code, reason = status.code.name, err.reason
        context.abort_with_status(status)
    except Exception:
        code = "INTERNAL"
        log.exception("%s failed", name, extra={"pool": getattr(request, "pool", None),
                                                "request_id": getattr(request, "request_id", None)})
        context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the manager's log")
    finally:
        self.metrics.observe(name, time.perf_counter() - start, code, reason)


def _stamp(name: str, request: Any) -> None:
    """Fill the fields only the server sets, replacing whatever a client sent, before the request is journaled.
    (Its request_id is then scoped to the caller's tenant: kvservice.server.stream.scoped_request_id.)

    CreatePool: the new pool's incarnation; derived from the request when it has a request_id (a retry
    of it must carry the same bytes), else random. RegisterWorker: the caller's token name.
    """
    if name == "CreatePool":
        request.incarnation = 0
        request.incarnation = derived_incarnation(request) if request.request_id else new_incarnation()
    elif name == "RegisterWorker":
        request.registered_by = current_principal()


for _name in METHODS:
    if _name in STREAMING:
        continue
    setattr(BlockManagerServicer, _name, functools.partialmethod(_serve, _name))
