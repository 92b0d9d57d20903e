"""Replicated managers on real nats-server processes: leases, takeover, kill -9 loops, a paused leader, NATS node loss.

Every test runs its own deployment name (stream and buckets) on a NATS cluster started for
the module on loopback ports chosen at start; fixtures stop every process they start.
Timings are never asserted (the failover figures are in bench/results/ha.md); what is
asserted: who may write, what was acknowledged, what was recovered.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.client import ClientError
from kvservice.client.aio_ha import AsyncLeaderClient
from kvservice.client.client import BlockManagerClient, RetryPolicy
from kvservice.client.deadline import RETRY_CODES
from kvservice.client.ha import LeaderClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.server.app import SERVICE_NAME, serve
from kvservice.server.ha import open_journal, serve_ha, stop_ha
from kvservice.server.leader_gate import LeaderGate
from kvservice.state.nats.journal import NatsConfig, NatsLink, NatsStore, retry_startup
from kvservice.state.nats.leader import Lease, LeaseConfig, LeaseLapsed, LeaseLost
from kvservice.state.tree import state_tree
from tests.clocks import ManualClock

from ..deploy.support import REPLICATED_METRICS, sample_names
from ..natsutil import NatsCluster, require_nats_server
from .ha_harness import HASystem, cluster_leader_node, epoch_of, kill_loop, pause_leader

pytestmark = pytest.mark.integration
TEST_LEASE = ("--leader-ttl", "1.0", "--leader-renew", "0.25", "--compact-every", "200")


@pytest.fixture(scope="module")
def nats3(tmp_path_factory):
    require_nats_server()
    cluster = NatsCluster(tmp_path_factory.mktemp("nats3"), 3).start()
    yield cluster
    cluster.stop()


def fresh_name() -> str:
    return "t" + uuid.uuid4().hex[:10]




# ---- the lease ----------------------------------------------------------------------------------------

def test_lease_is_taken_by_compare_and_set_only_after_a_silent_ttl(nats3):
    config = NatsConfig(tuple(nats3.urls), name=fresh_name(), replicas=3)
    lc = LeaseConfig(ttl_seconds=6.0, renew_seconds=0.05, poll_seconds=0.1, margin_seconds=0.5)
    links = [NatsLink(config) for _ in range(3)]
    clocks = [ManualClock(1000.0) for _ in range(3)]
    try:
        a, b, c = (retry_startup("opening the lease", lambda link=link, clk=clk, n=n:   # as serve_ha opens it
                                 Lease(link, lc, n, f"addr-{n}", clock=clk), seconds=30)
                   for link, clk, n in zip(links, clocks, "abc", strict=True))
        assert a.try_acquire()                           # absent: created
        assert a.take_due() is None                      # it holds the key: nothing to wait for
        assert not b.try_acquire()                       # first sight of a's revision starts b's timer...
        assert b.take_due() == 1000.0 + 6.0              # ...and b looks again exactly when it ends
        clocks[1].now += 5.9
        assert not b.try_acquire() and b.holder.node == "a" and b.take_due() == 1006.0
        a.check()                                         # a's own bound is sent + ttl - margin
        clocks[1].now += 0.2                              # 6.1 s of the same revision: b takes it by CAS
        assert b.try_acquire() and b.held
        assert not c.try_acquire() and c.holder.node == "b"
        lost = threading.Event()                          # a never noticed (paused, say); its renewal is refused
        a.start_renewing(1, lambda why: lost.set())
        assert lost.wait(10) and "another manager holds the leader key" in a.lost
        with pytest.raises(LeaseLost):
            a.check()
        b.release()                                       # a clean stop deletes the key by CAS...
        assert c.try_acquire()                            # ...so a standby takes it at once
        c.check()
        clocks[2].now += 6.0 - 0.5                        # no renewal yet (fake clock): c's bound passes
        with pytest.raises(LeaseLapsed, match="lapsed"):  # lapsed: it must not acknowledge...
            c.check()
        with pytest.raises(LeaseLapsed):
            c.wait_valid(0.2)
        assert c.held and c.lost is None                  # ...but nobody took the key: a renewal resumes it
        c.start_renewing(3, lambda why: lost.set())
        c.wait_valid(10)
        assert c.renewals >= 1 and c.remaining_seconds > 5.0
    finally:
        for link in links:
            link.close()


def test_lease_config_refuses_a_renewal_too_close_to_the_ttl():
    with pytest.raises(Exception, match="ttl/3"):
        LeaseConfig(ttl_seconds=1.0, renew_seconds=0.5)


# ---- a standby follows, refuses, takes over ------------------------------------------------------------

def test_standby_follows_refuses_and_takes_over_when_the_leader_stops(nats3, caplog):
    config = NatsConfig(tuple(nats3.urls), name=fresh_name(), replicas=3)
    lc = LeaseConfig(ttl_seconds=1.0, renew_seconds=0.25, poll_seconds=0.05, margin_seconds=0.1)
    a, ha_a = serve_ha(config, lc, "127.0.0.1:0", node="a")
    b = ha_b = None
    a_stopped = False
    try:
        with LeaderClient([f"127.0.0.1:{a.port}"], timeout=5, failover=60) as c:
            c.create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=256, max_seq_len=512))
            for i in range(1, 31):
                c.step("p", admit=[i], admit_tokens=[int(i * 7 % 90) + 1])
            epoch_a = c.epoch
        assert epoch_a >= 1 and ha_a.role == "leader"
        b, ha_b = serve_ha(config, lc, "127.0.0.1:0", node="b")
        target_b = f"127.0.0.1:{b.port}"
        with LeaderClient([f"127.0.0.1:{a.port}"], timeout=5, failover=60) as c:
            for i in range(1, 31):
                c.step("p", extend=[i], extend_tokens=3)
        deadline = time.monotonic() + 20
        while ha_b.journal.seq < ha_a.journal.seq and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ha_b.journal.seq == ha_a.journal.seq                 # hot: it follows the stream
        assert state_tree(b.manager) == state_tree(a.manager)
        # its consumer gone (the NATS node that kept it restarted): it reads on with a new one by itself
        gone = ha_b.store._sub._consumer
        link = ha_b.store.link
        link.call(link.js.delete_consumer(config.stream, gone), 10)
        with caplog.at_level(logging.WARNING, logger="kvservice.server.ha"), \
                LeaderClient([f"127.0.0.1:{a.port}"], timeout=5, failover=60) as c:
            for i in range(1, 31):
                c.step("p", extend=[i], extend_tokens=1)
            deadline = time.monotonic() + 60
            while ha_b.journal.seq < ha_a.journal.seq and time.monotonic() < deadline:
                time.sleep(0.02)
        assert ha_b.journal.seq == ha_a.journal.seq and "reading on with a new consumer" in caplog.text
        assert ha_b.store._sub._consumer != gone and state_tree(b.manager) == state_tree(a.manager)
        scraped = {name: _series(r) for name, r in (("a", a), ("b", b))}
        for r in scraped.values():                                    # what dashboards and alerts use
            assert sample_names(REPLICATED_METRICS) <= r["names"]
        assert scraped["a"]["kvservice_leader"] == 1.0 and scraped["b"]["kvservice_leader"] == 0.0
        assert scraped["b"]["kvservice_leader_epoch"] == float(epoch_a)
        with grpc.insecure_channel(target_b) as ch:                  # a standby is not ready, but alive
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        with BlockManagerClient(target_b, retries=0) as direct:
            with pytest.raises(ClientError) as exc:
                direct.get_pool("p")
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE and "the leader is a at 127.0.0.1" in exc.value.message
        before = state_tree(a.manager)
        stop_ha(a, ha_a)                                             # clean stop: snapshot, key released
        a_stopped = True
        with LeaderClient([target_b], timeout=5, failover=60) as c:
            r = c.step("p", extend=[5], extend_tokens=1)
            assert c.epoch == epoch_a + 1
        assert r.num_tokens.tolist() == [5 * 7 % 90 + 1 + 3 + 1 + 1]
        assert ha_b.role == "leader"
        with b.manager.locked("p") as pool:
            assert pool.steps > 0
        after = state_tree(b.manager)
        assert after != before
        j = open_journal(config, readonly=True)                      # what a third manager would recover
        try:
            assert state_tree(j.manager) == after
        finally:
            j.close(snapshot=False)
    finally:
        if ha_b is not None:
            stop_ha(b, ha_b)
        if not a_stopped:
            stop_ha(a, ha_a)


def test_a_standby_overtaken_by_a_compaction_recovers_from_the_newer_snapshot(nats3):
    """The standby stops reading while the leader snapshots and purges past it (as while it was paused or cut
    off); when it reads again its next entry is gone: it recovers from the newer snapshot in place (before
    issue 20 it exited 3), its lag gauge is right at once, and it takes over with the leader's exact state."""
    from kvservice.state.journal import JournalConfig
    config = NatsConfig(tuple(nats3.urls), name=fresh_name(), replicas=3)
    lc = LeaseConfig(ttl_seconds=1.0, renew_seconds=0.25, poll_seconds=0.05, margin_seconds=0.1)
    jc = JournalConfig(compact_every=20)
    a, ha_a = serve_ha(config, lc, "127.0.0.1:0", node="a", journal_config=jc)
    b, ha_b = serve_ha(config, lc, "127.0.0.1:0", node="b", journal_config=jc)
    a_stopped = False
    try:
        with LeaderClient([f"127.0.0.1:{a.port}"], timeout=5, failover=60) as c:
            c.create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=256, max_seq_len=512))
            for i in range(1, 6):
                c.step("p", admit=[i], admit_tokens=[i])
            _wait_until(lambda: ha_b.journal.seq == ha_a.journal.seq)
            ha_b.stop()                                  # it stops reading (its subscription dropped)...
            ha_b.store.stop_reading()
            for i in range(6, 80):                       # ... while the leader snapshots and purges past it
                c.step("p", admit=[i], admit_tokens=[i % 40 + 1], free=[i - 5])
        assert ha_a.journal.wait_for_snapshot(30) and ha_a.journal.snapshots >= 2
        assert ha_a.store.newest_snapshot_seq() > ha_b.journal.seq + 1
        with ha_b.journal._lock:                         # the follower cannot move while we look
            ha_b._stop.clear()
            ha_b.start()
            lag = ha_b.lag_entries
        assert lag >= 74                                 # right from the start (it read 0 until measured)
        _wait_until(lambda: ha_b.journal.seq == ha_a.journal.seq)
        assert ha_b.reloads >= 1 and ha_b.failed is None and ha_b.role == "standby"
        assert ha_b.journal.replayed_entries <= jc.compact_every
        assert state_tree(b.manager) == state_tree(a.manager)
        _wait_until(lambda: ha_b.lag_entries == 0)
        stop_ha(a, ha_a)
        a_stopped = True
        with LeaderClient([f"127.0.0.1:{b.port}"], timeout=5, failover=60) as c:
            r = c.step("p", extend=[79], extend_tokens=1)
        assert r.num_tokens.tolist() == [79 % 40 + 1 + 1] and ha_b.role == "leader"
    finally:
        stop_ha(b, ha_b)
        if not a_stopped:
            stop_ha(a, ha_a)


