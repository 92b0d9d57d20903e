"""gRPC adapter of WatchEvents: one server-streaming call reads one pool's event log.

The stream holds one server thread while it lasts (the hub caps concurrent streams, and those of one
tenant: docs/SECURITY.md#fairness). It ends
when the client cancels, the server stops, or the pool is deleted (after a last batch holding
AllBlocksCleared).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc

from kvservice.contract.auth import current_principal
from kvservice.contract.errors import KVError
from kvservice.contract.status import to_status
from kvservice.events.messages import batch_to_protos
from kvservice.manager.event_log import EventHub
from kvservice.v1 import block_manager_pb2 as pb

log = logging.getLogger("kvservice")
#: Seconds between checks that the client is still there.
POLL_SECONDS = 0.5


def watch_events(hub: EventHub, request: pb.WatchEventsRequest, context: grpc.ServicerContext,
                 metrics: Any = None) -> Iterator[pb.KVEventBatch]:
    """Stream request.pool's batches from request.from_sequence on (0 = a reset first, then live)."""
    try:
        sub = hub.subscribe(request.pool, request.from_sequence, "grpc", tenant=current_principal())
    except KVError as err:
        context.abort_with_status(to_status(err))
        return
    try:
        while context.is_active():
            items = sub.poll(POLL_SECONDS)
            if items is None:
                return
            for lb in items:
                yield from batch_to_protos(lb)
    except KVError as err:
        context.abort_with_status(to_status(err))
    except Exception:
        log.exception("WatchEvents failed")
        context.abort(grpc.StatusCode.INTERNAL, "internal error in WatchEvents; see the manager's log")
    finally:
        sub.close()
