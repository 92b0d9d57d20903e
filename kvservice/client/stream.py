"""StepStream clients (sync and asyncio): one long-lived stream per scheduler, incremental tables, resends.

``client.step_stream(pool)`` opens a stream; ``stream.step(...)`` takes the arguments of
``BlockManagerClient.step`` and returns the same StepResult, one request in flight at a time.

- Requests carry ``stream_seq`` 1, 2, 3, ... under one stream id (metadata ``kvservice-stream-id``,
  a uuid4 per stream, not per step). A request of a steady decode loop (the same extend ids and
  counts as the last one) is not serialized again: its bytes are reused with a new seq appended.
- deltas=True asks for incremental tables and keeps them in a :class:`PageTableMirror`; a result's
  tables are gathered from the mirror on first access and are exactly what a full reply carries
  (read them before the next step on the stream: the mirror then moves on).
- Deadlines: a step's ``timeout`` bounds the whole step, reconnections included; a reply not in by
  then cancels the call (DEADLINE_EXCEEDED, naming the stream and the manager).
- Reconnects (exactly once): a broken stream (UNAVAILABLE: a restart, a failover; or no reply within
  ``RetryPolicy.attempt_timeout``) is reopened under the same stream id, within what remains of the
  step's deadline (or of the policy's ``failover`` bound, if longer), and the unanswered request is
  resent with its original seq and bytes; the manager's journal answers a request it applied with
  its original reply. The default policy (``attempts=0``) reopens as often as the deadline allows;
  ``RetryPolicy(attempts=1)`` (``retries=0``) never does. Over a LeaderClient with several addresses
  the stream moves to the next address when a call breaks, and a reply from a deposed leader (a lower
  epoch than one seen) is refused and the request resent to the next.
- A step that still got no reply raises (UNAVAILABLE or DEADLINE_EXCEEDED: outcome unknown), and its
  request stays *pending* (``stream.pending``): the next ``step()`` resends it first, under its own
  seq, and learns its outcome. A caller's retry (a step with the same arguments) then returns the
  original reply (or raises its refusal): applied once, never twice. A different step first settles
  the pending one (its tables reach the mirror; its StepResult or refusal is in ``stream.settled``)
  and is then sent under the next seq, so the mirror follows the manager's order. ``resolve()``
  settles it explicitly. The manager remembers a request's reply for its idempotency window
  (``JournalConfig.id_window_seconds``, 600 s by default): resolve within it.
- A refused request raises ClientError (code, message, ErrorInfo reason and metadata, as from a unary
  Step); the stream goes on.
- Every reply's journal position goes through the client's position check (kvservice/client/position.py):
  a reply from a manager whose state was rolled back raises StateRolledBack before its tables are used.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import grpc
import numpy as np

from kvservice.client import codec
from kvservice.client.codec import ClientError, SpaceTables, StepResult, lineage_of, position_of
from kvservice.client.deadline import RETRY_CODES, CallBudget, RetryPolicy, client_error, code_of
from kvservice.client.position import StateRolledBack
from kvservice.contract.mirror import MirrorError, PageTableMirror
from kvservice.contract.transport import STREAM_ID_KEY
from kvservice.contract.wire import field_array
from kvservice.v1 import block_manager_pb2 as pb

METHOD = "/kvservice.v1.BlockManager/StepStream"
ECHO_METHOD = "/kvservice.v1.BlockManager/EchoStream"
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class MirrorTables(Mapping):
    """index space id -> SpaceTables of one result, gathered from the stream's mirror on first access."""

    def __init__(self, mirror: PageTableMirror, block_table: bool) -> None:
        self._mirror, self._seq, self._block_table = mirror, mirror.seq, block_table
        self._keys = sorted(mirror.spaces)
        self._done: dict[int, SpaceTables] = {}

    def __getitem__(self, space_id: int) -> SpaceTables:
        got = self._done.get(space_id)
        if got is not None:
            return got
        m = self._mirror
        if m.seq != self._seq:
            raise MirrorError(f"the tables of request {self._seq} were replaced by request {m.seq} on the stream; "
                              "read a result's tables before the next step")
        if space_id not in m.spaces:
            raise KeyError(space_id)
        got = SpaceTables(m.spaces[space_id].info, m.slot_mapping(space_id), m.page_table(space_id),
                          m.block_table(space_id) if self._block_table else None, m.slot_generations(space_id),
                          m.generations(space_id))
        self._done[space_id] = got
        return got

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def reply_error(reply: pb.StepReply) -> ClientError:
    e = reply.error
    return ClientError(_CODES.get(e.code, grpc.StatusCode.UNKNOWN), e.message, e.reason, dict(e.metadata))


