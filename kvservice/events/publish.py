"""A manager about to serve: its KV event settings applied and its ZeroMQ publishers started."""

from __future__ import annotations

from kvservice.manager.event_log import EventsConfig
from kvservice.manager.pools import BlockManager
from kvservice.manager.read_budget import ReadBudget


def configure_events(manager: BlockManager, config: EventsConfig) -> list:
    """Apply `config` to a manager about to serve: batches become visible only once durable (the servicer's
    transaction), and its ZeroMQ publishers start. Returns the started publishers (stop them on shutdown)."""
    from kvservice.events.zmq import ZmqPublisher  # pyzmq only where ZeroMQ is used
    hub = manager.events
    with hub.cond:
        hub.ring_batches, hub.ring_bytes, hub.max_subscribers = config.ring_batches, config.ring_bytes, \
            config.max_watchers
        hub.max_subscribers_per_tenant = config.watchers_per_tenant()
        hub.read_budget = ReadBudget(config.read_share, config.read_burst)
        for lg in hub.logs.values():
            lg.max_batches, lg.max_bytes = config.ring_batches, config.ring_bytes
        hub.deferred = True
    started: list = []
    try:
        for z in config.zmq:
            started.append(ZmqPublisher(hub, z).start())
    except BaseException:
        for pub in started:
            pub.stop()
        raise
    return started
