"""kvservice/server/ha.py: HAController._fence's result and phases, and HACollector's help texts, on a real
nats-server on loopback (tests/natsutil.py: skipped where it is not installed, failing under CI=true).

Oracles: the module docstring's takeover rule (fence with ``highest epoch seen + 1``), the phases _take_over's log
line names, and the Prometheus convention the other series of the project keep (a help text is a sentence).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvservice.state.journal import JournalConfig
from tests.clocks import ManualClock, until


def _controller(nats1, epoch: int):
    from kvservice.server.ha import HAController, LeaderGate, open_sole_writer
    from kvservice.state.nats.journal import NatsConfig
    from kvservice.state.nats.leader import Lease, LeaseConfig

    config = NatsConfig(tuple(nats1.urls), name="h" + uuid.uuid4().hex[:10])
    j = open_sole_writer(config, journal_config=JournalConfig(sync="normal", compact_every=1000,
                                                               background_snapshots=False),
                         lease_seconds=24 * 3600.0, epoch=epoch)
    lease = Lease(j.store.link, LeaseConfig(), "node-" + uuid.uuid4().hex[:6], "127.0.0.1:1")
    return j, HAController(j, j.store, lease, LeaderGate())


def test_fence_takes_the_next_epoch_above_the_highest_seen_and_names_its_phases(nats1) -> None:
    epoch = int(np.random.default_rng(41).integers(2, 50))
    j, ha = _controller(nats1, epoch)
    try:
        assert ha.store.max_epoch == epoch
        laps: list[str] = []
        assert ha._fence(laps.append) == epoch + 1
        assert laps == ["caught up", "fenced"]
        assert (ha.store.epoch, ha.store.max_epoch) == (epoch + 1, epoch + 1)
        assert ha._fence() == epoch + 2                       # the default lap: none recorded, fenced again
        assert ha.store.max_epoch == epoch + 2
    finally:
        j.close(snapshot=False)


def test_every_ha_series_has_a_help_sentence(nats1) -> None:
    from kvservice.server.ha import HACollector

    j, ha = _controller(nats1, 3)
    try:
        reg = CollectorRegistry()
        reg.register(HACollector(ha))
        helps = [ln.split(" ", 3)[3] for ln in generate_latest(reg).decode().splitlines() if ln.startswith("# HELP ")]
        assert len(helps) == 11
        bad = [h for h in helps if not (h[0].isupper() or h[0].isdigit()) or not h.endswith(".")]
        assert bad == []
    finally:
        j.close(snapshot=False)


def test_leader_hint_names_the_holder_its_address_and_epoch(nats1) -> None:
    from kvservice.state.nats.leader import Holder

    j, ha = _controller(nats1, 2)
    try:
        assert ha._leader_hint() == ""                           # no holder seen yet
        ha.lease.holder = Holder("mgr-b", "10.1.2.3:50051", 9, 4)
        assert ha._leader_hint() == "mgr-b at 10.1.2.3:50051 (epoch 9)"
        ha.lease.holder = Holder("mgr-c", "", 11, 5)
        assert ha._leader_hint() == "mgr-c at ? (epoch 11)"
    finally:
        j.close(snapshot=False)


def test_the_leader_gauge_is_one_only_while_leading_with_the_lease_held(nats1) -> None:
    from kvservice.server.ha import HACollector

    j, ha = _controller(nats1, 4)
    try:
        reg = CollectorRegistry()
        reg.register(HACollector(ha))
        ha.lag_entries = 17
        for role, held, want, lag in (("standby", True, 0.0, 17.0), ("leader", True, 1.0, 0.0),
                                      ("leader", False, 0.0, 0.0), ("failed", True, 0.0, 0.0)):
            ha.role, ha.lease.held = role, held
            assert (reg.get_sample_value("kvservice_leader"), reg.get_sample_value("kvservice_standby_lag_entries")) \
                == (want, lag), role
    finally:
        ha.lease.held = False
        j.close(snapshot=False)


def test_a_takeover_gives_every_worker_record_a_fresh_lease_and_changes_nothing_else() -> None:
    """docs/DURABILITY.md: at takeover every worker record gets a fresh lease start, as after a restart."""
    from kvservice.manager.pools import BlockManager
    from kvservice.manager.workers import WorkerRegistry
    from kvservice.server.ha import _refresh_worker_leases

    rng = np.random.default_rng(13)
    clock = ManualClock(100.0)
    m = BlockManager()
    m.workers = reg = WorkerRegistry(5.0, clock)
    ids = [f"w{i}" for i in range(4)]
    for i, wid in enumerate(ids):
        clock.now += float(rng.uniform(0.5, 2))
        reg.register(wid, "p", 8, tp_rank=i % 2, tp_size=2, address=f"10.0.0.{i}:9")
    before = {r.worker_id: r for r in reg.workers()}
    clock.now += 50.0                                          # every lease lapsed: all swept dead
    assert [r.alive for r in reg.workers()] == [False] * 4
    clock.now += float(rng.uniform(1, 3))
    _refresh_worker_leases(m)
    after = {r.worker_id: r for r in reg.workers()}
    assert sorted(after) == ids
    for wid in ids:
        a, b = after[wid], before[wid]
        assert (a.last_heartbeat, a.alive) == (clock.now, True)
        assert (a.pool, a.epoch, a.tp_rank, a.address, a.layer_end) == (b.pool, b.epoch, b.tp_rank, b.address, 8)
    reg.heartbeat("w2", before["w2"].epoch, "p")              # a live worker's next heartbeat succeeds


def test_a_takeover_fences_the_next_epoch_promotes_creates_the_pools_and_serves(nats1, caplog) -> None:
    """Module docstring: the lease won, read to the end and fence ``highest epoch seen + 1``; then serve with that
    epoch (the gate's, the lease's, the journal position's incarnation); configured pools missing are created."""
    import logging
    import re

    from kvservice.server.config import load_pools

    epoch = int(np.random.default_rng(43).integers(2, 30))
    j, ha = _controller(nats1, epoch)
    serving: list[bool] = []
    ha.set_serving = serving.append
    ha.pools = load_pools("pools:\n  - name: tk\n    layers: [{kv_heads: 2, head_dim: 8}]\n"
                          "    sizing: {num_slots: 16}\n")
    try:
        assert ha.lease.try_acquire()
        with caplog.at_level(logging.INFO, logger="kvservice.server.ha"):
            ha._take_over()
        assert ha.failed is None and ha.role == "leader" and serving == [True]
        assert (ha.gate.leader, ha.gate.epoch, ha.lease.epoch, ha.journal.incarnation) == (True,) + (epoch + 1,) * 3
        assert ha.store.max_epoch == epoch + 1
        assert ha.journal.manager.pool_names() == ["tk"]
        assert ha.takeover_seconds > 0
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("leader now")]
        m = re.fullmatch(rf"leader now: epoch {epoch + 1} at journal position (\d+) \(takeover [0-9.]+ s: (.*)\)", line)
        assert m is not None, line
        assert int(m.group(1)) == ha.journal.seq
        phases = [p.rsplit(" ", 1) for p in m.group(2).split(", ")]
        assert [name for name, _ in phases] == [
            "caught up", "fenced", "unsubscribe", "snapshots listed", "lease valid", "serving"]
        # the phases split the takeover's time: each its own share (rounded to 0.5 ms), together no more than all
        assert all(float(s) >= 0 for _, s in phases)
        assert sum(float(s) for _, s in phases) <= ha.takeover_seconds + 0.0005 * len(phases)
    finally:
        ha.stop()
        ha.release()
        j.close(snapshot=False)


