"""One recovery suite, run against every JournalStore backend (memory, SQLite state dir, NATS JetStream).

A twin journal (memory, never restarted) receives exactly the same requests as the journal under
test; after a crash and recovery, both get the same further requests and must answer byte for byte
alike and hold the same state: recovery rebuilt what was acknowledged, and nothing that behaves
differently.

The NATS backend starts one real nats-server on loopback for the module (tests/natsutil.py): it
skips where nats-server is not installed and fails under CI=true.
"""

import io
import json
import shutil
import uuid

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Entry, Journal, JournalConfig, MemoryStore
from kvservice.state.sqlite.store import SqliteStore
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb

from .test_journal import body, prefix_workload, setup_pools, step_req, workload

#: Worker leases here never lapse. They run on the wall clock: on a loaded machine a 10 s lease lapsed in the
#: reference twin (which never restarts) while the recovered journal had restarted it, so the states differed
#: in a worker's alive flag, not in anything journaled. Lease expiry has its own tests (test_journal.py).
WORKER_LEASE = 24 * 3600.0


class MemoryBackend:
    name = "memory"

    def __init__(self, tmp_path):
        self.store = MemoryStore()

    def open(self, config):
        return Journal.recover(self.store, WORKER_LEASE, config=config)

    def crash(self, j):
        """The process dies: the store keeps what was appended, nothing else happens."""

    def drop_entry(self, seq):
        self.store._entries = [e for e in self.store._entries if e.seq != seq]

    def damage_entry(self, seq):
        self.store._entries = [Entry(e.seq, e.method, e.request + b"\0", e.created, e.digest) if e.seq == seq else e
                               for e in self.store._entries]

    def damage_snapshot(self):
        seq, blob = self.store._snapshot
        self.store._snapshot = (seq, blob[:-9] + bytes([blob[-9] ^ 16]) + blob[-8:])


class SqliteBackend:
    name = "sqlite"

    def __init__(self, tmp_path):
        self.tmp, self.dir, self.n = tmp_path, tmp_path / "state0", 0

    def open(self, config):
        return Journal.open(self.dir, WORKER_LEASE, config=config)

    def crash(self, j):
        """What kill -9 leaves: the files as they are while the manager runs (log included), then a restart."""
        self.n += 1
        dest = self.tmp / f"state{self.n}"
        shutil.copytree(self.dir, dest, ignore=shutil.ignore_patterns("*-shm", "lock"))
        j.close(snapshot=False)                      # releases the old dir; the copy is what restarts
        self.dir = dest

    def _edit(self, *statements):
        """Run SQL on the stopped dir's database (closing folds the log in; an empty log is left, as after a crash)."""
        import sqlite3
        db = sqlite3.connect(self.dir / "state.db", isolation_level=None)
        for sql, args in statements:
            db.execute(sql, args)
        db.close()
        (self.dir / "state.db-wal").touch()

    def drop_entry(self, seq):
        self._edit(("DELETE FROM entries WHERE seq = ?", (seq,)))

    def damage_entry(self, seq):
        self._edit(("UPDATE entries SET request = CAST(request || X'00' AS BLOB) WHERE seq = ?", (seq,)))

    def damage_snapshot(self):
        (path,) = (self.dir / "snapshots").glob("snapshot-*.kvs")
        data = bytearray(path.read_bytes())
        data[-9] ^= 16
        path.write_bytes(bytes(data))


class NatsBackend:
    """A deployment name of its own on the module's nats-server; each open fences out the previous writer."""

    name = "nats"

    def __init__(self, tmp_path, cluster):
        from kvservice.state.nats.journal import NatsConfig
        self.config = NatsConfig(tuple(cluster.urls), name="u" + uuid.uuid4().hex[:10])

    def open(self, config):
        from kvservice.server.ha import open_sole_writer
        return open_sole_writer(self.config, journal_config=config, lease_seconds=WORKER_LEASE)

    def crash(self, j):
        """What kill -9 leaves: the stream and the snapshots as they are (no final snapshot)."""
        j.close(snapshot=False)

    def _with_link(self, fn):
        from kvservice.state.nats.journal import NatsLink
        link = NatsLink(self.config)
        try:
            return fn(link, lambda coro: link.call(coro, 10))
        finally:
            link.close()

    def _messages(self, link, call):
        info = call(link.js.stream_info(self.config.stream))
        msgs = [call(link.js.get_msg(self.config.stream, s)) for s in range(info.state.first_seq,
                                                                            info.state.last_seq + 1)]
        return [m for m in msgs if m is not None]

    def _entry(self, msgs, seq):
        return next(m for m in msgs if (m.headers or {}).get("Kvs-Kind") == "entry"
                    and m.headers["Kvs-Seq"] == str(seq))

    def drop_entry(self, seq):
        def drop(link, call):
            call(link.js.delete_msg(self.config.stream, self._entry(self._messages(link, call), seq).seq))
        self._with_link(drop)

    def damage_entry(self, seq):
        """Stream messages cannot be edited: rewrite the stream with one request byte appended to entry seq."""
        def damage(link, call):
            msgs = self._messages(link, call)
            bad = self._entry(msgs, seq).seq
            call(link.js.purge_stream(self.config.stream))
            for m in msgs:
                headers = {k: v for k, v in (m.headers or {}).items() if not k.startswith("Nats-")}
                call(link.js.publish(self.config.subject, (m.data or b"") + (b"\0" if m.seq == bad else b""),
                                     stream=self.config.stream, headers=headers))
        self._with_link(damage)

    def damage_snapshot(self):
        """One bit of the newest snapshot flipped, its object header rewritten to match (damage at the writer)."""
        from nats.js import api

        from kvservice.state.nats.journal import _digest

        def damage(link, call):
            obs = call(link.js.object_store(self.config.snapshot_bucket))
            (info,) = [i for i in call(obs.list(ignore_deletes=True)) if i.name.startswith("snap-")]
            out = io.BytesIO()
            call(obs.get(info.name, writeinto=out))
            blob = out.getvalue()
            blob = blob[:-9] + bytes([blob[-9] ^ 16]) + blob[-8:]
            meta = dict(json.loads(info.description), digest=_digest(blob))
            call(obs.put(info.name, blob, meta=api.ObjectMeta(name=info.name, description=json.dumps(meta))))
        self._with_link(damage)




