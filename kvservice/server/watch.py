"""gRPC adapter of WatchEvents: one server-streaming call reads one pool's event log.

The stream holds one server thread while it lasts (the hub caps concurrent streams). A reset it
sends is charged to the memory budget (kvservice/server/budget.py) until the next batches. It ends
when the client cancels, the server stops, or the pool is deleted (after a last batch holding
AllBlocksCleared).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc

from kvservice.contract.errors import KVError
from kvservice.contract.status import to_status
from kvservice.events.messages import batch_to_protos
from kvservice.manager.event_log import EventHub
from kvservice.server.admission import reserve_reply
from kvservice.v1 import block_manager_pb2 as pb

log = logging.getLogger("kvservice")
#: Seconds between checks that the client is still there.
POLL_SECONDS = 0.5


def watch_events(hub: EventHub, request: pb.WatchEventsRequest, context: grpc.ServicerContext,
                 metrics: Any = None) -> Iterator[pb.KVEventBatch]:
    """Stream request.pool's batches from request.from_sequence on (0 = a reset first, then live)."""
    try:
        sub = hub.subscribe(request.pool, request.from_sequence, "grpc")
    except KVError as err:
        context.abort_with_status(to_status(err))
        return
    try:
        while context.is_active():
            items = sub.poll(POLL_SECONDS)
            if items is None:
                return
            # a reset is this watcher's own copy of the pool's cached blocks (the ring's batches are shared):
            # charged to the memory budget before it is converted and sent (RESOURCE_EXHAUSTED past it)
            reserve_reply(sum(lb.nbytes for lb in items if lb.batch.reset))
            for lb in items:
                yield from batch_to_protos(lb)
    except KVError as err:
        context.abort_with_status(to_status(err))
    except Exception:
        log.exception("WatchEvents failed")
        context.abort(grpc.StatusCode.INTERNAL, "internal error in WatchEvents; see the manager's log")
    finally:
        sub.close()