class Pending(NamedTuple):
    """A request sent on a stream whose reply never came (its outcome is unknown until it is resent).

    seq: its stream_seq. body: its bytes without the stream fields (what a caller's retry is compared on).
    data: the bytes as sent (resent unchanged: the manager's journal recognises them). tables, block_table: as
    asked. seen: the client's journal positions before it was first sent (the reply's position check).
    """

    seq: int
    body: bytes
    data: bytes
    tables: bool
    block_table: bool
    seen: Any

    def same(self, body: bytes, tables: bool, block_table: bool) -> bool:
        """Is a new request (body and flags) this one again, i.e. a caller's retry of it?"""
        return body == self.body and tables == self.tables and block_table == self.block_table


class _Core:
    """Request bytes, the unanswered request, and reply handling shared by the sync and asyncio streams."""

    def __init__(self, pool: str, page_size: int, deltas: bool, stream_id: str | None) -> None:
        self.pool = pool
        self.deltas = deltas
        self.stream_id = stream_id or f"s-{uuid.uuid4().hex}"
        self.seq = 0                      # stream_seq of the last request sent
        self.mirror = PageTableMirror(page_size)
        self._cached: tuple[tuple, bytes] | None = None
        self.reused = 0                   # requests whose body bytes were reused (steady decode)
        self.last_reply: pb.StepReply | None = None     # the last reply received (its size is reported by benches)
        self.pending: Pending | None = None             # the request whose reply never came, if any
        #: (seq, StepResult or ClientError): the outcome of the last pending request that a step() with a different
        #: request settled first (None if none was).
        self.settled: tuple[int, StepResult | ClientError] | None = None
        self.resolved = 0                 # pending requests resent by a later step() or resolve()

    def budget(self, client: Any, timeout: float, seq: int) -> CallBudget:
        """The deadline of one exchange: `timeout`, reconnections included."""
        policy: RetryPolicy = client.retry
        return CallBudget(policy, timeout, f"StepStream {self.stream_id} (request {seq})", None, RETRY_CODES,
                          client.target)

    def single_attempt(self, client: Any) -> bool:
        """True if the client's policy allows one attempt only (RetryPolicy(attempts=1), retries=0): then a broken
        stream is not reopened within the step (attempts=0, the default, means as many as the deadline allows)."""
        return client.retry.attempts == 1

    def body(self, free: object, extend: object, extend_tokens: object, admit: object, admit_tokens: object,
             tables: bool, block_table: bool, extra: dict[str, Any]) -> bytes:
        """A request's bytes without the stream fields (cached for a steady decode loop)."""
        delta = self.deltas and tables
        key = None
        if free is None and admit is None and not extra and extend is not None:
            k = 1 if extend_tokens is None else extend_tokens
            key = (np.asarray(extend).tobytes(), np.asarray(k).tobytes(), tables, block_table)
        if key is not None and self._cached is not None and self._cached[0] == key:
            self.reused += 1
            return self._cached[1]
        req = codec.step_request(self.pool, free, extend, extend_tokens, admit, admit_tokens, tables,
                                 block_table and not delta, **extra)
        body = req.SerializeToString()
        self._cached = (key, body) if key is not None else None
        return body

    def start(self, body: bytes, tables: bool, block_table: bool, seen: Any) -> Pending:
        """Number a new request (the next stream_seq, the delta fields) and hold it as pending until answered."""
        delta = self.deltas and tables
        self.seq += 1
        tail = pb.StepRequest(stream_seq=self.seq, delta_tables=delta, delta_base=self.mirror.seq if delta else 0,
                              accept_tokens_added=delta)
        self.pending = Pending(self.seq, body, body + tail.SerializeToString(), tables, block_table, seen)
        return self.pending

    def request_bytes(self, free: object, extend: object, extend_tokens: object, admit: object, admit_tokens: object,
                      tables: bool, block_table: bool, extra: dict[str, Any]) -> bytes:
        """The next request, serialized: the (cached) body, then stream_seq and the delta fields (benches)."""
        body = self.body(free, extend, extend_tokens, admit, admit_tokens, tables, block_table, extra)
        data = self.start(body, tables, block_table, None).data
        self.pending = None
        return data

    def answered(self, p: Pending, reply: pb.StepReply) -> StepResult:
        """The outcome of pending request `p` from its reply (raises its ClientError if refused)."""
        if self.pending is p:
            self.pending = None
        return self.result(self.checked(reply, p.seen), p.tables, p.block_table)

    def settle(self, p: Pending, reply: pb.StepReply) -> None:
        """Record the outcome of `p` (answered while a different request waits) in `settled`: its tables reach the
        mirror, its refusal is kept; only a rolled-back manager (StateRolledBack) raises."""
        try:
            self.settled = (p.seq, self.answered(p, reply))
        except StateRolledBack:
            raise
        except ClientError as err:
            self.settled = (p.seq, err)

    def unanswered(self, err: ClientError, seq: int) -> ClientError:
        """`err` of a request that got no reply, saying what happens to it."""
        note = (f"; request {seq} of stream {self.stream_id} may or may not have been applied: it stays pending, "
                "and the next step() on this stream resends it first under the same stream_seq (a step() with the "
                "same arguments returns its original reply; stream.resolve() returns it)")
        return ClientError(err.code, err.message + note, err.reason,
                           {**err.metadata, "stream_id": self.stream_id, "stream_seq": str(seq)})

    def checked(self, reply: pb.StepReply, seen: Any) -> pb.StepReply:
        """The reply, once its journal position passed the client's check (StateRolledBack otherwise).

        seen: the client's positions taken before the request was sent (PositionTracker.seen()).
        """
        tracker = getattr(self.client, "position", None)          # type: ignore[attr-defined]
        if tracker is not None:
            try:
                tracker.check("StepStream", reply, seen, f"{self.stream_id}#{self.seq}")
            except ClientError:
                self.mirror.invalidate()          # the refused reply's tables are never applied
                raise
        return reply

    def result(self, reply: pb.StepReply, tables: bool, block_table: bool) -> StepResult:
        """The StepResult of a reply (ClientError if it was refused or its delta does not apply)."""
        self.last_reply = reply
        if reply.HasField("error"):
            if reply.error.reason == "REQUEST_ALREADY_APPLIED":
                self.mirror.invalidate()          # a reply we never saw moved the server's tables on
            raise reply_error(reply)
        if not (self.deltas and tables):
            if self.deltas:
                self.mirror.invalidate()
            return codec.parse_step(reply)
        try:
            self.mirror.apply(reply)
        except MirrorError as err:
            self.mirror.invalidate()              # the next request asks for full tables
            raise ClientError(grpc.StatusCode.DATA_LOSS, f"stream {self.stream_id}: {err}", "MIRROR_OUT_OF_SYNC") \
                from None
        m = self.mirror
        copies, copy_gens = codec.parse_copies(reply)
        return StepResult(m.seq_ids, m.num_tokens, m.new_token_indptr, MirrorTables(m, block_table),  # type: ignore[arg-type]
                          tuple(reply.layer_index_space), reply.num_free_slots,
                          field_array(reply, "admit_cached_tokens"), copies, position_of(reply), lineage_of(reply),
                          copy_gens, reply.pool_incarnation)


