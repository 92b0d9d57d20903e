"""The acknowledged high-water mark: the last journal position made durable, kept apart from the entries.

A store whose entries can lose their tail while the rest survives (SQLite: a write-ahead log cut
short, replaced by an older copy, truncated by a file system) cannot tell from the entries alone
whether what it holds is everything that was acknowledged. :class:`AckMark` is a small file of its
own: the journal advances it after every entry is durable (Journal._commit), and recovery refuses a
state whose position is below it (check_recovery, below). The file is written in place, never
truncated, and nothing that writes the log touches it.

When it is durable (``sync``, the state dir's sync=full), the write of position N (a pwrite and an
fdatasync) runs on a writer thread that starts as soon as N is committed, so its fdatasync overlaps
the next commit's instead of adding to every Step; ``advance(N + 1)`` waits for N's record to be on
disk before the reply of N + 1 may leave. Hence, whatever instant the machine stops:

    durable mark >= (last position whose reply left) - 1, and
    durable mark <= last position whose entry was durable (never ahead of the log's own promise).

So the mark proves every acknowledged position but possibly the last one, and the last one too once
one fdatasync has passed since its reply (a scheduler's next request usually comes later than that).
Without ``sync`` (sync=normal) each record is written in place (pwrite) before the reply leaves:
exact while the machine keeps running (kill -9, an external truncation), as sync=normal commits are.
What the mark cannot see is written in docs/DURABILITY.md ("What the high-water mark proves").

Layout (1024 bytes): two records, at offsets 0 and 512 (different disk sectors), position parity
choosing the one a write replaces, so a write torn by a crash leaves the other, one position older.
Record (40 bytes): magic b"KVACKED1", lineage uint64 LE, seq uint64 LE, blake2b-128 of those 24 bytes.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvservice.contract.errors import StateError
from kvservice.state.snapshot import digest16


@dataclass(frozen=True, slots=True)
class Acked:
    """What an AckMark holds: position `seq` of `lineage` was made durable (and every position before it)."""

    lineage: int
    seq: int


class AckMark:
    """The high-water mark file of one state (see the module docstring).

    found: the newest valid record when the file was opened (None: none); damaged: the file holds bytes
    but no valid record; required: set by the store when the state says it keeps a mark (then a missing
    one is refused). writes: records written.
    """

    MAGIC = b"KVACKED1"
    SIZE = 1024
    SLOT = 512
    _HEAD = struct.Struct("<8sQQ")

    def __init__(self, path: Path, sync: bool = True, writable: bool = True) -> None:
        """Read the mark now and, if writable, open the file for writing (created if missing)."""
        self.path = path
        self.sync = sync
        self.required = False
        self.writes = 0
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        records = [r for r in (self.decode(data[i:i + 40]) for i in (0, self.SLOT)) if r is not None]
        self.found: Acked | None = max(records, key=lambda r: r.seq, default=None)
        self.damaged = self.found is None and any(data)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if writable else None
        self._cv = threading.Condition(threading.Lock())
        self._want: Acked | None = None        # the record the writer thread is to write next
        self._done = self.found.seq if self.found is not None else 0     # highest seq on disk (this process)
        self._error: BaseException | None = None
        self._closing = False
        self._writer: threading.Thread | None = None

    @classmethod
    def record(cls, lineage: int, seq: int) -> bytes:
        head = cls._HEAD.pack(cls.MAGIC, lineage, seq)
        return head + digest16(head)

    @classmethod
    def decode(cls, raw: bytes) -> Acked | None:
        """The record in 40 bytes, None if they are not a valid one."""
        if len(raw) < 40:
            return None
        magic, lineage, seq = cls._HEAD.unpack(raw[:24])
        if magic != cls.MAGIC or digest16(raw[:24]) != raw[24:40]:
            return None
        return Acked(lineage, seq)

    # ---- writing ----------------------------------------------------------------------------------
    def advance(self, lineage: int, seq: int) -> None:
        """Position seq is durable in the journal: record it. Called with positions 1, 2, 3, ... in order.

        sync: first waits until seq - 1's record is on disk (started by the previous call), then hands seq's
        to the writer thread and returns. Otherwise writes it in place now. Raises (OSError, StateError)
        if a record could not be written: the journal then stops (the previous reply was already sent
        with its record pending; recovery finds the mark one position lower, which it reaches).
        """
        fd = self._writable()
        if not self.sync:
            os.pwrite(fd, self.record(lineage, seq), (seq & 1) * self.SLOT)
            self.writes += 1
            return
        with self._cv:
            while self._done < seq - 1 and self._want is not None and self._error is None:
                self._cv.wait()
            self._raise_error()
            self._want = Acked(lineage, seq)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name=f"ackmark-{self.path.name}",
                                                daemon=True)
                self._writer.start()
            self._cv.notify_all()

    def flush(self) -> None:
        """Wait until every record handed to advance() is on disk (raises the writer's error, if any)."""
        with self._cv:
            while self._want is not None and self._done < self._want.seq and self._error is None:
                self._cv.wait()
            self._raise_error()

    def reset(self, lineage: int, seq: int) -> None:
        """Both records at once, durable before it returns (a start: a new lineage, a repair, a fresh state):
        the file then says exactly (lineage, seq) whatever it held."""
        fd = self._writable()
        self.flush()
        blob = bytearray(self.SIZE)
        for s in (seq - 1, seq):
            at = (s & 1) * self.SLOT
            blob[at:at + 40] = self.record(lineage, max(s, 0))
        os.pwrite(fd, bytes(blob), 0)
        os.fsync(fd)
        with self._cv:
            self._done, self._want = seq, None
        self.found = Acked(lineage, seq)

    def close(self) -> None:
        """Write what is pending, stop the writer thread, close the file."""
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            if self._writer is not None:
                self._writer.join()
            os.close(self._fd)
            self._fd = None

    def _writable(self) -> int:
        if self._fd is None:
            raise StateError(f"{self.path}: the high-water mark is open read-only or closed")
        return self._fd

    def _raise_error(self) -> None:
        if self._error is not None:
            raise StateError(f"{self.path}: the high-water mark could not be written ({type(self._error).__name__}: "
                             f"{self._error})")

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._closing and (self._want is None or self._want.seq <= self._done):
                    self._cv.wait()
                if self._want is None or self._want.seq <= self._done:
                    return                                  # closing, nothing pending
                want = self._want
            try:
                os.pwrite(self._fd, self.record(want.lineage, want.seq), (want.seq & 1) * self.SLOT)  # type: ignore[arg-type]
                os.fdatasync(self._fd)                                                                  # type: ignore[arg-type]
            except BaseException as err:                    # reported to the next advance() / flush()
                with self._cv:
                    self._error = err
                    self._cv.notify_all()
                return
            with self._cv:
                self._done = max(self._done, want.seq)
                self.writes += 1
                self._cv.notify_all()


# ---- what recovery concludes from it (backend-neutral: any store with a mark) ------------------------------
REPAIR = "run `kvservice check-state DIR --repair` to accept"


def check_recovery(store: Any, seq: int, snapshot_seq: int) -> None:
    """Recovery of `store` (a stores.JournalStore) reached position seq: refuse it (StateError through
    store.override, which records it instead under repair: the state then starts a new lineage) if its
    mark is missing when required, damaged, of another lineage, or above seq (acknowledged entries lost)."""
    mark: AckMark | None = store.mark
    if mark is None:
        return
    found = mark.found
    where = f"{store.location}: the acknowledged high-water mark ({mark.path.name})"
    if found is None:
        if mark.damaged or mark.required:
            store.override(StateError(
                f"{where} is {'damaged' if mark.damaged else 'missing'}, so whether the journal's tail is complete "
                f"cannot be proved. {store.remedy}, or {REPAIR} the state as it is (it then starts a new lineage)",
                reason="STATE_DAMAGED"))
    elif store.lineage and found.lineage != store.lineage:
        store.override(StateError(
            f"{where} belongs to lineage {found.lineage:016x} but the state to {store.lineage:016x}: parts of two "
            f"state dirs were put together. {store.remedy}", reason="STATE_DAMAGED"))
    elif seq < found.seq:
        lost = f"change {found.seq} is" if found.seq == seq + 1 else f"changes {seq + 1}..{found.seq} are"
        store.override(StateError(
            f"{where} says position {found.seq} was acknowledged, but the journal holds only {seq} (snapshot at "
            f"{snapshot_seq}, then {seq - snapshot_seq} entries): acknowledged {lost} lost (the tail of the journal "
            "was cut: a write-ahead log truncated or replaced by an older copy, or storage that lost writes it had "
            f"confirmed). Serving this state would roll its clients back. {store.remedy}, or {REPAIR} the loss "
            "(the state then starts a new lineage)", reason="STATE_ROLLBACK", acknowledged=found.seq, recovered=seq))


def torn_tail_note(log_name: str, frames: int, seq: int, mark: AckMark | None, vouched: bool) -> str:
    """What an incomplete commit at the end of a log (`frames` frames, dropped) was, as far as the mark can tell.

    Called once check_recovery passed (the recovered position seq reaches the mark); vouched: no check was
    overridden (a repaired state's mark vouches for nothing)."""
    head = (f"{log_name}: the last {frames} frames are an incomplete commit (a write cut short by a crash, or a log "
            "cut in the middle of a frame); dropped.")
    found = mark.found if mark is not None else None
    if found is None or not vouched:
        return f"{head} No acknowledged high-water mark vouches for position {seq}: whether it was acknowledged is " \
               "not known"
    head += f" The recovered position {seq} reaches the acknowledged high-water mark ({found.seq})"
    if not mark.sync:          # written before each reply: exact unless the machine itself went down
        return f"{head}, so it was never acknowledged, unless the machine itself crashed (with --sync normal that " \
               "can lose acknowledged commits)"
    if found.seq < seq:        # the mark trails the last reply by at most one position
        return f"{head} and passes it, so it was never acknowledged"
    return f"{head}, so it was never acknowledged unless the machine stopped within one fdatasync of its reply (the " \
           "mark trails the last reply by at most one position); a client that got such a reply refuses this " \
           "state (STATE_ROLLED_BACK)"


__all__ = ["AckMark", "Acked", "check_recovery", "torn_tail_note"]
