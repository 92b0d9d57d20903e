"""Prometheus metrics of the manager, named as docs/DESIGN.md says.

Levels (slots, sequences) and domain counters are read from the pools at
scrape time by a collector, so the Step hot path pays nothing for them. RPC
durations are observed by the servicer, with the call's gRPC status code; a
refused call is also counted by its reason. Every series a dashboard or an
alert reads exists from the first scrape (at 0 until something happens): a
healthy manager shows 0, never "no data".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvservice.contract.errors import KVError
from kvservice.manager.pools import BlockManager

#: Reasons a Step is refused for lack of slots (Pool.alloc_failures keys); each pool exports each, from 0.
ALLOC_FAILURE_REASONS = ("out_of_slots",)
#: Status codes a refusal is pre-created with (method Step, reason = the code): the error model's codes.
REFUSAL_CODES = ("INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                 "UNAVAILABLE")
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
                    counts = dict.fromkeys(ALLOC_FAILURE_REASONS, 0) | pool.alloc_failures
                    for reason, count in counts.items():
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
        self.rpc_duration = Histogram("kvservice_rpc_duration_seconds", "Server-side time per RPC, by its gRPC "
                                      "status code.", ["method", "code"], registry=self.registry, buckets=RPC_BUCKETS)
        self.refusals = Counter("kvservice_requests_refused_total", "Requests answered with an error status, by "
                                "method, code and reason (the ErrorInfo reason, else the code).",
                                ["method", "code", "reason"], registry=self.registry)
        self._ok_duration: dict[str, Any] = {}          # method -> rpc_duration's child for code OK
        for method in ("Step", "Echo"):
            self._ok_duration[method] = self.rpc_duration.labels(method, "OK")
        for code in REFUSAL_CODES:
            self.refusals.labels("Step", code, code)

    def observe(self, method: str, seconds: float, code: str = "OK", reason: str = "") -> None:
        """One call: its server-side seconds, its status code name, and for an error its reason."""
        if code == "OK":                      # the histogram's child of an OK method, kept (labels() costs more)
            child = self._ok_duration.get(method)
            if child is None:
                child = self._ok_duration[method] = self.rpc_duration.labels(method, "OK")
            child.observe(seconds)
            return
        self.rpc_duration.labels(method, code).observe(seconds)
        self.refusals.labels(method, code, reason or code).inc()

    def observe_reply(self, method: str, seconds: float, reply: object) -> None:
        """A stream request: its reply says how it ended (``error`` set = refused)."""
        err = getattr(reply, "error", None)
        if err is not None and reply.HasField("error"):           # type: ignore[attr-defined]
            from grpc import StatusCode
            code = next((c.name for c in StatusCode if c.value[0] == err.code), str(err.code))
            self.observe(method, seconds, code, err.reason)
        else:
            self.observe(method, seconds)
