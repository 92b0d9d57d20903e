"""kvservice/server/ha.py: a standby's reload retries, a failed takeover, open_journal's recovery attempts and
read-only store, export_state's durable backup, and serve_ha's fail-stop chain.

Oracles: the module docstring (fail-stop: the journal fails, readiness turns NOT_SERVING, `kvservice serve` exits
3; a standby's store is read-only until it won the lease and fenced), open_journal's docstring (readonly:
nothing is written), RECOVERY_ATTEMPTS (recoveries tried while a compaction keeps overtaking the reader), the
exact messages the controller logs and fails with, and SQLite's own numbering of PRAGMA synchronous (FULL = 2).
Fakes stand in for the store, lease and journal where only the controller's own logic is checked; the rest runs
on the shared loopback nats-server (tests/conftest.py's nats1).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from kvservice.server.ha import HAController
from kvservice.state.journal import JournalConfig
from kvservice.state.nats.journal import JournalGap, StoreError

LEASE = 24 * 3600.0


class _Waits:
    """Stands in for the controller's stop event: records each wait's timeout and returns at once."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return False

    def is_set(self) -> bool:
        return False


def _fake_journal(**kw):
    fails: list[str] = []
    j = SimpleNamespace(manager=SimpleNamespace(events=SimpleNamespace(transaction=contextlib.nullcontext)),
                        _fail=fails.append, fails=fails, **kw)
    return j


def test_a_standby_reload_logs_each_retried_error_waits_longer_each_time_and_then_counts_the_reload(caplog):
    """_reload: a NATS/OS error while recovering again is logged as "standby reload: <message>; retrying" (the
    KVError's message, else the error's text) and waited out poll_seconds x attempt; a JournalGap retries at once;
    the first recovery that works counts one reload, logs where it got to, and returns True."""
    import nats.errors

    rng = np.random.default_rng(5)
    poll = float(rng.uniform(0.1, 0.9))
    snap, replayed, seq = (int(x) for x in rng.integers(10, 1000, 3))
    outcomes = [OSError("connection refused"), StoreError("no responders for the stream"), JournalGap("purged 7"),
                nats.errors.TimeoutError(), None]
    calls: list[int] = []

    def restart_reading() -> None:
        calls.append(1)
        err = outcomes[len(calls) - 1]
        if err is not None:
            raise err
    journal = _fake_journal(reload=lambda: replayed, snapshot_seq=snap, seq=seq)
    ha = HAController(journal, SimpleNamespace(restart_reading=restart_reading),
                      SimpleNamespace(config=SimpleNamespace(poll_seconds=poll)), None)
    ha._stop = _Waits()
    with caplog.at_level(logging.INFO, logger="kvservice.server.ha"):
        assert ha._reload(JournalGap("entry 3 was purged")) is True
    assert len(calls) == 5 and ha.reloads == 1 and ha.failed is None and journal.fails == []
    assert ha._stop.waits == pytest.approx([poll * 1, poll * 2, poll * 4])     # attempts 0, 1 and 3 failed
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvservice.server.ha"]
    assert msgs == [
        "standby fell behind a compaction (entry 3 was purged); recovering again from the newest snapshot",
        "standby reload: connection refused; retrying",
        "standby reload: no responders for the stream; retrying",
        "standby reload: nats: timeout; retrying",
        f"standby recovered again: snapshot at {snap}, {replayed} entries replayed, position {seq}"]


def test_a_standby_that_cannot_replay_the_newer_snapshot_fails_stop_naming_why():
    """_reload: a KVError other than a store error (damaged state) fail-stops at once: False, role "failed", the
    journal failed with "standby cannot recover from the newer snapshot: <message>"."""
    from kvservice.contract.errors import StateError

    def reload() -> int:
        raise StateError("snapshot 9 is not a kvservice snapshot")
    journal = _fake_journal(reload=reload)
    serving: list[bool] = []
    ha = HAController(journal, SimpleNamespace(restart_reading=lambda: None),
                      SimpleNamespace(config=SimpleNamespace(poll_seconds=0.5)), None, set_serving=serving.append)
    ha._stop = _Waits()
    assert ha._reload(JournalGap("entry 3 was purged")) is False
    why = "standby cannot recover from the newer snapshot: snapshot 9 is not a kvservice snapshot"
    assert (ha.role, ha.failed, journal.fails, serving, ha.reloads, ha._stop.waits) == (
        "failed", why, [why], [False], 0, [])