def test_managers_started_together_on_a_fresh_deployment_all_come_up(nats3, tmp_path):
    """Three `kvservice serve` started at the same instant create the stream and buckets concurrently (the ha
    overlay's podManagementPolicy: Parallel): every one comes up (issue 20: one exited 2 in 5 of 8 trials), one
    leads, and they all answer."""
    from .ha_harness import ManagerSlot
    for _ in range(2):
        name = fresh_name()
        slots = [ManagerSlot(tmp_path / name, s, nats3.url, name, ("--nats-replicas", "3", *TEST_LEASE))
                 for s in "abc"]
        try:
            threads = [threading.Thread(target=s.start, args=(180.0,)) for s in slots]
            for t in threads:
                t.start()
            for t in threads:
                t.join(200)
            assert all(s.alive() for s in slots), "\n".join(s.log_tail() for s in slots)
            with LeaderClient([s.target for s in slots], timeout=5, failover=60) as c:
                c.create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=64, max_seq_len=256))
                leaders = [s.name for s in slots if epoch_of(s.target) is not None]
            assert len(leaders) == 1 and all(s.alive() for s in slots)
        finally:
            for s in slots:
                s.stop()


def test_a_timeout_says_which_call_and_after_how_long(nats3):
    import asyncio

    from kvservice.state.nats.journal import StoreError
    link = NatsLink(NatsConfig(tuple(nats3.urls), name=fresh_name()))
    try:
        async def slow() -> None:
            await asyncio.sleep(5)

        async def inner_timeout() -> None:
            await asyncio.sleep(0.2)
            raise TimeoutError("nats: timeout")
        with pytest.raises(StoreError, match=r"did not answer listing snapshots within 0\.3 s"):
            link.call(slow(), 0.3, "listing snapshots")
        with pytest.raises(StoreError, match=r"timed out reading the leader key after \d+\.\d\d s .*nats: timeout"):
            link.call(inner_timeout(), 30, "reading the leader key")
    finally:
        link.close()


