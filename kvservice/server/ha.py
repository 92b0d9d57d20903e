"""A replicated manager: the NATS journal (state/nats/journal.py) and the leader lease (state/nats/leader.py)
wired to the server.

Every manager process starts as a **standby**: it recovers the newest snapshot plus the
journal tail, then follows the stream continuously (its in-memory state stays a few entries
behind the leader's) while it looks at the leader key every ``poll_seconds``. gRPC calls to a
standby are refused UNAVAILABLE naming the leader, and its readiness (health of
``kvservice.v1.BlockManager``) is NOT_SERVING, so a Kubernetes Service only routes to the leader;
the whole-server health ("") stays SERVING (liveness).

**Takeover**, once the lease is free or its holder stopped renewing for a TTL: start renewing;
read the stream to its end; append a fence of epoch ``highest epoch seen + 1`` with the
expected-last-sequence check (if the old leader slipped an entry in, read it and fence again);
from then on the old leader can no longer append. Then serve: every reply of this process
carries the epoch in the initial metadata ``kvservice-leader-epoch``; clients and workers
refuse a reply with a lower epoch than one they have seen (kvservice/client/ha.py).

**Fail-stop.** A leader whose renewal is refused (someone else holds the key), whose lease
lapsed (the journal's ``guard`` raises before a publish and before an append returns) or whose
append was fenced stops serving writes at once: the journal fails, health turns NOT_SERVING
and ``kvservice serve`` exits 3; restarted, it comes back as a standby. A standby that fell
behind a compaction (JournalGap: its next entry was purged) recovers again from the newer
snapshot in place (``Journal.reload``); one that cannot replay an entry fail-stops the same way.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import nats.errors
from grpc_health.v1 import health_pb2
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvservice.contract.errors import KVError, StateError
from kvservice.contract.transport import EPOCH_METADATA, NODE_METADATA
from kvservice.manager.pools import BlockManager
from kvservice.server.app import SERVICE_NAME, RunningServer, serve
from kvservice.server.config import PoolConfig
from kvservice.server.leader_gate import LeaderGate
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.nats.journal import (
    Fenced,
    JournalGap,
    NatsConfig,
    NatsLink,
    NatsStore,
    StoreError,
    retry_startup,
)
from kvservice.state.nats.leader import Lease, LeaseConfig, LeaseLost
from kvservice.state.sqlite.store import DB_NAME, SqliteStore
from kvservice.state.startup import ensure_pools
from kvservice.state.stores import Entry

log = logging.getLogger("kvservice.server.ha")
#: Initial-metadata key of every reply of a replicated manager: the epoch of the leader that answered.
FENCE_ATTEMPTS = 20
#: Recoveries tried while a leader's compaction keeps overtaking the reader (each one reads a newer snapshot).
RECOVERY_ATTEMPTS = 5


@dataclass
class HAController:
    """Follows the journal while standby, takes the lease over, fences the stream, fail-stops on loss.

    set_serving(bool): flips the readiness health; on_failed(why): the journal failed (the server exits).
    """

    journal: Journal
    store: NatsStore
    lease: Lease
    gate: LeaderGate
    pools: Sequence[PoolConfig] = ()
    set_serving: Callable[[bool], None] = lambda _serving: None
    role: str = "standby"
    takeover_seconds: float = 0.0
    applied: int = 0
    lag_entries: int = 0
    reloads: int = 0                 # recoveries from a newer snapshot after a compaction overtook this standby
    failed: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.gate.leader_hint = self._leader_hint
        self.gate.valid = lambda: self.lease.remaining_seconds > 0
        self._measure_lag()                    # right from the start, not 0 until the first measurement
        self._thread = threading.Thread(target=self._follow, daemon=True, name="ha-standby")
        self._thread.start()

    def _leader_hint(self) -> str:
        h = self.lease.holder
        return f"{h.node} at {h.address or '?'} (epoch {h.epoch})" if h is not None else ""

    # ---- standby ------------------------------------------------------------------------------------
    def _follow(self) -> None:
        poll = self.lease.config.poll_seconds
        next_look = 0.0
        next_lag = 0.0
        read_at_lag = -1                       # the stream message read when the lag was last measured
        while not self._stop.is_set():
            try:
                batch = self.store.poll(min(poll, max(0.005, next_look - time.monotonic())))
                if batch:
                    self._apply(batch)
                if self.store.pending is not None:
                    self.lag_entries = self.store.pending        # as the server said with the last message
                now = time.monotonic()
                if now >= next_lag:
                    next_lag = now + 1.0
                    behind = self._measure_lag()
                    if behind and self.store.last_stream_seq == read_at_lag:
                        # Its consumer delivers nothing while the stream holds more: the NATS node that kept it
                        # (R1, in memory) restarted, and nats-py notices only after missed heartbeats. Read on
                        # with a new one now, so that a takeover does not find this standby behind.
                        log.warning("standby: no journal message for 1 s while %d behind; reading on with a new "
                                    "consumer", behind)
                        self.store.stop_reading()
                    read_at_lag = self.store.last_stream_seq
                if now >= next_look:
                    if self.lease.try_acquire():
                        self._take_over()
                        return
                    due = self.lease.take_due()        # the holder's TTL ends before the next poll: look then
                    next_look = now + poll if due is None else now + min(poll, due - self.lease.clock())
            except JournalGap as err:
                if not self._reload(err):
                    return
            except (StoreError, nats.errors.Error, OSError) as err:
                log.warning("standby: %s; retrying", getattr(err, "message", err))   # NATS unreachable for now
                self._stop.wait(poll)
            except KVError as err:
                self._fail(f"standby cannot follow the journal: {err.message}")
                return

    def _measure_lag(self) -> int | None:
        """Journal stream messages not applied yet (also the gauge); None if NATS did not answer."""
        try:
            self.lag_entries = max(0, self.store.stream_last_seq() - self.store.last_stream_seq)
        except StoreError as err:
            log.debug("standby lag not measured: %s", err.message)
            return None
        return self.lag_entries

    def _reload(self, gap: JournalGap) -> bool:
        """A compaction purged this standby's next entry: recover again from the newer snapshot. False: failed."""
        log.warning("standby fell behind a compaction (%s); recovering again from the newest snapshot", gap.message)
        for attempt in range(RECOVERY_ATTEMPTS):
            try:
                self.store.restart_reading()
                with self.journal.manager.events.transaction():
                    replayed = self.journal.reload()
            except JournalGap as err:         # overtaken again while reading: a newer snapshot still
                gap = err
                continue
            except (StoreError, nats.errors.Error, OSError) as err:
                log.warning("standby reload: %s; retrying", getattr(err, "message", err))
                self._stop.wait(self.lease.config.poll_seconds * (attempt + 1))
                continue
            except KVError as err:
                self._fail(f"standby cannot recover from the newer snapshot: {err.message}")
                return False
            self.reloads += 1
            log.warning("standby recovered again: snapshot at %d, %d entries replayed, position %d",
                        self.journal.snapshot_seq, replayed, self.journal.seq)
            return True
        self._fail(f"standby fell behind a compaction and could not recover again: {gap.message}")
        return False

    def _apply(self, entries: Iterable[Entry]) -> None:
        """Apply acknowledged entries; their KV event batches become visible at once, numbered as the leader's.

        The hub stages batches until a transaction ends (a leader shows them once durable); these
        entries are durable already, so the batches are committed here: the standby's rings hold the
        same sequence numbers and events as the leader's, and WatchEvents resumes on it after a takeover.
        """
        with self.journal.manager.events.transaction():
            self.applied += self.journal.follow(entries)

    # ---- takeover -------------------------------------------------------------------------------------
    def _take_over(self) -> None:
        t0 = time.monotonic()
        phases: list[tuple[str, float]] = []           # where the takeover's time went, for its log line

        def lap(name: str) -> None:
            phases.append((name, time.monotonic() - t0 - sum(s for _, s in phases)))
        self.role = "taking over"
        self.lease.start_renewing(0, self._lost)
        lapse = self.lease.config.lapse_seconds
        try:
            self.store.guard = lambda: self.lease.wait_valid(lapse)   # waits through a lapse, raises once lost
            self.store.readonly = False        # it may fence now; it appends only once fenced (epoch > 0)
            # the next snapshot is due after the store's newest, not ours: listed while the stream is read and fenced
            pool = ThreadPoolExecutor(1, thread_name_prefix="ha-listing")
            listing = pool.submit(self.store.newest_snapshot_seq)
            pool.shutdown(wait=False)
            epoch = self._fence(lap)
            self.store.stop_reading()
            lap("unsubscribe")
            try:
                self.journal.snapshot_stored(listing.result())
            except StoreError as err:
                log.warning("newest snapshot not listed at takeover (%s); the next one is due early", err.message)
            lap("snapshots listed")
            self.lease.epoch = epoch
            self.journal.incarnation = epoch        # replies carry (epoch, seq) as their journal position
            self.lease.wait_valid(lapse)
            lap("lease valid")
        except (KVError, OSError) as err:
            self.lease.lose(f"takeover failed: {getattr(err, 'message', err)}")
            self._fail(f"takeover failed: {getattr(err, 'message', err)}")
            return
        _refresh_worker_leases(self.journal.manager)
        self.gate.promote(epoch)
        self.role = "leader"
        try:
            ensure_pools(self.journal, list(self.pools))
        except KVError as err:
            log.error("configured pools not created after takeover: %s", err.message)
        self.set_serving(True)
        lap("serving")
        self.takeover_seconds = time.monotonic() - t0
        log.info("leader now: epoch %d at journal position %d (takeover %.3f s: %s)", epoch, self.journal.seq,
                 self.takeover_seconds, ", ".join(f"{name} {s:.3f}" for name, s in phases))

    def _fence(self, lap: Callable[[str], None] = lambda _name: None) -> int:
        """Read to the end of the stream and fence it with the next epoch; again if the old leader wrote meanwhile."""
        for _ in range(FENCE_ATTEMPTS):
            try:
                self._apply(self.store.catch_up())
                lap("caught up")
            except JournalGap as err:         # overtaken by the old leader's last compaction: reload, read on
                if not self._reload(err):
                    raise StoreError(f"takeover: {self.failed}") from None
                continue
            seen = self.lease.holder.epoch if self.lease.holder is not None else 0
            epoch = max(self.store.max_epoch, seen) + 1
            try:
                self.store.fence(epoch)
                lap("fenced")
                return epoch
            except Fenced:
                log.warning("the journal moved while fencing epoch %d; reading on", epoch)
        raise StoreError(f"could not fence the journal in {FENCE_ATTEMPTS} attempts: another writer keeps appending")

    # ---- losing it ----------------------------------------------------------------------------------------
    def _lost(self, why: str) -> None:
        self.gate.depose(f"leadership lost: {why}")
        self._fail(f"leadership lost: {why}")

    def journal_failed(self, why: str) -> None:
        """The journal failed (a fenced or failed append): stop renewing so the standby takes over."""
        self.gate.depose(why)
        self.lease.lose(f"journal failed: {why}")
        self.role = "failed"
        self.failed = self.failed or why

    def _fail(self, why: str) -> None:
        self.role, self.failed = "failed", self.failed or why
        self.set_serving(False)
        self.journal._fail(why)         # fail-stop: `kvservice serve` exits 3 and is restarted as a standby

    def stop(self) -> None:
        """Stop following; a leader releases its key so the standby takes over at once (after a final snapshot)."""
        self._stop.set()
        self.gate.depose("shutting down")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)

    def release(self) -> None:
        self.lease.release()