@pytest.fixture(params=[MemoryBackend, SqliteBackend, NatsBackend], ids=lambda b: b.name)
def backend(request, tmp_path):
    if request.param is NatsBackend:
        return NatsBackend(tmp_path, request.getfixturevalue("nats1"))
    return request.param(tmp_path)


def config(compact_every=1000):
    return JournalConfig(sync="normal", compact_every=compact_every, background_snapshots=False)


class Twin:
    """Sends every request to the journal under test and to a reference that never restarts; replies must match."""

    def __init__(self, j):
        self.j, self.ref = j, Journal(BlockManager(WORKER_LEASE), config=config())

    def execute(self, method, req, _apply=None):
        for_j = type(req)()
        for_j.CopyFrom(req)
        try:
            got = self.j.execute(method, for_j, getattr(self.j.api, method))
        except Exception as err:
            with pytest.raises(type(err)):
                self.ref.execute(method, req, getattr(self.ref.api, method))
            raise
        try:
            want = self.ref.execute(method, req, getattr(self.ref.api, method))
        except Exception as err:
            raise AssertionError(f"{method}: the reference refused what the journal accepted ({err})") from None
        assert body(got) == body(want), f"{method} answers differently"
        return got

    @property
    def manager(self):
        return self.j.manager

    @property
    def api(self):
        return self.j.api


@pytest.mark.parametrize("compact_every", [1000, 17])
def test_recovery_rebuilds_the_exact_state_and_behaves_the_same(backend, compact_every):
    j = backend.open(config(compact_every))
    twin = Twin(j)
    setup_pools(twin)
    workload(twin, np.random.default_rng(compact_every), 120)
    prefix_workload(twin, np.random.default_rng(compact_every), 70)
    with j.manager.locked("c") as pool:
        assert pool.prefix.hits > 0                              # the prefix cache was exercised
    assert (j.snapshots > 0) == (compact_every == 17)
    acknowledged = state_tree(j.manager)
    backend.crash(j)
    j2 = backend.open(config(compact_every))
    assert state_tree(j2.manager) == acknowledged
    assert j2.seq == twin.ref.seq and j2.incarnation == 2
    twin.j = j2                                                  # the same future, request for request
    workload(twin, np.random.default_rng(99), 60)
    prefix_workload(twin, np.random.default_rng(98), 40)
    assert state_tree(j2.manager) == state_tree(twin.ref.manager)
    for name in ("a", "b", "c"):                                 # every figure but refusals (never journaled)
        req = pb.GetStatsRequest(pool=name)
        got, want = j2.read(req, j2.api.GetStats), twin.ref.read(req, twin.ref.api.GetStats)
        got.pools[name].refused = want.pools[name].refused = 0
        assert body(got) == body(want)
    j2.close()


def test_a_retry_after_a_restart_gets_the_original_reply(backend):
    j = backend.open(config())
    setup_pools(j)
    first = j.execute("Step", step_req("a", admit=[1, 2], n=[40, 17], rid="lost"), j.api.Step)
    backend.crash(j)
    j2 = backend.open(config())
    again = j2.execute("Step", step_req("a", admit=[1, 2], n=[40, 17], rid="lost"), j2.api.Step)
    assert body(again) == body(first) and j2.window.hits == 1
    assert (again.position.incarnation, again.position.seq) == (2, first.position.seq)
    with j2.manager.locked("a") as pool:
        assert pool.steps == 1
    j2.close()


def test_a_missing_entry_is_refused(backend):
    j = backend.open(config())
    setup_pools(j)
    workload(j, np.random.default_rng(2), 10)
    backend.crash(j)
    backend.drop_entry(6)
    with pytest.raises(StateError, match=r"entries 6\.\.6 are missing"):
        backend.open(config())


def test_a_damaged_entry_is_refused(backend):
    j = backend.open(config())
    setup_pools(j)
    workload(j, np.random.default_rng(2), 10)
    backend.crash(j)
    backend.damage_entry(7)
    with pytest.raises(StateError, match="entry 7 fails its checksum"):
        backend.open(config())


def test_a_damaged_snapshot_is_refused(backend):
    j = backend.open(config(compact_every=6))        # snapshots at 5 and 10: the byte flipped below is an array's
    setup_pools(j)
    workload(j, np.random.default_rng(2), 10)
    backend.crash(j)
    backend.damage_snapshot()
    with pytest.raises(StateError, match="fails its checksum"):
        backend.open(config())


def test_memory_store_is_not_durable_and_sqlite_is():
    assert not MemoryStore.durable and SqliteStore.durable