def _wait_until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_appends_go_through_the_stream_leader_and_a_failed_one_moves_on_to_the_next_server(nats3):
    """The direct connection publishes through the stream's Raft leader (no forwarding hop); after a failure the
    retry goes to the next server in turn, as without the preference, and the leader is read again once it got
    through; an unknown name falls back to any server."""
    import socket
    from dataclasses import replace

    from kvservice.server.ha import open_sole_writer
    from kvservice.state.startup import create_request
    from kvservice.v1 import block_manager_pb2 as pb
    config = NatsConfig(tuple(nats3.urls), name=fresh_name(), replicas=3)
    link = NatsLink(config)
    try:
        NatsStore(link)                            # creates the R3 stream: one of the three servers leads it
        deadline = time.monotonic() + 30
        while (leader := link.call(link.js.stream_info(config.stream), 10).cluster.leader) is None:
            assert time.monotonic() < deadline, "the new stream has no leader"
            time.sleep(0.05)
    finally:
        link.close()
    name_of = {n.url: n.name for n in nats3.nodes}
    assert leader in name_of.values()
    urls = sorted(nats3.urls, key=lambda u: name_of[u] == leader)      # the leader last: not the first in turn
    journal = open_sole_writer(replace(config, servers=tuple(urls)), lease_seconds=3600)
    direct = journal.store.link.direct
    rng = np.random.default_rng(20)
    workers = [f"w{i}" for i in rng.permutation(9)]

    def register(worker: str) -> None:
        journal.execute("RegisterWorker", pb.RegisterWorkerRequest(worker_id=worker, pool="p", backend="cpu",
                                                                   address="127.0.0.1:1"),
                        journal.api.RegisterWorker)
    try:
        journal.execute("CreatePool", create_request("p", CacheSpec.uniform(2, 1, 64, page_size=16),
                                                     Sizing(num_slots=32, max_seq_len=256), ()),
                        journal.api.CreatePool)
        for w in workers[:3]:
            register(w)
        assert direct.server_name == leader and direct.connects == 2        # the fence went through urls[0]
        direct.close()                             # what the journal does after a publish that timed out
        register(workers[3])
        assert direct.server_name == name_of[urls[0]] != leader       # the next server in turn, not the preferred
        journal.store.prefer_stream_leader()
        register(workers[4])
        assert direct.server_name == leader
        direct.prefer("no-such-server")
        register(workers[5])
        assert direct.server_name in name_of.values() and direct._preferred is None
        journal.store.prefer_stream_leader()
        register(workers[6])
        assert direct.server_name == leader
        direct._sock.shutdown(socket.SHUT_RDWR)    # the connection breaks under the next publish: it is retried,
        register(workers[7])                       # on the next server, and the stream's leader is read again
        assert journal.store.append_retries == 1 and direct.server_name != leader
        deadline = time.monotonic() + 30
        while direct._preferred != leader:
            assert time.monotonic() < deadline, "the stream's leader was not read again after the retry"
            time.sleep(0.01)
        register(workers[8])
        assert direct.server_name == leader
        assert journal.seq == 10 and journal.failed is None
    finally:
        journal.close(snapshot=False)
    check = open_journal(config, lease_seconds=3600)   # every entry, whichever server took it, in the stream
    try:
        assert sorted(w.worker_id for w in check.manager.workers.workers()) == sorted(workers)
    finally:
        check.close(snapshot=False)