def _refresh_worker_leases(manager: BlockManager) -> None:
    """At takeover every worker record gets a fresh lease start, as after a restart (docs/DURABILITY.md).

    Heartbeats are not journaled, so a standby never saw them (and a scrape of its metrics may
    have swept records dead). A live worker's next heartbeat, with the epoch it holds, succeeds;
    one that died meanwhile is marked dead one lease later.
    """
    reg = manager.workers
    now = reg._clock()               # WorkerRegistry has no public restore hook yet (as journal.load_manager)
    with reg._lock:
        for wid, rec in reg._workers.items():
            reg._workers[wid] = replace(rec, last_heartbeat=now, alive=True)


class HACollector:
    """kvservice_leader*, kvservice_lease_*, kvservice_standby_* series, read at scrape time."""

    def __init__(self, ha: HAController) -> None:
        self.ha = ha

    def collect(self) -> Iterator[Metric]:
        ha, lease, store = self.ha, self.ha.lease, self.ha.store
        yield GaugeMetricFamily("kvservice_leader", "1 while this manager is the leader (serves requests), else 0.",
                                value=1.0 if ha.role == "leader" and lease.held else 0.0)
        yield GaugeMetricFamily("kvservice_leader_epoch", "Epoch of the current leader as this manager knows it "
                                "(its own while it leads; the highest fenced one while standby).",
                                value=float(max(store.max_epoch, store.epoch)))
        yield GaugeMetricFamily("kvservice_lease_remaining_seconds", "Seconds left on this leader's lease "
                                "(0 on a standby).", value=lease.remaining_seconds)
        yield CounterMetricFamily("kvservice_lease_renewals_total", "Successful renewals of the leader lease.",
                                  value=lease.renewals)
        yield CounterMetricFamily("kvservice_lease_renew_failures_total", "Lease renewals that failed "
                                  "(timeout or NATS error; the lease lapses if they go on for a TTL).",
                                  value=lease.renew_failures)
        yield GaugeMetricFamily("kvservice_standby_lag_entries", "Journal stream messages the standby has not "
                                "applied yet (replication lag; 0 on the leader).",
                                value=float(ha.lag_entries if ha.role == "standby" else 0))
        yield CounterMetricFamily("kvservice_standby_reloads_total", "Times this standby recovered again from a "
                                  "newer snapshot because a compaction purged the entries it was to apply.",
                                  value=ha.reloads)
        yield CounterMetricFamily("kvservice_standby_applied_total", "Journal entries this manager applied while "
                                  "following the leader.", value=ha.applied)
        yield GaugeMetricFamily("kvservice_takeover_seconds", "How long this manager's takeover took (lease won "
                                "to serving); 0 if it never took over.", value=ha.takeover_seconds)
        yield CounterMetricFamily("kvservice_journal_append_retries_total", "Journal publishes retried after a "
                                  "timeout or a missing stream leader.", value=store.append_retries)
        yield CounterMetricFamily("kvservice_nats_disconnects_total", "Times the NATS connection dropped "
                                  "(the client reconnects to another server).", value=store.link.disconnects)


