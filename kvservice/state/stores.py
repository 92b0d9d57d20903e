"""The store interface of the journal (what a storage backend implements), the in-memory store, lineages
and the acknowledged high-water mark.

A store keeps acknowledged entries (each with a checksum) and the newest snapshot; the journal
(kvservice/state/journal.py) does everything else. Backends: MemoryStore here, store_sqlite.SqliteStore
(a state dir), journal_nats.NatsStore (a NATS JetStream stream: replicated managers, docs/HA.md).
Every backend implements JournalStore and passes the shared suite tests/unit/test_journal_backends.py.

A store's state belongs to one *lineage* (``new_lineage``): the id of one history of acknowledged
changes, stamped beside the position into every reply. A store that can lose the tail of its entries
while keeping the rest (SQLite: a write-ahead log cut short) also keeps an :class:`AckMark`, a file of
its own holding the highest position acknowledged, so that recovery can prove the tail it found complete.
"""

from __future__ import annotations

import os
import secrets
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvservice.contract.errors import StateError
from kvservice.state import snapshot as snap


@dataclass(frozen=True, slots=True)
class Entry:
    """One acknowledged mutating request: position, method, serialized request, wall-clock time, checksum.

    checksum: as stored (an entry read back), or None for a new entry: `digest` computes it on first
    read (a store that writes it reads it at append; the in-memory store only if it is read back).
    """

    seq: int
    method: str
    request: bytes
    created: float
    checksum: bytes | None = field(default=None, compare=False)   # filled lazily: not part of equality

    @property
    def digest(self) -> bytes:
        """The entry's checksum (entry_digest of its fields when it was made here)."""
        d = self.checksum
        if d is None:
            d = entry_digest(self.seq, self.method, self.request, self.created)
            object.__setattr__(self, "checksum", d)      # the same value whichever thread gets here first
        return d

    @staticmethod
    def make(seq: int, method: str, request: bytes, created: float) -> Entry:
        """A new entry; its checksum is computed when first read."""
        return Entry(seq, method, request, created)


def entry_digest(seq: int, method: str, request: bytes, created: float) -> bytes:
    """Checksum of a journal entry: its position, method, time and request bytes."""
    return snap.digest16(struct.pack("<qd", seq, created), method.encode(), b"\0", request)


# ---- lineages and the acknowledged high-water mark -------------------------------------------------
def new_lineage() -> int:
    """A fresh lineage id: a random nonzero 64-bit number (0 means "none" on the wire)."""
    while True:
        lineage = secrets.randbits(64)
        if lineage:
            return lineage


def lineage_hex(lineage: int) -> str:
    """How a lineage is written in files, headers and messages: 16 hex digits."""
    return f"{lineage:016x}"


@dataclass(frozen=True, slots=True)
class Acked:
    """What an AckMark says: position `seq` of `lineage` was acknowledged (so every position up to it was)."""

    lineage: int
    seq: int


class AckMark:
    """The acknowledged high-water mark: a small file, apart from the journal's entries, holding the highest
    position acknowledged so far and its lineage.

    The journal writes it after each entry is durable and before the reply leaves (Journal._commit), so
    at any instant it is at most the last acknowledged position; recovery refuses a state whose position
    is below it (acknowledged entries are missing, whatever the entries themselves look like). It lives in
    a file of its own so that what loses the entries' tail (a write-ahead log truncated, replaced by an
    older copy, cut by a file system) does not take it along; what it cannot see is written in
    docs/DURABILITY.md ("What the high-water mark proves").

    Layout (1024 bytes): two records, at offsets 0 and 512 (different disk sectors); position parity
    picks the one a write replaces, so a write torn by a crash leaves the other, one position older, intact.
    Record (40 bytes): magic b"KVACKED1", lineage uint64 LE, seq uint64 LE, blake2b-128 of those 24 bytes.
    sync: fdatasync each write (the state dir's sync=full: the mark is as durable as the commit before it);
    without it the mark survives a crash of the process, as sync=normal commits do.
    """

    MAGIC = b"KVACKED1"
    SIZE = 1024
    _SLOT = 512
    _RECORD = struct.Struct("<8sQQ")

    def __init__(self, path: Path, sync: bool = True, writable: bool = True) -> None:
        """Read the mark now (`found`: the newest valid record, None if there is none) and, if writable, open
        the file for writing (created if missing). `damaged`: the file holds bytes but no valid record."""
        self.path = path
        self.sync = sync
        self.found: Acked | None = None
        self.damaged = False
        self.required = False            # set by the store: the state says it keeps a mark, so one must be found
        self.writes = 0
        self._fd: int | None = None
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        records = [r for r in (self._decode(data[i:i + 40]) for i in (0, self._SLOT)) if r is not None]
        self.found = max(records, key=lambda r: r.seq, default=None)
        self.damaged = self.found is None and any(data)
        if writable:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    @classmethod
    def _decode(cls, raw: bytes) -> Acked | None:
        if len(raw) < 40:
            return None
        magic, lineage, seq = cls._RECORD.unpack(raw[:24])
        if magic != cls.MAGIC or snap.digest16(raw[:24]) != raw[24:40]:
            return None
        return Acked(lineage, seq)

    def write(self, lineage: int, seq: int) -> None:
        """Record that position seq of lineage is acknowledged (durable before it returns when sync)."""
        if self._fd is None:
            raise StateError(f"{self.path}: opened read-only")
        head = self._RECORD.pack(self.MAGIC, lineage, seq)
        os.pwrite(self._fd, head + snap.digest16(head), (seq & 1) * self._SLOT)
        if self.sync:
            os.fdatasync(self._fd)
        self.writes += 1

    def reset(self, lineage: int, seq: int) -> None:
        """Both records at once (a new lineage, or a repair): the file then says exactly (lineage, seq)."""
        if self._fd is None:
            raise StateError(f"{self.path}: opened read-only")
        blob = bytearray(self.SIZE)
        for s in (seq - 1, seq):
            head = self._RECORD.pack(self.MAGIC, lineage, max(s, 0))
            blob[(s & 1) * self._SLOT:(s & 1) * self._SLOT + 40] = head + snap.digest16(head)
        os.pwrite(self._fd, bytes(blob), 0)
        os.fsync(self._fd)
        self.found = Acked(lineage, seq)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---- the store interface ---------------------------------------------------------------------------
