"""Prometheus metrics of KV events and prefix-cache lookups, read from the event hub at scrape time.

kvservice_prefix_cache_lookup_pages_total{pool,group}   prompt pages admissions looked up in the cache
kvservice_prefix_cache_hit_pages_total{pool,group}      ... and found (hit ratio = hit / lookup)
kvservice_kv_event_sequence{pool}                       last committed batch sequence
kvservice_kv_event_batches_total{pool}                  batches published into the pool's log
kvservice_kv_events_published_total{pool,type}          events in them, by type
kvservice_kv_event_batches_sent_total{pool,transport}   batches handed to subscribers
kvservice_kv_event_batches_dropped_total{pool,transport} batches a subscriber lost (replaced by a reset)
kvservice_kv_event_resets_total{pool,transport}         resets sent
kvservice_kv_event_subscribers{pool,transport}          connected subscribers
kvservice_kv_event_subscriber_lag_batches{pool,transport} batches the furthest-behind subscriber has not read
kvservice_kv_event_buffer_batches{pool}                 the ring's capacity (lag past it means a reset)

transport: "grpc" (WatchEvents), "zmq" (a publisher), "zmq-replay" (replay requests).

Every pool with prefix caching exports each of these from the first scrape (at 0, every group, type
and transport): dashboards and alerts read 0 on a quiet manager, not "no data".
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvservice.contract.errors import KVError
from kvservice.manager.pools import BlockManager

TRANSPORTS = ("grpc", "zmq", "zmq-replay")
EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class EventCollector:
    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        hub = self.manager.events
        lookups = CounterMetricFamily("kvservice_prefix_cache_lookup_pages_total",
                                      "Prompt pages admissions looked up in the prefix cache (full pages but the "
                                      "last token's).", labels=["pool", "group"])
        hits = CounterMetricFamily("kvservice_prefix_cache_hit_pages_total",
                                   "Prompt pages found in the prefix cache.", labels=["pool", "group"])
        caching: dict[str, int] = {}                 # pools with prefix caching -> their number of groups
        for name in self.manager.pool_names():
            try:
                with self.manager.locked(name) as pool:
                    for g, cache in enumerate(pool.prefixes or ()):
                        hits.add_metric([name, str(g)], cache.hits)
                    if pool.prefixes:
                        caching[name] = len(pool.prefixes)
            except KVError:
                continue
        seq = GaugeMetricFamily("kvservice_kv_event_sequence", "Sequence number of the pool's last KV event batch.",
                                labels=["pool"])
        batches = CounterMetricFamily("kvservice_kv_event_batches_total", "KV event batches published (one per "
                                      "Step that changed the prefix cache).", labels=["pool"])
        events = CounterMetricFamily("kvservice_kv_events_published_total", "KV events published, by type.",
                                     labels=["pool", "type"])
        sent = CounterMetricFamily("kvservice_kv_event_batches_sent_total", "KV event batches sent to subscribers.",
                                   labels=["pool", "transport"])
        dropped = CounterMetricFamily("kvservice_kv_event_batches_dropped_total", "KV event batches a subscriber "
                                      "could not get any more (it got a reset instead).", labels=["pool", "transport"])
        resets = CounterMetricFamily("kvservice_kv_event_resets_total", "Resets (AllBlocksCleared + the whole cache) "
                                     "sent to subscribers.", labels=["pool", "transport"])
        subs = GaugeMetricFamily("kvservice_kv_event_subscribers", "Connected KV event subscribers.",
                                 labels=["pool", "transport"])
        lag = GaugeMetricFamily("kvservice_kv_event_subscriber_lag_batches", "Batches the furthest-behind subscriber "
                                "has not read yet.", labels=["pool", "transport"])
        cap = GaugeMetricFamily("kvservice_kv_event_buffer_batches", "Batches each pool's ring retains; a subscriber "
                                "lagging more gets a reset.", labels=["pool"])
        with hub.cond:
            looked = {(p, g): 0 for p, n in caching.items() for g in range(n)} | hub.lookup_pages
            for (pool_name, group), n in sorted(looked.items()):
                lookups.add_metric([pool_name, str(group)], n)
            for name in sorted(set(hub.logs) | set(caching)):
                lg = hub.logs.get(name)
                seq.add_metric([name], lg.committed if lg else 0)
                batches.add_metric([name], lg.batches_total if lg else 0)
                cap.add_metric([name], lg.max_batches if lg else hub.ring_batches)
                by_type = dict.fromkeys(EVENT_TYPES, 0) | (lg.events_by_type if lg else {})
                for kind, n in by_type.items():
                    events.add_metric([name, kind], n)
                per: dict[str, tuple[int, int]] = {}
                for s in (lg.subscribers if lg else ()):
                    count, worst = per.get(s.transport, (0, 0))
                    per[s.transport] = (count + 1, max(worst, s.lag))
                counters = lg.counters if lg else {}
                for transport in sorted(set(TRANSPORTS) | set(counters)):
                    c = counters.get(transport)
                    sent.add_metric([name, transport], c.sent if c else 0)
                    dropped.add_metric([name, transport], c.dropped if c else 0)
                    resets.add_metric([name, transport], c.resets if c else 0)
                    count, worst = per.get(transport, (0, 0))
                    subs.add_metric([name, transport], count)
                    lag.add_metric([name, transport], worst)
        yield from (lookups, hits, seq, batches, events, sent, dropped, resets, subs, lag, cap)