class StepStream(_Core):
    """A StepStream of a BlockManagerClient (use client.step_stream(pool)). Not thread-safe: one caller.

    deltas: incremental tables through a PageTableMirror. timeout: the deadline of each step, seconds,
    reconnections included (default: the client's). stream_id: name of the stream (default a fresh one;
    reuse one only to resume it). reconnects: how many times the stream was reopened.
    """

    def __init__(self, client: Any, pool: str, deltas: bool = True, timeout: float | None = None,
                 stream_id: str | None = None, page_size: int | None = None) -> None:
        super().__init__(pool, page_size or client.get_pool(pool).plan.page_size, deltas, stream_id)
        self.client = client
        self.timeout = timeout or client.timeout
        self._methods: dict[int, Any] = {}
        self._metadata = (*(client._metadata or ()), (STREAM_ID_KEY, self.stream_id))
        self._call: Any = None
        self._route = 0                   # the client's address index the open call goes to
        self._checked_call: Any = None    # the call whose leader epoch was checked
        self._queue: queue.SimpleQueue | None = None
        self._deadline = 0.0              # time.monotonic() by which the reply is due; 0 = none pending
        self._expired = False
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self.reconnects = 0

    def __enter__(self) -> StepStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the stream (the server keeps its session for a while: the same id could resume it)."""
        self._closed = True
        self._drop_call()

    def step(self, free: object = None, extend: object = None, extend_tokens: object = None, admit: object = None,
             admit_tokens: object = None, tables: bool = True, block_table: bool = False,
             **extra: Any) -> StepResult:
        """One scheduler iteration (arguments as BlockManagerClient.step; ids uint64 [n], counts int64 [n] or a
        scalar). Returns the batch with slot mappings and page tables per index space.

        If an earlier step got no reply (it raised UNAVAILABLE or DEADLINE_EXCEEDED), that request is resent
        first under its own stream_seq: a step with the same arguments returns its original reply (applied
        once); a different one is sent after it, once its outcome is in `settled`.
        """
        body = self.body(free, extend, extend_tokens, admit, admit_tokens, tables, block_table, extra)
        p = self.pending
        if p is not None:
            self.resolved += 1
            reply = self._roundtrip(p.data, p.seq)
            if p.same(body, tables, block_table):
                return self.answered(p, reply)
            self.settle(p, reply)
        p = self.start(body, tables, block_table, self.client.position.seen())
        return self.answered(p, self._roundtrip(p.data, p.seq))

    def resolve(self) -> StepResult | None:
        """Resend the pending request (if any) and return its outcome: its StepResult, or its refusal raised as
        ClientError; None if no request is pending. Raises UNAVAILABLE / DEADLINE_EXCEEDED if still no reply."""
        p = self.pending
        if p is None:
            return None
        self.resolved += 1
        return self.answered(p, self._roundtrip(p.data, p.seq))

    # ---- transport ---------------------------------------------------------------------------
    def _open(self) -> None:
        q: queue.SimpleQueue = queue.SimpleQueue()

        def requests() -> Iterator[bytes]:
            while (item := q.get()) is not None:
                yield item

        self._route, channel = self.client.stream_channel()
        method = self._methods.get(self._route)
        if method is None:
            method = self._methods[self._route] = channel.stream_stream(
                METHOD, request_serializer=None, response_deserializer=pb.StepReply.FromString)
        self._queue = q
        self._call = method(requests(), metadata=self._metadata)
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name=f"deadline-{self.stream_id}", daemon=True)
            self._watchdog.start()

    def _drop_call(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
        if self._call is not None:
            self._call.cancel()
        self._call = self._queue = None

    def _watch(self) -> None:
        """Cancels the call when a reply is overdue (a long-lived stream has no per-message deadline)."""
        tick = min(0.25, self.timeout / 4)
        while not self._closed:
            d, call = self._deadline, self._call
            if d and call is not None and time.monotonic() > d:
                self._expired = True
                call.cancel()
            time.sleep(tick)

    def _roundtrip(self, data: bytes, seq: int) -> pb.StepReply:
        budget = self.budget(self.client, self.timeout, seq)
        while True:
            try:
                if self._call is None:
                    self._open()
                self._expired = False
                self._deadline = time.monotonic() + budget.attempt_timeout()
                self._queue.put(data)             # type: ignore[union-attr]
                try:
                    reply = next(self._call)
                except StopIteration:
                    raise ClientError(grpc.StatusCode.UNAVAILABLE, "the manager ended the stream") from None
                finally:
                    self._deadline = 0.0
                if self._checked_call is not self._call:      # a new call: is it the leader's (a LeaderClient)?
                    self.client.stream_answered(self._route, self._call.initial_metadata())
                    self._checked_call = self._call
                return reply
            except (grpc.RpcError, ClientError) as exc:
                err = client_error(exc)
                if self._expired:
                    err = ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply in time (the call was cancelled)")
                self._drop_call()
                if code_of(err) in RETRY_CODES:
                    self.client.stream_failed(self._route)
                if self._closed or code_of(err) not in RETRY_CODES:
                    raise self.unanswered(err, seq) from None
                if self.single_attempt(self.client):
                    raise self.unanswered(budget.gave_up(err), seq) from None
                try:
                    pause = budget.pause_or_raise(err)
                except ClientError as gave_up:
                    raise self.unanswered(gave_up, seq) from None
                self.reconnects += 1
                time.sleep(pause)


class AsyncStepStream(_Core):
    """asyncio twin of StepStream: `stream = await client.step_stream(pool)`; same arguments and behaviour."""

    def __init__(self, client: Any, pool: str, page_size: int, deltas: bool = True, timeout: float | None = None,
                 stream_id: str | None = None) -> None:
        super().__init__(pool, page_size, deltas, stream_id)
        self.client = client
        self.timeout = timeout or client.timeout
        self._method = client._channel.stream_stream(METHOD, request_serializer=None,
                                                     response_deserializer=pb.StepReply.FromString)
        self._metadata = (*(client._metadata or ()), (STREAM_ID_KEY, self.stream_id))
        self._call: Any = None
        self.reconnects = 0

    async def __aenter__(self) -> AsyncStepStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def step(self, free: object = None, extend: object = None, extend_tokens: object = None,
                   admit: object = None, admit_tokens: object = None, tables: bool = True, block_table: bool = False,
                   **extra: Any) -> StepResult:
        """As StepStream.step (a pending request is resent first)."""
        body = self.body(free, extend, extend_tokens, admit, admit_tokens, tables, block_table, extra)
        p = self.pending
        if p is not None:
            self.resolved += 1
            reply = await self._roundtrip(p.data, p.seq)
            if p.same(body, tables, block_table):
                return self.answered(p, reply)
            self.settle(p, reply)
        p = self.start(body, tables, block_table, self.client.position.seen())
        return self.answered(p, await self._roundtrip(p.data, p.seq))

    async def resolve(self) -> StepResult | None:
        """As StepStream.resolve."""
        p = self.pending
        if p is None:
            return None
        self.resolved += 1
        return self.answered(p, await self._roundtrip(p.data, p.seq))

    async def _roundtrip(self, data: bytes, seq: int) -> pb.StepReply:
        budget = self.budget(self.client, self.timeout, seq)
        while True:
            try:
                if self._call is None:
                    self._call = self._method(metadata=self._metadata)
                reply = await asyncio.wait_for(self._exchange(data), budget.attempt_timeout())
                if reply is grpc.aio.EOF:
                    raise ClientError(grpc.StatusCode.UNAVAILABLE, "the manager ended the stream")
                return reply
            except (grpc.aio.AioRpcError, ClientError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    err = ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply in time (the call was cancelled)")
                else:
                    err = client_error(exc)
                if self._call is not None:
                    self._call.cancel()
                    self._call = None
                if code_of(err) not in RETRY_CODES:
                    raise self.unanswered(err, seq) from None
                if self.single_attempt(self.client):
                    raise self.unanswered(budget.gave_up(err), seq) from None
                try:
                    pause = budget.pause_or_raise(err)
                except ClientError as gave_up:
                    raise self.unanswered(gave_up, seq) from None
                self.reconnects += 1
                await asyncio.sleep(pause)

    async def _exchange(self, data: bytes) -> Any:
        await self._call.write(data)
        return await self._call.read()


class EchoStream:
    """Round trips of empty-ish payloads over one EchoStream (the transport floor of StepStream)."""

    def __init__(self, client: Any) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        method = client._channel.stream_stream(ECHO_METHOD, request_serializer=pb.EchoRequest.SerializeToString,
                                               response_deserializer=pb.EchoReply.FromString)

        def requests() -> Iterator[pb.EchoRequest]:
            while (item := self._queue.get()) is not None:
                yield item

        self._call = method(requests(), metadata=client._metadata)

    def echo(self, payload: bytes = b"") -> bytes:
        self._queue.put(pb.EchoRequest(payload=payload))
        try:
            return next(self._call).payload
        except grpc.RpcError as exc:
            raise ClientError.from_rpc(exc) from None

    def close(self) -> None:
        self._queue.put(None)
        self._call.cancel()

    def __enter__(self) -> EchoStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
