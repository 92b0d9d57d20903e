"""gRPC adapter of the BlockManager: maps each RPC onto ManagerAPI, errors onto statuses, times it.

Mutating RPCs go through the journal when one is configured, which makes them
durable before the reply and idempotent by request_id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from .api import ManagerAPI
from .errors import KVError
from .metrics import ManagerMetrics
from .status import to_status
from .v1 import block_manager_pb2 as pb
from .v1 import block_manager_pb2_grpc as pb_grpc

log = logging.getLogger("kvservice")

#: RPCs that change state: journaled and, with a request_id, idempotent.
MUTATING = frozenset({"CreatePool", "DeletePool", "Step", "RegisterWorker"})
METHODS = tuple(pb.DESCRIPTOR.services_by_name["BlockManager"].methods_by_name)


class Journal(Protocol):
    """Durability hook: run `apply` and make its effect durable before the reply is sent.

    apply(request) -> reply performs the domain change. An implementation may
    return a stored reply instead (a retried request_id) without calling apply.
    """

    def execute(self, method: str, request: Message, apply: Callable[[Message], Message]) -> Message: ...


class BlockManagerServicer(pb_grpc.BlockManagerServicer):
    def __init__(self, api: ManagerAPI, metrics: ManagerMetrics, journal: Journal | None = None) -> None:
        self.api = api
        self.metrics = metrics
        self.journal = journal


def _adapter(name: str) -> Callable[..., Any]:
    def method(self: BlockManagerServicer, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        try:
            apply = getattr(self.api, name)
            if self.journal is not None and name in MUTATING:
                return self.journal.execute(name, request, apply)
            return apply(request)
        except KVError as err:
            context.abort_with_status(to_status(err))
        except Exception:
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the manager's log")
        finally:
            self.metrics.rpc_duration.labels(name).observe(time.perf_counter() - start)
    method.__name__ = name
    return method


for _name in METHODS:
    setattr(BlockManagerServicer, _name, _adapter(_name))