def test_workers_keep_their_epoch_across_a_takeover(nats3):
    from prometheus_client import generate_latest

    from kvservice.v1 import block_manager_pb2 as pb
    config = NatsConfig(tuple(nats3.urls), name=fresh_name(), replicas=3)
    lc = LeaseConfig(ttl_seconds=1.0, renew_seconds=0.25, poll_seconds=0.05, margin_seconds=0.1)
    a, ha_a = serve_ha(config, lc, "127.0.0.1:0", node="a", lease_seconds=2.0)
    b, ha_b = serve_ha(config, lc, "127.0.0.1:0", node="b", lease_seconds=2.0)
    stopped_a = False
    try:
        with LeaderClient([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], timeout=5, failover=60) as c:
            c.create_pool("w", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=64, max_seq_len=256))
            epoch = c.register_worker(pb.RegisterWorkerRequest(worker_id="w0", pool="w", backend="cpu")).epoch
            deadline = time.monotonic() + 20
            while ha_b.journal.seq < ha_a.journal.seq and time.monotonic() < deadline:
                time.sleep(0.02)
            for _ in range(2):
                time.sleep(1.2)
                c.heartbeat("w0", epoch)                      # the leader sees w0 beat; the standby does not
            generate_latest(b.metrics.registry)               # a scrape of the standby sweeps w0 dead there
            assert not next(w for w in b.manager.workers.workers() if w.worker_id == "w0").alive
            stop_ha(a, ha_a)                                  # planned handover
            stopped_a = True
            c.heartbeat("w0", epoch)                          # same epoch, on the new leader
            (w,) = c.workers("w")
            assert (w.worker_id, w.epoch, w.alive) == ("w0", epoch, True) and c.epoch == ha_b.store.epoch
    finally:
        stop_ha(b, ha_b)
        if not stopped_a:
            stop_ha(a, ha_a)


def _series(running) -> dict:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    out: dict = {"names": set()}
    for fam in text_string_to_metric_families(generate_latest(running.metrics.registry).decode()):
        for sample in fam.samples:
            out["names"].add(sample.name)
            out[sample.name] = sample.value
    return out


# ---- clients refuse a lower epoch ---------------------------------------------------------------------------

def test_client_refuses_replies_from_a_lower_epoch():
    gates = [LeaderGate(), LeaderGate()]
    servers = [serve(interceptors=[g]) for g in gates]
    targets = [f"127.0.0.1:{s.port}" for s in servers]
    try:
        gates[0].promote(5)
        with LeaderClient(targets, timeout=2, retry=RetryPolicy(attempts=6, initial_backoff=0.01,
                                                                max_backoff=0.02)) as c:
            assert c.echo(b"x") == b"x" and c.epoch == 5
            gates[0].depose("deposed in a test")
            gates[1].promote(3)                        # a manager of an older epoch answers now
            with pytest.raises(ClientError) as exc:
                c.echo(b"y")
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE
            assert c.stale_replies >= 1 and c.epoch == 5
            gates[1].promote(6)                        # the real successor
            assert c.echo(b"z") == b"z" and c.epoch == 6
    finally:
        for s in servers:
            s.stop(0)


# ---- kill -9 under load -------------------------------------------------------------------------------------

def test_kill9_of_the_leader_under_load_loses_and_repeats_no_step(nats3, tmp_path):
    name = fresh_name()
    system = HASystem(tmp_path, nats3.url, name, extra=("--nats-replicas", "3", *TEST_LEASE))
    system.start()
    try:
        takeovers = kill_loop(system, 20, np.random.default_rng(14), load_seconds=(0.2, 0.8))
        system.raise_loader_errors()
    finally:
        system.stop()
    assert len(takeovers) == 20
    bad = [t for t in takeovers if t.lost or t.duplicated]
    assert not bad, bad
    epochs = [t.new_epoch for t in takeovers]
    assert all(t.new_epoch > t.old_epoch for t in takeovers) and epochs == sorted(epochs)
    assert all(ld.client.stale_replies == 0 for ld in system.loaders)
    assert min(ld.acked for ld in system.loaders) > 20


# ---- a paused leader ------------------------------------------------------------------------------------------

def test_a_paused_leader_acknowledges_nothing_after_its_lease_lapsed(nats3, tmp_path):
    name = fresh_name()
    system = HASystem(tmp_path, nats3.url, name, extra=("--nats-replicas", "3", *TEST_LEASE))
    system.start()
    try:
        time.sleep(1.0)
        t_stop = time.monotonic()
        r = pause_leader(system)                 # SIGSTOP, a Step waits in its socket, takeover, SIGCONT
        assert not r.acknowledged and r.code == grpc.StatusCode.UNAVAILABLE
        assert r.exit_status == 3                # fail-stop
        assert (r.lost, r.duplicated) == (0, 0), r.problems
        system.raise_loader_errors()
        assert all(ld.client.stale_replies == 0 for ld in system.loaders)
        assert all(e > r.old_epoch for ld in system.loaders for at, e, _ in ld.acks
                   if at > t_stop + r.paused_seconds)
        # the stream: nothing of the old epoch after the new leader's fence
        assert_no_write_after_fence(NatsConfig(tuple(nats3.urls), name=name), r.old_epoch)
    finally:
        system.stop()


def assert_no_write_after_fence(config: NatsConfig, old_epoch: int) -> None:
    link = NatsLink(config)
    try:
        store = NatsStore(link, readonly=True, create=False)
        store.last_snapshot()                  # a snapshot of a newer leader covers (and purged) its fence
        seen_new_fence = store.max_epoch > old_epoch
        msgs = link.call(_all_messages(link, config), 30)
        for headers in msgs:
            kind, epoch = headers.get("Kvs-Kind"), int(headers.get("Kvs-Epoch", "0"))
            if kind == "fence" and epoch > old_epoch:
                seen_new_fence = True
            elif kind == "entry" and seen_new_fence:
                assert epoch > old_epoch, f"an entry of epoch {epoch} after the fence of a newer one"
        assert seen_new_fence
    finally:
        link.close()


async def _all_messages(link: NatsLink, config: NatsConfig) -> list[dict[str, str]]:
    from nats.js import api
    info = await link.js.stream_info(config.stream)
    out = []
    sub = await link.js.subscribe(config.subject, ordered_consumer=True, stream=config.stream,
                                  config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL))
    try:
        while len(out) < info.state.messages:
            msg = await sub.next_msg(timeout=5)
            out.append(dict(msg.headers or {}))
    finally:
        await sub.unsubscribe()
    return out


