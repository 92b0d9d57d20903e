"""A replicated manager (kvservice/server/ha.py) served in-process on one real nats-server (tests/natsutil.py; skips
without the pinned binary, fails under CI=true): it takes the lease, serves as leader with its epoch, exports the
HA series with their help text, fail-stops when its journal fails, and its state exports to a SQLite state dir
that holds the same pools and sequences (docs/HA.md)."""

from __future__ import annotations

import uuid

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.client.codec import ClientError
from kvservice.client.deadline import RetryPolicy
from kvservice.client.ha import LeaderClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing

HA_SERIES = {"kvservice_leader": "gauge", "kvservice_leader_epoch": "gauge", "kvservice_lease_remaining_seconds":
             "gauge", "kvservice_lease_renewals": "counter", "kvservice_lease_renew_failures": "counter",
             "kvservice_standby_lag_entries": "gauge", "kvservice_standby_reloads": "counter",
             "kvservice_standby_applied": "counter", "kvservice_takeover_seconds": "gauge",
             "kvservice_journal_append_retries": "counter", "kvservice_nats_disconnects": "counter"}




def _series(registry) -> tuple[dict[str, tuple[str, str]], dict[str, float]]:
    fams = list(text_string_to_metric_families(generate_latest(registry).decode()))
    return {f.name: (f.type, f.documentation) for f in fams}, \
        {s.name: s.value for f in fams for s in f.samples if not s.labels}


def test_a_replicated_manager_leads_exports_its_series_fail_stops_and_exports_its_state(nats1, tmp_path):
    from kvservice.server.ha import LeaseConfig, export_state, serve_ha, stop_ha
    from kvservice.state.journal import Journal
    from kvservice.state.nats.journal import NatsConfig

    config = NatsConfig(tuple(nats1.urls), name="h" + uuid.uuid4().hex[:10])
    running, ha = serve_ha(config, LeaseConfig(), "127.0.0.1:0", node="n1")
    target = f"127.0.0.1:{running.port}"
    rng = np.random.default_rng(29)
    lens = rng.integers(1, 40, 3).tolist()
    try:
        with LeaderClient(target, timeout=60, retry=RetryPolicy(failover=60)) as c:
            c.create_pool("p", CacheSpec.uniform(2, 1, 64, "float16", 16), Sizing(num_slots=64, max_seq_len=256))
            c.step("p", admit=[11, 12, 13], admit_tokens=lens, tables=False)
            epoch = c.epoch
        assert epoch >= 1 and ha.role == "leader"
        # no advertise given: the address written in the lease key (docs/HA.md) is the listen host, bound port
        holder = ha.lease.current()
        assert holder is not None and (holder.node, holder.address) == ("n1", target)
        # its readiness (health of kvservice.v1.BlockManager, docs/HA.md) turns SERVING once it leads
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(target) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service="kvservice.v1.BlockManager"), timeout=30)
            assert health_pb2.HealthCheckResponse.SERVING in (m.status for m in watch)   # DEADLINE_EXCEEDED if never
        docs, values = _series(running.metrics.registry)
        for name, kind in HA_SERIES.items():
            assert docs[name][0] == kind and docs[name][1], name          # every series is there, with help text
        assert values["kvservice_leader"] == 1.0 and values["kvservice_leader_epoch"] == epoch
        assert values["kvservice_takeover_seconds"] == ha.takeover_seconds > 0
        # the journal fails (a fenced append): this manager stops leading at once and says so
        ha.journal_failed("test: the append was fenced")
        assert ha.role == "failed" and ha.failed.endswith("journal failed: test: the append was fenced")
        with LeaderClient(target, timeout=5, retry=RetryPolicy(attempts=1)) as c:
            with pytest.raises(ClientError) as err:
                c.echo(b"x")
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "test: the append was fenced" in err.value.message
        assert _series(running.metrics.registry)[1]["kvservice_leader"] == 0.0
    finally:
        stop_ha(running, ha)
    backup = tmp_path / "backup"
    export_state(config, backup)
    j = Journal.open(backup, readonly=True)
    try:
        assert j.manager.pool_names() == ["p"]
        with j.manager.locked("p") as pool:
            ids, tokens = pool.sequences()
        assert dict(zip(ids.tolist(), tokens.tolist(), strict=True)) == {11: lens[0], 12: lens[1], 13: lens[2]}
    finally:
        j.close(snapshot=False)


