"""kvservice/server/ha.py: the exact log lines and messages of _fail, _measure_lag, open_journal, export_state and
serve_ha (mutation round d6ha).

Oracles: the module docstring (fail-stop: readiness NOT_SERVING, the journal fails with the reason), the texts the
controller logs (written out here by hand), docs/HA.md (a standby advertises the address clients are sent to),
and nats-server's own list of connections (/connz) for the connection names. Fakes stand in for the store and
journal where only the controller's logic is checked; the rest runs on the shared loopback nats-server (nats1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from kvservice.server.ha import HAController
from kvservice.state.journal import JournalConfig
from kvservice.state.nats.journal import JournalGap, StoreError
from tests.unit.test_mut_d5hm_ha import LEASE, _config, _seed
from tests.unit.test_server_ha_units import _connections


def _fake_journal():
    fails: list[str] = []
    return SimpleNamespace(manager=SimpleNamespace(events=SimpleNamespace(transaction=contextlib.nullcontext)),
                           _fail=fails.append, fails=fails)


def test_fail_turns_readiness_off_and_fails_the_journal_with_each_reason_given():
    """_fail: role "failed", the first reason kept as `failed`, readiness off (set_serving(False)) on every call,
    and the journal failed with the reason of that call (the journal keeps its own first one)."""
    journal = _fake_journal()
    serving: list[bool] = []
    ha = HAController(journal, None, None, None, set_serving=serving.append)
    ha._fail("leadership lost: renewal refused")
    ha._fail("takeover failed: later")
    assert (ha.role, ha.failed, serving, journal.fails) == (
        "failed", "leadership lost: renewal refused", [False, False],
        ["leadership lost: renewal refused", "takeover failed: later"])


def test_measure_lag_logs_why_it_was_not_measured_at_debug(caplog):
    """_measure_lag: a StoreError is logged at DEBUG as "standby lag not measured: <message>" and gives None."""
    def down() -> int:
        raise StoreError("no responders for the stream")
    ha = HAController(None, SimpleNamespace(last_stream_seq=4, stream_last_seq=down), None, None)
    with caplog.at_level(logging.DEBUG, logger="kvservice.server.ha"):
        assert ha._measure_lag() is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvservice.server.ha"] == [
        (logging.DEBUG, "standby lag not measured: no responders for the stream")]


def test_reload_that_never_recovers_fails_naming_the_last_gap():
    """_reload: RECOVERY_ATTEMPTS recoveries each overtaken again (JournalGap) fail-stop with "standby fell behind a
    compaction and could not recover again: <the last gap's message>"; nothing counted, no waits."""
    from tests.unit.test_mut_d5hm_ha import _Waits

    n = 0

    def restart_reading() -> None:
        nonlocal n
        n += 1
        raise JournalGap(f"entry {100 + n} was purged")
    journal = _fake_journal()
    serving: list[bool] = []
    ha = HAController(journal, SimpleNamespace(restart_reading=restart_reading),
                      SimpleNamespace(config=SimpleNamespace(poll_seconds=0.5)), None, set_serving=serving.append)
    ha._stop = _Waits()
    assert ha._reload(JournalGap("entry 100 was purged")) is False
    why = "standby fell behind a compaction and could not recover again: entry 105 was purged"
    assert (n, ha.reloads, ha.role, ha.failed, journal.fails, serving, ha._stop.waits) == (
        5, 0, "failed", why, [why], [False], [])


def test_open_journal_logs_each_recovery_started_again(nats1, monkeypatch, caplog):
    """open_journal: each JournalGap while recovering is logged at INFO as "recovering again: <message>"."""
    from kvservice.server import ha
    from kvservice.state.journal import Journal

    config = _config(nats1)
    _seed(config)
    real = Journal.recover.__func__
    tries: list[int] = []

    def recover(cls, store, *a, **kw):
        tries.append(1)
        if len(tries) <= 2:
            raise JournalGap(f"entry {len(tries) * 7} was purged")
        return real(cls, store, *a, **kw)
    monkeypatch.setattr(Journal, "recover", classmethod(recover))
    with caplog.at_level(logging.INFO, logger="kvservice.server.ha"):
        j = ha.open_journal(config, LEASE)
    try:
        assert [r.getMessage() for r in caplog.records if r.name == "kvservice.server.ha"] == [
            "recovering again: entry 7 was purged", "recovering again: entry 14 was purged"]
        assert j.store.owns_link is True                 # it opened the link, so closing the journal closes it
    finally:
        j.close(snapshot=False)


