"""One recovery suite, two journal backends: SQLite (a state dir) and NATS JetStream (a real nats-server).

The backend fixture opens a writable Journal over persistent state, "crashes" it (closes it
without a snapshot, as kill -9 would leave it) and opens it again; every test here runs
against both. NATS-only tests at the end: entries larger than a message, a writer dying
mid-entry, two writers (fencing), checksums.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvservice.contract.errors import JournalUnavailable, KVError
from kvservice.contract.wire import to_tensor
from kvservice.core.invariants import assert_invariants
from kvservice.server.ha import open_journal, open_sole_writer
from kvservice.state.journal import Journal, JournalConfig, StateError
from kvservice.state.nats.journal import Fenced, NatsConfig, NatsLink, NatsStore, StoreError, Unrecoverable
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb

from ..natsutil import NatsCluster
from ..unit.test_journal import body, prefix_workload, run, setup_pools, step_req, workload

pytestmark = pytest.mark.integration




#: Workers' lease in these tests: longer than any run, so that a worker is never swept dead while a
#: workload runs on a loaded machine (a sweep is not journaled: the recovered worker would be alive and
#: the compared states would differ by the machine's speed). Leases are tested with a clock of their own.
LEASE_S = 3600.0


class SqliteBackend:
    name = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self, config: JournalConfig) -> Journal:
        return Journal.open(self.path, LEASE_S, config=config)

    def open_readonly(self) -> Journal:
        return Journal.open(self.path, LEASE_S, readonly=True)

    def stored_entries(self) -> int:
        import sqlite3
        db = sqlite3.connect(self.path / "state.db")
        try:
            return db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        finally:
            db.close()


class NatsBackend:
    """A deployment name of its own on the module's nats-server; a new writer fences out the previous one."""

    name = "nats"

    def __init__(self, cluster: NatsCluster) -> None:
        self.config = NatsConfig(tuple(cluster.urls), name="b" + uuid.uuid4().hex[:10])

    def open(self, config: JournalConfig) -> Journal:
        return open_sole_writer(self.config, journal_config=config, lease_seconds=LEASE_S)

    def open_readonly(self) -> Journal:
        return open_journal(self.config, LEASE_S, readonly=True)

    def stored_entries(self) -> int:
        link = NatsLink(self.config)
        try:
            info = link.call(link.js.stream_info(self.config.stream), 10)
            return int(info.state.messages)
        finally:
            link.close()


@pytest.fixture(params=["sqlite", "nats"])
def backend(request, tmp_path):
    if request.param == "sqlite":
        return SqliteBackend(tmp_path / "state")
    return NatsBackend(request.getfixturevalue("nats1"))


def crash(j: Journal) -> None:
    j.close(snapshot=False)


FAST = JournalConfig(sync="normal", compact_every=1000)


@pytest.mark.parametrize("compact_every", [1000, 17])
def test_recovery_rebuilds_the_exact_state(backend, compact_every):
    j = backend.open(JournalConfig(sync="normal", compact_every=compact_every))
    setup_pools(j)
    workload(j, np.random.default_rng(compact_every), 120)
    prefix_workload(j, np.random.default_rng(compact_every), 60)
    with j.manager.locked("c") as pool:
        assert pool.prefix.hits > 0                       # the prefix cache was exercised
    before = state_tree(j.manager)
    crash(j)
    j2 = backend.open(FAST)
    assert state_tree(j2.manager) == before
    for name in j2.manager.pool_names():
        with j2.manager.locked(name) as pool:
            assert_invariants(pool)
    workload(j2, np.random.default_rng(5), 30)           # it goes on exactly like the original would
    after = state_tree(j2.manager)
    j2.close()                                            # clean: snapshot
    j3 = backend.open_readonly()
    try:
        assert state_tree(j3.manager) == after and j3.seq == j3.snapshot_seq
    finally:
        j3.close(snapshot=False)


