"""The one place domain errors become gRPC statuses (with google.rpc.ErrorInfo details)."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvservice.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KVError,
    NotFound,
    ResourceExhausted,
)

DOMAIN = "kvservice.v1"

#: Domain error class -> (gRPC status code, google.rpc code number).
_CODES: list[tuple[type[KVError], grpc.StatusCode, int]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, code_pb2.INVALID_ARGUMENT),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, code_pb2.FAILED_PRECONDITION),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, code_pb2.RESOURCE_EXHAUSTED),
    (NotFound, grpc.StatusCode.NOT_FOUND, code_pb2.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS, code_pb2.ALREADY_EXISTS),
]


def to_status(err: KVError) -> grpc.Status:
    """A grpc.Status for a domain error: code by class, message as written, ErrorInfo(reason, metadata)."""
    num = next((n for cls, _, n in _CODES if isinstance(err, cls)), code_pb2.INTERNAL)
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=err.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(status_pb2.Status(code=num, message=err.message, details=[detail]))


def error_info(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo detail of a failed call, if the server sent one."""
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None
