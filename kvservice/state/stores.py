"""The store interface of the journal (what a storage backend implements), the in-memory store, lineages
and the acknowledged high-water mark.

A store keeps acknowledged entries (each with a checksum) and the newest snapshot; the journal
(kvservice/state/journal.py) does everything else. Backends: MemoryStore here, store_sqlite.SqliteStore
(a state dir), journal_nats.NatsStore (a NATS JetStream stream: replicated managers, docs/HA.md).
Every backend implements JournalStore and passes the shared suite tests/unit/test_journal_backends.py.

A store's state belongs to one *lineage* (``new_lineage``): the id of one history of acknowledged
changes, stamped beside the position into every reply. A store that can lose the tail of its entries
while keeping the rest (SQLite: a write-ahead log cut short) also keeps an :class:`AckMark`, a file of
its own holding the highest position acknowledged (kvservice/state/ackmark.py), so that recovery can prove
the tail it found complete.
"""

from __future__ import annotations

import secrets
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

from google.protobuf.message import Message

from kvservice.contract.errors import StateError
from kvservice.state import snapshot as snap
from kvservice.state.ackmark import AckMark


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


def entry_request(request: Message, received: bytes | None = None) -> bytes:
    """The bytes a request is journaled as.

    received: the bytes the request arrived as (kvservice.contract.serving.Received), or None. With them,
    the entry is those bytes followed by the request_id field as the server set it (scoped to the tenant, or
    derived from the stream; written even when empty): parsing the entry again gives the request as applied,
    since the last occurrence of a singular field wins. The server changes no other field of the requests it
    keeps the bytes of (Step). Without them, the message serialized (deterministic).
    """
    if received is None:
        return request.SerializeToString(deterministic=True)
    tag = _REQUEST_ID_TAG.get(type(request))
    if tag is None:
        tag = _REQUEST_ID_TAG[type(request)] = _varint(request.DESCRIPTOR.fields_by_name["request_id"].number << 3 | 2)
    value = request.request_id.encode()                       # type: ignore[attr-defined]
    n = len(value)
    return b"".join((received, tag, bytes((n,)) if n < 0x80 else _varint(n), value))


_REQUEST_ID_TAG: dict[type, bytes] = {}                        # message type -> its request_id field's tag


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def entry_digest(seq: int, method: str, request: bytes, created: float) -> bytes:
    """Checksum of a journal entry: its position, method, time and request bytes."""
    return snap.digest16(struct.pack("<qd", seq, created), method.encode(), b"\0", request)


# ---- lineages ------------------------------------------------------------------------------------
def new_lineage() -> int:
    """A fresh lineage id: a random nonzero 64-bit number (0 means "none" on the wire)."""
    while True:
        lineage = secrets.randbits(64)
        if lineage:
            return lineage


def lineage_hex(lineage: int) -> str:
    """How a lineage is written in files, headers and messages: 16 hex digits."""
    return f"{lineage:016x}"


def continued_lineage(current: int, found: int | str | None, where: str) -> int:
    """The lineage of a state of lineage `current` (0 = none yet) that reads `found` (a snapshot's, a fence's; an
    int, its hex, or None): found if it had none, else current. StateError if the two name different histories."""
    found = int(found, 16) if isinstance(found, str) else (found or 0)
    if found and current and found != current:
        raise StateError(f"{where} belongs to lineage {lineage_hex(found)}, the state to {lineage_hex(current)}: "
                         "parts of two different states (damaged)")
    return current or found


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


__all__ = ["Entry", "JournalStore", "MemoryStore", "continued_lineage", "entry_digest", "lineage_hex", "new_lineage"]