# ---- a NATS node dies ---------------------------------------------------------------------------------------

def test_a_nats_node_killed_mid_run_costs_no_step_and_no_failover(tmp_path):
    require_nats_server()
    cluster = NatsCluster(tmp_path / "nats", 3).start()
    system = HASystem(tmp_path / "managers", cluster.url, fresh_name(), extra=("--nats-replicas", "3", *TEST_LEASE))
    try:
        system.start()
        time.sleep(1.0)
        _, epoch = system.leader()
        victim = cluster_leader_node(cluster, system.nats_name)      # the worst one: it leads the journal
        t_kill = time.monotonic()
        victim.kill()
        system.first_ack_after(t_kill + 0.5, epoch - 1, timeout=40)   # Steps go on (after a Raft election)
        time.sleep(2.0)
        assert all(s.alive() for s in system.slots), "a manager gave up during the NATS election"
        assert system.leader()[1] == epoch, "the leader lapsed and lost its lease"
        lost, dup, problems = system.check_exact()
        assert (lost, dup) == (0, 0), problems
        victim.start()                                                # it comes back and catches up
        cluster.wait_ready()
        time.sleep(1.0)
        lost, dup, problems = system.check_exact()
        assert (lost, dup) == (0, 0), problems
        system.raise_loader_errors()
        assert all(ld.client.stale_replies == 0 for ld in system.loaders)
    finally:
        system.stop()
        cluster.stop()


# ---- WatchEvents across a failover ------------------------------------------------------------------------

class _HAWatcher(threading.Thread):
    """A LeaderClient's WatchEvents from `from_sequence` into {seq: events}, in arrival order (parts joined)."""

    def __init__(self, targets: list[str], pool: str, from_sequence: int) -> None:
        super().__init__(daemon=True)
        self.client = LeaderClient(targets, timeout=2.0, failover=60)
        self.stream = self.client.watch_events(pool, from_sequence)
        self.batches: list[tuple[int, bool, list]] = []
        self.error: Exception | None = None

    def run(self) -> None:
        from kvservice.events.messages import proto_to_events
        try:
            events: list = []
            for msg in self.stream:
                events += proto_to_events(msg)
                if not msg.more:
                    self.batches.append((msg.sequence, msg.reset, events))
                    events = []
        except Exception as err:               # reported by the test
            self.error = err

    def wait_for(self, seq: int, timeout: float = 40.0) -> None:
        end = time.monotonic() + timeout
        while not (self.batches and self.batches[-1][0] >= seq):
            assert self.error is None, self.error
            assert time.monotonic() < end, f"watcher stuck at {self.batches[-1][0] if self.batches else None}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.stream.cancel()
        self.join(10)
        self.client.close()


