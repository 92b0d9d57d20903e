"""Durable manager state: an SQLite journal (WAL) of acknowledged mutating RPCs, snapshots, idempotent retries.

A state dir holds ``state.db`` (SQLite, WAL mode) and ``lock`` (flock of the serving process).

Write path (:meth:`Journal.execute`, one lock around it): a request_id seen before returns the
original reply; otherwise the request is applied to the in-memory manager and its serialized
form is INSERTed (one statement = one transaction) before the reply leaves. Failed requests
(domain errors) change nothing and are not journaled. If the write fails, or a mutating call
fails unexpectedly (so the memory may differ from the disk), the journal fails stop: every
later call is refused UNAVAILABLE and ``on_fail`` tells the server to exit.

Recovery: load the newest snapshot (pickled pools, worker records, recent request ids and
replies), then replay every later entry through a fresh ManagerAPI. The domain is
deterministic, so replay rebuilds the same slots and regenerates the same replies. Every
``compact_every`` entries the journal writes a snapshot and drops the entries it covers, so
recovery replays at most that many. See docs/DURABILITY.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import pickle
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import Message

from .api import ManagerAPI
from .errors import AlreadyExists, InvalidArgument, KVError
from .geometry import CacheSpec
from .manager import BlockManager
from .planner import Sizing, plan
from .pool import Pool
from .servicer import JournalUnavailable
from .v1 import block_manager_pb2 as pb

log = logging.getLogger("kvservice.journal")

FORMAT = 1
DB_NAME = "state.db"
REQUESTS: dict[str, type[Message]] = {"CreatePool": pb.CreatePoolRequest, "DeletePool": pb.DeletePoolRequest,
                                      "Step": pb.StepRequest, "RegisterWorker": pb.RegisterWorkerRequest}
REPLIES: dict[str, type[Message]] = {"CreatePool": pb.PoolInfo, "DeletePool": pb.DeletePoolReply,
                                     "Step": pb.StepReply, "RegisterWorker": pb.RegisterWorkerReply}
SYNC_MODES = ("full", "normal")


@dataclass(frozen=True, slots=True)
class JournalConfig:
    """Knobs of the journal.

    sync: SQLite `synchronous` in WAL mode. "full" fsyncs every commit (survives power loss);
        "normal" survives a process crash (kill -9) but may lose the last commits on an OS crash.
    compact_every: entries (acknowledged mutating RPCs) between snapshots; bounds recovery replay.
    compact_bytes: serialized request bytes between snapshots (the other bound).
    id_window: request ids remembered for idempotency (most recent).
    id_window_seconds: ... and for at most this long, seconds.
    reply_cache_bytes: serialized bytes of replies kept for retries (most recent first kept).
    snapshot_replies: replies written into each snapshot (the most recent ones).
    """

    sync: str = "full"
    compact_every: int = 10_000
    compact_bytes: int = 256 << 20
    id_window: int = 100_000
    id_window_seconds: float = 600.0
    reply_cache_bytes: int = 64 << 20
    snapshot_replies: int = 256

    def __post_init__(self) -> None:
        if self.sync not in SYNC_MODES:
            raise InvalidArgument(f"sync must be one of {', '.join(SYNC_MODES)}, got {self.sync!r}")
        if self.compact_every < 1 or self.id_window < 1:
            raise InvalidArgument("compact_every and id_window must be >= 1")


class StateError(KVError):
    """A state dir that cannot be used (busy, corrupt, written by an incompatible version)."""

    reason = "STATE_ERROR"


def digest(data: bytes) -> bytes:
    """16-byte fingerprint of a serialized request (a reused request_id must carry the same request)."""
    return hashlib.blake2b(data, digest_size=16).digest()


class IdempotencyWindow:
    """request_id -> (method, digest, journal seq, wall time) for the last N ids / T seconds, and recent replies.

    A retry of a known id gets its stored reply; an id whose reply was dropped from the
    (byte-bounded) cache is refused ALREADY_EXISTS (reason REQUEST_ALREADY_APPLIED), never applied twice.
    """

    def __init__(self, config: JournalConfig) -> None:
        self.config = config
        self.ids: OrderedDict[str, tuple[str, bytes, int, float]] = OrderedDict()
        self.replies: OrderedDict[str, tuple[Message, int]] = OrderedDict()
        self.reply_bytes = 0
        self.hits = 0

    def lookup(self, rid: str, method: str, fingerprint: bytes) -> Message | None:
        """The stored reply of a retried request, None for a new id; KVError for a reused or expired id."""
        known = self.ids.get(rid)
        if known is None:
            return None
        k_method, k_digest, seq, _ = known
        if k_method != method or k_digest != fingerprint:
            raise InvalidArgument(f"request_id {rid!r} was already used by a different {k_method} request "
                                  f"(journal position {seq}); use a fresh id per request", reason="REQUEST_ID_REUSED",
                                  request_id=rid)
        stored = self.replies.get(rid)
        if stored is None:
            raise AlreadyExists(f"{method} {rid!r} was already applied (journal position {seq}); its reply is no "
                                f"longer kept (reply cache {self.config.reply_cache_bytes} bytes)",
                                reason="REQUEST_ALREADY_APPLIED", request_id=rid, position=seq)
        self.hits += 1
        return stored[0]

    def remember(self, rid: str, method: str, fingerprint: bytes, seq: int, at: float, reply: Message) -> None:
        """Record an applied request (at: wall-clock seconds) and keep its reply while the byte budget allows."""
        self.ids[rid] = (method, fingerprint, seq, at)
        size = reply.ByteSize()
        self.replies[rid] = (reply, size)
        self.reply_bytes += size
        self.evict(at)

    def evict(self, now: float) -> None:
        c = self.config
        oldest = now - c.id_window_seconds
        while self.ids and (len(self.ids) > c.id_window or next(iter(self.ids.values()))[3] < oldest):
            rid, _ = self.ids.popitem(last=False)
            self._drop_reply(rid)
        while self.replies and self.reply_bytes > c.reply_cache_bytes:
            self._drop_reply(next(iter(self.replies)))

    def _drop_reply(self, rid: str) -> None:
        stored = self.replies.pop(rid, None)
        if stored is not None:
            self.reply_bytes -= stored[1]

    def export(self) -> dict[str, Any]:
        """Picklable state: every id, and the serialized replies of the most recent `snapshot_replies`."""
        recent = list(self.replies.items())[-self.config.snapshot_replies:]
        return {"ids": list(self.ids.items()),
                "replies": [(rid, self.ids[rid][0], msg.SerializeToString()) for rid, (msg, _) in recent]}

    def load(self, state: dict[str, Any]) -> None:
        self.ids = OrderedDict(state["ids"])
        for rid, method, data in state["replies"]:
            msg = REPLIES[method].FromString(data)
            self.replies[rid] = (msg, len(data))
            self.reply_bytes += len(data)


class SqliteStore:
    """The tables of a state dir: entries (the journal tail), snapshots, meta. Not thread-safe (Journal locks)."""

    def __init__(self, state_dir: Path, sync: str = "full", readonly: bool = False) -> None:
        self.path = state_dir / DB_NAME
        self.readonly = readonly
        if readonly:
            if not self.path.exists():
                raise StateError(f"{state_dir}: no kvservice state here ({DB_NAME} is missing)")
            self.db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None,
                                      check_same_thread=False)
        else:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            mode = self.db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise StateError(f"{self.path}: cannot switch SQLite to WAL mode (got {mode})")
            self.db.execute(f"PRAGMA synchronous={sync.upper()}")
            self.db.executescript("""
                CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE IF NOT EXISTS entries(seq INTEGER PRIMARY KEY, method TEXT NOT NULL,
                                                   request BLOB NOT NULL, created REAL NOT NULL);
                CREATE TABLE IF NOT EXISTS snapshots(seq INTEGER PRIMARY KEY, state BLOB NOT NULL,
                                                     created REAL NOT NULL);
            """)
            self.db.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?)", (str(FORMAT),))
        row = self.db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
        if row is None or int(row[0]) != FORMAT:
            raise StateError(f"{self.path}: state format {row[0] if row else '?'} is not {FORMAT}")

    def last_snapshot(self) -> tuple[int, bytes] | None:
        row = self.db.execute("SELECT seq, state FROM snapshots ORDER BY seq DESC LIMIT 1").fetchone()
        return (int(row[0]), bytes(row[1])) if row else None

    def entries_after(self, seq: int) -> Iterator[tuple[int, str, bytes, float]]:
        for s, method, data, created in self.db.execute(
                "SELECT seq, method, request, created FROM entries WHERE seq > ? ORDER BY seq", (seq,)):
            yield int(s), method, bytes(data), float(created)

    def append(self, seq: int, method: str, data: bytes, at: float) -> None:
        """One entry, committed (autocommit: the INSERT is its own transaction)."""
        self.db.execute("INSERT INTO entries VALUES (?, ?, ?, ?)", (seq, method, data, at))

    def write_snapshot(self, seq: int, state: bytes, at: float) -> None:
        """Store a snapshot at journal position seq and drop the entries and snapshots it covers, atomically."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?, ?)", (seq, state, at))
            self.db.execute("DELETE FROM entries WHERE seq <= ?", (seq,))
            self.db.execute("DELETE FROM snapshots WHERE seq < ?", (seq,))
            self.db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.db.close()