def test_a_tools_sole_writer_connects_under_the_tools_name(nats1):
    """open_sole_writer (kvservice import-state, tests) connects as "kvservice-tool", the name NATS shows for the
    connection (`nats server report connections`), so an operator tells a tool's writer from a manager's
    ("kvservice-<node>"); it fences the stream with the next epoch."""
    from kvservice.server.ha import open_sole_writer
    from kvservice.state.nats.journal import NatsConfig

    config = NatsConfig(tuple(nats1.urls), name="t" + uuid.uuid4().hex[:10])
    first = open_sole_writer(config)
    try:
        assert first.store.link.nc.options["name"] == "kvservice-tool"
        assert first.store.epoch == 1
    finally:
        first.close(snapshot=False)
    second = open_sole_writer(config, epoch=5)
    try:
        assert second.store.epoch == 5
    finally:
        second.close(snapshot=False)


def test_a_standby_whose_consumer_is_gone_reads_on_with_a_new_one_and_says_so(nats1):
    """ha.py _follow: a standby whose consumer delivers nothing while the stream holds more (the NATS node that kept
    it restarted; here it is deleted) logs how far behind it is, reads on with a new consumer and catches up."""
    import logging
    import re
    import threading
    import time

    from kvservice.server.ha import LeaseConfig, serve_ha, stop_ha
    from kvservice.state.nats.journal import NatsConfig
    from kvservice.state.tree import state_tree

    said: list[str] = []
    heard = threading.Event()

    class Listen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "reading on with a new" in record.msg.lower():
                try:
                    said.append(record.getMessage())
                except TypeError:                   # its arguments do not fit its format
                    said.append(f"unformattable: {record.msg!r} % {record.args!r}")
                heard.set()

    config = NatsConfig(tuple(nats1.urls), name="s" + uuid.uuid4().hex[:10])
    lc = LeaseConfig(ttl_seconds=1.0, renew_seconds=0.25, poll_seconds=0.05, margin_seconds=0.1)
    a, ha_a = serve_ha(config, lc, "127.0.0.1:0", node="a")
    b = ha_b = None
    listen = Listen(logging.WARNING)
    logging.getLogger("kvservice.server.ha").addHandler(listen)
    try:
        with LeaderClient(f"127.0.0.1:{a.port}", timeout=60, retry=RetryPolicy(failover=60)) as c:
            c.create_pool("p", CacheSpec.uniform(2, 1, 64, "float16", 16), Sizing(num_slots=64, max_seq_len=512))
            c.step("p", admit=[1, 2], admit_tokens=[5, 9], tables=False)
            b, ha_b = serve_ha(config, lc, "127.0.0.1:0", node="b")
            link = ha_b.store.link
            link.call(link.js.delete_consumer(config.stream, ha_b.store._sub._consumer), 10)
            for _ in range(5):
                c.step("p", extend=[1, 2], extend_tokens=1, tables=False)
        assert heard.wait(60), "the standby never read on"
        assert re.fullmatch(r"standby: no journal message for 1 s while [1-9]\d* behind; reading on with a new "
                            r"consumer", said[0]), said
        deadline, idle = time.monotonic() + 60, threading.Event()    # then it catches up (polled, bounded)
        while ha_b.journal.seq < ha_a.journal.seq and time.monotonic() < deadline:
            idle.wait(0.02)
        assert ha_b.journal.seq == ha_a.journal.seq and state_tree(b.manager) == state_tree(a.manager)
    finally:
        logging.getLogger("kvservice.server.ha").removeHandler(listen)
        if b is not None:
            stop_ha(b, ha_b)
        stop_ha(a, ha_a)
