"""Reading the replicated journal: the stream's messages decoded into entries, for recovery and a standby.

``StreamReader`` is a part of :class:`kvservice.state.nats.journal.NatsStore` (a base class holding its
reading side; the state it works on is the store's). ``entries_after`` (recovery), ``catch_up`` (read to
the stream's end: a takeover) and ``poll`` (a hot standby's tail) read through one ordered consumer that
starts after the snapshot loaded; ``_decode`` turns messages into ``stores.Entry`` (an entry larger than a
message arrives in parts, reassembled here; a fence raises ``max_epoch`` and carries the lineage; an entry
that does not follow the last one read is a ``JournalGap`` for a standby: a compaction purged what it was
to read next, and it recovers again from the newer snapshot). The journal checks each entry's checksum and
position, as for every store. Message layout: kvservice/state/nats/journal.py.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.js import api

from kvservice.contract.errors import StateError
from kvservice.state.nats.config import JournalGap, NatsConfig, StoreError, Unrecoverable
from kvservice.state.nats.link import NatsLink
from kvservice.state.stores import Entry, continued_lineage

log = logging.getLogger("kvservice.nats")

#: Seconds catch_up waits for a message before it reads on with a new consumer: first, and at most (doubling).
CATCH_UP_WAIT = (0.2, 2.0)


@dataclass(slots=True)
class PartialEntry:
    """An entry whose parts are being read (it is complete once `count` chunks arrived)."""

    seq: int
    method: str
    at: float
    count: int
    digest: str
    chunks: list[bytes]



class StreamReader:
    """The reading side of NatsStore (a base class; NatsStore sets every attribute named here)."""

    link: NatsLink
    config: NatsConfig
    path: str
    lineage: int
    seq: int
    last_stream_seq: int
    first_stream_seq: int
    max_epoch: int
    pending: int | None
    _parts: PartialEntry | None
    _sub: Any
    _inbox: collections.deque[Any]
    _wake: asyncio.Event | None
    _stream_at: dict[int, int]
    _at_lock: threading.Lock
    _call: Callable[..., Any]
    stream_last_seq: Callable[[], int]
    _snapshot_newer_than: Callable[[int], bool]

    # ---- reading -------------------------------------------------------------------------------------
    def entries_after(self, seq: int) -> Iterator[Entry]:
        """Every complete entry after journal position seq, up to the end of the stream as it is now."""
        for entry in self.catch_up(strict=False):
            if entry.seq > seq:
                yield entry

    def catch_up(self, strict: bool = True) -> Iterator[Entry]:
        """Read (from where this store is) to the last message the stream holds when called."""
        last = self.stream_last_seq()
        deadline = time.monotonic() + max(30.0, self.config.append_seconds)
        wait = CATCH_UP_WAIT[0]
        while self.last_stream_seq < last:
            before = self.last_stream_seq
            batch = self.poll(wait, strict=strict)
            if self.last_stream_seq == before:     # nothing delivered (not even a fence or a part)
                first = self._call(self._stream_first_seq(), what="reading the stream's first sequence")
                if first > self.last_stream_seq + 1 and (strict or self._snapshot_newer_than(self.seq)):
                    raise self._overtaken()         # what we were to read next was purged by a compaction
                if time.monotonic() > deadline:
                    raise StoreError(f"{self.path}: stream stopped at {self.last_stream_seq} while reading to {last}")
                # the consumer's node restarted under it (nats-py notices after missed heartbeats): a new one
                log.info("%s: nothing delivered for %.1f s at message %d of %d; reading on with a new consumer",
                         self.path, wait, self.last_stream_seq, last)
                self.stop_reading()
                wait = min(CATCH_UP_WAIT[1], 2 * wait)
            yield from batch

    def _overtaken(self) -> JournalGap:
        return JournalGap(f"{self.path}: the stream was compacted past position {self.seq} while it was read (a "
                          "newer snapshot was stored meanwhile); recover again from it")

    async def _stream_first_seq(self) -> int:
        info = await self.link.js.stream_info(self.config.stream)
        return int(info.state.first_seq)

    async def _stream_last_seq(self) -> int:
        info = await self.link.js.stream_info(self.config.stream)
        return int(info.state.last_seq)

    def poll(self, wait: float, max_messages: int = 1024, strict: bool = True) -> list[Entry]:
        """Complete entries that arrived (waiting up to `wait` s for the first message); [] if none.

        Fences are consumed here too (they raise max_epoch). strict: raise JournalGap if an entry
        does not follow the last one (the stream was purged past what this store has read: a
        standby); else pass it on, and the journal refuses the gap (recovery: entries missing).
        """
        if self._sub is None:        # a consumer is created through the JetStream meta leader: allow an election
            self._call(self._subscribe(max(1, self.first_stream_seq, self.last_stream_seq + 1)),
                       max(10.0, 3 * self.config.request_seconds), "subscribing to the journal stream")
        msgs = self._call(self._take(wait, max_messages), wait + self.config.request_seconds + 1.0,
                          "reading the journal stream")
        if msgs:
            self.pending = int(msgs[-1].metadata.num_pending) + len(self._inbox)
        out = []
        for msg in msgs:
            entry = self._decode(msg, strict)
            if entry is not None:
                out.append(entry)
        return out

    async def _subscribe(self, start: int) -> None:
        self._wake = asyncio.Event()
        self._inbox.clear()

        async def deliver(msg: Any) -> None:
            self._inbox.append(msg)
            assert self._wake is not None
            self._wake.set()
        self._sub = await self.link.js.subscribe(
            self.config.subject, cb=deliver, ordered_consumer=True, stream=self.config.stream,
            config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start))

    async def _take(self, wait: float, max_messages: int) -> list[Any]:
        assert self._wake is not None
        if not self._inbox:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                return []
        out = []
        while self._inbox and len(out) < max_messages:
            out.append(self._inbox.popleft())
        return out

    def stop_reading(self) -> None:
        """Drop the stream subscription (a leader does not read)."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                self._call(sub.unsubscribe(), what="unsubscribing from the journal stream")
            except (StoreError, nats.errors.Error) as err:
                log.debug("unsubscribe: %s", err)
        self._inbox.clear()

    def _decode(self, msg: Any, strict: bool = True) -> Entry | None:
        stream_seq = int(msg.metadata.sequence.stream)
        if stream_seq <= self.last_stream_seq:
            return None                                   # redelivered after a consumer reset
        if stream_seq > self.last_stream_seq + 1 and not strict and self._snapshot_newer_than(self.seq):
            # Recovery listed the snapshots, then the leader stored a newer one and purged the stream
            # below it before these messages were read: what is missing is in that snapshot.
            raise self._overtaken()
        self.last_stream_seq = stream_seq
        h = msg.headers or {}
        kind = h.get("Kvs-Kind", "")
        if kind == "fence":
            self._parts = None                            # an unfinished entry of the old writer is void
            self.max_epoch = max(self.max_epoch, int(h["Kvs-Epoch"]))
            self.lineage = continued_lineage(self.lineage, h.get("Kvs-Lineage"), f"{self.path}: fence {stream_seq}")
            return None
        if kind != "entry":
            raise Unrecoverable(f"{self.path}: stream message {stream_seq} is not a kvservice journal entry")
        seq = int(h["Kvs-Seq"])
        index, count = (int(x) for x in h["Kvs-Part"].split("/"))
        if index == 0:
            self._parts = PartialEntry(seq, h["Kvs-Method"], float(h["Kvs-At"]), count, h["Kvs-Digest"], [])
        parts = self._parts
        if parts is None or parts.seq != seq or len(parts.chunks) != index:
            self._parts = None                            # a part whose entry began before we started: skip
            return None
        parts.chunks.append(bytes(msg.data))
        if len(parts.chunks) < parts.count:
            return None
        self._parts = None
        data = b"".join(parts.chunks)
        try:
            checksum = bytes.fromhex(parts.digest)
        except ValueError:
            raise StateError(f"{self.path}: journal entry {seq} (stream {stream_seq}) has an unreadable "
                             "checksum (damaged)") from None
        if seq <= self.seq:
            return None                                   # covered by the snapshot we loaded
        if seq != self.seq + 1 and strict:
            raise JournalGap(f"{self.path}: journal entry {seq} follows {self.seq}: the entries between were "
                             "compacted into a newer snapshot; recover again from it")
        self.seq = seq
        with self._at_lock:
            self._stream_at[seq] = stream_seq
        return Entry(seq, parts.method, data, parts.at, checksum)



__all__ = ["CATCH_UP_WAIT", "PartialEntry", "StreamReader"]