def default_node_id() -> str:
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}-{os.getpid()}"


def open_journal(config: NatsConfig, lease_seconds: float = 10.0, journal_config: JournalConfig | None = None,
                 readonly: bool = True, link: NatsLink | None = None, startup_seconds: float = 60.0) -> Journal:
    """Recover the replicated state (newest snapshot + journal tail) into a fresh manager.

    NATS errors (a stream or bucket being created by another manager started at the same time, a
    stream leader being elected) are retried for up to startup_seconds; damaged state is not.

    readonly: inspection (kvservice check-state nats://...): nothing is written. A standby opens
    it the same way, and its store turns writable only after it won the lease and fenced.
    """
    own = link is None
    link = link or NatsLink(config, client_name="kvservice-inspect" if readonly else "kvservice")
    try:
        for attempt in range(RECOVERY_ATTEMPTS):
            try:
                journal = retry_startup("recovering the replicated state", lambda: Journal.recover(
                    NatsStore(link, readonly=True, create=not readonly), lease_seconds, journal_config),
                    startup_seconds)
                break
            except JournalGap as err:       # the leader compacted while we read: a newer snapshot holds it all
                if attempt + 1 == RECOVERY_ATTEMPTS:
                    raise
                log.info("recovering again: %s", err.message)
        journal.store.owns_link = own
    except BaseException:
        if own:
            link.close()
        raise
    return journal


