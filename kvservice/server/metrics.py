"""Prometheus metrics of the manager, named as docs/DESIGN.md says.

Levels (slots, sequences) and domain counters are read from the pools at
scrape time by a collector, so the Step hot path pays nothing for them. RPC
durations are observed by the servicer.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvservice.contract.errors import KVError
from kvservice.manager.pools import BlockManager

RPC_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25,
               0.5, 1.0, 2.5)


class ManagerCollector:
    """Exports kvservice_slots_total, _slots_free, _sequences, _alloc_failures_total and the prefix-cache
    counters per pool, and kvservice_workers by pool and state."""

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        total = GaugeMetricFamily("kvservice_slots_total", "Slots per layer group of the pool.", labels=["pool"])
        free = GaugeMetricFamily("kvservice_slots_free", "Free slots (fewest over layer groups).",
                                 labels=["pool"])
        seqs = GaugeMetricFamily("kvservice_sequences", "Live sequences in the pool.", labels=["pool"])
        fails = CounterMetricFamily("kvservice_alloc_failures_total",
                                    "Step calls refused for lack of slots, by reason.", labels=["pool", "reason"])
        hits = CounterMetricFamily("kvservice_prefix_cache_hits_total",
                                   "Pages served from the prefix cache instead of being recomputed.", labels=["pool"])
        evictions = CounterMetricFamily("kvservice_prefix_cache_evictions_total",
                                        "Cached pages evicted (LRU) to make room.", labels=["pool"])
        for name in self.manager.pool_names():
            try:
                with self.manager.locked(name) as pool:
                    total.add_metric([name], pool.plan.num_slots)
                    free.add_metric([name], pool.num_free_slots)
                    seqs.add_metric([name], pool.num_sequences)
                    for reason, count in pool.alloc_failures.items():
                        fails.add_metric([name, reason], count)
                    if pool.prefix is not None:
                        hits.add_metric([name], pool.prefix.hits)
                        evictions.add_metric([name], pool.allocators[0].evictions)
            except KVError:  # a pool deleted between listing and locking
                continue
        workers = GaugeMetricFamily("kvservice_workers", "Registered workers by pool and state.",
                                    labels=["pool", "state"])
        counts: dict[tuple[str, str], int] = {}
        for w in self.manager.workers.workers():
            key = (w.pool, "alive" if w.alive else "dead")
            counts[key] = counts.get(key, 0) + 1
        for (pool_name, state), n in sorted(counts.items()):
            workers.add_metric([pool_name, state], n)
        yield from (total, free, seqs, fails, hits, evictions, workers)


class ManagerMetrics:
    """The registry a manager process serves on /metrics."""

    def __init__(self, manager: BlockManager, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.registry.register(ManagerCollector(manager))
        self.rpc_duration = Histogram("kvservice_rpc_duration_seconds", "Server-side time per RPC.",
                                      ["method"], registry=self.registry, buckets=RPC_BUCKETS)