def test_export_state_refuses_a_dir_with_state_naming_it(nats1, tmp_path):
    """export_state: a dir that already holds kvservice state is refused with "<dir> already holds kvservice
    state; export into a new dir", and the first export's backup is left as it was."""
    from kvservice.contract.errors import StateError
    from kvservice.server.ha import export_state
    from kvservice.state.sqlite.store import DB_NAME

    config = _config(nats1)
    _seed(config)
    export_state(config, tmp_path / "b")
    before = (tmp_path / "b" / DB_NAME).read_bytes()
    with pytest.raises(StateError) as err:
        export_state(config, tmp_path / "b")
    assert err.value.message == f"{tmp_path / 'b'} already holds kvservice state; export into a new dir"
    assert (tmp_path / "b" / DB_NAME).read_bytes() == before


def _names(nats1) -> list[str]:
    return list(_connections(nats1).values())


@pytest.mark.parametrize("advertise", ["", "mgr-a.example:7001"])
def test_serve_ha_names_its_node_everywhere_and_logs_it_started_as_a_standby(nats1, monkeypatch, caplog, advertise):
    """serve_ha: without a node it is "<HOSTNAME>-<pid>"; the NATS connection is named "kvservice-<node>", the gate
    and lease carry the node, the lease advertises `advertise` or else the listen host with the bound port, the
    controller drives the journal it recovered, and the log says "manager <node>: standby of <url> (journal
    position <seq>), lease <ttl> s"."""
    from kvservice.server.ha import serve_ha, stop_ha
    from kvservice.state.nats.leader import LeaseConfig

    host = "h" + uuid.uuid4().hex[:8]
    monkeypatch.setenv("HOSTNAME", host)
    node = f"{host}-{os.getpid()}"
    config = _config(nats1)
    seq = _seed(config)
    ttl = float(np.random.default_rng(3).integers(20, 90))
    with caplog.at_level(logging.INFO, logger="kvservice.server.ha"):
        running, ha = serve_ha(config, LeaseConfig(ttl_seconds=ttl), "127.0.0.1:0", advertise=advertise,
                               journal_config=JournalConfig(sync="normal", compact_every=1000,
                                                            background_snapshots=False), lease_seconds=LEASE)
    try:
        assert f"kvservice-{node}" in _names(nats1)
        assert (ha.gate.node, ha.lease.node) == (node, node)
        assert ha.lease.address == (advertise or f"127.0.0.1:{running.port}")
        assert ha.journal is running.journal and ha.store is ha.journal.store
        assert ha.store.owns_link is False                # the link is serve_ha's: stop_ha closes it
        assert f"manager {node}: standby of {config.url} (journal position {seq}), lease {ttl:g} s" in [
            r.getMessage() for r in caplog.records if r.name == "kvservice.server.ha"]
    finally:
        stop_ha(running, ha)


