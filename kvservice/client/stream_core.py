"""What the sync and asyncio StepStream clients share: request bytes, the pending request, reply handling.

The transports (and the rules a caller sees) are in kvservice/client/stream.py; this module holds the
state of one stream that does not depend on how its bytes travel: the next ``stream_seq``, the
request whose reply never came (:class:`Pending`: resent unchanged, so the manager's journal
recognises it), the table mirror, and turning a reply into a StepResult after the position check.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import grpc
import numpy as np

from kvservice.client import codec
from kvservice.client.codec import ClientError, SpaceTables, StepResult, lineage_of, position_of
from kvservice.client.deadline import RETRY_CODES, CallBudget, RetryPolicy, code_of
from kvservice.client.position import StateRolledBack
from kvservice.contract.mirror import MirrorError, PageTableMirror
from kvservice.contract.wire import field_array
from kvservice.v1 import block_manager_pb2 as pb

_CODES = {c.value[0]: c for c in grpc.StatusCode}
METHOD = "/kvservice.v1.BlockManager/StepStream"
#: Statuses that end a stream call before any of its requests is applied (a token outside its pools, a malformed
#: stream id, an unknown method): the unanswered request is known not to have been applied.
REFUSED_CALL = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.UNIMPLEMENTED)


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


class StreamCore:
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
        self.reconnects = 0               # times the stream was reopened
        self.route = 0                    # the client's address index the open (or last) call goes to
        self._methods: dict[int, Any] = {}

    def route_method(self, client: Any) -> Any:
        """The StepStream method for the next call, on the channel the client names (client.stream_channel(): its
        one channel, or a LeaderClient's current address); remembered per address. Sets `route`."""
        self.route, channel = client.stream_channel()
        method = self._methods.get(self.route)
        if method is None:
            method = self._methods[self.route] = channel.stream_stream(
                METHOD, request_serializer=None, response_deserializer=pb.StepReply.FromString)
        return method

    def broken(self, client: Any, err: ClientError, seq: int, budget: CallBudget, closed: bool = False) -> float:
        """The stream's call broke with `err` (already dropped) while request `seq` waited for its reply.

        Tells the client (client.stream_failed: a LeaderClient moves to its next address) if no manager answered,
        and returns the pause before the stream is reopened under the same id and `seq` is resent; raises the
        ClientError the step raises instead (unanswered: the request stays pending unless the call was refused)
        when the error is final, the stream was closed, the policy allows one attempt, or the deadline is spent.
        """
        again = code_of(err) in RETRY_CODES
        if again:
            client.stream_failed(self.route)
        if closed or not again:
            raise self.unanswered(err, seq) from None
        if self.single_attempt(client):
            raise self.unanswered(budget.gave_up(err), seq) from None
        try:
            pause = budget.pause_or_raise(err)
        except ClientError as gave_up:
            raise self.unanswered(gave_up, seq) from None
        self.reconnects += 1
        return pause

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
        """`err` of request `seq` that got no reply, saying what happens to it: dropped if the status says the call
        was refused before any request was applied (REFUSED_CALL), else it stays pending."""
        meta = {**err.metadata, "stream_id": self.stream_id, "stream_seq": str(seq)}
        if err.code in REFUSED_CALL:
            if self.pending is not None and self.pending.seq == seq:
                self.pending = None
            return ClientError(err.code, f"{err.message} (request {seq} of stream {self.stream_id} was not applied)",
                               err.reason, meta)
        note = (f"; request {seq} of stream {self.stream_id} may or may not have been applied: it stays pending, "
                "and the next step() on this stream resends it first under the same stream_seq (a step() with the "
                "same arguments returns its original reply; stream.resolve() returns it)")
        return ClientError(err.code, err.message + note, err.reason, meta)

    def expect(self, reply: pb.StepReply, seq: int) -> pb.StepReply:
        """`reply` if it answers request `seq`; UNAVAILABLE otherwise (a reply left on a call by a step that was
        cancelled: the call is out of step and is reopened)."""
        if reply.stream_seq != seq:
            raise ClientError(grpc.StatusCode.UNAVAILABLE, f"stream {self.stream_id}: got the reply to request "
                              f"{reply.stream_seq} while waiting for request {seq}; reopening the stream")
        return reply

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