def test_a_failure_turns_readiness_off_fails_the_journal_and_keeps_the_first_reason(nats1) -> None:
    """Module docstring, fail-stop: health turns NOT_SERVING and the journal fails (kvservice serve exits 3)."""
    from kvservice.contract.errors import JournalUnavailable

    j, ha = _controller(nats1, 2)
    serving: list[bool] = []
    ha.set_serving = serving.append
    try:
        ha._fail("first reason")
        ha._fail("second reason")
        assert (ha.role, ha.failed, serving) == ("failed", "first reason", [False, False])
        assert j.failed
        with pytest.raises(JournalUnavailable):
            j.execute("DeletePool", __import__("kvservice.v1.block_manager_pb2", fromlist=["x"]).DeletePoolRequest(
                pool="p"), lambda r: r)
    finally:
        j.close(snapshot=False)


def test_start_follows_in_a_daemon_thread_and_hooks_the_gate(nats1) -> None:
    """A standby follows in a daemon thread (a hung NATS call never keeps the process alive); the gate names the
    leader through the lease and is valid only while this manager holds a lease with time left."""
    from kvservice.state.nats.leader import Holder

    j, ha = _controller(nats1, 2)
    ha.lease.try_acquire = lambda: False                  # stay a standby: this test is about following
    try:
        ha.start()
        assert ha._thread is not None and ha._thread.daemon and ha._thread.name == "ha-standby"
        assert ha._thread.is_alive() and ha.lag_entries == 0
        ha.lease.holder = Holder("mgr-z", "10.9.8.7:1", 5, 1)
        assert ha.gate.leader_hint() == "mgr-z at 10.9.8.7:1 (epoch 5)"
        assert ha.gate.valid() is False
    finally:
        ha.stop()
        j.close(snapshot=False)
    assert not ha._thread.is_alive()