def _wait_for_event_sequence(slot, pool: str, seq: int, timeout: float = 30.0) -> None:
    """Until the manager's kvservice_kv_event_sequence{pool} (its last visible batch) reaches seq."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    end = time.monotonic() + timeout
    got = None
    while time.monotonic() < end:
        with urllib.request.urlopen(f"http://127.0.0.1:{slot.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        got = next((x.value for fam in text_string_to_metric_families(text) for x in fam.samples
                    if x.name == "kvservice_kv_event_sequence" and x.labels.get("pool") == pool), None)
        if got is not None and got >= seq:
            return
        time.sleep(0.05)
    raise AssertionError(f"{slot.name}: last visible event batch of {pool} is {got}, the leader's is {seq}")


def test_watch_events_resume_on_the_new_leader_after_kill9_with_no_gap_or_duplicate(nats3, tmp_path):
    """A watcher subscribed through a LeaderClient; steps before and after two kill -9 of the leader. What
    it received equals, batch for batch, the events rebuilt by replaying the journal from NATS."""
    from tests.kv_workload import Workload

    from .ha_harness import ManagerSlot
    from .test_kv_events import SIZING as EV_SIZING
    from .test_kv_events import SPEC as EV_SPEC
    from .test_kv_events import canon, run_steps
    name = fresh_name()
    extra = ("--nats-replicas", "3", "--leader-ttl", "1.0", "--leader-renew", "0.25", "--compact-every", "100000")
    slots = [ManagerSlot(tmp_path, s, nats3.url, name, extra) for s in ("a", "b")]
    watcher = None
    try:
        for s in slots:
            s.start()
        targets = [s.target for s in slots]
        w = Workload(np.random.default_rng(23))
        with LeaderClient(targets, timeout=2.0, failover=60) as c:
            c.create_pool("ev", EV_SPEC, EV_SIZING, prefix_caching=True)
            watcher = _HAWatcher(targets, "ev", 1)
            watcher.start()
            seq = run_steps(c, w, 20)
            watcher.wait_for(seq)
            for _ in range(2):
                leader = next(s for s in slots if s.alive() and epoch_of(s.target) is not None)
                standby = next(s for s in slots if s is not leader)
                _wait_for_event_sequence(standby, "ev", seq)   # the standby's ring: the same numbers, visible
                run_steps(c, w, 5)                     # some batches the watcher may not have read yet
                leader.kill9()
                leader.start()                         # back as the standby (recovered from NATS, following)
                seq = run_steps(c, w, 15)              # retried onto the new leader; the watcher is away meanwhile
                watcher.wait_for(seq)
            epoch = c.epoch
        assert watcher.stream.reconnects >= 2 and watcher.client.epoch == epoch >= 3
        watcher.stop()
        got = watcher.batches
        assert [s for s, _, _ in got] == list(range(1, seq + 1)), "a gap or a duplicate"
        assert not any(reset for _, reset, _ in got)
        j = open_journal(NatsConfig(tuple(nats3.urls), name=name), readonly=True)   # the journal, replayed
        try:
            rebuilt = {lb.seq: lb.batch.events for lb in j.manager.events.logs["ev"].batches}
        finally:
            j.close(snapshot=False)
        assert sorted(rebuilt) == list(range(1, seq + 1))
        for s, _, events in got:
            assert canon(events) == canon(rebuilt[s]), f"batch {s} differs from the journal's"
        assert sum(len(e) for _, _, e in got) > 3 * seq // 2
    finally:
        if watcher is not None and watcher.is_alive():
            watcher.stop()
        for s in slots:
            s.stop()


def test_watch_events_refuses_a_lower_epoch_and_resumes_where_it_stopped():
    """Two in-process managers fed the same Steps (so the same batches): the watcher's leader stops, the
    other answers first with a lower epoch (refused), then as the successor: the stream resumes exactly."""
    from tests.kv_workload import Workload, client_step_args

    from .test_kv_events import SIZING as EV_SIZING
    from .test_kv_events import SPEC as EV_SPEC
    from .test_kv_events import canon
    gates = [LeaderGate(), LeaderGate()]
    servers = [serve(interceptors=[g]) for g in gates]
    targets = [f"127.0.0.1:{s.port}" for s in servers]
    gates[0].promote(5)
    gates[1].promote(3)                                     # a deposed manager still answering
    directs = [BlockManagerClient(t, timeout=5) for t in targets]
    w = Workload(np.random.default_rng(31))

    def step_both(n: int, alive: list[BlockManagerClient]) -> int:
        for _ in range(n):
            kw = w.step()
            outcomes = []
            for d in alive:
                try:
                    d.step("ev", **client_step_args(kw))
                    outcomes.append(True)
                except ClientError as err:
                    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                    outcomes.append(False)
            assert len(set(outcomes)) == 1
            if outcomes[0]:
                w.applied(kw)
        seqs = {d.stats("ev")["ev"].event_sequence for d in alive}
        assert len(seqs) == 1
        return seqs.pop()
    watcher = None
    try:
        for d in directs:
            d.create_pool("ev", EV_SPEC, EV_SIZING, prefix_caching=True, request_id="create-ev")
        watcher = _HAWatcher(targets, "ev", 1)
        watcher.client.retry = RetryPolicy(attempts=200, initial_backoff=0.01, max_backoff=0.05, failover=60)
        watcher.start()
        first = step_both(15, directs)
        watcher.wait_for(first)
        assert watcher.client.epoch == 5
        servers[0].stop(0)                                  # the leader goes; the other still says epoch 3
        time.sleep(0.3)
        assert watcher.client.stale_replies >= 1 and watcher.error is None
        last = step_both(10, directs[1:])
        gates[1].promote(6)                                 # now the successor
        watcher.wait_for(last)
        assert watcher.client.epoch == 6 and watcher.stream.reconnects >= 2
        got = watcher.batches
        assert [s for s, _, _ in got] == list(range(1, last + 1)) and not any(r for _, r, _ in got)
        ring = {lb.seq: lb.batch.events for lb in servers[1].manager.events.logs["ev"].batches}
        for s, _, events in got:
            assert canon(events) == canon(ring[s])
    finally:
        if watcher is not None:
            watcher.stop()
        for d in directs:
            d.close()
        for s in servers:
            s.stop(0)


# ---- StepStream across a failover ----------------------------------------------------------------------------

class AckedSteps:
    """What a stream loop over two decoding sequences (1 and 2, admitted with one token each) acknowledged, for the
    StepStream-across-kill -9 tests (sync and asyncio): each reply must match the acknowledged count."""

    def __init__(self) -> None:
        self.acked = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def took(self, outcome) -> bool:
        """Record one step's outcome (its StepResult or ClientError); False ends the loop."""
        if isinstance(outcome, ClientError):
            if outcome.code in RETRY_CODES:
                return True                       # outcome unknown: the caller retries the same step
            self.errors.append(str(outcome))
            return False
        if outcome.num_tokens.tolist() != [self.acked + 2] * 2:
            self.errors.append(f"after {self.acked} acknowledged steps: {outcome.num_tokens.tolist()}")
            return False
        self.acked += 1
        return True

    def wait_for(self, n: int) -> None:
        """Wait until the loop acknowledged n more Steps (progress counted; bounded generously)."""
        want, deadline = self.acked + n, time.monotonic() + 120
        while self.acked < want and not self.errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.acked >= want and not self.errors, (self.acked, want, self.errors)

    def kill_leaders(self, slots, kills: int, client) -> list[int]:
        """kill -9 the leader `kills` times, each once 10 more Steps were acknowledged (restarted as the standby), then
        wait for 10 more and stop the loop; returns the client's epoch before each kill."""
        epochs = []
        for _ in range(kills):
            self.wait_for(10)
            leader = next(s for s in slots if s.alive() and epoch_of(s.target) is not None)
            epochs.append(client.epoch)
            leader.kill9()
            leader.start()                        # back as the standby
        self.wait_for(10)
        self.stop.set()
        return epochs

    def check(self, sequences, steps: int) -> None:
        """The manager's state after the loop: each acknowledged Step applied exactly once."""
        assert not self.errors, self.errors
        (q1, q2) = sequences
        assert (q1.num_tokens, q2.num_tokens) == (1 + self.acked, 1 + self.acked)
        assert steps == 1 + self.acked                # one applied Step per acknowledged one


def _manager_slots(nats3, tmp_path) -> list:
    from .ha_harness import ManagerSlot
    name = fresh_name()
    return [ManagerSlot(tmp_path, s, nats3.url, name, ("--nats-replicas", "3", *TEST_LEASE)) for s in ("a", "b")]


STREAM_POOL = ("st", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=1024, max_seq_len=4096))


