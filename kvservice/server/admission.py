"""Charges every BlockManager call to the memory budget (kvservice/server/budget.py) before it allocates.

:class:`AdmissionInterceptor` is the outermost server interceptor. For each call it makes one
:class:`CallCharges` (the caller's tenant: the name of its bearer token, "" without tokens) and
wraps the method's request parser: before a request's bytes are parsed, WIRE_FACTOR x their size is
charged; a request that does not fit is not parsed at all and the call ends RESOURCE_EXHAUSTED
(reason MEMORY_BUDGET) before the handler, so nothing changes in state. A Step then charges
REPLY_FACTOR x its reply bound (kvservice/core/limits.py) before it is applied (:func:`reserve_reply`,
called by ManagerAPI.check_step_cost; refused the same way). A unary call's charges are released when
its handler returns; a stream's request and reply charges when its handler asks for the next request
(the reply was sent) or the call ends, for whatever reason (an error, a cancellation, the client going
away).

gRPC parses requests on its own polling thread, outside the call's context: the parser reaches the
call's charges through the closure made for that call, the handler through a context variable.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvservice.contract.serving import Malformed
from kvservice.contract.status import to_status
from kvservice.server.budget import REPLY_FACTOR, WIRE_FACTOR, BudgetExceeded, Charge, MemoryBudget

#: What the parser of a call without a known token returns (its handler refuses the call UNAUTHENTICATED).
_NOT_READ = Malformed("request (not read: the call has no known token)", PermissionError("no known token"))
_CALL: contextvars.ContextVar[CallCharges | None] = contextvars.ContextVar("kvservice_call_charges", default=None)


class OverBudget:
    """Stands for a request that was not parsed because its charge did not fit (the call is refused)."""

    __slots__ = ("error",)

    def __init__(self, error: BudgetExceeded) -> None:
        self.error = error


class CallCharges:
    """The charges of one call: its current request (from its wire size) and the reply that request builds.

    After close() (the call ended) nothing more is charged: a request parsed late for a call that is gone
    is left uncharged rather than charged forever.
    """

    def __init__(self, budget: MemoryBudget, tenant: str, method: str) -> None:
        self.budget, self.tenant, self.method = budget, tenant, method
        self.request: Charge | None = None
        self.reply: Charge | None = None
        self.closed = False
        self._lock = threading.Lock()

    def admit(self, wire_bytes: int) -> None:
        """Charge a request of `wire_bytes` (the previous one of a stream is done: its charges are replaced)."""
        with self._lock:
            if self.reply is not None:
                self.reply.release()
                self.reply = None
            if self.closed:
                return
            nbytes = WIRE_FACTOR * wire_bytes
            if self.request is not None and nbytes <= self.request.nbytes:
                self.request.resize(nbytes)      # a stream's steady loop: one update, never refused
                return
            if self.request is not None:
                self.request.release()
                self.request = None
            self.request = self.budget.charge(self.tenant, nbytes, f"{self.method} request")

    def reserve_reply(self, reply_bytes: int) -> None:
        """Charge the reply of the current request, at most `reply_bytes` on the wire."""
        with self._lock:
            if self.closed:
                return
            if self.reply is None:
                self.reply = self.budget.charge(self.tenant, REPLY_FACTOR * reply_bytes, f"{self.method} reply")
            else:
                self.reply.resize(REPLY_FACTOR * reply_bytes)

    def done(self) -> None:
        """The current request and its reply are done (a stream waits for its next request)."""
        with self._lock:
            self._release()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._release()

    def _release(self) -> None:
        for c in (self.request, self.reply):
            if c is not None:
                c.release()
        self.request = self.reply = None


def reserve_reply(reply_bytes: int) -> None:
    """Charge the running call's reply (BudgetExceeded if it does not fit); nothing outside a call (replays)."""
    call = _CALL.get()
    if call is not None:
        call.reserve_reply(reply_bytes)


class AdmissionInterceptor(grpc.ServerInterceptor):
    """Charges the calls of `service` (full name) to `budget`; tenant_of(metadata) names the caller's tenant.

    Calls of the tenant `unparsed` (those without a known token, which the token check refuses) have their
    requests neither charged nor parsed: they cost the budget nothing.
    """

    def __init__(self, budget: MemoryBudget, service: str, tenant_of: Callable[[Any], str],
                 unparsed: str | None = None) -> None:
        self.budget = budget
        self.prefix = f"/{service}/"
        self.tenant_of = tenant_of
        self.unparsed = unparsed

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        tenant = self.tenant_of(details.invocation_metadata)
        if tenant == self.unparsed:
            return _unparsed(handler)
        call = CallCharges(self.budget, tenant, details.method[len(self.prefix):])
        _CALL.set(call)          # this runs in the call's own context, where its handler runs too
        kw = {"request_deserializer": _charging(handler.request_deserializer, call),
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, call), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_unary_stream(handler.unary_stream, call), **kw)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_stream_stream(handler.stream_stream, call), **kw)
        return grpc.stream_unary_rpc_method_handler(_stream_unary(handler.stream_unary, call), **kw)


def _unparsed(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` (a refusal) with a parser that reads nothing."""
    return handler._replace(request_deserializer=_skip) if hasattr(handler, "_replace") else handler


def _skip(data: bytes) -> Malformed:
    return _NOT_READ


def _charging(parse: Callable[[bytes], Any], call: CallCharges) -> Callable[[bytes], Any]:
    def charged(data: bytes) -> Any:
        try:
            call.admit(len(data))
        except BudgetExceeded as err:
            return OverBudget(err)
        return parse(data)
    return charged


def _on_end(call: CallCharges, context: grpc.ServicerContext) -> None:
    """Release the call's charges when it terminates, even if its handler never runs to its end."""
    if not context.add_callback(call.close):
        call.close()


def _refuse(request: Any, context: grpc.ServicerContext) -> None:
    if isinstance(request, OverBudget):
        context.abort_with_status(to_status(request.error))


def _checked(requests: Iterator[Any], context: grpc.ServicerContext, call: CallCharges) -> Iterator[Any]:
    for request in requests:
        _refuse(request, context)
        yield request
        # The handler asks for the next request: this one is answered (its reply sent). Nothing here keeps it
        # while the stream waits, so neither does the budget (what its session keeps is charged there).
        request = None
        call.done()


def _unary(inner: Callable[..., Any], call: CallCharges) -> Callable[..., Any]:
    def behavior(request: Any, context: grpc.ServicerContext) -> Any:
        _on_end(call, context)
        try:
            _refuse(request, context)
            return inner(request, context)
        finally:
            call.close()
    return behavior


def _unary_stream(inner: Callable[..., Any], call: CallCharges) -> Callable[..., Any]:
    def behavior(request: Any, context: grpc.ServicerContext) -> Any:
        _on_end(call, context)
        _refuse(request, context)
        return _closing(inner(request, context), call)
    return behavior


def _closing(replies: Iterator[Any], call: CallCharges) -> Iterator[Any]:
    try:
        yield from replies
    finally:
        call.close()


def _stream_stream(inner: Callable[..., Any], call: CallCharges) -> Callable[..., Any]:
    def behavior(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        _on_end(call, context)
        return _closing(inner(_checked(requests, context, call), context), call)
    return behavior


def _stream_unary(inner: Callable[..., Any], call: CallCharges) -> Callable[..., Any]:
    def behavior(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        _on_end(call, context)
        try:
            return inner(_checked(requests, context, call), context)
        finally:
            call.close()
    return behavior
