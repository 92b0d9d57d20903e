"""kvservice.server.ha without a serving manager: export_state, HACollector, journal_failed and stop.

One real nats-server on loopback for the module (tests/natsutil.py: skipped where it is not installed,
failing under CI=true); every test uses a deployment name of its own. The expected values are the
requests the test sent (a plain-Python tally) and the rules of docs/HA.md and the module docstring.
"""

from __future__ import annotations

import json
import threading
import urllib.request
import uuid

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvservice.client.codec import create_pool_request, step_request
from kvservice.contract.errors import StateError
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.state.journal import Journal, JournalConfig
from tests.clocks import until

LEASE = 24 * 3600.0




def _connections(nats1) -> dict[int, str]:
    """{client id: connection name} of the server's open client connections (nats-server's /connz)."""
    with urllib.request.urlopen(f"{nats1.monitor}/connz?limit=1024", timeout=10) as r:
        return {c["cid"]: c.get("name", "") for c in json.load(r)["connections"] or ()}


def _config(nats1):
    from kvservice.state.nats.journal import NatsConfig
    return NatsConfig(tuple(nats1.urls), name="h" + uuid.uuid4().hex[:10])


def _journal_config() -> JournalConfig:
    return JournalConfig(sync="normal", compact_every=1000, background_snapshots=False)


def _write_state(j: Journal, rng: np.random.Generator) -> dict[int, int]:
    """Pool "p" with a few admitted sequences of random lengths; {seq_id: num_tokens} as sent."""
    j.execute("CreatePool", create_pool_request("p", CacheSpec.uniform(2, 2, 8, "float16", 4),
                                                Sizing(num_slots=64, max_seq_len=64)), j.api.CreatePool)
    ids = sorted(int(i) for i in rng.choice(np.arange(1, 10_000), 5, replace=False))
    tokens = [int(t) for t in rng.integers(1, 30, len(ids))]
    j.execute("Step", step_request("p", admit=ids, admit_tokens=tokens), j.api.Step)
    return dict(zip(ids, tokens, strict=True))


def _live(j: Journal) -> dict[int, int]:
    ids, ntok = j.manager.pool_and_lock("p")[0].sequences()
    return dict(zip(ids.tolist(), ntok.tolist(), strict=True))


def test_export_state_writes_a_state_dir_that_opens_to_the_replicated_state(nats1, tmp_path) -> None:
    from kvservice.server.ha import export_state, open_sole_writer

    config = _config(nats1)
    j = open_sole_writer(config, journal_config=_journal_config(), lease_seconds=LEASE)
    want = _write_state(j, np.random.default_rng(23))
    position = j.seq
    j.close()
    src = export_state(config, tmp_path / "backup")
    assert src.seq == position
    copy = Journal.open(tmp_path / "backup", LEASE, readonly=True)
    try:
        assert copy.manager.pool_names() == ["p"] and _live(copy) == want and copy.seq == position
    finally:
        copy.close(snapshot=False)
    with pytest.raises(StateError, match="already holds kvservice state"):    # never over an existing state dir
        export_state(config, tmp_path / "backup")


def test_import_state_connects_as_kvservice_import_and_continues_the_state_dirs_position(nats1, tmp_path) -> None:
    """import_state names its NATS connections "kvservice-import" and "kvservice-import-journal" (an operator
    tells them from a manager's in nats-server's connz; closed connections stay listed there) and leaves the new
    deployment at the state dir's position and the epoch asked for."""
    from kvservice.server.ha import export_state, import_state, open_sole_writer

    config = _config(nats1)
    j = open_sole_writer(config, journal_config=_journal_config(), lease_seconds=LEASE)
    _write_state(j, np.random.default_rng(29))
    position = j.seq
    j.close()
    closed = f"{nats1.monitor}/connz?state=closed&limit=100000"

    def closed_names() -> dict[int, str]:
        with urllib.request.urlopen(closed, timeout=10) as r:
            return {c["cid"]: c.get("name", "") for c in json.load(r)["connections"] or ()}

    inspects = lambda: sum(name == "kvservice-inspect" for name in closed_names().values())  # noqa: E731
    k = inspects()
    export_state(config, tmp_path / "sd")
    assert until(lambda: inspects() > k)    # the export's own connection, listed once the server saw it close
    before, epoch = closed_names(), int(np.random.default_rng(31).integers(2, 50))
    assert import_state(tmp_path / "sd", _config(nats1), epoch=epoch) == (position, epoch)
    opened = lambda: sorted(name for cid, name in closed_names().items() if cid not in before)  # noqa: E731
    assert until(lambda: len(opened()) >= 2)          # the server lists a close once it has seen it
    assert opened() == ["kvservice-import", "kvservice-import-journal"]


def _controller(nats1, epoch: int):
    from kvservice.server.ha import HAController, LeaderGate, open_sole_writer
    from kvservice.state.nats.leader import Lease, LeaseConfig

    j = open_sole_writer(_config(nats1), journal_config=_journal_config(), lease_seconds=LEASE, epoch=epoch)
    lease = Lease(j.store.link, LeaseConfig(), "node-" + uuid.uuid4().hex[:6], "127.0.0.1:1")
    return j, lease, HAController(j, j.store, lease, LeaderGate())


