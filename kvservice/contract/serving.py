"""The one way a kvservice gRPC server (manager or worker) is built: lenient parsing, health, reflection.

A request whose bytes do not parse is answered INVALID_ARGUMENT naming the message type, never gRPC's
INTERNAL. Nothing here knows the manager or the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from google.protobuf.descriptor_pool import Default as _default_pool
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvservice.contract.auth import ServerTLS
from kvservice.contract.received import KEEP_BYTES, Received
from kvservice.contract.transport import MAX_MESSAGE_BYTES

_POOL = _default_pool()
_MANAGER = "kvservice.v1.BlockManager"


def grpc_server(service: str, servicer: object, listen: str, tls: ServerTLS | None = None,
                interceptors: Sequence[grpc.ServerInterceptor] = (), max_workers: int = 8,
                max_message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A gRPC server (not started) with `servicer` under lenient handlers, health and reflection, bound to
    `listen` (port 0 picks one). Returns (server, bound port, health servicer). Manager and worker share it."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes), ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options,
                         interceptors=list(interceptors))
    add_lenient_service(server, service, servicer)         # undecodable bytes: INVALID_ARGUMENT, not INTERNAL
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:            # grpcio >= 1.5x raises RuntimeError on a failed bind; older ones return port 0
        port = server.add_secure_port(listen, tls.credentials()) if tls else server.add_insecure_port(listen)
    except RuntimeError as err:
        raise OSError(f"cannot listen on {listen} ({err}): is another process bound to it?") from None
    if port == 0:
        raise OSError(f"cannot listen on {listen}: is another process bound to it?")
    return server, port, health_servicer


class Malformed:
    """Stands for a request whose bytes do not parse: the handler answers INVALID_ARGUMENT, not gRPC's INTERNAL."""

    __slots__ = ("error", "type_name")

    def __init__(self, type_name: str, error: Exception) -> None:
        self.type_name, self.error = type_name, error


def lenient_handlers(service: str, servicer: object) -> dict[str, grpc.RpcMethodHandler]:
    """The methods of `service` (full name) on `servicer`, with a request parser that never raises.

    gRPC answers a request it cannot deserialize with INTERNAL; here it becomes INVALID_ARGUMENT
    naming the message type. Usable for any service of kvservice.v1 (the worker's too).
    """
    handlers = {}
    for m in _POOL.FindServiceByName(service).methods:
        req_cls, rep_cls = GetMessageClass(m.input_type), GetMessageClass(m.output_type)
        kw = {"request_deserializer": _parser(req_cls, service == _MANAGER and m.name in KEEP_BYTES),
              "response_serializer": rep_cls.SerializeToString}
        if m.client_streaming:                  # the handler answers a Malformed item of the stream itself
            make = grpc.stream_stream_rpc_method_handler if m.server_streaming else grpc.stream_unary_rpc_method_handler
            handlers[m.name] = make(getattr(servicer, m.name), **kw)
        else:
            make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
            handlers[m.name] = make(_refuse_malformed(getattr(servicer, m.name)), **kw)
    return handlers


def add_lenient_service(server: grpc.Server, service: str, servicer: object) -> None:
    """Register `servicer` like the generated add_*Servicer_to_server, with lenient_handlers."""
    handlers = lenient_handlers(service, servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def _parser(cls: type, keep: bool = False) -> Callable[[bytes], object]:
    """The request parser of a method: the message, a Received (keep: with its bytes), or a Malformed."""
    def parse(data: bytes) -> object:
        try:
            return Received(cls.FromString(data), data) if keep else cls.FromString(data)
        except Exception as err:      # DecodeError, or anything else a hostile payload provokes
            return Malformed(cls.DESCRIPTOR.full_name, err)
    return parse


def _refuse_malformed(behavior: Callable[[object, grpc.ServicerContext], object]) -> Callable[..., object]:
    def guarded(request: object, context: grpc.ServicerContext) -> object:
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request is not a valid {request.type_name} message ({type(request.error).__name__})")
        return behavior(request, context)
    return guarded