def test_import_state_refuses_a_deployment_that_already_holds_entries(nats1, tmp_path) -> None:
    from kvservice.client.codec import create_pool_request
    from kvservice.contract.errors import StateError
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.server.ha import export_state, import_state
    from kvservice.state.nats.journal import NatsLink, NatsStore

    j, _ha = _controller(nats1, 1)
    config = j.store.link.config
    req = create_pool_request("p", CacheSpec.uniform(2, 2, 8, "float16", 4), Sizing(num_slots=8))
    j.execute("CreatePool", req, j.api.CreatePool)
    j.close(snapshot=False)
    link = NatsLink(config, client_name="kvservice-test")
    try:
        store = NatsStore(link)
        assert store.stream_last_seq() > 0 and store.last_snapshot() is None      # entries, and no snapshot
    finally:
        link.close()
    export_state(config, tmp_path / "sd")
    with pytest.raises(StateError) as err:
        import_state(tmp_path / "sd", config)
    assert err.value.message.endswith(" already holds a journal; import into a fresh --nats-name "
                                      "(docs/operations.md, 'Restore from a snapshot')")


def test_a_standby_overtaken_by_every_recovery_fails_after_the_attempts_naming_the_last_gap(nats1) -> None:
    """_reload: a compaction that overtakes each of RECOVERY_ATTEMPTS recoveries (a JournalGap every time: a fault
    injected in Journal.reload) fail-stops the standby; False tells the follower to stop."""
    from kvservice.server.ha import RECOVERY_ATTEMPTS, HAController, LeaderGate, open_journal
    from kvservice.state.nats.journal import JournalGap
    from kvservice.state.nats.leader import Lease, LeaseConfig

    writer, _ = _controller(nats1, 2)
    config = writer.store.link.config
    writer.close(snapshot=False)
    j = open_journal(config, 24 * 3600.0, JournalConfig(sync="normal", compact_every=1000,
                                                         background_snapshots=False))     # a standby's journal
    ha = HAController(j, j.store, Lease(j.store.link, LeaseConfig(), "node-s", "127.0.0.1:1"), LeaderGate())
    tries: list[int] = []

    def overtaken() -> int:
        tries.append(1)
        raise JournalGap(f"entry {100 + len(tries)} was purged")
    j.reload = overtaken
    try:
        assert ha._reload(JournalGap("entry 100 was purged")) is False
        assert len(tries) == RECOVERY_ATTEMPTS and ha.reloads == 0
        assert ha.role == "failed"
        assert ha.failed == (f"standby fell behind a compaction and could not recover again: entry "
                             f"{100 + RECOVERY_ATTEMPTS} was purged")
    finally:
        j.close(snapshot=False)


def test_a_served_standby_takes_over_names_its_nats_connection_and_readiness_follows_the_role(nats1) -> None:
    """serve_ha: the manager connects as "kvservice-<node>"; readiness (health of the BlockManager service) turns
    SERVING once it leads, NOT_SERVING when told; once the process failed, nothing turns it back on."""
    import json
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvservice.server.app import SERVICE_NAME
    from kvservice.server.ha import serve_ha, stop_ha
    from kvservice.state.nats.journal import NatsConfig
    from kvservice.state.nats.leader import LeaseConfig

    def names() -> set[str]:
        with urllib.request.urlopen(f"{nats1.monitor}/connz?limit=1024", timeout=10) as r:
            return {c.get("name", "") for c in json.load(r)["connections"] or ()}

    node = "mgr-" + uuid.uuid4().hex[:6]
    config = NatsConfig(tuple(nats1.urls), name="h" + uuid.uuid4().hex[:10])
    running, ha = serve_ha(config, LeaseConfig(), "127.0.0.1:0", node=node, lease_seconds=24 * 3600.0)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    health = health_pb2_grpc.HealthStub(channel)

    def status() -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10).status
    try:
        assert f"kvservice-{node}" in names()
        assert until(lambda: ha.role == "leader")
        assert status() == health_pb2.HealthCheckResponse.SERVING
        ha.set_serving(False)
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        running.failed.set()                          # the process is failing: readiness may not come back
        ha.set_serving(True)
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        channel.close()
        stop_ha(running, ha)
