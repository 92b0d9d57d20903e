"""Prometheus metrics of a worker, named as docs/DESIGN.md says."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

KERNEL_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


class WorkerMetrics:
    def __init__(self, pool: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.violations = Counter("kvworker_bounds_violations_total",
                                  "Page-table entries a kernel refused to follow (never read or written).",
                                  ["kernel", "layer", "reason"], registry=self.registry)
        self.guard_corruptions = Counter("kvworker_guard_corruptions_total",
                                         "Corrupted canary bytes found around a cache buffer.", ["buffer"],
                                         registry=self.registry)
        self.kernel_duration = Histogram("kvworker_kernel_duration_seconds", "Time per kernel call.", ["kernel"],
                                         registry=self.registry, buckets=KERNEL_BUCKETS)
        self.leader_epoch_refusals = Counter("kvworker_leader_epoch_refusals_total",
                                             "Kernel calls refused for naming a deposed leader's epoch or none "
                                             "(replicated managers, docs/HA.md).", ["reason"],
                                             registry=self.registry)
        self.state_rollbacks = Counter("kvworker_state_rollbacks_total",
                                       "Manager replies (registration, heartbeats, pool reads) this worker refused "
                                       "because the manager's state was behind what it had already seen in the same "
                                       "lineage (STATE_ROLLED_BACK, docs/DURABILITY.md).", registry=self.registry)
        self.kernels_stopped = Counter("kvworker_kernels_stopped_total",
                                       "Kernel calls stopped part-way because their deadline passed or their caller "
                                       "went away (CPU kernels; kvservice/worker/cancel.py).", registry=self.registry)
        self.cache_bytes = Gauge("kvworker_cache_bytes", "Bytes of KV cache this worker holds.", ["pool"],
                                 registry=self.registry)
        self.pool = pool