class _Lease:
    def __init__(self) -> None:
        self.config = SimpleNamespace(lapse_seconds=1.0, poll_seconds=0.5)
        self.holder = None
        self.lost: list[str] = []
        self.renewing: list[int] = []

    def start_renewing(self, delay, on_lost) -> None:
        self.renewing.append(delay)

    def lose(self, why: str) -> None:
        self.lost.append(why)

    def wait_valid(self, lapse) -> None:
        return None


@pytest.mark.parametrize("err, text", [(StoreError("stream KV_h1 not found"), "stream KV_h1 not found"),
                                       (OSError("connection reset by peer"), "connection reset by peer")])
def test_a_takeover_that_cannot_read_the_stream_gives_the_lease_up_and_fails_stop(err, text):
    """Module docstring, fail-stop: a takeover that fails (here: reading the stream to its end) gives the lease up
    and fails the journal, both with "takeover failed: <message>"; readiness turns NOT_SERVING, nothing is promoted
    and the store is never fenced."""
    fenced: list[int] = []

    def catch_up():
        raise err
    store = SimpleNamespace(guard=None, readonly=True, newest_snapshot_seq=lambda: 0, catch_up=catch_up,
                            stop_reading=lambda: None, fence=fenced.append, max_epoch=3)
    promoted: list[int] = []
    gate = SimpleNamespace(promote=promoted.append)
    lease = _Lease()
    journal = _fake_journal()
    serving: list[bool] = []
    ha = HAController(journal, store, lease, gate, set_serving=serving.append)
    ha._take_over()
    why = f"takeover failed: {text}"
    assert (lease.lost, journal.fails, ha.role, ha.failed, serving) == ([why], [why], "failed", why, [False])
    assert (promoted, fenced, lease.renewing) == ([], [], [0])


def _config(nats1):
    from kvservice.state.nats.journal import NatsConfig
    return NatsConfig(tuple(nats1.urls), name="d" + uuid.uuid4().hex[:10])


def _seed(config) -> int:
    """A deployment with one pool written by a sole writer; its journal position."""
    from kvservice.client.codec import create_pool_request
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.server.ha import open_sole_writer

    j = open_sole_writer(config, journal_config=JournalConfig(sync="normal", compact_every=1000,
                                                               background_snapshots=False), lease_seconds=LEASE)
    j.execute("CreatePool", create_pool_request("p", CacheSpec.uniform(2, 2, 8, "float16", 4), Sizing(num_slots=8)),
              j.api.CreatePool)
    seq = j.seq
    j.close(snapshot=False)
    return seq


@pytest.mark.parametrize("gaps", [0, 1, 4, 5])
def test_open_journal_recovers_again_up_to_recovery_attempts_times(nats1, monkeypatch, gaps):
    """open_journal: a JournalGap (a compaction overtook the reader) starts the recovery again from a newer
    snapshot, RECOVERY_ATTEMPTS recoveries in all; the last one's gap is raised."""
    from kvservice.server import ha
    from kvservice.state.journal import Journal

    assert ha.RECOVERY_ATTEMPTS == 5
    config = _config(nats1)
    seq = _seed(config)
    real = Journal.recover.__func__
    tries: list[int] = []

    def recover(cls, store, *a, **kw):
        tries.append(1)
        if len(tries) <= gaps:
            raise JournalGap(f"entry {len(tries)} was purged")
        return real(cls, store, *a, **kw)
    monkeypatch.setattr(Journal, "recover", classmethod(recover))
    if gaps >= ha.RECOVERY_ATTEMPTS:
        with pytest.raises(JournalGap) as err:
            ha.open_journal(config, LEASE)
        assert err.value.message == f"entry {ha.RECOVERY_ATTEMPTS} was purged"
        assert len(tries) == ha.RECOVERY_ATTEMPTS
        return
    j = ha.open_journal(config, LEASE)
    try:
        assert len(tries) == gaps + 1 and j.seq == seq and j.manager.pool_names() == ["p"]
    finally:
        j.close(snapshot=False)


@pytest.mark.parametrize("readonly", [True, False])
def test_open_journal_gives_a_read_only_store_that_cannot_fence_or_append(nats1, readonly):
    """open_journal's docstring: inspection writes nothing, and a standby opens it the same way, its store
    writable only after it won the lease and fenced: either way the store refuses to fence."""
    from kvservice.server.ha import open_journal

    config = _config(nats1)
    _seed(config)
    j = open_journal(config, LEASE, readonly=readonly)
    try:
        assert j.store.readonly is True
        with pytest.raises(StoreError) as err:
            j.store.fence(j.store.max_epoch + 1)
        assert err.value.message == "a read-only store cannot fence"
    finally:
        j.close(snapshot=False)