#: The series HACollector exports, one each (deploy/'s rules and the Grafana board read some of them).
HA_SERIES = ("kvservice_leader", "kvservice_leader_epoch", "kvservice_lease_remaining_seconds",
             "kvservice_lease_renewals_total", "kvservice_lease_renew_failures_total",
             "kvservice_standby_lag_entries", "kvservice_standby_reloads_total", "kvservice_standby_applied_total",
             "kvservice_takeover_seconds", "kvservice_journal_append_retries_total",
             "kvservice_nats_disconnects_total")


def test_ha_collector_exports_each_series_with_help_and_the_controllers_figures(nats1) -> None:
    from kvservice.server.ha import HACollector

    rng = np.random.default_rng(7)
    epoch = int(rng.integers(3, 9))
    j, _lease, ha = _controller(nats1, epoch)
    try:
        ha.lag_entries, ha.reloads, ha.applied = (int(x) for x in rng.integers(1, 1000, 3))
        ha.takeover_seconds = float(rng.uniform(0.1, 5))
        ha.store.append_retries, ha.store.link.disconnects = (int(x) for x in rng.integers(1, 1000, 2))
        reg = CollectorRegistry()
        reg.register(HACollector(ha))
        text = generate_latest(reg).decode()
        helps = {ln.split(" ", 3)[2]: ln.split(" ", 3)[3] for ln in text.splitlines() if ln.startswith("# HELP ")}
        assert sorted(helps) == sorted(HA_SERIES)
        assert all(h and h != "None" for h in helps.values()), helps
        want = {"kvservice_leader": 0.0, "kvservice_leader_epoch": float(epoch),       # a standby: not leading
                "kvservice_lease_remaining_seconds": 0.0, "kvservice_lease_renewals_total": 0.0,
                "kvservice_lease_renew_failures_total": 0.0, "kvservice_standby_lag_entries": float(ha.lag_entries),
                "kvservice_standby_reloads_total": float(ha.reloads),
                "kvservice_standby_applied_total": float(ha.applied),
                "kvservice_takeover_seconds": ha.takeover_seconds,
                "kvservice_journal_append_retries_total": float(ha.store.append_retries),
                "kvservice_nats_disconnects_total": float(ha.store.link.disconnects)}
        assert {k: reg.get_sample_value(k) for k in want} == want
        ha.role = "leader"                          # leading but the lease not held: still 0; no lag on a leader
        assert reg.get_sample_value("kvservice_leader") == 0.0
        assert reg.get_sample_value("kvservice_standby_lag_entries") == 0.0
    finally:
        j.close(snapshot=False)


def test_a_failed_journal_deposes_the_leader_gives_the_lease_up_and_keeps_the_first_reason(nats1) -> None:
    """Module doc, fail-stop: a leader whose append was fenced stops serving writes at once and stops renewing."""
    j, lease, ha = _controller(nats1, 2)
    try:
        assert lease.try_acquire() and lease.held           # a fresh deployment name: the key is free
        ha.gate.promote(2)
        ha.role = "leader"
        ha.journal_failed("append fenced by epoch 3")
        assert not ha.gate.leader and "append fenced by epoch 3" in ha.gate.refusal()
        assert not lease.held and lease.lost == "journal failed: append fenced by epoch 3"
        assert (ha.role, ha.failed) == ("failed", "append fenced by epoch 3")      # as _fail names the state
        ha.journal_failed("a later failure")
        assert ha.failed == "append fenced by epoch 3"
    finally:
        lease.release()
        j.close(snapshot=False)


class _Follower(threading.Thread):
    """The standby's thread as HAController.start makes it (it ends once stop() sets the stop event), noting how
    long each join may wait."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__(target=stop.wait, daemon=True, name="ha-standby")
        self.waits: list[float | None] = []

    def join(self, timeout: float | None = None) -> None:
        self.waits.append(timeout)
        super().join(timeout)


def test_stop_deposes_ends_the_follower_and_waits_for_it_a_bounded_time(nats1) -> None:
    """stop() must not hang a shutdown (stop_ha then snapshots and releases the key) on a stuck follower."""
    j, _lease, ha = _controller(nats1, 1)
    try:
        ha.gate.promote(1)
        follower = _Follower(ha._stop)
        ha._thread = follower
        follower.start()
        ha.stop()
        assert not follower.is_alive() and not ha.gate.leader and "shutting down" in ha.gate.refusal()
        (wait,) = follower.waits
        assert wait is not None and 0 < wait <= 30
    finally:
        j.close(snapshot=False)


def test_a_sole_writers_nats_connections_are_named_as_the_tools(nats1) -> None:
    """open_sole_writer (kvservice import-state, tests) connects as "kvservice-tool", its journal publisher as
    "kvservice-tool-journal", so an operator tells a tool's connections from a manager's in nats-server's connz."""
    from kvservice.server.ha import open_sole_writer

    before = _connections(nats1)
    j = open_sole_writer(_config(nats1), journal_config=_journal_config(), lease_seconds=LEASE)
    try:
        opened = sorted(name for cid, name in _connections(nats1).items() if cid not in before)
        assert opened == ["kvservice-tool", "kvservice-tool-journal"]
    finally:
        j.close(snapshot=False)


