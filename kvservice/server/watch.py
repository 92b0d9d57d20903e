"""gRPC adapter of WatchEvents: one server-streaming call reads one pool's event log.

The stream holds one server thread while it lasts (the hub caps concurrent streams, and those of one
tenant: docs/SECURITY.md#fairness). A reset it sends is charged to the memory budget
(kvservice/server/budget.py) until the next batches. It ends
when the client cancels, the server stops, or the pool is deleted (after a last batch holding
AllBlocksCleared).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc

from kvservice.contract.auth import current_principal
from kvservice.contract.errors import KVError
from kvservice.contract.status import to_status
from kvservice.events.messages import batch_to_protos
from kvservice.manager.event_log import EventHub
from kvservice.server.admission import reserve_reply
from kvservice.v1 import block_manager_pb2 as pb

log = logging.getLogger("kvservice")
#: Seconds between checks that the client is still there.
POLL_SECONDS = 0.5
#: Batches of catch-up read and encoded at once (each piece is charged before the next starts).
CATCHUP_BATCHES = 256


def watch_events(hub: EventHub, request: pb.WatchEventsRequest, context: grpc.ServicerContext,
                 metrics: Any = None) -> Iterator[pb.KVEventBatch]:
    """Stream request.pool's batches from request.from_sequence on (0 = a reset first, then live).

    Resets and catch-up (batches committed before the stream began) are pieces of the caller's
    tenant's read work (hub.read_budget, CPU seconds); while it may not start one the stream waits,
    holding nothing but its own watcher slot. Live batches are free.
    """
    tenant = current_principal()
    budget = hub.read_budget
    try:
        sub = hub.subscribe(request.pool, request.from_sequence, "grpc", tenant=tenant)
    except KVError as err:
        context.abort_with_status(to_status(err))
        return
    live_from = sub.log.committed          # batches up to this one are catch-up, later ones live
    try:
        while context.is_active():
            heavy = sub.heavy(live_from)
            if heavy:
                wait = budget.try_start(tenant)
                if wait > 0:
                    time.sleep(min(wait, POLL_SECONDS))
                    continue
            start = time.thread_time()
            try:
                items = sub.poll(POLL_SECONDS, CATCHUP_BATCHES if heavy else None)
                if items:
                    # a reset is this watcher's own copy of the pool's cached blocks (the ring's batches are
                    # shared): charged to the memory budget before it is converted (RESOURCE_EXHAUSTED past it)
                    reserve_reply(sum(lb.nbytes for lb in items if lb.batch.reset))
                messages = [m for lb in items for m in batch_to_protos(lb)] if items else []
            finally:
                if heavy:
                    budget.finish(tenant, time.thread_time() - start)
            if not heavy and any(lb.batch.reset for lb in items or ()):     # fell behind while it waited
                budget.charge(tenant, time.thread_time() - start)
            if items is None:
                return
            yield from messages
    except KVError as err:
        context.abort_with_status(to_status(err))
    except Exception:
        log.exception("WatchEvents failed")
        context.abort(grpc.StatusCode.INTERNAL, "internal error in WatchEvents; see the manager's log")
    finally:
        sub.close()
