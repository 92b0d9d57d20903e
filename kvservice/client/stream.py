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
  ``RetryPolicy(attempts=1)`` (``retries=0``) never does. Where each call goes is the client's say
  (``stream_channel`` / ``stream_answered`` / ``stream_failed``): over a LeaderClient (sync) or an
  AsyncLeaderClient (asyncio) with several addresses the stream moves to the next address when a
  call breaks, and a reply from a deposed leader (a lower epoch than one seen) is refused and the
  request resent to the next, under its seq.
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
from collections.abc import Iterator
from typing import Any

import grpc

from kvservice.client.codec import ClientError, StepResult
from kvservice.client.deadline import client_error
from kvservice.client.stream_core import METHOD, MirrorTables, Pending, StreamCore, reply_error
from kvservice.contract.transport import STREAM_ID_KEY
from kvservice.v1 import block_manager_pb2 as pb

ECHO_METHOD = "/kvservice.v1.BlockManager/EchoStream"

__all__ = ["METHOD", "AsyncStepStream", "EchoStream", "MirrorTables", "Pending", "StepStream", "reply_error"]


class StepStream(StreamCore):
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
        self._metadata = (*(client._metadata or ()), (STREAM_ID_KEY, self.stream_id))
        self._call: Any = None
        self._checked_call: Any = None    # the call whose leader epoch was checked
        self._queue: queue.SimpleQueue | None = None
        self._deadline = 0.0              # time.monotonic() by which the reply is due; 0 = none pending
        self._expired = False
        self._closed = False
        self._watchdog: threading.Thread | None = None

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

        method = self.route_method(self.client)
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
                    self.client.stream_answered(self.route, self._call.initial_metadata())
                    self._checked_call = self._call
                return self.expect(reply, seq)
            except (grpc.RpcError, ClientError) as exc:
                err = client_error(exc)
                if self._expired:
                    err = ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply in time (the call was cancelled)")
                self._drop_call()
                self.client._pause(self.broken(self.client, err, seq, budget, self._closed))


class AsyncStepStream(StreamCore):
    """asyncio twin of StepStream: `stream = await client.step_stream(pool)`; same arguments and behaviour."""

    def __init__(self, client: Any, pool: str, page_size: int, deltas: bool = True, timeout: float | None = None,
                 stream_id: str | None = None) -> None:
        super().__init__(pool, page_size, deltas, stream_id)
        self.client = client
        self.timeout = timeout or client.timeout
        self._metadata = (*(client._metadata or ()), (STREAM_ID_KEY, self.stream_id))
        self._call: Any = None
        self._checked_call: Any = None    # the call whose leader epoch was checked

    async def __aenter__(self) -> AsyncStepStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the stream's call (a later step opens a new one under the same id)."""
        self._drop_call()

    def _drop_call(self) -> None:
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
                    self._call = self.route_method(self.client)(metadata=self._metadata)
                reply = await asyncio.wait_for(self._exchange(data), budget.attempt_timeout())
                if reply is grpc.aio.EOF:
                    raise ClientError(grpc.StatusCode.UNAVAILABLE, "the manager ended the stream")
                if self._checked_call is not self._call:      # a new call: is it the leader's (AsyncLeaderClient)?
                    self.client.stream_answered(self.route, await self._call.initial_metadata())
                    self._checked_call = self._call
                return self.expect(reply, seq)
            except asyncio.CancelledError:        # the caller cancelled the step: its reply may still come on this
                self._drop_call()                 # call, so the next step opens a new one (the request stays pending)
                raise
            except (grpc.RpcError, ClientError, TimeoutError) as exc:   # grpc.RpcError: AioRpcError, StaleLeader
                if isinstance(exc, TimeoutError):
                    err = ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply in time (the call was cancelled)")
                else:
                    err = client_error(exc)
                self._drop_call()
                await self.client._pause(self.broken(self.client, err, seq, budget))

    async def _exchange(self, data: bytes) -> Any:
        """Write one request and read its reply. A call that already ended (the manager closed it, or died) reports
        its own status on the read (a refusal stays a refusal); a write that core could not send (the connection
        broke under it: grpc.aio says INTERNAL) is UNAVAILABLE, so the request is resent on a new call."""
        call = self._call
        try:
            await call.write(data)
        except asyncio.InvalidStateError:         # "RPC already finished": read() raises its status (or EOF)
            pass
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.INTERNAL:
                raise
            raise ClientError(grpc.StatusCode.UNAVAILABLE, f"the stream's connection broke before the request was "
                              f"sent ({exc.details()})") from None
        return await call.read()


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