def test_a_standby_whose_consumer_vanished_reads_on_with_a_new_one(nats1, caplog) -> None:
    """Module code: a standby's consumer that delivers nothing while the stream holds more (its NATS node, R1 in
    memory, restarted) is replaced within about a second, and the warning says so; the standby then holds the
    leader's state. Here the consumer is deleted on the server while the writer appends."""
    import logging

    from kvservice.server.ha import HAController, LeaderGate, open_journal, open_sole_writer
    from kvservice.state.nats.leader import Lease, LeaseConfig

    config, rng = _config(nats1), np.random.default_rng(31)
    writer = open_sole_writer(config, journal_config=_journal_config(), lease_seconds=LEASE)
    want = _write_state(writer, rng)
    lease_config = LeaseConfig(ttl_seconds=300, renew_seconds=10, poll_seconds=0.2)
    holder = Lease(writer.store.link, lease_config, "writer")
    assert holder.try_acquire()                  # the key is held (and stands still far shorter than its TTL)
    standby = open_journal(config, LEASE, _journal_config(), readonly=False)
    ha = HAController(standby, standby.store, Lease(standby.store.link, lease_config, "standby"), LeaderGate())
    caplog.set_level(logging.WARNING, logger="kvservice.server.ha")
    try:
        ha.start()
        assert until(lambda: standby.seq == writer.seq) and _live(standby) == want
        link = writer.store.link
        for c in link.call(link.js.consumers_info(config.stream), 10):
            link.call(link.js.delete_consumer(config.stream, c.name), 10)
        ids = [int(i) for i in rng.choice(np.arange(10_000, 20_000), 3, replace=False)]
        tokens = [int(t) for t in rng.integers(1, 30, len(ids))]
        writer.execute("Step", step_request("p", admit=ids, admit_tokens=tokens), writer.api.Step)
        want.update(zip(ids, tokens, strict=True))
        assert until(lambda: standby.seq == writer.seq), (standby.seq, writer.seq)
        assert _live(standby) == want and ha.role == "standby" and ha.failed is None
        notes = [r.getMessage() for r in caplog.records if r.name == "kvservice.server.ha"]
        assert any(n.startswith("standby: no journal message for 1 s while ") and
                   n.endswith(" behind; reading on with a new consumer") for n in notes), notes
    finally:
        ha.stop()
        standby.close(snapshot=False)
        holder.release()
        writer.close(snapshot=False)


def test_the_default_node_id_is_hostname_dash_pid(monkeypatch) -> None:
    """docs/HA.md: --node-id defaults to HOSTNAME-pid (the HOSTNAME variable, a pod's name; the host's name without)."""
    import os
    import socket

    from kvservice.server.ha import default_node_id
    pod = f"kvservice-{uuid.uuid4().hex[:5]}"
    monkeypatch.setenv("HOSTNAME", pod)
    assert default_node_id() == f"{pod}-{os.getpid()}"
    monkeypatch.delenv("HOSTNAME")
    assert default_node_id() == f"{socket.gethostname()}-{os.getpid()}"


def test_a_standby_that_cannot_recover_from_the_newer_snapshot_fails_naming_why(nats1) -> None:
    """ha.py _reload: a standby that fell behind a compaction recovers again from the newest snapshot; if that
    snapshot cannot be decoded (here: random bytes stored under a valid store digest, so only the snapshot's own
    format check refuses them) it fail-stops, and its reason says what it could not do and why."""
    from kvservice.server.ha import HAController, LeaderGate, open_journal, open_sole_writer
    from kvservice.state import snapshot as snap
    from kvservice.state.nats.config import JournalGap
    from kvservice.state.nats.leader import Lease, LeaseConfig

    config, rng = _config(nats1), np.random.default_rng(37)
    writer = open_sole_writer(config, journal_config=_journal_config(), lease_seconds=LEASE)
    standby = open_journal(config, LEASE, _journal_config(), readonly=False)
    try:
        _write_state(writer, rng)
        junk = rng.integers(0, 256, 300, dtype=np.uint8).tobytes()
        writer.store.write_snapshot(writer.seq, snap.Encoded(b"", len(junk), [junk]))
        ha = HAController(standby, standby.store, Lease(standby.store.link, LeaseConfig(), "standby"), LeaderGate())
        assert ha._reload(JournalGap("test: the entries after 0 were purged")) is False
        assert ha.role == "failed"
        assert ha.failed.startswith("standby cannot recover from the newer snapshot: ")
        assert "too short to be a snapshot" in ha.failed or "not a kvservice snapshot" in ha.failed, ha.failed
        assert ha.reloads == 0
    finally:
        standby.close(snapshot=False)
        writer.close(snapshot=False)
