"""The journal: mutating RPCs applied once, in order, made durable by a store before their reply.

:class:`Journal` is what the servicer calls. It serialises mutating requests (one lock), answers a
retried request_id with the original reply (:class:`IdempotencyWindow`), applies a new request to
the in-memory manager and appends it to a :class:`JournalStore` before the reply leaves, and
stamps every reply with the journal position (lineage, incarnation, seq) so a client can tell when a
manager came back behind what it saw. Reads of pool state wait only for an uncommitted change of
the pool they read (:class:`~kvservice.state.gate.PoolGate`), never for other pools or for a snapshot.

Refusals and failures: a domain error (any ``kvservice.contract.errors`` class, including a request that
cannot be decoded) changed nothing, is not journaled and the manager keeps serving. A store that
cannot append fails the journal stop (every later call UNAVAILABLE, ``on_fail`` tells the server to
exit): memory would otherwise run ahead of the disk. An unexpected exception inside a change (a bug)
leaves memory possibly different from the journal, so the manager is rebuilt from the store (its
snapshot and entries: exactly what was acknowledged) and keeps serving; only if that fails does it stop.

Stores (kvservice/state/stores.py: the interface a backend implements): ``MemoryStore`` (``--state memory``:
in-process, lost with the process) and ``store_sqlite.SqliteStore`` (``--state-dir``). Recovery is the same for
both: decode and check the newest snapshot (kvservice/state/snapshot.py), replay every later entry after
verifying its checksum and that none is missing, then check every pool's invariants, the acknowledged
high-water mark (kvservice/state/ackmark.py) and the store's witness of the last acknowledged position.
Snapshots are captured under the lock (copies of the arrays: the pause) and encoded and written outside it
(kvservice/state/journal_snapshots.py, a base class of Journal).
See docs/DURABILITY.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from google.protobuf.message import Message

from kvservice.contract.errors import JournalUnavailable, KVError, StateError
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.state import ackmark
from kvservice.state import snapshot as snap
from kvservice.state.fingerprints import PrefixDigests, digest
from kvservice.state.gate import PoolGate
from kvservice.state.idempotency import IdempotencyWindow
from kvservice.state.journal_config import METHODS, REQUESTS, JournalConfig
from kvservice.state.journal_snapshots import Capture, JournalSnapshots
from kvservice.state.stores import (
    Entry,
    JournalStore,
    MemoryStore,
    continued_lineage,
    entry_digest,
    entry_request,
    lineage_hex,
)

log = logging.getLogger("kvservice.state.journal")

_TARGET = {"Step": "pool", "DeletePool": "pool", "CreatePool": "name"}     # the pool a mutation changes



class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


# ---- the journal ----------------------------------------------------------------------------------------
class Journal(JournalSnapshots):
    """Serialises mutating RPCs, makes them durable through a store and idempotent by request_id.

    store None = a fresh MemoryStore (``kvservice serve --state memory``).
    Counters (read by metrics and benchmarks): commits, snapshots, window.hits, resyncs,
    snapshot_pause_seconds / snapshot_pause_max_seconds (journal lock held to capture a snapshot),
    snapshot_seconds and snapshot_bytes (the last snapshot's encode + write, outside the lock).
    """

    def __init__(self, manager: BlockManager, store: JournalStore | None = None,
                 config: JournalConfig | None = None) -> None:
        self.manager = manager
        self.api = ManagerAPI(manager)
        self.store: JournalStore = store if store is not None else MemoryStore()
        self.config = config or JournalConfig()
        self.window = IdempotencyWindow(self.config)
        self.seq = 0                    # journal position of the last applied entry
        self.snapshot_seq = 0           # position covered by the newest snapshot
        self.incarnation = self.store.begin(0) if store is None else self.store.incarnation
        self.recovery_seconds = 0.0
        self._appended = 0              # request bytes appended (all time) ...
        self._snap_appended = 0         # ... and when the newest snapshot was captured
        self._compact_at = self.config.snapshot_due_tail
        self.replayed_entries = 0       # entries the last recovery (or reload) replayed after its snapshot
        self.commits = 0
        self.snapshots = 0
        self.resyncs = 0
        self.snapshot_pause_seconds = 0.0
        self.snapshot_pause_max_seconds = 0.0
        self.snapshot_seconds = 0.0
        self.snapshot_bytes = 0
        self.failed: str | None = None
        self.on_fail: Callable[[str], None] | None = None
        self.observe_commit: Callable[[float], None] | None = None
        self._lock = threading.Lock()
        self._digests = PrefixDigests()             # request fingerprints of steady decode loops
        self._gate = PoolGate()
        self._writer_done = threading.Event()        # clear while a captured snapshot is being written
        self.snapshot_waits = 0                      # calls that waited for a snapshot (the tail at compact_every)
        self._writer_done.set()
        # Pools unchanged since the last snapshot reuse its arrays: an idle pool costs no pause.
        self._states: dict[str, Any] = {}           # name -> PoolState of the newest snapshot
        self._dirty: set[str] = set()                # pools changed by an entry since it was captured
        self.state_dir: Path | None = getattr(self.store, "state_dir", None)
        if store is None and manager.pool_names():        # a manager filled outside the journal: keep a baseline
            with self._lock:
                cap = self._capture_locked(force=True)
            if cap is not None:
                self._write_capture(cap)

    # ---- opening and recovery --------------------------------------------------------------
    @classmethod
    def open(cls, state_dir: str | Path, lease_seconds: float = 10.0, config: JournalConfig | None = None,
             readonly: bool = False, repair: bool = False) -> Journal:
        """Recover the manager kept in state_dir (created if missing, unless readonly) and journal into it.

        readonly: inspect a state dir (of a stopped, crashed or running manager) without writing it.
        repair: accept the state dir as it is on disk (rewrite its MANIFEST) when only the MANIFEST or its
            witness disagrees; every content check still applies (``kvservice check-state DIR --repair``).
        Raises StateError if the dir is busy, damaged, incomplete or from an incompatible version.
        """
        from kvservice.state.sqlite.store import SqliteStore
        config = config or JournalConfig()
        return cls.recover(SqliteStore.open(Path(state_dir), config.sync, readonly, repair), lease_seconds, config)

    @classmethod
    def recover(cls, store: JournalStore, lease_seconds: float = 10.0,
                config: JournalConfig | None = None) -> Journal:
        """A journal over `store` whose manager holds exactly the state the store acknowledged."""
        journal = cls(BlockManager(lease_seconds), store, config)
        try:
            t0 = time.perf_counter()
            replayed = journal._load(journal.manager, journal.window)
            # Pools rebuilt from the snapshot were checked as they were loaded; check the ones replay changed.
            problems = snap.verify_pools(journal._pools(journal.manager), journal._dirty)
            if problems:
                raise StateError(f"{store.location}: recovered state breaks invariants: {'; '.join(problems[:4])}",
                                 reason="STATE_INVARIANTS", problems=problems)
            ackmark.check_recovery(store, journal.seq, journal.snapshot_seq)
            store.check_position(journal.seq)
            if not store.readonly:
                lineage = store.lineage
                journal.incarnation = store.begin(journal.seq)
                if store.lineage != lineage and journal.manager.pool_names():
                    journal.snapshot(force=True)        # the snapshot it recovered from names the old lineage
            # The next snapshot follows the newest one in the store, not this process's start: under leader
            # churn each new leader would otherwise push it further and none would ever be written.
            journal._compact_at = journal.snapshot_seq + journal.config.snapshot_due_tail
            journal.replayed_entries = replayed
            journal.recovery_seconds = time.perf_counter() - t0
            log.info("recovered %s: snapshot at %d, %d entries replayed in %.3f s, lineage %s, incarnation %d, "
                     "pools: %s", store.location, journal.snapshot_seq, replayed, journal.recovery_seconds,
                     lineage_hex(store.lineage), journal.incarnation, ", ".join(journal.manager.pool_names()) or "none")
        except BaseException:
            store.close(clean=False, seq=journal.seq)
            raise
        return journal

    @property
    def lineage(self) -> int:
        """The state's lineage (its store's), stamped into every reply beside the position."""
        return self.store.lineage

    def _load(self, manager: BlockManager, window: IdempotencyWindow | None) -> int:
        """Restore the store's newest snapshot into manager and replay the later entries.

        window None: rebuild the manager only (resync). Returns the number of entries replayed.
        Raises StateError naming the first problem (damaged snapshot or entry, gap, failed replay).
        """
        try:
            return self._load_unchecked(manager, window)
        except StateError as err:
            if err.reason in ("STATE_ERROR", "STATE_DAMAGED"):
                err.reason = "STATE_DAMAGED"
                if "backup" not in err.message:
                    err.message = f"{err.message}. {self.store.remedy}"
                    err.args = (err.message,)
            raise

    def _load_unchecked(self, manager: BlockManager, window: IdempotencyWindow | None) -> int:
        where = self.store.location
        found = self.store.load_snapshot()
        snapshot_seq = 0
        if found is not None:
            snapshot_seq, blob = found
            name = f"{where}: snapshot at {snapshot_seq} ({self.store.snapshot_where})"
            s = snap.decode(blob, name)
            if s.seq != snapshot_seq:
                raise StateError(f"{name} holds position {s.seq} (damaged)")
            try:                                # a store that records no lineage continues its snapshot's
                self.store.lineage = continued_lineage(self.store.lineage, s.lineage, name)
            except StateError as err:
                self.store.override(err)
            manager.restore(snap.build_pools(s.pools, name), s.workers)
            if window is not None:
                window.load(s.window)
        api = ManagerAPI(manager)
        expected = snapshot_seq + 1
        # Only the last replay_replies Steps get their reply rebuilt (window None: none at all); an entry waits in
        # `recent` until enough later entries are read to tell whether it is one of them. Bounded in entries and
        # in request bytes.
        keep = self.config.replay_replies if window is not None else 0
        recent: deque[tuple[Entry, Message]] = deque()
        recent_bytes = 0
        quiet = _Quiet()
        logging.getLogger("kvservice").addFilter(quiet)
        try:
            for e in self.store.entries_after(snapshot_seq):
                recent.append((e, self._checked(e, expected, where)))
                recent_bytes += len(e.request)
                expected += 1
                while len(recent) > keep or (recent_bytes > self.config.reply_cache_bytes and len(recent) > 1):
                    old, request = recent.popleft()
                    recent_bytes -= len(old.request)
                    self._apply(api, old, request, window, where, reply=False)
            for e, request in recent:
                self._apply(api, e, request, window, where, reply=True)
        finally:
            logging.getLogger("kvservice").removeFilter(quiet)
        replayed = expected - snapshot_seq - 1
        if window is not None:
            window.evict(time.time())
            self.snapshot_seq, self.seq = snapshot_seq, expected - 1
        return replayed

    @staticmethod
    def _pools(manager: BlockManager) -> dict[str, Any]:
        out = {}
        for name in manager.pool_names():
            with manager.locked(name) as pool:
                out[name] = pool
        return out

    def _replay(self, api: ManagerAPI, e: Entry, expected: int, window: IdempotencyWindow | None,
                where: str) -> None:
        """Check one journal entry and apply it with its reply rebuilt (a standby: its window answers retries
        after a takeover). StateError naming the entry if it cannot be applied."""
        self._apply(api, e, self._checked(e, expected, where), window, where, reply=True)

    @staticmethod
    def _checked(e: Entry, expected: int, where: str) -> Message:
        """One journal entry's request, once its position, checksum and method are checked (recovery, a standby).
        StateError naming the entry otherwise."""
        if e.seq != expected:
            raise StateError(f"{where}: journal entries {expected}..{e.seq - 1} are missing (after position "
                             f"{expected - 1}): acknowledged changes are lost")
        if entry_digest(e.seq, e.method, e.request, e.created) != e.digest:
            raise StateError(f"{where}: journal entry {e.seq} fails its checksum (damaged)")
        if e.method not in REQUESTS:
            raise StateError(f"{where}: journal entry {e.seq} has unknown method {e.method!r}")
        try:
            return REQUESTS[e.method].FromString(e.request)
        except Exception as err:              # an unreadable entry: never a traceback at start
            raise StateError(f"{where}: journal entry {e.seq} ({e.method}) cannot be replayed "
                             f"({type(err).__name__}: {err})") from None

    def _apply(self, api: ManagerAPI, e: Entry, request: Message, window: IdempotencyWindow | None, where: str,
               reply: bool) -> None:
        """Apply a checked entry's request through api and remember its id in window (None: rebuild a manager
        only, resync). reply False: a Step is applied without tables or reply (ManagerAPI.apply_step), its id
        remembered without a reply. StateError naming the entry if it cannot be applied."""
        try:
            if not reply and e.method == "Step":
                answer = None
                api.apply_step(request)
            else:
                answer = getattr(api, e.method)(request)
        except KVError as err:
            raise StateError(f"{where}: journal entry {e.seq} ({e.method}) failed on replay: "
                             f"{err.message}; the state and this kvservice disagree") from None
        except Exception as err:              # a bug: never a traceback at start
            raise StateError(f"{where}: journal entry {e.seq} ({e.method}) cannot be replayed "
                             f"({type(err).__name__}: {err})") from None
        rid = getattr(request, "request_id", "")
        if window is not None and rid:
            window.remember(rid, e.method, digest(e.request), e.seq, e.created, answer)
        if window is not None:
            self._appended += len(e.request)
            if e.method in _TARGET:
                self._dirty.add(getattr(request, _TARGET[e.method]))

    def snapshot_stored(self, seq: int) -> None:
        """The store holds a snapshot at position seq that this journal did not write (the leader a standby
        followed, kvservice/server/ha.py): the next snapshot is due after it, as after one of its own."""
        with self._lock:
            if seq > self.snapshot_seq:
                self.snapshot_seq = seq
                self._compact_at = seq + self.config.snapshot_due_tail

    def reload(self) -> int:
        """Replace the whole state with the store's newest snapshot and the entries after it; entries replayed.

        For a standby whose next entry a compaction purged (kvservice/server/ha.py): what it missed is in the
        newer snapshot. The idempotency window comes from it too. StateError as recovery raises it.
        """
        with self._lock:
            scratch = BlockManager(self.manager.workers.lease_seconds)
            window = IdempotencyWindow(self.config)
            replayed = self._load(scratch, window)
            self.manager.restore(self._pools(scratch), scratch.workers.workers())
            self.window = window
            self._states, self._dirty = {}, set(self.manager.pool_names())
            self._compact_at = self.snapshot_seq + self.config.snapshot_due_tail
            self.replayed_entries = replayed
        return replayed

    def apply_entry(self, entry: Entry) -> None:
        """Check and apply the next entry another manager journaled (journal lock held; a standby,
        kvservice/server/ha.py).

        The same checks as recovery (position, checksum, replay); StateError if it cannot be applied.
        """
        quiet = _Quiet()
        logging.getLogger("kvservice").addFilter(quiet)
        try:
            self._replay(self.api, entry, self.seq + 1, self.window, self.store.location)
        finally:
            logging.getLogger("kvservice").removeFilter(quiet)
        self.seq = entry.seq

    def follow(self, entries: Iterable[Entry]) -> int:
        """Apply entries another manager journaled (a hot standby), under the journal lock; returns how many."""
        n = 0
        with self._lock:
            for entry in entries:
                self.apply_entry(entry)
                n += 1
        return n

    # ---- the hooks the servicer calls -----------------------------------------------------
    def execute(self, method: str, request: Message, apply: Callable[[Message], Message],
                received: bytes | None = None) -> Message:
        """Apply a mutating request once: durable before it returns, the stored reply for a retried request_id.

        apply(request) -> reply makes the change; a Step's arrays were decoded once by its caller (a request
        that cannot be decoded was refused before it came here), so nothing here decodes them again.
        received: the bytes the request arrived as, which are journaled and fingerprinted
        (stores.entry_request); None: the request is serialized.
        """
        while True:
            with self._lock:
                if not self._tail_full():
                    reply, cap = self._execute_locked(method, request, apply, received)
                    break
            self.snapshot_waits += 1        # the tail is at compact_every: wait (unlocked) for the snapshot
            self._writer_done.wait()
        if cap is not None:
            if self.config.background_snapshots:
                threading.Thread(target=self._write_capture, args=(cap,), name="kvservice-snapshot",
                                 daemon=True).start()
            else:
                self._write_capture(cap)
        return reply

    def _execute_locked(self, method: str, request: Message, apply: Callable[[Message], Message],
                        received: bytes | None = None) -> tuple[Message, Capture | None]:
        """execute under the journal lock: (reply, a snapshot capture to write outside the lock or None)."""
        self._check_usable()
        rid = getattr(request, "request_id", "")
        data = entry_request(request, received)
        fingerprint = (self._digests(request.pool, data) if method == "Step" else digest(data)) if rid else b""
        if rid:
            stored = self.window.lookup(rid, method, fingerprint)
            if stored is not None:
                return self._stamped_copy(stored), None
        with self._gate.writing(getattr(request, _TARGET[method]) if method in _TARGET else None):
            try:
                reply = apply(request)
            except KVError:
                raise                       # refused: nothing changed, nothing to journal
            except Exception as err:
                self._resync(f"{method} failed unexpectedly ({type(err).__name__}: {err})")
                raise
            now = time.time()
            self._commit(method, data, now)
            if method in _TARGET:
                self._dirty.add(getattr(request, _TARGET[method]))
            self._stamp(reply)
        if rid:
            self.window.remember(rid, method, fingerprint, self.seq, now, reply)
        cap = self._capture_locked() if not self.store.readonly and self._due() else None
        return reply, cap

    def read(self, request: Message, apply: Callable[[Message], Message]) -> Message:
        """A read of pool state: only committed state is visible, and nothing once the journal failed.

        It waits only while a change of the same pool is uncommitted (a read of all pools: any pool).
        """
        self._check_usable()
        with self._gate.reading(getattr(request, "pool", "")):
            reply = apply(request)
            self._stamp(reply)
        return reply

    def stamp(self, reply: Message) -> Message:
        """The reply with its journal position (if it has the field) set to now: reads that wait for no commit."""
        self._stamp(reply)
        return reply

    def _stamp(self, reply: Message) -> None:
        if "position" in reply.DESCRIPTOR.fields_by_name:
            pos = reply.position                               # type: ignore[attr-defined]
            pos.incarnation = self.incarnation
            pos.seq = self.seq
            pos.lineage = self.store.lineage

    def _stamped_copy(self, stored: Message) -> Message:
        reply = type(stored)()
        reply.CopyFrom(stored)
        self._stamp(reply)
        return reply

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise JournalUnavailable(f"the manager stopped accepting requests: {self.failed}; it must restart "
                                     "(state is recovered from its state dir)")

    def _commit(self, method: str, data: bytes, now: float) -> None:
        seq = self.seq + 1
        t0 = time.perf_counter()
        try:
            self.store.append(Entry.make(seq, method, data, now))
            mark = self.store.mark
            if mark is not None:                # after the entry is durable, before the reply leaves
                mark.advance(self.store.lineage, seq)
        except Exception as err:
            self._fail(f"journal write failed ({type(err).__name__}: {err})")
            raise JournalUnavailable(f"{method} was not made durable and is not acknowledged: "
                                     f"{self.failed}") from None
        if self.observe_commit is not None and self.store.durable:
            self.observe_commit(time.perf_counter() - t0)
        self._appended += len(data)
        self.seq = seq
        self.commits += 1

    def _resync(self, why: str) -> None:
        """After an unexpected error inside a change: rebuild the manager from the store (what was acknowledged)."""
        log.exception("%s; rebuilding the manager from the journal", why)
        try:
            scratch = BlockManager(self.manager.workers.lease_seconds)
            self._load(scratch, None)
            self.manager.restore(self._pools(scratch), scratch.workers.workers())
            self._dirty |= set(self.manager.pool_names())
            self.resyncs += 1
        except Exception as err:
            self._fail(f"{why}, and rebuilding the manager from the journal failed ({type(err).__name__}: {err})")

    def _fail(self, why: str) -> None:
        if self.failed is not None:
            return
        self.failed = why
        log.critical("journal failed, stopping: %s", why)
        if self.on_fail is not None:
            self.on_fail(why)

    def close(self, snapshot: bool = True) -> None:
        """Snapshot (if asked and healthy), then release the store, telling it the final position."""
        cap = self._capture_when_idle(check=False) if snapshot and not self.store.readonly else None
        if cap is not None:
            self._write_capture(cap)
        self._writer_done.wait()
        with self._lock:
            self.store.close(clean=self.failed is None, seq=self.seq)


__all__ = ["METHODS", "Entry", "IdempotencyWindow", "Journal", "JournalConfig", "JournalStore", "MemoryStore",
           "StateError"]