def test_snapshots_bound_the_journal_tail(backend):
    j = backend.open(JournalConfig(sync="normal", compact_every=10, background_snapshots=False))
    setup_pools(j)
    workload(j, np.random.default_rng(1), 45)
    assert j.snapshots >= 3 and j.seq - j.snapshot_seq < 10
    tail = j.seq - j.snapshot_seq
    tree = state_tree(j.manager)
    crash(j)
    assert backend.stored_entries() == tail               # compaction dropped what the snapshot covers
    j2 = backend.open_readonly()
    try:
        assert j2.seq - j2.snapshot_seq == tail and state_tree(j2.manager) == tree
    finally:
        j2.close(snapshot=False)


def test_retry_after_a_restart_gets_the_original_reply(backend):
    j = backend.open(FAST)
    setup_pools(j)
    first = run(j, "Step", step_req("a", admit=[1, 2], n=[40, 17], rid="step-1"))
    crash(j)
    j2 = backend.open(FAST)                               # regenerated by replay
    assert body(run(j2, "Step", step_req("a", admit=[1, 2], n=[40, 17], rid="step-1"))) == body(first)
    j2.close()                                            # ... or kept in the snapshot
    j3 = backend.open(FAST)
    assert j3.seq == j3.snapshot_seq
    again = run(j3, "Step", step_req("a", admit=[1, 2], n=[40, 17], rid="step-1"))
    assert body(again) == body(first)          # the same reply, stamped with the position now
    assert (again.position.incarnation, again.position.seq) == (j3.incarnation, j3.seq)
    assert j3.incarnation > first.position.incarnation
    assert j3.window.hits == 1
    with j3.manager.locked("a") as pool:
        assert pool.steps == 1
    crash(j3)


def test_write_failure_fail_stops_and_the_step_is_not_there_after_recovery(backend):
    j = backend.open(FAST)
    setup_pools(j)
    run(j, "Step", step_req("a", admit=[1], n=[20], rid="ok"))
    durable = state_tree(j.manager)
    stops = []
    j.on_fail = stops.append

    def broken(*_a):
        raise OSError(5, "Input/output error")
    j.store.append = broken
    with pytest.raises(JournalUnavailable, match="not made durable"):
        run(j, "Step", step_req("a", admit=[2], n=[20], rid="lost"))
    assert stops and j.failed
    crash(j)
    j2 = backend.open_readonly()
    try:
        assert state_tree(j2.manager) == durable
    finally:
        j2.close(snapshot=False)


# ---- NATS only ------------------------------------------------------------------------------------------------

@pytest.fixture
def nats_backend(nats1):
    return NatsBackend(nats1)