def _lock_dir(state_dir: Path) -> int:
    """flock DIR/lock for this process; StateError naming the holder if another process has it."""
    fd = os.open(state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StateError(f"state dir {state_dir} is in use by another kvservice (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _pool_fields() -> frozenset[str]:
    """Attribute names of a Pool of this code version (a snapshot from another layout is refused)."""
    probe = Pool("probe", plan(CacheSpec.uniform(1, 1, 64), Sizing(num_slots=1)))
    return frozenset(vars(probe))


def dump_manager(manager: BlockManager) -> dict[str, Any]:
    """Pools (each pickled under its lock) and worker records; the caller holds the journal lock."""
    pools: dict[str, bytes] = {}
    for name in manager.pool_names():
        with manager.locked(name) as pool:
            pools[name] = pickle.dumps(pool, protocol=pickle.HIGHEST_PROTOCOL)
    return {"pools": pools, "workers": manager.workers.workers()}


def load_manager(manager: BlockManager, state: dict[str, Any]) -> None:
    """Install pools and worker records of a snapshot into an empty manager.

    Recovered workers keep their epoch and alive flag and get a fresh lease start (now),
    so a live worker's next heartbeat succeeds; one that died meanwhile lapses one lease later.
    """
    fields = _pool_fields()
    for name, blob in state["pools"].items():
        pool = pickle.loads(blob)
        if frozenset(vars(pool)) != fields:
            raise StateError(f"snapshot pool {name!r} was written by a kvservice with another Pool layout "
                             f"(differs in {sorted(frozenset(vars(pool)) ^ fields)}); see docs/DURABILITY.md")
        # BlockManager and WorkerRegistry have no public restore hook yet: install directly.
        manager._pools[name] = pool
        manager._locks[name] = threading.Lock()
    reg = manager.workers
    now = reg._clock()
    with reg._lock:
        for rec in state["workers"]:
            reg._workers[rec.worker_id] = replace(rec, last_heartbeat=now)


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


class Journal:
    """Serialises mutating RPCs, makes them durable (with a store) and idempotent by request_id.

    store None = memory only: idempotent retries, no durability (``kvservice serve --state memory``).
    Counters (read by metrics): commits, snapshots, window.hits (retries answered from the window).
    """

    def __init__(self, manager: BlockManager, store: SqliteStore | None = None,
                 config: JournalConfig | None = None) -> None:
        self.manager = manager
        self.api = ManagerAPI(manager)
        self.store = store
        self.config = config or JournalConfig()
        self.window = IdempotencyWindow(self.config)
        self.seq = 0                    # journal position of the last applied entry
        self.snapshot_seq = 0           # position covered by the newest snapshot
        self.tail_bytes = 0
        self._compact_at = self.config.compact_every
        self.commits = 0
        self.snapshots = 0
        self.failed: str | None = None
        self.on_fail: Callable[[str], None] | None = None
        self.observe_commit: Callable[[float], None] | None = None
        self._lock = threading.Lock()
        self._dir_fd: int | None = None
        self.state_dir: Path | None = None

    # ---- opening and recovery --------------------------------------------------------------
    @classmethod
    def open(cls, state_dir: str | Path, lease_seconds: float = 10.0, config: JournalConfig | None = None,
             readonly: bool = False) -> Journal:
        """Recover the manager kept in state_dir (created if missing, unless readonly) and journal into it.

        readonly: inspect a state dir (e.g. of a crashed or running manager) without locking or writing it.
        Raises StateError if the dir is busy, corrupt or from an incompatible version.
        """
        config = config or JournalConfig()
        path = Path(state_dir)
        fd = None
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
            fd = _lock_dir(path)
        try:
            store = SqliteStore(path, config.sync, readonly)
        except (sqlite3.Error, StateError) as err:
            if fd is not None:
                os.close(fd)
            raise StateError(f"{path}: cannot open the state database: {err}") from None
        journal = cls(BlockManager(lease_seconds), store, config)
        journal._dir_fd, journal.state_dir = fd, path
        try:
            journal._recover()
        except BaseException:
            journal.close(snapshot=False)
            raise
        return journal

    def _recover(self) -> None:
        assert self.store is not None
        t0 = time.perf_counter()
        snap = self.store.last_snapshot()
        if snap is not None:
            self.snapshot_seq, blob = snap
            try:
                state = pickle.loads(blob)
            except Exception as err:
                raise StateError(f"{self.store.path}: snapshot at {self.snapshot_seq} cannot be read "
                                 f"({type(err).__name__}: {err})") from None
            load_manager(self.manager, state)
            self.window.load(state["window"])
            self.seq = self.snapshot_seq
        replayed = 0
        quiet = _Quiet()
        logging.getLogger("kvservice").addFilter(quiet)
        try:
            for entry in self.store.entries_after(self.snapshot_seq):
                self.apply_entry(*entry)
                replayed += 1
        finally:
            logging.getLogger("kvservice").removeFilter(quiet)
        self.window.evict(time.time())
        self._compact_at = self.snapshot_seq + self.config.compact_every
        log.info("recovered %s: snapshot at %d, %d entries replayed in %.3f s, pools: %s", self.store.path,
                 self.snapshot_seq, replayed, time.perf_counter() - t0, ", ".join(self.manager.pool_names()) or "none")

    def apply_entry(self, seq: int, method: str, data: bytes, at: float) -> None:
        """Replay one journaled request (recovery; a standby following the leader, kvservice/ha.py)."""
        request = REQUESTS[method].FromString(data)
        try:
            reply = getattr(self.api, method)(request)
        except KVError as err:
            where = self.store.path if self.store is not None else "journal"
            raise StateError(f"{where}: journal entry {seq} ({method}) failed on replay: {err.message}") from None
        rid = getattr(request, "request_id", "")
        if rid:
            self.window.remember(rid, method, digest(data), seq, at, reply)
        self.seq = seq
        self.tail_bytes += len(data)

    def follow(self, entries: Iterable[tuple[int, str, bytes, float]]) -> int:
        """Apply entries another manager journaled (a hot standby), under the journal lock; returns how many."""
        n = 0
        with self._lock:
            for entry in entries:
                self.apply_entry(*entry)
                n += 1
        return n

    # ---- the hook the servicer calls -----------------------------------------------------
    def execute(self, method: str, request: Message, apply: Callable[[Message], Message]) -> Message:
        """Apply a mutating request once: durable before it returns, the stored reply for a retried request_id."""
        with self._lock:
            self._check_usable()
            rid = getattr(request, "request_id", "")
            data = request.SerializeToString(deterministic=True) if rid or self.store is not None else b""
            fingerprint = digest(data) if rid else b""
            if rid:
                stored = self.window.lookup(rid, method, fingerprint)
                if stored is not None:
                    return stored
            try:
                reply = apply(request)
            except KVError:
                raise                       # refused: nothing changed, nothing to journal
            except Exception:
                if self.store is not None:
                    self._fail(f"{method} failed unexpectedly; the in-memory state may differ from the journal")
                raise
            now = time.time()
            self._commit(method, data, now)
            if rid:
                self.window.remember(rid, method, fingerprint, self.seq, now, reply)
            if self.store is not None and (self.seq >= self._compact_at
                                           or self.tail_bytes >= self.config.compact_bytes):
                self._snapshot_locked()
            return reply

    def read(self, request: Message, apply: Callable[[Message], Message]) -> Message:
        """A read of pool state: only committed state is visible, and nothing once the journal failed."""
        with self._lock:
            self._check_usable()
            return apply(request)

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise JournalUnavailable(f"the manager stopped accepting requests: {self.failed}; it must restart "
                                     "(state is recovered from its state dir)")

    def _commit(self, method: str, data: bytes, now: float) -> None:
        seq = self.seq + 1
        if self.store is not None:
            t0 = time.perf_counter()
            try:
                self.store.append(seq, method, data, now)
            except Exception as err:
                self._fail(f"journal write failed ({type(err).__name__}: {err})")
                raise JournalUnavailable(f"{method} was not made durable and is not acknowledged: "
                                         f"{self.failed}") from None
            if self.observe_commit is not None:
                self.observe_commit(time.perf_counter() - t0)
            self.tail_bytes += len(data)
        self.seq = seq
        self.commits += 1

    def _fail(self, why: str) -> None:
        if self.failed is not None:
            return
        self.failed = why
        log.critical("journal failed, stopping: %s", why)
        if self.on_fail is not None:
            self.on_fail(why)

    # ---- compaction --------------------------------------------------------------------------
    def snapshot(self) -> None:
        """Write a snapshot now (also done every compact_every entries and on a clean close)."""
        with self._lock:
            self._check_usable()
            self._snapshot_locked()

    def _snapshot_locked(self) -> None:
        if self.store is None or self.store.readonly or self.seq == self.snapshot_seq:
            return
        t0 = time.perf_counter()
        blob = self._snapshot_blob()
        try:
            self.store.write_snapshot(self.seq, blob, time.time())
        except Exception as err:          # the entries are still there: keep serving, try again later
            log.error("snapshot at %d failed (%s: %s); recovery replays the longer tail", self.seq,
                      type(err).__name__, err)
            self._compact_at = self.seq + max(1, self.config.compact_every // 2)   # try again later
            return
        self.snapshot_seq, self.tail_bytes = self.seq, 0
        self._compact_at = self.seq + self.config.compact_every
        self.snapshots += 1
        log.info("snapshot at journal position %d: %d bytes in %.1f ms", self.seq, len(blob),
                 1e3 * (time.perf_counter() - t0))

    def _snapshot_blob(self) -> bytes:
        state = {"format": FORMAT, "seq": self.seq, **dump_manager(self.manager), "window": self.window.export()}
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    def snapshot_to(self, store: Any) -> None:
        """Write this journal's state as a snapshot at its position into another store (any backend).

        Backups and moves between backends (kvservice export-state / import-state, docs/HA.md).
        """
        with self._lock:
            store.write_snapshot(self.seq, self._snapshot_blob(), time.time())

    def close(self, snapshot: bool = True) -> None:
        """Snapshot (if asked and healthy) and release the state dir."""
        with self._lock:
            if snapshot and self.failed is None:
                self._snapshot_locked()
            if self.store is not None:
                self.store.close()
                self.store = None
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None


#: Pool attributes that are caches or counters of refused calls (not journaled): left out of state_tree.
UNTRACKED = frozenset({"_sorted", "refused", "alloc_failures"})


def state_tree(manager: BlockManager, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Everything a recovery must reproduce, as plain nested values (==-comparable).

    Pools: every attribute, recursively (arrays as dtype, shape and bytes), except UNTRACKED
    and `skip` (attribute names, at any depth). Workers: every record field except the lease clock.
    """
    pools = {}
    for name in manager.pool_names():
        with manager.locked(name) as pool:
            pools[name] = _canon(pool, UNTRACKED | skip)
    workers = [(w.worker_id, w.pool, w.layer_begin, w.layer_end, w.tp_rank, w.tp_size, w.backend, w.epoch,
                w.address, w.alive) for w in manager.workers.workers()]
    return {"pools": pools, "workers": workers}


def _canon(obj: Any, skip: frozenset[str], depth: int = 0) -> Any:
    if depth > 32:
        raise ValueError("state_tree: structure too deep")
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return ("dict", tuple((_canon(k, skip, depth + 1), _canon(v, skip, depth + 1)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_canon(v, skip, depth + 1) for v in obj)
    if isinstance(obj, (set, frozenset)):
        return ("set", tuple(sorted(repr(_canon(v, skip, depth + 1)) for v in obj)))
    if callable(obj) and hasattr(obj, "__qualname__"):
        return ("callable", obj.__module__, obj.__qualname__)
    names = list(getattr(obj, "__dict__", {})) + [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
    return (type(obj).__qualname__, tuple((n, _canon(getattr(obj, n), skip, depth + 1)) for n in dict.fromkeys(names)
                                          if n not in skip and hasattr(obj, n)))


def create_request(name: str, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...]) -> pb.CreatePoolRequest:
    """The CreatePool request of a configured pool (config pools are journaled like API-created ones)."""
    from .convert import cache_spec_to_proto
    return pb.CreatePoolRequest(name=name, cache=cache_spec_to_proto(spec), backends=list(backends),
                                sizing=pb.Sizing(max_batch=sizing.max_batch, max_seq_len=sizing.max_seq_len,
                                                 memory_budget_bytes=sizing.memory_budget_bytes,
                                                 num_slots=sizing.num_slots))


def ensure_pools(journal: Journal, pools: list[Any]) -> list[str]:
    """Create (through the journal) each configured pool that does not exist yet; returns the names created."""
    created = []
    existing = set(journal.manager.pool_names())
    for pc in pools:
        if pc.name in existing:
            with journal.manager.locked(pc.name) as pool:
                if pool.plan.geometry.spec != pc.spec:
                    log.warning("pool %r from the state dir differs from its configuration; serving the state's "
                                "(delete the pool to recreate it from the configuration)", pc.name)
            continue
        journal.execute("CreatePool", create_request(pc.name, pc.spec, pc.sizing, pc.backends),
                        journal.api.CreatePool)
        created.append(pc.name)
    return created


__all__ = ["Journal", "JournalConfig", "StateError", "dump_manager", "ensure_pools", "load_manager", "state_tree"]