def test_export_state_writes_the_backup_with_full_sync(nats1, tmp_path, monkeypatch):
    """export_state writes a backup: its SQLite connection runs PRAGMA synchronous=FULL (SQLite's value 2) and its
    acknowledgement mark is fsynced, as a manager's state dir by default (sync "full")."""
    from kvservice.server.ha import export_state
    from kvservice.state.sqlite.store import SqliteStore

    config = _config(nats1)
    _seed(config)
    real = SqliteStore.open.__func__
    seen: list[tuple[int, bool]] = []

    def spy(cls, *a, **kw):
        store = real(cls, *a, **kw)
        seen.append((store.db.execute("PRAGMA synchronous").fetchone()[0], store.mark.sync))
        return store
    monkeypatch.setattr(SqliteStore, "open", classmethod(spy))
    export_state(config, tmp_path / "backup")
    assert seen == [(2, True)]


def test_a_served_manager_whose_journal_fails_stops_serving_and_tells_the_process(nats1):
    """serve_ha keeps the server's own fail-stop: once the journal fails the controller has failed (lease given up)
    AND the process is told to exit (running.failed), readiness and liveness both NOT_SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvservice.server.app import SERVICE_NAME
    from kvservice.server.ha import serve_ha, stop_ha
    from kvservice.state.nats.leader import LeaseConfig
    from tests.clocks import until

    running, ha = serve_ha(_config(nats1), LeaseConfig(), "127.0.0.1:0", node="n-" + uuid.uuid4().hex[:6],
                           lease_seconds=LEASE)
    try:
        assert until(lambda: ha.role in ("leader", "failed"))
        ha.journal._fail("test: an append was fenced")
        assert running.failed.is_set()
        assert ha.role == "failed" and ha.failed.endswith("test: an append was fenced")   # maybe via the lease
        assert ha.lease.lost == "journal failed: test: an append was fenced"
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for name in ("", SERVICE_NAME):
                assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == \
                    health_pb2.HealthCheckResponse.NOT_SERVING, name
    finally:
        stop_ha(running, ha)


class _FenceStore:
    """A stream that the old leader keeps appending to: every fence is refused (Fenced) unless `accept_at`."""

    def __init__(self, max_epoch: int, accept_at: int | None = None, gap_at: int | None = None) -> None:
        self.max_epoch = max_epoch
        self.accept_at = accept_at
        self.gap_at = gap_at
        self.tries: list[int] = []
        self.catch_ups = 0

    def catch_up(self) -> list:
        self.catch_ups += 1
        if self.catch_ups == self.gap_at:
            raise JournalGap("entry 12 was purged")
        return []

    def fence(self, epoch: int) -> None:
        from kvservice.state.nats.journal import Fenced
        self.tries.append(epoch)
        self.max_epoch = max(self.max_epoch, epoch - 1) + (0 if len(self.tries) == self.accept_at else 1)
        if len(self.tries) != self.accept_at:
            raise Fenced(f"wrong last sequence at epoch {epoch}")


def _fence_controller(store, holder_epoch: int | None):
    lease = _Lease()
    if holder_epoch is not None:
        lease.holder = SimpleNamespace(epoch=holder_epoch)
    journal = _fake_journal(follow=lambda entries: len(list(entries)))
    return HAController(journal, store, lease, None)


def test_fence_uses_the_epoch_above_the_highest_seen_reads_on_when_refused_and_names_its_laps(caplog):
    """Module docstring: fence with epoch highest seen (the stream's fences, the lease holder's) + 1; if the old
    leader slipped an entry in (Fenced), read on and fence again, logging it; the laps name each read and fence."""
    store = _FenceStore(max_epoch=7, accept_at=3)
    ha = _fence_controller(store, holder_epoch=9)
    laps: list[str] = []
    with caplog.at_level(logging.WARNING, logger="kvservice.server.ha"):
        assert ha._fence(laps.append) == 12
    assert store.tries == [10, 11, 12]          # above the holder's 9, then above each epoch the stream showed
    assert laps == ["caught up", "caught up", "caught up", "fenced"]
    assert [r.getMessage() for r in caplog.records] == [
        "the journal moved while fencing epoch 10; reading on", "the journal moved while fencing epoch 11; reading on"]


def test_fence_gives_up_after_fence_attempts_naming_them():
    """_fence: a writer that keeps appending makes every one of FENCE_ATTEMPTS fences fail: StoreError naming the
    count; nothing is fenced."""
    from kvservice.server.ha import FENCE_ATTEMPTS

    assert FENCE_ATTEMPTS == 20
    store = _FenceStore(max_epoch=2)
    ha = _fence_controller(store, holder_epoch=None)
    with pytest.raises(StoreError) as err:
        ha._fence()
    assert err.value.message == "could not fence the journal in 20 attempts: another writer keeps appending"
    assert store.tries == list(range(3, 23)) and store.catch_ups == 20


def test_fence_overtaken_by_a_compaction_it_cannot_recover_from_names_the_failure():
    """_fence: a JournalGap while reading to the end reloads; a reload that fails makes the takeover fail with
    "takeover: <the controller's failure>"; one that works reads on and fences."""
    from kvservice.contract.errors import StateError

    def bad_reload() -> int:
        raise StateError("snapshot 4 is damaged")
    store = _FenceStore(max_epoch=1, accept_at=1, gap_at=1)
    store.restart_reading = lambda: None
    ha = _fence_controller(store, holder_epoch=None)
    ha.journal.reload = bad_reload
    with pytest.raises(StoreError) as err:
        ha._fence()
    assert err.value.message == "takeover: standby cannot recover from the newer snapshot: snapshot 4 is damaged"
    assert store.tries == []

    store = _FenceStore(max_epoch=1, accept_at=1, gap_at=1)
    store.restart_reading = lambda: None
    ha = _fence_controller(store, holder_epoch=None)
    ha.journal.reload, ha.journal.snapshot_seq, ha.journal.seq = (lambda: 2), 5, 7
    ha._stop = _Waits()
    assert ha._fence() == 2 and ha.reloads == 1 and store.catch_ups == 2 and store.tries == [2]


def test_leadership_lost_deposes_the_gate_and_fails_stop_naming_why():
    """_lost (the lease renewer's callback): the gate refuses with "leadership lost: <why>" and the controller
    fail-stops with the same reason; the first reason is kept."""
    deposed: list[str] = []
    journal = _fake_journal()
    serving: list[bool] = []
    ha = HAController(journal, None, _Lease(), SimpleNamespace(depose=deposed.append), set_serving=serving.append)
    ha._lost("the key is held by mgr-b")
    ha._lost("later")
    why = "leadership lost: the key is held by mgr-b"
    assert deposed == [why, "leadership lost: later"]
    assert (ha.role, ha.failed, journal.fails[0], serving) == ("failed", why, why, [False, False])


def test_measure_lag_is_the_stream_messages_not_applied_and_none_when_nats_does_not_answer():
    """_measure_lag: stream's last sequence minus the last one read (never below 0), also the gauge; a StoreError
    leaves the gauge as it was and returns None."""
    rng = np.random.default_rng(11)
    read, ahead = (int(x) for x in rng.integers(1, 10_000, 2))
    store = SimpleNamespace(last_stream_seq=read, stream_last_seq=lambda: read + ahead)
    ha = HAController(None, store, None, None)
    assert ha._measure_lag() == ahead and ha.lag_entries == ahead
    store.stream_last_seq = lambda: read - 3                  # a stream read past what was last measured
    assert ha._measure_lag() == 0 and ha.lag_entries == 0
    ha.lag_entries = 17

    def down() -> int:
        raise StoreError("no responders")
    store.stream_last_seq = down
    assert ha._measure_lag() is None and ha.lag_entries == 17


def test_export_state_fills_an_existing_empty_dir(nats1, tmp_path):
    """A backup target that already exists but holds no state (a mounted volume, a dir made beforehand) is used as
    it is (docs/HA.md: the export refuses only a dir that already holds kvservice state); the backup then opens as a
    state dir at the source's position."""
    from kvservice.server.ha import export_state
    from kvservice.state.sqlite.store import DB_NAME, SqliteStore

    config = _config(nats1)
    _seed(config)
    target = tmp_path / "mounted"
    target.mkdir()
    src = export_state(config, target)
    assert (target / DB_NAME).exists()
    store = SqliteStore.open(target, readonly=True)
    try:
        assert store.load_snapshot()[0] == src.seq > 0
    finally:
        store.close(clean=False, seq=src.seq)
