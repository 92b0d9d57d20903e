"""The journal's SQLite backend: a state dir that refuses to serve when anything in it is damaged or missing.

Layout of DIR (format 2):

    state.db (+ -wal, -shm)   SQLite, WAL mode: meta(key, value): format, incarnation, lineage;
                              entries(seq, method, request, created, digest): the journal tail;
                              snapshots(seq, file, header_digest, nbytes, created): the newest snapshot
    snapshots/snapshot-<seq>.kvs   snapshot files (kvservice/state/snapshot.py)
    MANIFEST                  JSON witness, replaced atomically: format, incarnation, lineage, running,
                              last_seq (at least this many changes were acknowledged), snapshot_seq,
                              acked_mark (ACKED is kept), digest
    ACKED                     the acknowledged high-water mark (kvservice/state/ackmark.py): the last position
                              acknowledged, written after every commit, outside the log
    lock                      flock of the serving process (its pid inside)

What is checked on open, before anything is served (each failure is a StateError that says what is
wrong and what to do; ``kvservice check-state DIR`` prints the same): the MANIFEST's own checksum; a
state.db that is missing or empty while the MANIFEST says the dir holds state (versus a genuinely fresh
dir); the database header (a header that lost WAL mode would make SQLite ignore the log); the write-ahead
log frame by frame (kvservice/state/sqlite/wal.py: damage is refused, an incomplete last commit dropped);
a log missing after an unclean stop; SQLite's quick_check; format, incarnation and lineage; the snapshot
file recorded in the database (present, same size, same header digest). The journal then checks the
snapshot, each entry and that none is missing, every pool's invariants, the recovered position against
ACKED (ackmark.check_recovery: a tail lost from the log is refused, whatever the log looks like) and
against the MANIFEST's last_seq (check_position). Under repair (``check-state --repair``) a failed witness
check is recorded instead (``override``) and the state starts a new lineage. Recovery reads through a
read-only connection: a refused start leaves the dir as it was.

Read-only opens (check-state, tests) work on a private copy of the database: on a stopped dir
after the same checks (holding a shared lock so no manager starts meanwhile), on a running one
through SQLite's online backup (its log is then not checked: the manager is writing it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvservice.contract.errors import StateError
from kvservice.state import snapshot as snap
from kvservice.state.ackmark import AckMark, torn_tail_note
from kvservice.state.sqlite.dirfiles import (
    FORMAT,
    MANIFEST,
    REPAIR,
    RESTORE,
    fsync_dir,
    lock_dir,
    read_manifest,
    write_manifest,
)
from kvservice.state.sqlite.wal import check_wal, db_header
from kvservice.state.stores import Entry, JournalStore, lineage_hex, new_lineage

log = logging.getLogger("kvservice.state.journal")

DB_NAME = "state.db"
ACKED = "ACKED"
SNAP_DIR = "snapshots"


def _ro_uri(path: Path) -> str:
    return f"file:{urllib.request.pathname2url(str(path))}?mode=ro"


class SqliteStore(JournalStore):
    """A state dir (see the module docstring). Use SqliteStore.open."""

    durable = True
    remedy = "Restore the state dir from a backup (see docs/DURABILITY.md, \"Damaged state\")"

    def __init__(self, state_dir: Path, readonly: bool, lock_fd: int | None, repair: bool) -> None:
        self.state_dir = state_dir
        self.location = str(state_dir)
        self.readonly = readonly
        self.repair = repair
        self.live = False                       # readonly: a manager is running on the dir
        self._lock_fd = lock_fd
        self._db_lock = threading.Lock()        # appends vs the snapshot thread's transaction
        self._manifest_lock = threading.Lock()
        self._copy_dir: Path | None = None
        self.manifest: dict[str, Any] | None = None
        self.snapshot_seq = 0
        self.torn_frames = 0
        self.notes: list[str] = []              # what check-state reports besides problems
        self.overridden: list[str] = []         # checks a repair accepted: the state then gets a new lineage
        self.db: sqlite3.Connection | None = None
        self.mark: AckMark | None = None
        self._sync = "full"
        self._recovering = False                # db is the read-only connection recovery reads through

    # ---- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, state_dir: Path, sync: str = "full", readonly: bool = False, repair: bool = False) -> SqliteStore:
        """Open (creating it if missing and not readonly) and check a state dir; StateError if it cannot serve."""
        if readonly:
            if not (state_dir / DB_NAME).exists() and not (state_dir / MANIFEST).exists():
                raise StateError(f"{state_dir}: no kvservice state here ({DB_NAME} and {MANIFEST} are missing)",
                                 reason="STATE_MISSING")
            fd = lock_dir(state_dir, shared=True)
            store = cls(state_dir, True, fd if fd is not None and fd >= 0 else None, False)
            store.live = fd is None
        else:
            state_dir.mkdir(parents=True, exist_ok=True)
            store = cls(state_dir, False, lock_dir(state_dir), repair)
        try:
            store._open(sync)
        except BaseException:
            store._release()
            raise
        return store

    def _open(self, sync: str) -> None:
        d = self.state_dir
        db_path, wal = d / DB_NAME, d / (DB_NAME + "-wal")
        try:
            self.manifest = read_manifest(d)
        except StateError as err:
            self.override(err)
            self.manifest = None
        m = self.manifest
        # Read before anything else (a running manager's online copy below is taken after it, so the mark
        # can only be behind that copy, never ahead of it).
        self.mark = AckMark(d / ACKED, sync == "full", writable=not self.readonly)
        self.mark.required = bool(m and m.get("acked_mark"))
        db_has = db_path.exists() and db_path.stat().st_size > 0
        snap_files = sorted((d / SNAP_DIR).glob("snapshot-*.kvs")) if (d / SNAP_DIR).exists() else []
        fresh = self._fresh(m, db_path, db_has, len(snap_files))
        if fresh:
            for p in (db_path, wal, d / (DB_NAME + "-shm")):
                p.unlink(missing_ok=True)
            db_has = False
        elif m is not None and m["format"] != FORMAT:
            raise StateError(f"{d}: state format {m['format']} is not {FORMAT}; use the kvservice release that "
                             "wrote it", reason="STATE_FORMAT")
        elif not db_has:
            raise StateError(f"{d}: {DB_NAME} is missing or empty, but {MANIFEST} says this dir holds state "
                             f"(incarnation {m['incarnation'] if m else '?'}, at least {m['last_seq'] if m else '?'} "
                             f"changes acknowledged, snapshot at {m['snapshot_seq'] if m else '?'}): {RESTORE}",
                             reason="STATE_DAMAGED")
        wal_existed = wal.exists()
        self._check_files(db_path, wal, db_has, wal_existed)
        self._connect(sync, fresh)
        self._check_tables(wal_existed)

    def _fresh(self, m: dict | None, db_path: Path, db_has: bool, snap_files: int) -> bool:
        """Whether the dir holds no state yet (start empty); StateError when it holds state but no MANIFEST says
        how much was acknowledged (unless repairing: then that is noted as overridden)."""
        d = self.state_dir
        if m is None and self.repair and (db_has or snap_files):
            self.overridden.append("no MANIFEST: how much was acknowledged is unknown")
        acked = self.mark.found.seq if self.mark.found is not None else 0
        if m is None and not self.repair and acked and not db_has:
            raise StateError(f"{d}: {MANIFEST} and {DB_NAME} are missing, but {ACKED} says {acked} changes were "
                             f"acknowledged here: this is not a fresh state dir. {RESTORE}, or move {ACKED} away "
                             "to start empty", reason="STATE_DAMAGED")
        if m is not None or self.repair:
            return False
        if not db_has and not snap_files and not self.readonly:
            return True
        if db_has and not snap_files and not acked and self._interrupted_first_start(db_path) and not self.readonly:
            return True
        raise StateError(f"{d}: {MANIFEST} is missing but the dir holds kvservice state "
                         f"({'state.db' if db_has else 'no state.db'}, {snap_files} snapshot files): "
                         f"how much it acknowledged is unknown. {REPAIR}, or {RESTORE}", reason="STATE_DAMAGED")

    def _check_files(self, db_path: Path, wal: Path, db_has: bool, wal_existed: bool) -> None:
        """The database header and the write-ahead log, checked before SQLite opens (and may rewrite) them."""
        d = self.state_dir
        if db_has and not (self.readonly and self.live):
            page_size, problem = db_header(db_path)
            if problem:
                raise StateError(f"{d}: {problem}: {RESTORE}", reason="STATE_DAMAGED")
            if wal_existed:
                rep = check_wal(wal, page_size)
                if rep.problem:
                    raise StateError(f"{d}: {rep.problem}. {RESTORE}; or, to accept losing those commits, move "
                                     f"{wal.name} away and {REPAIR}", reason="STATE_DAMAGED")
                if rep.torn:
                    self.torn_frames = rep.torn     # whether that commit was acknowledged: check_position says
        elif self.live:
            self.notes.append("a manager is running on this dir: checked through an online copy; its "
                              "write-ahead log was not checked")

    def _interrupted_first_start(self, db_path: Path) -> bool:
        """A state.db with our tables and nothing in them, no MANIFEST: a first start that stopped early.

        Looks at a copy: SQLite must not touch the real log before it is checked.
        """
        with tempfile.TemporaryDirectory(prefix="kvservice-peek-") as tmp:
            for suffix in ("", "-wal"):
                if Path(f"{db_path}{suffix}").exists():
                    shutil.copyfile(f"{db_path}{suffix}", Path(tmp) / f"{DB_NAME}{suffix}")
            return self._empty_tables(Path(tmp) / DB_NAME, db_path)

    @staticmethod
    def _empty_tables(copy: Path, db_path: Path) -> bool:
        try:
            db = sqlite3.connect(copy, isolation_level=None)
            try:
                fmt = db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
                if fmt is not None and fmt[0] != str(FORMAT):
                    raise StateError(f"{db_path}: state format {fmt[0]} (pickled snapshots) was written by an "
                                     "older kvservice and is not read by this one: finish with the old release "
                                     "(drain its pools), then start this one on a fresh state dir",
                                     reason="STATE_FORMAT")
                n = db.execute("SELECT (SELECT COUNT(*) FROM entries) + (SELECT COUNT(*) FROM snapshots)").fetchone()
                return fmt is not None and n[0] == 0
            finally:
                db.close()
        except sqlite3.Error:
            return False

    def _connect(self, sync: str, fresh: bool) -> None:
        d = self.state_dir
        db_path = d / DB_NAME
        try:
            if self.readonly:
                self._copy_dir = Path(tempfile.mkdtemp(prefix="kvservice-check-"))
                copy = self._copy_dir / DB_NAME
                if self.live:
                    src = sqlite3.connect(_ro_uri(db_path), uri=True)
                    dst = sqlite3.connect(copy)
                    try:
                        src.backup(dst)
                    finally:
                        src.close()
                        dst.close()
                else:
                    shutil.copyfile(db_path, copy)
                    if (d / (DB_NAME + "-wal")).exists():
                        shutil.copyfile(d / (DB_NAME + "-wal"), self._copy_dir / (DB_NAME + "-wal"))
                db_path = copy
            else:
                (d / (DB_NAME + "-shm")).unlink(missing_ok=True)      # we hold the lock: rebuilt from the log
            self._sync = sync
            if fresh or self.readonly:
                self.db = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
            else:
                # Recovery reads through a read-only connection: if it refuses the state, closing it leaves
                # the log as it found it (a read-write connection closing last would checkpoint it into
                # state.db and delete it, destroying what the refusal is about). begin() reopens read-write.
                self.db = sqlite3.connect(_ro_uri(db_path), uri=True, isolation_level=None, check_same_thread=False)
                self._recovering = True
            mode = self.db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise StateError(f"{db_path}: cannot switch SQLite to WAL mode (got {mode})")
            self.db.execute(f"PRAGMA synchronous={sync.upper()}")
            if fresh:
                self.db.executescript(f"""
                    CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
                    CREATE TABLE entries(seq INTEGER PRIMARY KEY, method TEXT NOT NULL, request BLOB NOT NULL,
                                         created REAL NOT NULL, digest BLOB NOT NULL);
                    CREATE TABLE snapshots(seq INTEGER PRIMARY KEY, file TEXT NOT NULL, header_digest BLOB NOT NULL,
                                           nbytes INTEGER NOT NULL, created REAL NOT NULL);
                    INSERT INTO meta VALUES ('format', '{FORMAT}'), ('incarnation', '0');
                """)
            else:
                found = self.db.execute("PRAGMA quick_check(8)").fetchall()
                if [r[0] for r in found] != ["ok"]:
                    raise StateError(f"{d / DB_NAME}: SQLite finds the database damaged: "
                                     f"{'; '.join(r[0] for r in found)}. {RESTORE}", reason="STATE_DAMAGED")
        except sqlite3.Error as err:
            raise StateError(f"{d / DB_NAME}: cannot be read ({type(err).__name__}: {err}). {RESTORE}",
                             reason="STATE_DAMAGED") from None

    def _check_tables(self, wal_existed: bool) -> None:
        d, m = self.state_dir, self.manifest
        try:
            meta = dict(self.db.execute("SELECT key, value FROM meta").fetchall())      # type: ignore[union-attr]
            row = self.db.execute("SELECT MAX(seq) FROM snapshots").fetchone()        # type: ignore[union-attr]
        except sqlite3.Error as err:
            raise StateError(f"{d / DB_NAME}: its tables cannot be read ({err}); written by another kvservice, or "
                             f"damaged. {RESTORE}", reason="STATE_DAMAGED") from None
        if meta.get("format") != str(FORMAT):
            old = meta.get("format") == "1"
            raise StateError(f"{d / DB_NAME}: state format {meta.get('format', '?')} is not {FORMAT}" +
                             (": format 1 (pickled snapshots) was written by an older kvservice and is not read by "
                              "this one; finish with the old release (drain its pools), then start this one on a "
                              "fresh state dir" if old else f". {RESTORE}"), reason="STATE_FORMAT")
        try:
            self.incarnation = int(meta.get("incarnation", ""))
            self.lineage = int(meta.get("lineage", "0"), 16)
        except ValueError:
            raise StateError(f"{d / DB_NAME}: incarnation {meta.get('incarnation')!r} or lineage "
                             f"{meta.get('lineage')!r} is damaged. {RESTORE}", reason="STATE_DAMAGED") from None
        self.snapshot_seq = int(row[0] or 0)
        if m is None:
            return
        if self.lineage and m.get("lineage") and m["lineage"] != lineage_hex(self.lineage):
            self.override(StateError(f"{d}: {DB_NAME} belongs to lineage {lineage_hex(self.lineage)} but {MANIFEST} "
                                     f"to {m['lineage']}: the database comes from another state dir. {RESTORE}, or "
                                     f"{REPAIR}", reason="STATE_DAMAGED"))
        if self.incarnation not in (m["incarnation"], m["incarnation"] + 1):
            raise StateError(f"{d}: {DB_NAME} is at incarnation {self.incarnation} but {MANIFEST} at "
                             f"{m['incarnation']}: the database was replaced by another copy. {RESTORE}, or {REPAIR}",
                             reason="STATE_DAMAGED")
        if m["running"] and self.incarnation == m["incarnation"] and not wal_existed:
            self.override(StateError(f"{d}: {DB_NAME}-wal is missing after an unclean stop of incarnation "
                                     f"{m['incarnation']}: the changes acknowledged since its last checkpoint are "
                                     f"lost. {RESTORE}, or {REPAIR}", reason="STATE_DAMAGED"))
        if m["snapshot_seq"] > self.snapshot_seq:
            self.override(StateError(f"{d}: {MANIFEST} records a snapshot at {m['snapshot_seq']} but {DB_NAME} "
                                     f"{'has none' if not self.snapshot_seq else f'only one at {self.snapshot_seq}'}: "
                                     f"{RESTORE}", reason="STATE_DAMAGED"))

    # ---- JournalStore -------------------------------------------------------------------------
    def load_snapshot(self) -> tuple[int, bytes] | None:
        if not self.snapshot_seq:
            return None
        d = self.state_dir
        try:
            seq, name, hd, nbytes = self.db.execute(                                  # type: ignore[union-attr]
                "SELECT seq, file, header_digest, nbytes FROM snapshots WHERE seq = ?", (self.snapshot_seq,)).fetchone()
        except (sqlite3.Error, TypeError, ValueError) as err:
            raise StateError(f"{d / DB_NAME}: the snapshot record cannot be read ({err}). {RESTORE}",
                             reason="STATE_DAMAGED") from None
        path = d / SNAP_DIR / str(name)
        self.snapshot_where = f"{SNAP_DIR}/{name}"
        if path.parent != d / SNAP_DIR or not path.name.startswith("snapshot-"):
            raise StateError(f"{d / DB_NAME}: the snapshot record names {name!r} (damaged). {RESTORE}",
                             reason="STATE_DAMAGED")
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            again = " (the running manager replaced it meanwhile: run the check again)" if self.live else ""
            raise StateError(f"{path}: the snapshot at {seq} is missing{again}; the entries it covers were "
                             f"dropped, so the state cannot be rebuilt without it. {RESTORE}",
                             reason="STATE_DAMAGED") from None
        if len(blob) != nbytes or blob[16:32] != bytes(hd):
            raise StateError(f"{path}: {len(blob)} bytes, header digest {blob[16:32].hex()}; the database recorded "
                             f"{nbytes} bytes, {bytes(hd).hex()}: truncated, damaged or replaced. {RESTORE}",
                             reason="STATE_DAMAGED")
        return int(seq), blob

    def entries_after(self, seq: int) -> Iterator[Entry]:
        try:
            for s, method, data, created, dg in self.db.execute(                       # type: ignore[union-attr]
                    "SELECT seq, method, request, created, digest FROM entries WHERE seq > ? ORDER BY seq", (seq,)):
                yield Entry(int(s), str(method), bytes(data), float(created), bytes(dg))
        except (sqlite3.Error, TypeError, ValueError) as err:
            raise StateError(f"{self.state_dir / DB_NAME}: journal entries cannot be read ({type(err).__name__}: "
                             f"{err}). {RESTORE}", reason="STATE_DAMAGED") from None

    def check_position(self, seq: int) -> None:
        m = self.manifest
        if m is not None and seq < m["last_seq"]:
            self.override(StateError(f"{self.state_dir}: {MANIFEST} says at least {m['last_seq']} changes were "
                                     f"acknowledged, but the state dir holds only {seq}: acknowledged changes were "
                                     f"lost (a damaged, replaced or rolled-back {DB_NAME}). {RESTORE}, or {REPAIR}",
                                     reason="STATE_ROLLBACK"))
        if self.torn_frames:            # after ackmark.check_recovery: the recovered position reaches ACKED
            self.notes.append(torn_tail_note(f"{DB_NAME}-wal", self.torn_frames, seq, self.mark, not self.overridden))
            log.warning("%s: %s", self.state_dir, self.notes[-1])

    def override(self, err: StateError) -> None:
        if not self.repair:
            raise err
        self.overridden.append(err.message)
        self.notes.append(f"accepted (repair): {err.message}")

    def begin(self, seq: int) -> int:
        inc = self.incarnation + 1
        if not self.lineage or self.overridden:
            old, self.lineage = self.lineage, new_lineage()
            if old:
                log.warning("%s: the state no longer provably continues lineage %s (%s); it starts lineage %s: "
                            "clients see a new history", self.state_dir, lineage_hex(old), "; ".join(self.overridden),
                            lineage_hex(self.lineage))
                self.notes.append(f"new lineage {lineage_hex(self.lineage)} (was {lineage_hex(old)})")
        assert self.mark is not None
        self.mark.reset(self.lineage, seq)
        if self._recovering:                    # every check passed: from here on the dir is written
            self._reopen_writable()
        with self._db_lock:
            self.db.execute("UPDATE meta SET value = ? WHERE key = 'incarnation'", (str(inc),))  # type: ignore[union-attr]
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('lineage', ?)",                  # type: ignore[union-attr]
                            (lineage_hex(self.lineage),))
            self._checkpoint()
        self._write_manifest(incarnation=inc, running=True, last_seq=seq)
        self.incarnation = inc
        keep = {f"snapshot-{self.snapshot_seq:012d}.kvs"}
        if (self.state_dir / SNAP_DIR).exists():
            for p in (self.state_dir / SNAP_DIR).iterdir():        # files of snapshots never recorded, temp files
                if p.name not in keep:
                    p.unlink(missing_ok=True)
        return inc

    def append(self, entry: Entry) -> None:
        with self._db_lock:
            self.db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?)",                 # type: ignore[union-attr]
                            (entry.seq, entry.method, entry.request, entry.created, entry.digest))

    def write_snapshot(self, seq: int, encoded: snap.Encoded) -> None:
        sdir = self.state_dir / SNAP_DIR
        sdir.mkdir(exist_ok=True)
        name = f"snapshot-{seq:012d}.kvs"
        tmp = sdir / (name + ".tmp")
        with open(tmp, "wb") as f:
            for chunk in encoded.chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, sdir / name)
        fsync_dir(sdir)
        with self._db_lock:
            db = self.db
            db.execute("BEGIN IMMEDIATE")                                                       # type: ignore[union-attr]
            try:
                db.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?, ?, ?, ?)",           # type: ignore[union-attr]
                           (seq, name, encoded.header_digest, encoded.nbytes, time.time()))
                db.execute("DELETE FROM entries WHERE seq <= ?", (seq,))                        # type: ignore[union-attr]
                db.execute("DELETE FROM snapshots WHERE seq < ?", (seq,))                       # type: ignore[union-attr]
                db.execute("COMMIT")                                                            # type: ignore[union-attr]
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")                                                      # type: ignore[union-attr]
                raise
            old, self.snapshot_seq = self.snapshot_seq, seq
        if old and old != seq:
            (sdir / f"snapshot-{old:012d}.kvs").unlink(missing_ok=True)
        m = self.manifest or {}
        self._write_manifest(incarnation=self.incarnation, running=True, last_seq=max(seq, m.get("last_seq", 0)))

    def close(self, clean: bool, seq: int) -> None:
        if self.db is not None and not self.readonly:
            with self._db_lock:
                try:
                    done = self._checkpoint()
                except sqlite3.Error:
                    done = False
                if done and self.manifest is not None:      # everything is in state.db: the log may go
                    self._write_manifest(incarnation=self.incarnation, running=False,
                                         last_seq=max(seq, self.manifest["last_seq"]))
        self._release()

    # ---- helpers ---------------------------------------------------------------------------------
    def _reopen_writable(self) -> None:
        assert self.db is not None
        self.db.close()
        self.db = sqlite3.connect(self.state_dir / DB_NAME, isolation_level=None, check_same_thread=False)
        mode = self.db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise StateError(f"{self.state_dir / DB_NAME}: cannot switch SQLite to WAL mode (got {mode})")
        self.db.execute(f"PRAGMA synchronous={self._sync.upper()}")
        self._recovering = False

    def _checkpoint(self) -> bool:
        """Copy the log into state.db and truncate it; False if a reader kept it from completing."""
        busy, _, _ = self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()            # type: ignore[union-attr]
        return not busy

    def _write_manifest(self, **fields: Any) -> None:
        with self._manifest_lock:
            fields.setdefault("snapshot_seq", self.snapshot_seq)
            fields.setdefault("lineage", lineage_hex(self.lineage))
            fields.setdefault("acked_mark", True)
            write_manifest(self.state_dir, **fields)
            self.manifest = read_manifest(self.state_dir)

    def _release(self) -> None:
        if self.mark is not None:
            with contextlib.suppress(StateError, OSError):     # a mark that could not be written failed the journal
                self.mark.close()
        if self.db is not None:
            with contextlib.suppress(sqlite3.Error):
                self.db.close()
            self.db = None
        if self._copy_dir is not None:
            shutil.rmtree(self._copy_dir, ignore_errors=True)
            self._copy_dir = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


__all__ = ["DB_NAME", "FORMAT", "MANIFEST", "SqliteStore", "read_manifest", "write_manifest"]