def open_sole_writer(config: NatsConfig, journal_config: JournalConfig | None = None, lease_seconds: float = 10.0,
                     epoch: int = 0) -> Journal:
    """Recover the replicated state and fence the stream as its only writer, *without* a lease.

    For tools run while no manager runs (kvservice import-state) and for tests. A manager that
    takes the lease later fences this writer out in turn. epoch: at least this epoch.
    """
    link = NatsLink(config, client_name="kvservice-tool")
    try:
        store = NatsStore(link, owns_link=True)
        journal = Journal.recover(store, lease_seconds, journal_config)
        store.stop_reading()
        store.fence(max(store.max_epoch + 1, epoch))
        journal.incarnation = store.incarnation
    except BaseException:
        link.close()
        raise
    return journal


def export_state(config: NatsConfig, state_dir: str | Path) -> Journal:
    """Recover the replicated state read-only and write it as the snapshot of a new SQLite state dir.

    The dir is a backup (copy it anywhere) and a valid `--state-dir` / `check-state` argument.
    Returns the recovered journal (closed). Refuses a dir that already holds kvservice state.
    """
    src = open_journal(config, readonly=True)
    try:
        path = Path(state_dir)
        if (path / DB_NAME).exists():
            raise StateError(f"{path} already holds kvservice state; export into a new dir")
        path.mkdir(parents=True, exist_ok=True)
        dst = SqliteStore.open(path, sync="full")
        try:
            dst.lineage = src.lineage                       # a backup continues the history it copies
            dst.begin(src.seq)
            src.snapshot_to(dst)
        finally:
            dst.close(clean=True, seq=src.seq)
    finally:
        src.close(snapshot=False)
    return src


