"""The leader gate of a replicated manager: only the leader serves BlockManager calls, every reply names it.

A gRPC server interceptor (server/ha.py wires it): a standby refuses UNAVAILABLE naming the leader it
knows; a leader whose lease lapsed refuses until it renews or a standby takes over; the leader stamps
its epoch and node id on the initial metadata of every reply (the clients refuse a lower epoch than
one they saw: kvservice/client/ha.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from kvservice.contract.transport import EPOCH_METADATA, NODE_METADATA
from kvservice.server.app import SERVICE_NAME


class LeaderGate(grpc.ServerInterceptor):
    """Refuses BlockManager calls UNAVAILABLE unless this process leads; stamps the epoch on every reply."""

    def __init__(self, service: str = SERVICE_NAME) -> None:
        self.service = service
        self.epoch = 0
        self.node = ""
        self.leader = False
        self.why = "standby: following the journal"
        self.leader_hint: Callable[[], str] = lambda: ""
        self.valid: Callable[[], bool] = lambda: True       # False while the leader's lease is lapsed

    def promote(self, epoch: int) -> None:
        self.epoch, self.leader = epoch, True

    def depose(self, why: str) -> None:
        self.leader, self.why = False, why

    def refusal(self) -> str:
        hint = self.leader_hint()
        return (f"this manager does not serve requests ({self.why})"
                + (f"; the leader is {hint}" if hint else "; no leader right now (failover in progress)")
                + ": retry (the clients retry UNAVAILABLE with the same request_id)")

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.lstrip("/").partition("/")[0] != self.service:
            return handler
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._gated(handler.unary_unary), **kw)
        if handler.unary_stream is not None:        # server streams (WatchEvents): only the leader's
            return grpc.unary_stream_rpc_method_handler(self._gated(handler.unary_stream), **kw)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._gated(handler.stream_unary), **kw)
        return grpc.stream_stream_rpc_method_handler(self._gated(handler.stream_stream), **kw)

    def _gated(self, inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def gated(request: Any, context: grpc.ServicerContext) -> Any:
            if not self.leader:
                context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal())
            if not self.valid():
                context.abort(grpc.StatusCode.UNAVAILABLE, "the leader's lease lapsed (NATS unreachable or the "
                              "process was paused); it serves again once renewed, or a standby takes over: retry")
            context.send_initial_metadata(((EPOCH_METADATA, str(self.epoch)), (NODE_METADATA, self.node)))
            return inner(request, context)
        return gated
