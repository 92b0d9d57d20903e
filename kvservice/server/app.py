"""A running manager: gRPC server (BlockManager + health + reflection), the journal, and the /metrics endpoint."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvservice.contract.auth import (
    BM,
    UNAUTHENTICATED,
    ServerTLS,
    TokenAuthInterceptor,
    TokenTable,
    manager_rules,
    principal_of,
)
from kvservice.contract.serving import grpc_server
from kvservice.contract.transport import MAX_MESSAGE_BYTES
from kvservice.events.metrics import EventCollector
from kvservice.events.publish import configure_events
from kvservice.manager.api import ManagerAPI
from kvservice.manager.event_log import EventsConfig
from kvservice.manager.pools import BlockManager
from kvservice.server.admission import AdmissionInterceptor, reserve_reply
from kvservice.server.budget import (
    DEFAULT_MEMORY_LIMIT,
    BudgetLimits,
    MemoryBudget,
    cgroup_memory_limit,
    derive_budget,
)
from kvservice.server.config import PoolConfig
from kvservice.server.http import MetricsServer, health_probe
from kvservice.server.limits import Limits
from kvservice.server.metrics import ManagerMetrics
from kvservice.server.servicer import BlockManagerServicer
from kvservice.state.journal import Journal
from kvservice.state.startup import ensure_pools
from kvservice.v1 import block_manager_pb2

log = logging.getLogger("kvservice")

SERVICE_NAME = block_manager_pb2.DESCRIPTOR.services_by_name["BlockManager"].full_name
COMMIT_BUCKETS = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1, 1.0)


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    metrics_port: int | None
    manager: BlockManager
    metrics: ManagerMetrics
    _http: object | None = None
    journal: Journal | None = None
    #: Set when the journal failed (fail-stop): the process should exit and be restarted.
    failed: threading.Event = field(default_factory=threading.Event)
    health: health.HealthServicer | None = None
    publishers: list = field(default_factory=list)     # ZeroMQ KV event publishers (events/zmq.py)
    budget: MemoryBudget | None = None                 # memory budget of requests and sessions (server/budget.py)
    servicer: BlockManagerServicer | None = None

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (in-flight calls get `grace` seconds), then snapshot and close the journal."""
        self.server.stop(grace).wait()
        for pub in self.publishers:
            pub.stop()
        if self._http is not None:
            self._http.shutdown()  # type: ignore[attr-defined]
        if self.journal is not None:
            self.journal.close()


class JournalCollector:
    """kvservice_journal_* levels and counters, read at scrape time."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def collect(self) -> Iterator[Metric]:
        j = self.journal
        yield GaugeMetricFamily("kvservice_journal_tail_entries", "Journal entries since the last snapshot "
                                "(replayed on recovery).", value=j.seq - j.snapshot_seq)
        yield CounterMetricFamily("kvservice_journal_snapshots_total", "Snapshots written (compactions).",
                                  value=j.snapshots)
        yield CounterMetricFamily("kvservice_idempotent_replays_total", "Retried requests answered with their "
                                  "original reply.", value=j.window.hits)
        yield GaugeMetricFamily("kvservice_journal_failed", "1 once the journal failed (the manager fail-stops).",
                                value=1.0 if j.failed else 0.0)
        yield GaugeMetricFamily("kvservice_journal_snapshot_pause_seconds", "Longest time mutating calls waited "
                                "while a snapshot was captured (the journal lock held).",
                                value=j.snapshot_pause_max_seconds)


class BudgetCollector:
    """kvservice_memory_budget_* levels and counters (kvservice/server/budget.py), read at scrape time."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget

    def collect(self) -> Iterator[Metric]:
        b = self.budget
        yield GaugeMetricFamily("kvservice_memory_budget_bytes", "Bytes requests in flight, Step replies and open "
                                "stream sessions may hold together (--rpc-memory-budget).", value=b.limits.total_bytes)
        yield GaugeMetricFamily("kvservice_memory_budget_charged_bytes", "Bytes charged to the memory budget now.",
                                value=b.charged_bytes)
        refused = CounterMetricFamily("kvservice_memory_budget_refusals_total", "Requests refused "
                                      "RESOURCE_EXHAUSTED because their charge did not fit the memory budget.",
                                      labels=["what"])
        for what, n in sorted(b.refused.items()):
            refused.add_metric([what], n)
        yield refused