def import_state(state_dir: str | Path, config: NatsConfig, epoch: int = 1) -> tuple[int, int]:
    """Write the state of a SQLite state dir as the snapshot of a new replicated deployment; (position, epoch).

    For a deployment name that holds nothing yet: a restore after NATS lost its data, or the move
    of a single manager to replication. No manager may run on that name meanwhile (this fences
    the stream without a lease). epoch: the epoch the managers continue from; above any epoch
    clients and workers have seen, or they refuse the new leader until restarted.
    """
    src = Journal.open(state_dir, readonly=True)
    link = NatsLink(config, client_name="kvservice-import")
    try:
        store = NatsStore(link)
        if store.stream_last_seq() > 0 or store.last_snapshot() is not None:
            raise StateError(f"{store.path} already holds a journal; import into a fresh --nats-name "
                             "(docs/operations.md, 'Restore from a snapshot')")
        store.seq = src.seq
        store.lineage = src.lineage                         # the deployment continues the state dir's history
        store.fence(max(1, epoch))
        src.snapshot_to(store)
        return src.seq, store.epoch
    finally:
        src.close(snapshot=False)
        link.close()


def serve_ha(config: NatsConfig, lease_config: LeaseConfig, listen: str, pools: Sequence[PoolConfig] = (),
             node: str | None = None, advertise: str = "", journal_config: JournalConfig | None = None,
             lease_seconds: float = 10.0, **serve_kwargs: Any) -> tuple[RunningServer, HAController]:
    """Start a replicated manager: recover, serve as a standby, follow, take over when the lease is free.

    serve_kwargs go to server.serve (tls, tokens, limits, metrics_port, ...). Stop it with
    `stop_ha(running, ha)`.
    """
    node = node or default_node_id()
    link = NatsLink(config, client_name=f"kvservice-{node}")
    try:
        journal = open_journal(config, lease_seconds, journal_config, readonly=False, link=link)
        assert isinstance(journal.store, NatsStore)
        lease = retry_startup("opening the leader lease bucket", lambda: Lease(link, lease_config, node, advertise))
    except BaseException:
        link.close()
        raise
    gate = LeaderGate()
    gate.node = node
    extra = list(serve_kwargs.pop("interceptors", ()))
    running = serve(listen, journal=journal, interceptors=[*extra, gate], serving=False, **serve_kwargs)
    if not advertise:
        lease.address = f"{listen.rsplit(':', 1)[0]}:{running.port}"

    def set_serving(on: bool) -> None:
        if running.health is not None and not running.failed.is_set():
            running.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if on
                               else health_pb2.HealthCheckResponse.NOT_SERVING)

    ha = HAController(journal, journal.store, lease, gate, pools, set_serving)
    previous = journal.on_fail

    def on_fail(why: str) -> None:
        ha.journal_failed(why)
        if previous is not None:
            previous(why)
    journal.on_fail = on_fail
    running.metrics.registry.register(HACollector(ha))
    ha.start()
    log.info("manager %s: standby of %s (journal position %d), lease %g s", node, config.url, journal.seq,
             lease_config.ttl_seconds)
    return running, ha


def stop_ha(running: RunningServer, ha: HAController, grace: float = 2.0) -> None:
    """Stop serving and following; a healthy leader snapshots, then releases the key (fast planned failover)."""
    ha.stop()
    running.stop(grace)               # snapshot (leader only: a standby's store is read-only) and close the journal
    ha.release()
    ha.store.link.close()


__all__ = ["EPOCH_METADATA", "NODE_METADATA", "HACollector", "HAController", "LeaderGate", "LeaseLost", "export_state",
           "import_state", "open_journal", "open_sole_writer", "serve_ha", "stop_ha"]