def test_a_step_stream_follows_the_leader_across_kill9_applying_each_step_once(nats3, tmp_path):
    """Issue 27, item 2: a StepStream of a LeaderClient (default settings) under three kill -9 of the leader: it
    reconnects to the new leader under the same stream id, resends its unanswered request with the same seq, and
    every acknowledged Step was applied exactly once (tokens and the pool's step count)."""
    slots, model = _manager_slots(nats3, tmp_path), AckedSteps()
    try:
        for s in slots:
            s.start()
        with LeaderClient([s.target for s in slots]) as c:
            c.create_pool(*STREAM_POOL)
            stream = c.step_stream("st")
            stream.step(admit=[1, 2], admit_tokens=[1, 1])

            def loop() -> None:
                while not model.stop.is_set():
                    try:
                        outcome = stream.step(extend=[1, 2], extend_tokens=1)
                    except ClientError as err:
                        outcome = err
                    if not model.took(outcome):
                        return

            worker = threading.Thread(target=loop, daemon=True)
            worker.start()
            epochs = model.kill_leaders(slots, 3, c)
            worker.join(60)
            model.check(c.sequences("st").sequences, c.stats("st")["st"].steps)
            assert stream.reconnects >= 3 and c.epoch > epochs[-1] > epochs[0]
            assert c.stale_replies == 0
            stream.close()
    finally:
        model.stop.set()
        for s in slots:
            s.stop()


class FailStop(grpc.ServerInterceptor):
    """While `failed`, every open StepStream call ends UNAVAILABLE at its next request, as on a leader whose journal
    fail-stopped when it was deposed (server/stream.py: a failed journal ends the call)."""

    def __init__(self) -> None:
        self.failed = False

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.stream_stream is None:
            return handler
        inner = handler.stream_stream

        def stream(request_iterator, context):
            def requests():
                for r in request_iterator:
                    if self.failed:
                        context.abort(grpc.StatusCode.UNAVAILABLE, "the manager stopped serving (test: deposed)")
                    yield r
            yield from inner(requests(), context)
        return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)


class DeposedLeaderPair:
    """Two in-process managers behind LeaderGates (the lower-epoch stream tests): address 0 leads at epoch 5.
    depose(client): its open streams end, address 1 answers at the lower epoch 3, and once `client` refused that
    epoch (a helper thread watches stale_replies) address 0 comes back as the leader of epoch 7."""

    SPEC, SIZING = CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=64, max_seq_len=512)

    def __init__(self) -> None:
        self.gates, self.stop = [LeaderGate(), LeaderGate()], FailStop()
        self.servers = [serve(interceptors=[self.gates[0], self.stop]), serve(interceptors=[self.gates[1]])]
        self.targets = [f"127.0.0.1:{s.port}" for s in self.servers]
        self.gates[0].promote(5)
        self.helper: threading.Thread | None = None

    def depose(self, client) -> None:
        self.gates[0].depose("test: deposed")
        self.stop.failed = True
        self.gates[1].promote(3)                      # a deposed manager that still answers

        def comeback() -> None:                       # once the stale epoch was refused: a newer leader
            deadline = time.monotonic() + 15
            while client.stale_replies == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            self.stop.failed = False
            self.gates[0].promote(7)
        self.helper = threading.Thread(target=comeback, daemon=True)
        self.helper.start()

    def close(self) -> None:
        for srv in self.servers:
            srv.stop(0)


def test_a_step_stream_refuses_a_lower_epoch_and_resends_to_the_leader():
    """Two in-process managers behind LeaderGates: the stream's leader is deposed (its open stream ends), the other
    answers with a lower epoch (refused: its reply never reaches the mirror), then the first comes back as a newer
    leader: the unanswered request is resent there under its seq and applied once."""
    pair = DeposedLeaderPair()
    try:
        with LeaderClient(pair.targets, timeout=20) as c:
            c.create_pool("st", pair.SPEC, pair.SIZING)
            s = c.step_stream("st")
            s.step(admit=[1], admit_tokens=[5])
            s.step(extend=[1], extend_tokens=1)
            assert c.epoch == 5
            pair.depose(c)
            r = s.step(extend=[1], extend_tokens=1)
            pair.helper.join(20)
            assert c.stale_replies >= 1 and c.epoch == 7 and s.reconnects >= 2
            assert r.num_tokens.tolist() == [7] and s.seq == 3
            assert c.stats("st")["st"].steps == 3      # applied once, on the leader
            s.close()
    finally:
        pair.close()


# ---- the asyncio client across a failover (AsyncLeaderClient) ---------------------------------------------------

def test_an_async_step_stream_follows_the_leader_across_kill9_applying_each_step_once(nats3, tmp_path):
    """Issue 27, item 2, asyncio: the twin of the sync test above with an AsyncLeaderClient (default settings) whose
    stream loop runs on its own event loop, under two kill -9 of the leader: the stream reconnects to the new leader
    under the same id, resends its unanswered request with its seq, and every acknowledged Step was applied exactly
    once (tokens and the pool's step count, read by the asyncio client after the loop)."""
    slots, model = _manager_slots(nats3, tmp_path), AckedSteps()
    opened, got = threading.Event(), {}

    async def run() -> None:
        async with AsyncLeaderClient([s.target for s in slots]) as c:
            got["client"] = c
            await c.create_pool(*STREAM_POOL)
            stream = await c.step_stream("st")
            await stream.step(admit=[1, 2], admit_tokens=[1, 1])
            opened.set()
            while not model.stop.is_set():
                try:
                    outcome = await stream.step(extend=[1, 2], extend_tokens=1)
                except ClientError as err:
                    outcome = err
                if not model.took(outcome):
                    break
            got["sequences"] = (await c.sequences("st")).sequences
            got["steps"] = (await c.stats("st"))["st"].steps
            got["reconnects"] = stream.reconnects
            await stream.close()

    worker = threading.Thread(target=lambda: got.setdefault("error", _run_or_error(run)), daemon=True)
    try:
        for s in slots:
            s.start()
        worker.start()
        assert opened.wait(60), got
        c = got["client"]
        epochs = model.kill_leaders(slots, 2, c)
        worker.join(60)
        assert got["error"] is None, got["error"]
        model.check(got["sequences"], got["steps"])
        assert got["reconnects"] >= 2 and c.epoch > epochs[-1] > epochs[0]
        assert c.stale_replies == 0
    finally:
        model.stop.set()
        for s in slots:
            s.stop()