class JournalStore(ABC):
    """Where a Journal keeps entries and snapshots: the interface a storage backend implements.

    Calls come from the journal: append under the journal lock, write_snapshot from a snapshot
    thread (concurrently with appends: the store serialises its own bookkeeping). Every backend
    passes the shared suite tests/unit/test_journal_backends.py.
    """

    #: Survives the process (False: an in-process store).
    durable: bool = False
    #: Opened only to inspect: the journal never writes through it.
    readonly: bool = False
    #: Starts of a manager on this store so far (1 = the first), stamped into every reply.
    incarnation: int = 1
    #: Where the state lives, for messages.
    location: str = "memory"
    #: What an operator can do about damaged state here, appended to refusals.
    remedy: str = "the state is lost with it"
    #: The newest snapshot's name, for messages (set by load_snapshot).
    snapshot_where: str = "snapshot"
    #: The lineage of the state held here (new_lineage); 0 = none yet: begin() or a fence makes one for a
    #: store that starts from nothing, and a store with none adopts the lineage of the snapshot it loads.
    lineage: int = 0
    #: The acknowledged high-water mark, for a store that can lose the tail of its entries (None: its own
    #: witness, check_position, covers it). The journal writes it after every append and checks it on recovery.
    mark: AckMark | None = None
    #: Accept a state its witnesses disagree with (kvservice check-state --repair): a check that would refuse
    #: is reported through override() instead, and the state then starts a new lineage.
    repair: bool = False

    @abstractmethod
    def load_snapshot(self) -> tuple[int, bytes | memoryview] | None:
        """The newest snapshot as (journal position, encoded bytes), None if there is none.

        StateError if a snapshot should exist but is missing or damaged (its integrity as a
        file; the journal checks the contents)."""

    @abstractmethod
    def entries_after(self, seq: int) -> Iterator[Entry]:
        """Every entry after position seq, in order (the journal checks digests and gaps)."""

    @abstractmethod
    def begin(self, seq: int) -> int:
        """Recovery reached position seq: start a new incarnation (returned) and accept appends."""

    @abstractmethod
    def append(self, entry: Entry) -> None:
        """Make one entry durable before returning. Any exception means it may not be (fail-stop)."""

    @abstractmethod
    def write_snapshot(self, seq: int, encoded: snap.Encoded) -> None:
        """Store a snapshot at position seq, then drop the entries and older snapshots it covers."""

    def check_position(self, seq: int) -> None:  # noqa: B027  (optional hook, default: no witness)
        """StateError if the store knows that more than seq entries were acknowledged (a rollback)."""

    def override(self, err: StateError) -> None:
        """A recovery check failed: raise it, or (repair) record it and go on; the state then gets a new lineage."""
        raise err

    @abstractmethod
    def close(self, clean: bool, seq: int) -> None:
        """Release the store; clean: the journal stopped normally at position seq."""


class MemoryStore(JournalStore):
    """Entries and the newest snapshot in this process's memory (``kvservice serve --state memory``).

    Recovery from it (Journal.recover) works within the process: tests use it to restart a
    journal, and the journal to rebuild its manager after an unexpected error.
    """

    def __init__(self) -> None:
        self._entries: list[Entry] = []
        self._snapshot: tuple[int, bytes] | None = None
        self._lock = threading.Lock()
        self.incarnation = 0
        self.lineage = new_lineage()          # state that starts from nothing in this process

    def load_snapshot(self) -> tuple[int, bytes] | None:
        return self._snapshot

    def entries_after(self, seq: int) -> Iterator[Entry]:
        with self._lock:
            entries = [e for e in self._entries if e.seq > seq]
        return iter(entries)

    def begin(self, seq: int) -> int:
        self.incarnation += 1
        return self.incarnation

    def append(self, entry: Entry) -> None:
        with self._lock:
            self._entries.append(entry)

    def write_snapshot(self, seq: int, encoded: snap.Encoded) -> None:
        blob = b"".join(bytes(c) for c in encoded.chunks)
        with self._lock:
            self._snapshot = (seq, blob)
            self._entries = [e for e in self._entries if e.seq > seq]

    def close(self, clean: bool, seq: int) -> None:
        pass


__all__ = ["AckMark", "Acked", "Entry", "JournalStore", "MemoryStore", "entry_digest", "lineage_hex", "new_lineage"]