HA_HELP = {
    "kvservice_leader": ("gauge", "1 while this manager is the leader (serves requests), else 0."),
    "kvservice_leader_epoch": ("gauge", "Epoch of the current leader as this manager knows it (its own while it "
                               "leads; the highest fenced one while standby)."),
    "kvservice_lease_remaining_seconds": ("gauge", "Seconds left on this leader's lease (0 on a standby)."),
    "kvservice_lease_renewals_total": ("counter", "Successful renewals of the leader lease."),
    "kvservice_lease_renew_failures_total": ("counter", "Lease renewals that failed (timeout or NATS error; the "
                                             "lease lapses if they go on for a TTL)."),
    "kvservice_standby_lag_entries": ("gauge", "Journal stream messages the standby has not applied yet "
                                      "(replication lag; 0 on the leader)."),
    "kvservice_standby_reloads_total": ("counter", "Times this standby recovered again from a newer snapshot "
                                        "because a compaction purged the entries it was to apply."),
    "kvservice_standby_applied_total": ("counter", "Journal entries this manager applied while following the "
                                        "leader."),
    "kvservice_takeover_seconds": ("gauge", "How long this manager's takeover took (lease won to serving); 0 if "
                                   "it never took over."),
    "kvservice_journal_append_retries_total": ("counter", "Journal publishes retried after a timeout or a missing "
                                               "stream leader."),
    "kvservice_nats_disconnects_total": ("counter", "Times the NATS connection dropped (the client reconnects to "
                                         "another server)."),
}


@pytest.mark.parametrize("role, held", [("leader", True), ("leader", False), ("standby", False),
                                        ("taking over", True), ("failed", False)])
def test_ha_collector_exports_every_series_type_help_and_value(role, held):
    """HACollector: the 11 series in order, each with its type and exact help sentence; kvservice_leader is 1 only
    for role "leader" with the lease held, the epoch is the higher of the stream's fences and the store's own,
    the lag is exported only while "standby", the rest are the controller's, lease's and store's figures."""
    from prometheus_client import CollectorRegistry

    from kvservice.server.ha import HACollector

    rng = np.random.default_rng(len(role) * 2 + held)
    v = [int(x) for x in rng.integers(1, 10_000, 8)]
    low, high = sorted(int(x) for x in rng.choice(np.arange(1, 100), 2, replace=False))
    max_epoch, own_epoch = (high, low) if held else (low, high)     # either one may be the higher
    lease = SimpleNamespace(held=held, remaining_seconds=float(rng.uniform(0.5, 9)), renewals=v[0],
                            renew_failures=v[1])
    store = SimpleNamespace(max_epoch=max_epoch, epoch=own_epoch, append_retries=v[2],
                            link=SimpleNamespace(disconnects=v[3]))
    ha = HAController(None, store, lease, None, role=role, takeover_seconds=float(rng.uniform(0.1, 5)),
                      applied=v[4], lag_entries=v[5], reloads=v[6])
    fams = list(HACollector(ha).collect())
    assert [(f.name, f.type, f.documentation) for f in fams] == [
        (n.removesuffix("_total"), t, h) for n, (t, h) in HA_HELP.items()]
    reg = CollectorRegistry()
    reg.register(HACollector(ha))
    want = {"kvservice_leader": 1.0 if (role, held) == ("leader", True) else 0.0,
            "kvservice_leader_epoch": float(max(max_epoch, own_epoch)),
            "kvservice_lease_remaining_seconds": lease.remaining_seconds,
            "kvservice_lease_renewals_total": float(v[0]), "kvservice_lease_renew_failures_total": float(v[1]),
            "kvservice_standby_lag_entries": float(v[5]) if role == "standby" else 0.0,
            "kvservice_standby_reloads_total": float(v[6]), "kvservice_standby_applied_total": float(v[4]),
            "kvservice_takeover_seconds": ha.takeover_seconds,
            "kvservice_journal_append_retries_total": float(v[2]), "kvservice_nats_disconnects_total": float(v[3])}
    assert {k: reg.get_sample_value(k) for k in want} == want


@pytest.mark.parametrize("readonly, name", [(True, "kvservice-inspect"), (False, "kvservice")])
def test_open_journal_names_its_own_connection_by_purpose(nats1, readonly, name):
    """open_journal without a link opens its own, named "kvservice-inspect" for an inspection and "kvservice"
    otherwise (nats-server's /connz lists it), and the journal owns it."""
    from kvservice.server.ha import open_journal

    config = _config(nats1)
    _seed(config)
    before = set(_connections(nats1))
    j = open_journal(config, LEASE, readonly=readonly)
    try:
        opened = [n for cid, n in _connections(nats1).items() if cid not in before]
        assert opened == [name] and j.store.owns_link is True
    finally:
        j.close(snapshot=False)