def _run_or_error(main) -> BaseException | None:
    """asyncio.run(main()) on this thread; the exception it raised, or None."""
    try:
        asyncio.run(main())
    except BaseException as exc:                      # reported by the test's thread
        return exc
    return None


def test_an_async_step_stream_refuses_a_lower_epoch_and_resends_to_the_leader():
    """The asyncio twin of test_a_step_stream_refuses_a_lower_epoch_and_resends_to_the_leader: the stream's leader is
    deposed (its open stream ends), the other manager answers with a lower epoch (refused: its reply never reaches
    the mirror), then the first comes back as a newer leader: the unanswered request is resent there under its seq
    and applied once."""
    pair = DeposedLeaderPair()

    async def run() -> None:
        async with AsyncLeaderClient(pair.targets, timeout=20) as c:
            await c.create_pool("st", pair.SPEC, pair.SIZING)
            s = await c.step_stream("st")
            await s.step(admit=[1], admit_tokens=[5])
            await s.step(extend=[1], extend_tokens=1)
            assert c.epoch == 5 and s.reconnects == 0
            pair.depose(c)
            r = await s.step(extend=[1], extend_tokens=1)
            await asyncio.to_thread(pair.helper.join, 20)
            assert c.stale_replies >= 1 and c.epoch == 7 and s.reconnects >= 2
            assert r.num_tokens.tolist() == [7] and s.seq == 3 and s.pending is None
            assert (await c.stats("st"))["st"].steps == 3      # applied once, on the leader
            await s.close()
    try:
        asyncio.run(run())
    finally:
        pair.close()


def test_async_leader_client_refusals_stay_put_and_all_addresses_down_names_them():
    """A standby's refusal moves a call on; a refused request (INVALID_ARGUMENT) does not, and leaves nothing pending;
    a lower epoch is refused until the deadline; with every address down a call and a stream step end UNAVAILABLE at
    their deadline naming both addresses (the step's request stays pending: its outcome is unknown)."""
    gates = [LeaderGate(), LeaderGate()]
    # address 0 is a standby: it refuses UNAVAILABLE and its health says NOT_SERVING, as serve_ha's standby does (a
    # SERVING report would rightly move the client there, whenever its health watch got it: seen under load)
    servers = [serve(interceptors=[g], serving=i == 1) for i, g in enumerate(gates)]
    targets = [f"127.0.0.1:{s.port}" for s in servers]
    gates[1].promote(5)
    spec, sizing = CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=64, max_seq_len=512)

    async def run() -> None:
        async with AsyncLeaderClient(targets, timeout=1.0) as c:
            await c.create_pool("st", spec, sizing)
            assert c.current_target == targets[1] and c.epoch == 5
            s = await c.step_stream("st")
            await s.step(admit=[1], admit_tokens=[5])
            with pytest.raises(ClientError) as exc:   # a unary refusal: raised, the client stays
                await c.step("st", admit=[2], admit_tokens=10_000)
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and c.current_target == targets[1]
            with pytest.raises(ClientError) as exc:   # a stream refusal: raised, nothing pending, no reconnect
                await s.step(admit=[2], admit_tokens=10_000)
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_seq_len" in exc.value.message
            assert s.pending is None and s.reconnects == 0 and c.current_target == targets[1]
            r = await s.step(extend=[1], extend_tokens=1)
            assert r.num_tokens.tolist() == [6] and (await c.stats("st"))["st"].steps == 2

            gates[1].depose("test: deposed")          # the only one answering now says a lower epoch
            gates[0].promote(3)
            with pytest.raises(ClientError) as exc:
                await c.echo(b"x")
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE and c.stale_replies >= 1 and c.epoch == 5

            for srv in servers:                       # every address down
                srv.stop(0)
            with pytest.raises(ClientError) as exc:
                await c.get_pool("st")
            err = exc.value
            assert err.code == grpc.StatusCode.UNAVAILABLE and err.reason == "RETRIES_EXHAUSTED"
            assert all(t in err.message for t in targets) and int(err.metadata["attempts"]) >= 2, err.message
            with pytest.raises(ClientError) as exc:
                await s.step(extend=[1], extend_tokens=1)
            err = exc.value
            assert err.code == grpc.StatusCode.UNAVAILABLE and all(t in err.message for t in targets), err.message
            assert s.pending is not None and s.pending.seq == 4 and "stays pending" in err.message
            await s.close()
    try:
        asyncio.run(run())
    finally:
        for srv in servers:
            srv.stop(0)


def test_a_journal_stream_that_cannot_be_placed_is_refused_with_the_servers_reason(nats3):
    """Five replicas asked of a three-node cluster (as a cluster missing peers answers): the error names the
    journal stream and gives the server's reason, not the "stream not found" of the look-up after the
    refusal; nothing is created."""
    from kvservice.state.nats.config import StoreError
    config = NatsConfig(tuple(nats3.urls), name=fresh_name(), replicas=5)
    link = NatsLink(config)
    try:
        with pytest.raises(StoreError, match=r"creating the journal stream \(5 replicas\) was refused: "
                                             r"no suitable peers for placement \(err_code 10005\)"):
            NatsStore(link)

        async def names() -> list[str]:
            return [s.config.name for s in await link.js.streams_info()]
        assert config.stream not in link.call(names(), 10.0, "listing streams")
    finally:
        link.close()