def serve(listen: str = "127.0.0.1:0", metrics_port: int | None = None, pools: Sequence[PoolConfig] = (),
          manager: BlockManager | None = None, max_workers: int = 8,
          metrics_addr: str = "127.0.0.1", lease_seconds: float = 10.0,
          journal: Journal | None = None, *, tls: ServerTLS | None = None, tokens: TokenTable | None = None,
          limits: Limits | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
          events: EventsConfig | None = None, max_streams: int = 64,
          interceptors: Sequence[grpc.ServerInterceptor] = (), serving: bool = True,
          budget: BudgetLimits | None = None) -> RunningServer:
    """Start the manager on `listen` (port 0 picks one); metrics on metrics_port (0 picks, None = off).

    journal: a durable kvservice.state.journal.Journal (its manager is served); None = an in-memory one
        (idempotent retries, no durability). Configured `pools` missing from it are created through it.
    tls: serve TLS (mutual TLS if it has a client CA); tokens: require pool-scoped bearer tokens.
    limits: per-request caps (default Limits()); max_message_bytes: gRPC message limit both ways.
    events: KV event rings, WatchEvents streams and ZeroMQ publishers (default EventsConfig()).
    max_streams: StepStream/EchoStream calls open at once; each holds a thread, added to max_workers.
    interceptors: more server interceptors (after the token check); serving=False starts with the
        BlockManager service NOT_SERVING in health (a standby: kvservice/server/ha.py), the server itself SERVING.
    budget: the memory budget of requests, replies and stream sessions (kvservice/server/budget.py); None =
        derived from the cgroup memory limit (default_budget_limits).
    """
    if journal is None:
        journal = Journal(manager or BlockManager(lease_seconds))
    elif manager is not None and manager is not journal.manager:
        raise ValueError("pass either a manager or a journal (which holds its manager), not both")
    manager = journal.manager
    ensure_pools(journal, list(pools))
    warn_unknown_event_pools(manager, events)
    metrics = ManagerMetrics(manager)
    metrics.registry.register(JournalCollector(journal))
    metrics.registry.register(EventCollector(manager))
    publishers = configure_events(manager, events or EventsConfig())
    if journal.store is not None:
        commit = Histogram("kvservice_journal_commit_seconds", "Time to make one mutating RPC durable.",
                           registry=metrics.registry, buckets=COMMIT_BUCKETS)
        journal.observe_commit = commit.observe
    memory = MemoryBudget(budget or default_budget_limits(limits or Limits(), tokens is not None))
    metrics.registry.register(BudgetCollector(memory))
    admission = AdmissionInterceptor(memory, SERVICE_NAME, functools.partial(principal_of, tokens), UNAUTHENTICATED)
    chain: list[grpc.ServerInterceptor] = [admission]
    if tokens is not None:
        chain.append(TokenAuthInterceptor(tokens, BM, manager_rules(_worker_pool(manager))))
    chain.extend(interceptors)
    api = ManagerAPI(manager, max_reply_bytes=max_message_bytes, fence=True)
    api.reserve_reply = reserve_reply
    servicer = BlockManagerServicer(api, metrics, journal, limits or Limits(), max_streams, memory)
    try:
        server, port, health_servicer = grpc_server(SERVICE_NAME, servicer, listen, tls, chain,
                                                    max_workers + max_streams, max_message_bytes)
    except BaseException:
        for pub in publishers:
            pub.stop()
        raise
    running = RunningServer(server, port, None, manager, metrics, None, journal, health=health_servicer,
                            publishers=publishers, budget=memory, servicer=servicer)
    journal.on_fail = lambda why: _fail_stop(running)
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if serving
                        else health_pb2.HealthCheckResponse.NOT_SERVING)
    if metrics_port is not None:
        http = MetricsServer(metrics.registry, metrics_port, metrics_addr, health_probe(health_servicer, ""),
                             health_probe(health_servicer, SERVICE_NAME))
        running._http, running.metrics_port = http, http.server_port
    log.info("kvservice listening on port %d (%s%s), metrics on %s, state: %s", port,
             "mutual TLS" if tls and tls.client_ca else "TLS" if tls else "plaintext",
             f", {len(tokens)} tokens" if tokens is not None else "", running.metrics_port,
             journal.state_dir or (journal.store.location if journal.store.durable else "memory only"))
    return running


def default_budget_limits(limits: Limits, tenants: bool, memory_limit: int | None = None) -> BudgetLimits:
    """The budget of a manager in `memory_limit` bytes (default: its cgroup's limit, else DEFAULT_MEMORY_LIMIT):
    derive_budget of it; each tenant may hold half of it when the server takes tokens, all of it otherwise."""
    if memory_limit is None:
        memory_limit = cgroup_memory_limit() or DEFAULT_MEMORY_LIMIT
    total = derive_budget(memory_limit, limits.max_total_slots)
    return BudgetLimits(total, total // 2 if tenants else total)


def warn_unknown_event_pools(manager: BlockManager, events: EventsConfig | None) -> list[str]:
    """Log a warning for each ZeroMQ publisher whose pool does not exist now (a typo publishes nothing; a pool
    created later over the API is published from then on). Returns those pools."""
    names = set(manager.pool_names())
    missing = [z.pool for z in (events.zmq if events else ()) if z.pool not in names]
    for pool in missing:
        log.warning("--kv-events-zmq names pool %r, which does not exist (pools: %s); its publisher waits for a "
                    "pool of that name to be created", pool, ", ".join(sorted(names)) or "none")
    return missing


def _fail_stop(running: RunningServer) -> None:
    """The journal failed: report NOT_SERVING and let the process owner (kvservice serve) exit."""
    if running.health is not None:
        for name in ("", SERVICE_NAME):
            running.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    running.failed.set()


def _worker_pool(manager: BlockManager) -> Callable[[str], str | None]:
    def pool_of(worker_id: str) -> str | None:
        rec = next((w for w in manager.workers.workers() if w.worker_id == worker_id), None)
        return rec.pool if rec else None
    return pool_of