def _prefix_pool_request(name: str, max_seq_len: int) -> pb.CreatePoolRequest:
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.state.startup import create_request
    req = create_request(name, CacheSpec.uniform(2, 1, 64, page_size=16),
                         Sizing(num_slots=max_seq_len // 16 + 64, max_seq_len=max_seq_len), ())
    req.enable_prefix_caching = True
    return req


def test_an_entry_larger_than_a_message_is_split_and_rebuilt(nats_backend):
    j = nats_backend.open(FAST)
    run(j, "CreatePool", _prefix_pool_request("big", 400_000))
    tokens = np.random.default_rng(3).integers(1, 30_000, 300_000).astype(np.int64)     # 2.4 MB of token ids
    req = step_req("big", admit=[7], n=[len(tokens)], rid="big-1")
    req.admit_token_ids.CopyFrom(to_tensor(tokens))
    assert req.ByteSize() > 2 * j.store.max_part_bytes
    run(j, "Step", req)
    run(j, "Step", step_req("big", extend=[7], k=5, rid="small"))
    tree = state_tree(j.manager)
    crash(j)
    j2 = nats_backend.open_readonly()
    try:
        assert state_tree(j2.manager) == tree and j2.seq == 3
        assert "big-1" in j2.window.ids
    finally:
        j2.close(snapshot=False)


def test_a_writer_dying_mid_entry_leaves_nothing_half_applied(nats_backend):
    j = nats_backend.open(FAST)
    run(j, "CreatePool", _prefix_pool_request("big", 400_000))
    run(j, "Step", step_req("big", admit=[1], n=[100], rid="one"))
    tree = state_tree(j.manager)
    store: NatsStore = j.store
    # The first part of a three-part entry reaches the stream, then the writer dies.
    store._publish(b"\x00" * 1000, {"Kvs-Kind": "entry", "Kvs-Seq": str(store.seq + 1), "Kvs-Method": "Step",
                                    "Kvs-At": "0.0", "Kvs-Epoch": str(store.epoch), "Kvs-Part": "0/3",
                                    "Kvs-Digest": "0" * 32, "Nats-Msg-Id": "dying"})
    crash(j)
    j2 = nats_backend.open(FAST)                          # the next writer reads past it and fences
    assert state_tree(j2.manager) == tree
    run(j2, "Step", step_req("big", extend=[1], k=2, rid="two"))
    tree2 = state_tree(j2.manager)
    crash(j2)
    j3 = nats_backend.open_readonly()
    try:
        assert state_tree(j3.manager) == tree2 and j3.seq == 3
    finally:
        j3.close(snapshot=False)


def test_a_fenced_writer_cannot_append_and_fail_stops(nats_backend):
    old = nats_backend.open(FAST)
    setup_pools(old)
    run(old, "Step", step_req("a", admit=[1], n=[10], rid="before"))
    new = nats_backend.open(FAST)                         # recovers and fences: old's view is now stale
    tree = state_tree(new.manager)
    with pytest.raises(JournalUnavailable, match="another manager wrote it"):
        run(old, "Step", step_req("a", admit=[2], n=[10], rid="stale"))
    assert old.failed
    run(new, "Step", step_req("a", admit=[3], n=[10], rid="after"))
    crash(old)
    crash(new)
    j = nats_backend.open_readonly()
    try:
        assert "stale" not in j.window.ids and "after" in j.window.ids
        with j.manager.locked("a") as pool:
            ids, _ = pool.sequences()
            assert sorted(ids.tolist()) == [1, 3]
        assert state_tree(j.manager) != tree
    finally:
        j.close(snapshot=False)


def test_two_writers_fencing_the_same_epoch_from_the_same_view_one_wins(nats_backend):
    """The race a non-atomic lease allows: two managers read the stream to the same end and fence the same
    epoch. The second fence is refused (its message id is its own, so the server cannot answer it with the
    first one's "duplicate"), its entries too; everything the winner acknowledges is recovered."""
    first = nats_backend.open(FAST)
    setup_pools(first)
    run(first, "Step", step_req("a", admit=[1], n=[10], rid="before"))
    crash(first)
    a = open_journal(nats_backend.config, readonly=False)
    b = open_journal(nats_backend.config, readonly=False)
    sa, sb = a.store, b.store
    assert sa.last_stream_seq == sb.last_stream_seq and sa.max_epoch == sb.max_epoch
    epoch = sa.max_epoch + 1
    for s in (sa, sb):
        s.readonly = False
    sa.fence(epoch)
    with pytest.raises(Fenced, match="another manager wrote it"):
        sb.fence(epoch)
    a.incarnation = epoch
    run(a, "Step", step_req("a", admit=[2], n=[10], rid="winner"))
    sb.epoch, sb.writer = epoch, sa.writer       # even a loser that took the fence as its own (and the token)
    with pytest.raises(JournalUnavailable):       # cannot append: the stream moved past what it read
        run(b, "Step", step_req("a", admit=[3], n=[10], rid="loser"))
    crash(a)
    crash(b)
    j = nats_backend.open_readonly()
    try:
        assert {"before", "winner"} <= set(j.window.ids) and "loser" not in j.window.ids
    finally:
        j.close(snapshot=False)


def test_a_fence_at_an_epoch_already_seen_is_refused_before_it_is_published(nats_backend):
    """A writer that has read the stream to its end knows the highest epoch fenced so far; a fence at that
    epoch (or below) would make two writers of one epoch, the split brain the kill loop found. It is refused
    by the store itself, before anything reaches the stream (not only by the expected-sequence check)."""
    first = nats_backend.open(FAST)
    setup_pools(first)
    crash(first)
    a = open_journal(nats_backend.config, readonly=False)
    a.store.readonly = False
    epoch = a.store.max_epoch + 1
    a.store.fence(epoch)
    crash(a)
    c = open_journal(nats_backend.config, readonly=False)      # caught up: it has read a's fence
    try:
        store = c.store
        assert store.max_epoch == epoch
        store.readonly = False
        end = store.stream_last_seq()
        for stale in (epoch, epoch - 1):
            with pytest.raises(StoreError, match=f"epoch {stale} is not above the highest seen, {epoch}"):
                store.fence(stale)
        assert store.stream_last_seq() == end and store.epoch != epoch   # nothing published, nothing taken
        store.fence(epoch + 1)                                            # the next epoch is taken as usual
        assert store.max_epoch == epoch + 1 and store.stream_last_seq() == end + 1
    finally:
        crash(c)


def test_a_corrupt_entry_or_snapshot_is_refused(nats_backend):
    j = nats_backend.open(FAST)
    setup_pools(j)
    store: NatsStore = j.store
    store._publish(b"not the request", {"Kvs-Kind": "entry", "Kvs-Seq": str(store.seq + 1), "Kvs-Method": "Step",
                                        "Kvs-At": "0.0", "Kvs-Epoch": str(store.epoch), "Kvs-Part": "0/1",
                                        "Kvs-Digest": "0" * 32, "Nats-Msg-Id": "corrupt"})
    crash(j)
    with pytest.raises(StateError, match="fails its checksum"):
        nats_backend.open_readonly()
    # A snapshot whose header does not match its bytes
    link = NatsLink(nats_backend.config)
    try:
        from nats.js import api
        obs = link.call(link.js.object_store(nats_backend.config.snapshot_bucket), 10)
        meta = {"format": 2, "seq": 99, "stream_seq": 0, "epoch": 1, "at": 0.0, "bytes": 3, "digest": "0" * 32}
        link.call(obs.put("snap-" + "9" * 20, b"abc", meta=api.ObjectMeta(name="snap-" + "9" * 20,
                                                                           description=json.dumps(meta))), 10)
    finally:
        link.close()
    with pytest.raises(Unrecoverable, match="does not match its header"):   # damage: refused at once, not retried
        nats_backend.open_readonly()


def test_a_missing_deployment_is_reported(nats1, caplog):
    """At once: a stream that is not there will not appear by waiting (check-state against a wrong name)."""
    config = NatsConfig(tuple(nats1.urls), name="absent" + uuid.uuid4().hex[:6])
    with pytest.raises(StoreError, match="no kvservice journal there"):
        open_journal(config, readonly=True)
    assert "retrying" not in caplog.text


def test_recovery_refuses_an_entry_the_code_cannot_replay(nats_backend):
    j = nats_backend.open(FAST)
    setup_pools(j)
    store: NatsStore = j.store
    bad = step_req("a", extend=[12345], k=1).SerializeToString()       # an unknown sequence: refused on replay
    from kvservice.state.stores import entry_digest
    digest = entry_digest(store.seq + 1, "Step", bad, 0.0).hex()           # intact: only the replay refuses it
    store._publish(bad, {"Kvs-Kind": "entry", "Kvs-Seq": str(store.seq + 1), "Kvs-Method": "Step", "Kvs-At": "0.0",
                         "Kvs-Epoch": str(store.epoch), "Kvs-Part": "0/1", "Kvs-Digest": digest,
                         "Nats-Msg-Id": "unreplayable"})
    crash(j)
    with pytest.raises((StateError, KVError), match="failed on replay"):
        nats_backend.open_readonly()


def test_state_moves_between_backends_unchanged(nats1, tmp_path):
    """A state dir imported into NATS, served, exported back: the same state at every hop (backup and restore)."""
    from kvservice.server.ha import export_state, import_state
    j = Journal.open(tmp_path / "single", config=FAST)
    setup_pools(j)
    workload(j, np.random.default_rng(7), 60)
    tree = state_tree(j.manager)
    j.close()
    config = NatsConfig(tuple(nats1.urls), name="m" + uuid.uuid4().hex[:8])
    seq, epoch = import_state(tmp_path / "single", config, epoch=41)
    assert epoch == 41
    with pytest.raises(StateError, match="already holds a journal"):
        import_state(tmp_path / "single", config)
    w = open_sole_writer(config, journal_config=FAST)              # what a manager taking over does
    assert state_tree(w.manager) == tree and w.seq == seq and w.store.epoch == 42
    workload(w, np.random.default_rng(8), 20)
    tree2 = state_tree(w.manager)
    crash(w)
    export_state(config, tmp_path / "backup")
    with pytest.raises(StateError, match="already holds kvservice state"):
        export_state(config, tmp_path / "backup")
    b = Journal.open(tmp_path / "backup", readonly=True)
    try:
        assert state_tree(b.manager) == tree2
    finally:
        b.close(snapshot=False)


def test_check_state_and_export_state_on_the_command_line(nats_backend, tmp_path):
    import subprocess
    import sys

    from .conftest import ROOT
    j = nats_backend.open(FAST)
    setup_pools(j)
    workload(j, np.random.default_rng(9), 20)
    crash(j)
    url, name = nats_backend.config.url, nats_backend.config.name

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "kvservice.server.cli", *args, "--nats-name", name], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    out = cli("check-state", url)
    assert out.returncode == 0 and "pool a:" in out.stdout and "invariants ok" in out.stdout, out.stdout + out.stderr
    out = cli("export-state", url, str(tmp_path / "copy"))
    assert out.returncode == 0 and "exported" in out.stdout, out.stderr
    out = cli("import-state", str(tmp_path / "copy"), url)                # that deployment is not empty
    assert out.returncode == 2 and "already holds a journal" in out.stderr


# ---- the journal's direct publish connection (kvservice/state/nats/direct.py) ------------------------------------

def test_direct_publisher_acks_reconnects_and_skips_late_replies(nats_backend):
    import asyncio
    import socket

    import nats.errors

    from kvservice.state.nats.direct import DirectPublisher
    config = nats_backend.config
    link = NatsLink(config)
    pub = DirectPublisher(config.servers, "test")
    try:
        NatsStore(link)                                              # creates the stream
        rng = np.random.default_rng(9)
        payloads = [rng.bytes(int(rng.integers(1, 3000))) for _ in range(5)]
        seqs = [int(json.loads(pub.request(config.subject, p, {"Kvs-Kind": "test"}, 5).data)["seq"])
                for p in payloads]
        last = link.call(link.js.stream_info(config.stream), 10).state.last_seq
        assert seqs == list(range(last - 4, last + 1))
        stored = [link.call(link.js.get_msg(config.stream, s), 10) for s in seqs]   # what the server holds
        assert [m.data for m in stored] == payloads and all(m.headers["Kvs-Kind"] == "test" for m in stored)

        delays = {b"slow": 0.6, b"fast": 0.0}                        # a responder on another connection

        async def respond(msg) -> None:
            await asyncio.sleep(delays[msg.data])
            await link.nc.publish(msg.reply, b"re:" + msg.data)
        link.call(link.nc.subscribe("kvs.test.echo", cb=respond), 5)
        link.call(link.nc.flush(), 5)
        with pytest.raises(nats.errors.TimeoutError):
            pub.request("kvs.test.echo", b"slow", {}, 0.2)
        time.sleep(0.7)                                              # its late reply is on the socket now
        assert pub.request("kvs.test.echo", b"fast", {}, 5).data == b"re:fast"
        assert pub.connects == 1

        pub._sock.shutdown(socket.SHUT_RDWR)                         # the server side goes away
        with pytest.raises(OSError):
            pub.request(config.subject, b"x", {"Kvs-Kind": "test"}, 5)
        assert json.loads(pub.request(config.subject, b"y", {"Kvs-Kind": "test"}, 5).data)["seq"] == last + 1
        assert pub.connects == 2
        reply = pub.request("kvs.nobody.listens", b"z", {}, 5)       # no responder: status 503, not a hang
        assert reply.no_responders
        watchful = DirectPublisher(config.servers, "test", idle_check_seconds=0.0)
        try:                                        # one that looks before it publishes after a quiet spell
            watchful.request(config.subject, b"a", {"Kvs-Kind": "test"}, 5)
            watchful._sock.shutdown(socket.SHUT_RDWR)
            ack = json.loads(watchful.request(config.subject, b"b", {"Kvs-Kind": "test"}, 5).data)
            assert ack["seq"] == last + 3 and watchful.connects == 2       # reconnected first, no failed try
        finally:
            watchful.close()
    finally:
        pub.close()
        link.close()


def test_direct_publisher_refuses_what_is_not_a_reachable_nats_server():
    import socket
    import threading

    from kvservice.state.nats.direct import DirectError, DirectPublisher
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def not_nats() -> None:
        try:
            conn, _ = srv.accept()
        except OSError:                             # closed by the test
            return
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()
    th = threading.Thread(target=not_nats, daemon=True)
    th.start()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed_port = free.getsockname()[1]
    free.close()
    try:
        pub = DirectPublisher((f"nats://127.0.0.1:{port}", f"nats://127.0.0.1:{closed_port}"), "test")
        with pytest.raises(DirectError) as err:
            pub.request("kvs.x", b"", {}, 2)
        assert "does not speak the NATS protocol" in err.value.message and str(closed_port) in err.value.message
        assert pub.connects == 0 and pub._sock is None
    finally:
        srv.close()
        th.join(5)


def test_a_reader_overtaken_by_a_compaction_recovers_again_from_the_newer_snapshot(nats_backend):
    """A reader lists the snapshots, then the leader stores a newer one and purges the stream below it before
    the reader reads on: the reader is told (JournalGap, not "acknowledged changes are lost"), and open_journal
    recovers again, from the newer snapshot, to exactly the writer's state."""
    from kvservice.state.nats.journal import JournalGap
    j = nats_backend.open(FAST)
    rng = np.random.default_rng(17)
    setup_pools(j)
    workload(j, rng, 15, pools=("a",))
    j.snapshot()
    first = j.snapshot_seq
    workload(j, rng, 15, pools=("b",))
    link = NatsLink(nats_backend.config)
    try:
        reader = NatsStore(link, readonly=True, create=False)
        assert reader.load_snapshot()[0] == first            # what it listed: the older snapshot
        j.snapshot()                                          # meanwhile: a newer one, the stream purged below it
        assert j.snapshot_seq > first
        with pytest.raises(JournalGap, match="compacted past position"):
            list(reader.entries_after(first))
        reader.close(clean=False, seq=first)
    finally:
        link.close()
    run(j, "Step", step_req("c", admit=[1], n=[30], rid="after"))
    tree, seq = state_tree(j.manager), j.seq
    j2 = nats_backend.open_readonly()
    try:
        assert state_tree(j2.manager) == tree and j2.seq == seq and j2.snapshot_seq == j.snapshot_seq
    finally:
        j2.close(snapshot=False)
        crash(j)


def test_direct_publisher_keeps_its_place_across_a_reply_cut_by_a_timeout_and_drops_a_malformed_line():
    """A scripted NATS peer on a real socket: the first reply arrives in two pieces with the request's timeout
    between them (the request times out; the next one skips that late reply whole and gets its own), then a
    malformed message line (DirectError, the connection is dropped, the next request connects again)."""
    import re
    import socket
    import threading
    import time

    import nats.errors

    from kvservice.state.nats.direct import DirectError, DirectPublisher
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    ack = b'{"stream":"s","seq":%d}'
    hdr = b"NATS/1.0\r\n\r\n"

    def serve_one(conn: socket.socket, script: list) -> None:
        conn.sendall(b'INFO {"headers":true,"max_payload":1048576}\r\n')
        buf = b""
        while b"PING\r\n" not in buf:
            buf += conn.recv(65536)
        conn.sendall(b"PONG\r\n")
        buf = b""
        for step in script:
            while not re.search(rb"HPUB \S+ (\S+) \d+ \d+\r\n", buf):
                buf += conn.recv(65536)
            reply = re.search(rb"HPUB \S+ (\S+) \d+ \d+\r\n", buf).group(1)
            buf = buf[buf.index(b"\r\n") + 2:]
            step(conn, reply)

    def split_reply(conn, reply):
        body = hdr + b"\r\n-ERR 'a payload line, not a protocol line'\r\n" + ack % 1   # bytes are bytes in a body
        msg = b"HMSG %s 1 %d %d\r\n%s\r\n" % (reply, len(hdr), len(body), body)
        conn.sendall(msg[:len(msg) - 9])
        time.sleep(0.6)                                  # the request gave up after 0.2 s
        conn.sendall(msg[len(msg) - 9:])

    def whole_reply(conn, reply):
        body = hdr + ack % 2
        conn.sendall(b"PING\r\nHMSG %s 1 %d %d\r\n%s\r\n" % (reply, len(hdr), len(body), body))

    def malformed(conn, reply):
        conn.sendall(b"HMSG %s 1 twelve\r\n" % reply)

    def peer() -> None:
        try:
            conn, _ = srv.accept()
            serve_one(conn, [split_reply, whole_reply, malformed])
            conn2, _ = srv.accept()
            serve_one(conn2, [whole_reply])
            time.sleep(0.5)
            conn.close()
            conn2.close()
        except OSError:
            return
    th = threading.Thread(target=peer, daemon=True)
    th.start()
    try:
        pub = DirectPublisher((f"nats://127.0.0.1:{port}",), "test")
        with pytest.raises(nats.errors.TimeoutError):
            pub.request("kvs.x", b"entry-1", {"Nats-Msg-Id": "1"}, 0.2)
        time.sleep(0.6)                                  # the rest of the late reply is on its way
        got = pub.request("kvs.x", b"entry-2", {"Nats-Msg-Id": "2"}, 5)
        assert got.data == ack % 2 and got.headers == hdr and pub.connects == 1
        with pytest.raises(DirectError) as err:
            pub.request("kvs.x", b"entry-3", {"Nats-Msg-Id": "3"}, 5)
        assert "malformed" in err.value.message and pub._sock is None
        assert pub.request("kvs.x", b"entry-3", {"Nats-Msg-Id": "3"}, 5).data == ack % 2
        assert pub.connects == 2
        with pytest.raises(DirectError) as err:
            pub.request("kvs.x", b"x" * (1 << 20), {}, 5)
        assert "max_payload of 1048576" in err.value.message
        pub.close()
    finally:
        srv.close()
        th.join(5)


def test_a_lease_bucket_that_cannot_be_placed_is_refused_with_the_servers_reason(nats1):
    """Three replicas asked of one unclustered server: the refusal names the bucket and why, no retry forever."""
    from kvservice.state.nats.leader import Lease, LeaseConfig
    link = NatsLink(NatsConfig((nats1.url,), name="t" + uuid.uuid4().hex[:10], replicas=3))
    try:
        with pytest.raises(StoreError, match=r"lease bucket KVS_t\w+_leader.*replicas > 1 not supported"):
            Lease(link, LeaseConfig(), "a", "addr-a")
    finally:
        link.close()



def test_catch_up_reads_on_with_a_new_consumer_when_its_consumer_is_gone(nats_backend, caplog):
    """A standby's ordered consumer lives on one NATS node (R1, in memory): when that node restarts, the consumer is
    gone and nats-py notices only after missed heartbeats (seconds). catch_up (what a takeover reads the stream to
    its end with) reads on with a new consumer from the next message: every entry after the reader's position,
    each once, in order."""
    import logging
    j = nats_backend.open(FAST)
    rng = np.random.default_rng(23)
    setup_pools(j)
    workload(j, rng, 10, pools=("a",))
    link = NatsLink(nats_backend.config)
    try:
        reader = NatsStore(link, readonly=True, create=False)
        assert reader.load_snapshot() is None
        before = [e.seq for e in reader.entries_after(0)]
        assert before == list(range(1, j.seq + 1))
        gone = reader._sub._consumer
        link.call(link.js.delete_consumer(nats_backend.config.stream, gone), 10)
        workload(j, rng, 10, pools=("b",))
        with caplog.at_level(logging.INFO, logger="kvservice.nats"):
            after = [e.seq for e in reader.catch_up()]
        assert after == list(range(before[-1] + 1, j.seq + 1))
        assert "reading on with a new consumer" in caplog.text
        assert reader._sub._consumer != gone
        reader.close(clean=False, seq=j.seq)
    finally:
        link.close()
        crash(j)
