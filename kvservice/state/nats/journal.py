"""The replicated journal backend: a NATS JetStream stream of entries and an object store of snapshots.

``NatsStore`` implements the journal's store interface (``stores.JournalStore``, as the SQLite
state dir does): ``load_snapshot`` (the bytes kvservice/state/snapshot.py encodes), ``entries_after``
(``stores.Entry`` with the checksum the writer computed; the journal verifies it and the
positions, as for every backend), ``begin`` (the incarnation: this store's fencing epoch),
``append``, ``write_snapshot``, ``check_position``, ``close``. What the SQLite store's MANIFEST
witnesses (how many changes were acknowledged) is the stream itself here: every publish is
checked by the server against the last stream sequence this store saw, and recovery reads the
stream to its end.

What HA adds on top (used by kvservice/server/ha.py): ``poll`` (tail new entries: a hot standby),
``catch_up`` (read to the end of the stream), ``fence(epoch)`` (become the only writer),
``epoch`` / ``max_epoch``, and ``guard`` (a callable that raises when this process may no
longer write: the leader lease, checked before every publish and again before an append returns).

Layout, for a deployment name N (``--nats-name``, default ``kvservice``):
- stream ``KVS_N``, subject ``kvs.N.journal``: one message per entry (or per part of an entry
  larger than the server's max_payload), headers ``Kvs-Kind`` (entry|fence), ``Kvs-Seq``,
  ``Kvs-Method``, ``Kvs-At``, ``Kvs-Epoch``, ``Kvs-Part`` (i/n), ``Kvs-Digest`` (the entry's
  checksum, ``stores.entry_digest``, hex: position, method, time and the whole request),
  ``Kvs-Writer`` (the writer incarnation, below). Every publish carries
  ``Nats-Expected-Last-Sequence`` (the stream sequence this store last saw): a writer whose view
  of the stream is stale is refused by the server, so two managers can never both append. And
  ``Nats-Msg-Id`` (``message_id``: epoch, a random token drawn at each fence, position, part): a
  retry of the same publish keeps its id, so the server stores it once, and no other writer ever
  uses it, so the server's "duplicate" answer can only name this writer's own earlier publish
  (``check_ack``). docs/HA.md, "Why two writers are impossible", gives the argument;
  tests/unit/test_ha_model.py checks it exhaustively on a model of the protocol. A fence also
  carries ``Kvs-Lineage``, the state's lineage (a fresh stream's first fence makes it;
  docs/DURABILITY.md, "Lineages").
- object store ``KVS_N_snapshots``: ``snap-<seq>`` objects (the bytes kvservice/state/snapshot.py
  encodes), their description a JSON header (journal seq, stream seq, epoch, bytes, blake2b
  digest). After a snapshot is stored, the stream is purged below its stream sequence.

Reading (recovery, catch-up, a standby's tail): kvservice/state/nats/reader.py, a base class of NatsStore.
Threading: ``NatsLink`` (kvservice/state/nats/link.py).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import io
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.js import api

from kvservice.contract.errors import StateError
from kvservice.state import snapshot as snap
from kvservice.state.nats.assets import ensure_assets
from kvservice.state.nats.config import (
    Fenced,
    JournalGap,
    NatsConfig,
    StoreError,
    Unrecoverable,
    parse_state_url,
    retry_startup,
)
from kvservice.state.nats.direct import DirectError
from kvservice.state.nats.fencing import check_ack, fence_id, message_id
from kvservice.state.nats.link import NatsLink
from kvservice.state.nats.reader import PartialEntry, StreamReader
from kvservice.state.stores import Entry, JournalStore, lineage_hex, new_lineage

log = logging.getLogger("kvservice.nats")
T = TypeVar("T")

SNAPSHOT_FORMAT = 2                            # 2: kvservice/state/snapshot.py bytes (1: pickles, refused)
_WRONG_LAST_SEQUENCE = (10071, 10164)          # JSStreamWrongLastSequence(Constant)Err
#: Room left in each message for the headers (the payload limit counts both).
_HEADER_ROOM = 1024


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class NatsStore(StreamReader, JournalStore):
    """Journal entries in a JetStream stream, snapshots in an object store (see the module doc).

    The Journal's lock serialises appends; a snapshot is written from the journal's snapshot thread
    meanwhile (it looks up the stream sequence of its position, recorded by append or read); a
    standby's single follower thread reads. owns_link: close the link with the store (inspection tools).
    create: create the stream and the snapshot bucket if missing (else StoreError).
    readonly: never write; a standby's store stays read-only until it has fenced the stream.
    """

    def __init__(self, link: NatsLink, readonly: bool = False, owns_link: bool = False, create: bool = True) -> None:
        self.link = link
        self.config = link.config
        self.readonly = readonly
        self.owns_link = owns_link
        self.path = f"{self.config.url} (stream {self.config.stream})"
        self.location = self.path
        self.durable = True
        self.remedy = ("restore the deployment from a backup (kvservice import-state DIR nats://... into a fresh "
                       "--nats-name; docs/operations.md)")
        self.snapshot_where = f"bucket {self.config.snapshot_bucket}"
        self.guard: Callable[[], None] | None = None
        self.epoch = 0                 # the epoch this store writes under; 0 = not fenced (cannot append)
        self.writer = ""               # random token of this writer incarnation, drawn at each fence
        self.max_epoch = 0             # highest epoch seen in a snapshot header or a fence
        self.seq = 0                   # journal position of the last complete entry read or written
        self.last_stream_seq = 0       # stream sequence of the last message read or written
        self.first_stream_seq = 0      # where reading starts: one past the stream sequence of the snapshot
        self.appends = 0
        self.append_retries = 0
        #: Stream messages after the last one this reader received, as the server said with it (None: none yet).
        self.pending: int | None = None
        self._parts: PartialEntry | None = None
        self._sub: Any = None
        self._inbox: collections.deque[Any] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._obs: Any = None
        self._stream_at: dict[int, int] = {}    # journal position -> stream sequence of its last message
        self._at_lock = threading.Lock()
        self._relearning = threading.Lock()     # held while the stream's leader is read again (a thread)
        self.max_part_bytes = max(4096, link.nc.max_payload - _HEADER_ROOM)
        self._obs = self._call(ensure_assets(link.js, self.config, self.path, create),
                               max(10.0, 3 * self.config.request_seconds),
                               "opening the journal stream and the snapshot bucket")

    @property  # type: ignore[override]
    def incarnation(self) -> int:
        """The epoch this store writes under (fenced), else the highest it has seen: stamped into replies."""
        return max(self.epoch, self.max_epoch, 1)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, what: str = "a request") -> T:
        """link.call, with any NATS error turned into a StoreError that names this store and the call."""
        try:
            return self.link.call(coro, timeout or self.config.request_seconds + 1.0, what)
        except nats.errors.Error as err:
            raise StoreError(f"{self.path}: {what}: {type(err).__name__}: {err}") from None

    def stream_last_seq(self) -> int:
        """The stream's last sequence now (one request)."""
        return self._call(self._stream_last_seq(), what="reading the stream's last sequence")

    # ---- snapshots ------------------------------------------------------------------------------
    def load_snapshot(self) -> tuple[int, bytes] | None:
        """The newest snapshot (verified), or None; reading then starts after its stream sequence.

        A writer (fenced) never reads again: its position is the stream's end, and a rebuild of its
        manager (the journal's resync) is refused, so it fail-stops and a standby takes over.
        """
        if self.epoch:
            raise StateError(f"{self.path}: a leader does not re-read the replicated journal; it stops and a "
                             "standby (which holds every acknowledged entry) takes over")
        found = self._call(self._last_snapshot(), max(30.0, self.config.request_seconds),
                           "listing and reading the newest snapshot")
        if found is None:
            return None
        meta, blob = found
        self.seq = int(meta["seq"])
        self.last_stream_seq = int(meta["stream_seq"])
        self.first_stream_seq = self.last_stream_seq + 1
        self.max_epoch = max(self.max_epoch, int(meta["epoch"]))
        with self._at_lock:
            self._stream_at = {self.seq: self.last_stream_seq}
        self.snapshot_where = f"bucket {self.config.snapshot_bucket}, snap-{self.seq:020d}"
        return self.seq, blob

    last_snapshot = load_snapshot

    def _snapshot_newer_than(self, seq: int) -> bool:
        """Whether the bucket holds a snapshot of a position after seq now (one listing)."""
        return self.newest_snapshot_seq() > seq

    def newest_snapshot_seq(self) -> int:
        """Journal position of the newest snapshot in the bucket now (0 if none): one listing."""
        name = self._call(self._newest_snapshot_name(), max(10.0, self.config.request_seconds), "listing snapshots")
        return int(name.removeprefix("snap-")) if name else 0

    def restart_reading(self) -> None:
        """Forget the read position (a standby about to recover again from a newer snapshot: Journal.reload)."""
        if self.epoch:
            raise StoreError("a leader does not re-read the replicated journal")
        self.stop_reading()
        self.seq = self.last_stream_seq = self.first_stream_seq = 0
        self._parts = None
        with self._at_lock:
            self._stream_at = {}

    async def _newest_snapshot_name(self) -> str:
        obs = self._obs
        if obs is None:
            try:
                obs = await self.link.js.object_store(self.config.snapshot_bucket)
            except nats.js.errors.BucketNotFoundError:
                return ""
        try:
            infos = await obs.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return ""
        return max((i.name for i in infos if i.name.startswith("snap-") and not i.deleted), default="")

    async def _last_snapshot(self) -> tuple[dict[str, Any], bytes] | None:
        if self._obs is None:
            return None
        try:
            infos = await self._obs.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return None
        snaps = sorted((i for i in infos if i.name.startswith("snap-") and not i.deleted), key=lambda i: i.name)
        if not snaps:
            return None
        info = snaps[-1]
        try:
            meta = json.loads(info.description or "")
            if int(meta["format"]) != SNAPSHOT_FORMAT:
                raise ValueError(f"snapshot format {meta['format']} is not {SNAPSHOT_FORMAT} (written by an older "
                                 "kvservice: export it with that version, import the state dir with this one)")
        except (ValueError, KeyError, TypeError) as err:
            raise Unrecoverable(f"{self.path}: snapshot {info.name} has an unreadable header ({err})") from None
        out = io.BytesIO()
        try:
            await self._obs.get(info.name, writeinto=out)
        except nats.js.errors.DigestMismatchError:
            raise Unrecoverable(f"{self.path}: snapshot {info.name} is corrupt (SHA-256 mismatch)") from None
        blob = out.getvalue()
        if len(blob) != int(meta["bytes"]) or _digest(blob) != meta["digest"]:
            raise Unrecoverable(f"{self.path}: snapshot {info.name} does not match its header "
                             f"({len(blob)} bytes, header says {meta['bytes']})")
        return meta, blob

    def write_snapshot(self, seq: int, encoded: snap.Encoded) -> None:
        """Store a snapshot at journal position seq, then drop the entries and older snapshots it covers.

        Runs on the journal's snapshot thread while appends go on: the stream is purged only up to
        the stream sequence of position seq (recorded when it was appended or read).
        """
        if self.readonly or self.epoch == 0:
            raise StoreError("this manager does not write the journal (read-only or standby)")
        self._check_guard()
        with self._at_lock:
            stream_seq = self._stream_at.get(seq)
        if stream_seq is None:
            raise StoreError(f"{self.path}: no stream sequence known for journal position {seq}")
        state = b"".join(bytes(c) for c in encoded.chunks)
        meta = {"format": SNAPSHOT_FORMAT, "seq": seq, "stream_seq": stream_seq, "epoch": self.epoch,
                "lineage": lineage_hex(self.lineage), "at": time.time(), "bytes": len(state), "digest": _digest(state)}
        self._call(self._write_snapshot(f"snap-{seq:020d}", state, meta), max(60.0, self.config.append_seconds),
                   f"storing snapshot {seq} ({len(state)} bytes)")
        with self._at_lock:
            self._stream_at = {s: q for s, q in self._stream_at.items() if s >= seq}

    async def _write_snapshot(self, name: str, state: bytes, meta: dict[str, Any]) -> None:
        assert self._obs is not None
        await self._obs.put(name, state, meta=api.ObjectMeta(name=name, description=json.dumps(meta)))
        await self.link.js.purge_stream(self.config.stream, seq=int(meta["stream_seq"]) + 1)
        try:
            infos = await self._obs.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return
        for info in infos:
            if info.name.startswith("snap-") and info.name < name and not info.deleted:
                await self._obs.delete(info.name)

    # ---- writing -------------------------------------------------------------------------------------
    def begin(self, seq: int) -> int:
        """Recovery reached position seq; the incarnation is the epoch (a writer appends once fenced)."""
        if seq != self.seq:
            raise StoreError(f"recovered position {seq}, but this store read to {self.seq}")
        return self.incarnation

    def check_position(self, seq: int) -> None:
        """The stream is the witness: recovery must have replayed every complete entry read from it."""
        if seq != self.seq:
            raise StateError(f"{self.path}: the stream holds entries up to {self.seq}, recovery reached {seq}",
                             reason="STATE_ROLLBACK")

    def append(self, entry: Entry) -> None:
        """Publish one entry (in parts if larger than a message), each fenced on the last stream sequence."""
        if self.readonly or self.epoch == 0:
            raise StoreError("this manager does not write the journal (read-only or standby)")
        seq, method, data, at = entry.seq, entry.method, entry.request, entry.created
        if seq != self.seq + 1:
            raise StoreError(f"append at journal position {seq}, but this store is at {self.seq}")
        self._check_guard()
        step = self.max_part_bytes
        chunks = [data[i:i + step] for i in range(0, len(data), step)] or [b""]
        digest = entry.digest.hex()
        for i, chunk in enumerate(chunks):
            headers = {"Kvs-Kind": "entry", "Kvs-Seq": str(seq), "Kvs-Method": method, "Kvs-At": repr(at),
                       "Kvs-Epoch": str(self.epoch), "Kvs-Part": f"{i}/{len(chunks)}", "Kvs-Digest": digest,
                       "Kvs-Writer": self.writer, "Nats-Msg-Id": message_id(self.epoch, self.writer, seq, i)}
            self._publish(chunk, headers)
        self.seq = seq
        with self._at_lock:
            self._stream_at[seq] = self.last_stream_seq
        self.appends += 1
        self._check_guard()                               # still the leader now that it is durable

    def fence(self, epoch: int) -> None:
        """Append a fence for `epoch` right after the last message this store read; Fenced if the stream moved.

        From then on, every other writer is refused (its expected last sequence is stale). Each fence
        starts a new writer incarnation: a fresh random token in every message id it writes.
        """
        if self.readonly:
            raise StoreError("a read-only store cannot fence")
        if epoch <= self.max_epoch:
            raise StoreError(f"epoch {epoch} is not above the highest seen, {self.max_epoch}")
        writer = secrets.token_hex(8)
        lineage = self.lineage or new_lineage()      # kept once this fence is in (the first fence of a fresh stream)
        self._publish(b"", {"Kvs-Kind": "fence", "Kvs-Epoch": str(epoch), "Kvs-Seq": str(self.seq),
                            "Kvs-Writer": writer, "Kvs-Lineage": lineage_hex(lineage),
                            "Nats-Msg-Id": fence_id(epoch, writer)})
        self.epoch = self.max_epoch = epoch
        self.writer, self.lineage = writer, lineage
        self._parts = None
        with self._at_lock:
            self._stream_at[self.seq] = self.last_stream_seq     # a snapshot at this position reads on after it
        self.prefer_stream_leader()

    def _relearn_stream_leader(self) -> None:
        """prefer_stream_leader on a thread of its own (one at a time): the Step whose publish was retried does
        not wait for the stream's info."""
        if self._relearning.acquire(blocking=False):
            def run() -> None:
                try:
                    self.prefer_stream_leader()
                except Exception as err:         # the store closed meanwhile (its loop gone): nothing to route
                    log.debug("%s: stream leader not read again: %s", self.path, err)
                finally:
                    self._relearning.release()
            threading.Thread(target=run, name="kvs-stream-leader", daemon=True).start()

    def prefer_stream_leader(self) -> None:
        """Send appends to the server that leads the stream's Raft group (DirectPublisher.prefer), as it is now.

        Best effort, at each fence and after each publish that got through on a retry (on a thread of its own:
        the leader may have moved): the route changes, not what a publish must pass. A publish to another
        server is forwarded to the leader, and its acknowledgement back: about 0.1 ms of a 1 ms append on the
        3-node loopback cluster (bench/results/ha.md). A failed publish forgets the preference, so its retry
        goes to the next server in turn, as before.
        """
        try:
            info = self._call(self.link.js.stream_info(self.config.stream), what="reading the stream's leader")
        except StoreError as err:
            log.info("%s: stream leader not read (%s); appends go through any server", self.path, err.message)
            return
        leader = info.cluster.leader if info.cluster is not None else None
        self.link.direct.prefer(leader)

    def _check_guard(self) -> None:
        if self.guard is not None:
            self.guard()

    def _publish(self, payload: bytes, headers: dict[str, str]) -> None:
        """Publish with the expected-last-sequence fence; retry timeouts (same Nats-Msg-Id) until append_seconds.

        The acknowledgement is checked by ``check_ack``: "duplicate" counts only for a retry.
        """
        c = self.config
        deadline = time.monotonic() + c.append_seconds
        delay = 0.05
        sent = False
        while True:
            headers["Nats-Expected-Last-Sequence"] = str(self.last_stream_seq)
            try:
                sent_before, sent = sent, True
                stream_seq, duplicate = self._publish_once(payload, headers)
            except nats.js.errors.APIError as err:
                if err.err_code in _WRONG_LAST_SEQUENCE:
                    raise Fenced(f"the journal stream moved past {self.last_stream_seq} ({err.description}): "
                                 "another manager wrote it; this one is no longer the leader") from None
                if err.code is not None and err.code < 500 and err.code != 503:
                    raise StoreError(f"NATS refused the journal entry: {err.description}") from None
                why: Exception = err
            except nats.errors.TimeoutError as err:
                why = err
                self.link.direct.close()     # the retry (same id) goes to the next server: this one may be cut off
            except (StoreError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError,
                    nats.js.errors.NoStreamResponseError, OSError) as err:
                why = err
            else:
                self.last_stream_seq = check_ack(stream_seq, duplicate, sent_before, self.last_stream_seq)
                if sent_before:
                    self._relearn_stream_leader()    # a retry got through: the stream's leader may have moved
                return
            if time.monotonic() + delay >= deadline:
                raise StoreError(f"NATS did not store the journal entry within {c.append_seconds:g} s "
                                 f"({type(why).__name__}: {why})")
            self.append_retries += 1
            self._check_guard()
            time.sleep(delay)
            delay = min(0.5, delay * 2)

    def _publish_once(self, payload: bytes, headers: dict[str, str]) -> tuple[int, bool]:
        """One JetStream publish, acknowledged: (stream sequence, duplicate); APIError etc. as js.publish raises."""
        c = self.config
        try:
            reply = self.link.direct.request(c.subject, payload, {**headers, "Nats-Expected-Stream": c.stream},
                                             c.request_seconds)
        except DirectError as err:
            raise StoreError(err.message) from None
        if reply.no_responders:
            raise nats.js.errors.NoStreamResponseError
        try:
            ack = json.loads(reply.data)
        except ValueError:
            raise StoreError(f"NATS answered a journal publish with {reply.data[:80]!r}") from None
        if isinstance(ack, dict) and "error" in ack:
            nats.js.errors.APIError.from_error(ack["error"])       # raises the matching APIError
        try:
            return int(ack["seq"]), bool(ack.get("duplicate", False))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise StoreError(f"NATS answered a journal publish without a stream sequence: "
                             f"{reply.data[:80]!r}") from None

    def close(self, clean: bool = True, seq: int = 0) -> None:
        self.stop_reading()
        if self.owns_link:
            self.link.close()


__all__ = ["Fenced", "JournalGap", "NatsConfig", "NatsLink", "NatsStore", "StoreError", "Unrecoverable", "check_ack",
           "fence_id", "message_id", "parse_state_url", "retry_startup"]
