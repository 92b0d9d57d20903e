"""StepStream's deadline watchdog and EchoStream, read whole on hand-made calls (kvservice/client/stream.py).

- StepStream._watch (the stream module doc: "a reply not in by then cancels the call"): every tick (a quarter of
  the step's deadline, at most 0.25 s) it cancels the open call and marks the step expired only when a reply is
  due (a deadline is set), a call is open, and the clock is past that deadline; it stops once the stream is
  closed. Read on a scripted clock, one state per tick.
- EchoStream: one EchoStream call on the client's channel (its method path, the EchoRequest / EchoReply codecs,
  the client's metadata); echo(payload) sends one request and returns its reply's payload (b"" by default); a
  broken call raises ClientError with its code and details; close() ends the request stream and cancels the call.
- The transports (StepStream._open / _roundtrip / _drop_call, AsyncStepStream._roundtrip / _exchange; the module
  doc's "Reconnects"): each request goes on the open call (one StepStream method per address, the client's token
  and the stream id as metadata) with its reply due within the step's deadline; the first reply of each call is
  shown to the client (stream_answered, the leader check); a call that ended, broke (UNAVAILABLE, a write that
  could not be sent), or stayed silent (DEADLINE_EXCEEDED) is dropped (its requests ended, cancelled), reported
  (stream_failed), and reopened after the client's pause with the same request resent; a refused call raises at
  once and its request is known not applied; a step the caller cancels drops its call.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from kvservice.client import stream as stream_mod
from kvservice.client.codec import ClientError
from kvservice.client.deadline import RetryPolicy
from kvservice.client.stream import AsyncStepStream, EchoStream, StepStream
from kvservice.v1 import block_manager_pb2 as pb
from tests.support_client import RpcErr


class Call:
    def __init__(self):
        self.cancels = 0

    def cancel(self):
        self.cancels += 1


class Script:
    """The stream module's clock: tick k shows state k (deadline, call) at time `now`; sleep() records each tick."""

    def __init__(self, s, states):
        self.s, self.states, self.ticks, self.seen = s, states, [], []
        self.now = 0.0
        self._load(0)

    def _load(self, k):
        self.now, self.s._deadline, self.s._call = self.states[k]

    def monotonic(self):
        return self.now

    def sleep(self, tick):
        self.ticks.append(tick)
        call = self.states[len(self.seen)][2]
        self.seen.append((self.s._expired, call.cancels if call is not None else None))
        self.s._expired = False
        if len(self.seen) == len(self.states):
            self.s._closed = True
        else:
            self._load(len(self.seen))


@pytest.mark.parametrize("timeout, tick", [(0.6, 0.15), (4.0, 0.25), (1.0, 0.25)])
def test_the_watchdog_cancels_the_call_only_when_a_due_reply_is_overdue(monkeypatch, timeout, tick):
    s = StepStream(SimpleNamespace(timeout=timeout, _metadata=None), "p", page_size=4, stream_id="s-w")
    states = [(50.0, 0.0, Call()),      # no reply due: never cancelled, however late
              (50.0, 60.0, Call()),     # due at 60, now 50: not yet
              (60.0, 60.0, Call()),     # exactly at the deadline: not yet past it
              (70.0, 60.0, None),       # overdue, but no call open: nothing to cancel
              (70.0, 60.0, Call()),     # overdue with a call open: cancelled, the step expired
              (80.0, 0.0, None)]        # nothing due, nothing open
    script = Script(s, states)
    monkeypatch.setattr(stream_mod, "time", script)
    s._watch()
    assert script.seen == [(False, 0), (False, 0), (False, 0), (False, None), (True, 1), (False, None)]
    assert script.ticks == [tick] * len(states)
    s._closed = True
    before = len(script.ticks)
    s._watch()                                   # a closed stream's watchdog returns at once
    assert len(script.ticks) == before


class EchoCall:
    """An EchoStream call: reads its request iterator, answers each request with its payload, or breaks."""

    def __init__(self, requests, metadata, broken=None):
        self.requests, self.metadata, self.broken = requests, metadata, broken
        self.sent, self.cancelled = [], 0

    def __iter__(self):
        return self

    def __next__(self):
        req = next(self.requests)
        self.sent.append(req)
        if self.broken is not None:
            raise self.broken
        return pb.EchoReply(payload=req.payload)

    def cancel(self):
        self.cancelled += 1


class Channel:
    def __init__(self, broken=None):
        self.opened, self.calls, self.broken = [], [], broken

    def stream_stream(self, method, request_serializer=None, response_deserializer=None):
        self.opened.append((method, request_serializer, response_deserializer))

        def open_call(requests, metadata=None):
            call = EchoCall(requests, metadata, self.broken)
            self.calls.append(call)
            return call
        return open_call


def test_echo_stream_sends_each_payload_on_one_call_and_returns_the_replys():
    ch = Channel()
    md = (("authorization", "Bearer e"),)
    with EchoStream(SimpleNamespace(_channel=ch, _metadata=md)) as e:
        assert e.echo(b"\x00ab") == b"\x00ab"
        assert e.echo() == b""
        assert e.echo(b"z" * 300) == b"z" * 300
        [call] = ch.calls
        assert call.metadata is md and [r.payload for r in call.sent] == [b"\x00ab", b"", b"z" * 300]
        assert all(type(r) is pb.EchoRequest for r in call.sent) and call.cancelled == 0
    assert ch.opened == [("/kvservice.v1.BlockManager/EchoStream", pb.EchoRequest.SerializeToString,
                          pb.EchoReply.FromString)]
    assert call.cancelled == 1
    with pytest.raises(StopIteration):           # closed: its request stream has ended
        next(call.requests)


def test_a_broken_echo_stream_raises_client_error_with_the_calls_code_and_details():
    ch = Channel(RpcErr(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many streams"))
    e = EchoStream(SimpleNamespace(_channel=ch, _metadata=None))
    with pytest.raises(ClientError) as err:
        e.echo(b"q")
    assert (err.value.code, err.value.message, err.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                     "too many streams", "")
    assert ch.calls[0].metadata is None
    e.close()
    assert ch.calls[0].cancelled == 1



# ---- StepStream's transport: _open, _roundtrip, _drop_call on hand-made calls ------------------------------------
class StreamCall:
    """A StepStream call: each next() reads one request from the stream's request iterator (recorded), notes how long
    the watchdog would wait, and answers with the next scripted outcome (a reply, an error, or the end)."""

    def __init__(self, stream, requests, metadata, outcomes, md):
        self.s, self.requests, self.metadata, self.outcomes, self.md = stream, requests, metadata, outcomes, md
        self.sent, self.due, self.cancels = [], [], 0

    def __iter__(self):
        return self

    def __next__(self):
        self.sent.append(next(self.requests))
        self.due.append(self.s._deadline - time.monotonic())
        got = self.outcomes.pop(0)
        if got == "closing":                       # close() from another thread, then the call breaks
            self.s._closed = True
            raise RpcErr(grpc.StatusCode.UNAVAILABLE, "gone")
        if got == "expired":                       # the watchdog cancelled the call: gRPC says CANCELLED
            self.s._expired = True
            raise RpcErr(grpc.StatusCode.CANCELLED, "refused")
        if isinstance(got, Exception):
            raise got
        if got is None:
            raise StopIteration
        return got

    def initial_metadata(self):
        return self.md

    def cancel(self):
        self.cancels += 1


class StreamClient:
    """What a StepStream asks of its client: the channel of the next call (address `route`), and the hooks."""

    def __init__(self, scripts, retry=None):
        self.timeout, self._metadata, self.target = 40.0, (("authorization", "Bearer s"),), "mgr:1"
        self.retry = retry or RetryPolicy()
        self.position = None
        self.scripts, self.calls, self.opened, self.log = scripts, [], [], []
        self.route = 0

    def stream_channel(self):
        return self.route, self

    def stream_stream(self, method, request_serializer=None, response_deserializer=None):
        self.opened.append((self.route, method, request_serializer, response_deserializer))

        def open_call(requests, metadata=None):
            outcomes, md = self.scripts.pop(0)
            call = StreamCall(self.stream, requests, metadata, outcomes, md)
            self.calls.append(call)
            return call
        return open_call

    def stream_answered(self, index, metadata):
        self.log.append(("answered", index, metadata))

    def stream_failed(self, index):
        self.log.append(("failed", index))

    def _pause(self, seconds):
        self.log.append(("pause", seconds))


def _sync_stream(client, stream_id):
    """A StepStream on `client` (pool p, page size 4); client.stream is where StreamCall reads its deadline."""
    s = StepStream(client, "p", page_size=4, stream_id=stream_id)
    client.stream = s
    return s


def _pending_refused(s):
    """Request 1 sent as the pending step: the ClientError it raised; the stream is closed after."""
    try:
        s.pending = s.start(b"body", False, False, None)
        with pytest.raises(ClientError) as err:
            s._roundtrip(s.pending.data, 1)
    finally:
        s.close()
    return err.value


def test_a_sync_stream_sends_each_request_on_its_call_and_reopens_a_broken_one_under_the_same_id():
    md_a, md_b, md_c = (("e", "1"),), (("e", "2"),), (("e", "3"),)
    client = StreamClient([([pb.StepReply(stream_seq=1), pb.StepReply(stream_seq=2), None], md_a),
                           ([pb.StepReply(stream_seq=3), "expired"], md_b),
                           ([pb.StepReply(stream_seq=4), RpcErr(grpc.StatusCode.PERMISSION_DENIED, "not yours")],
                            md_c)])
    s = _sync_stream(client, "s-t")
    try:
        assert s._roundtrip(b"d1", 1).stream_seq == 1 and s._deadline == 0.0
        watchdog = s._watchdog
        assert watchdog.daemon and watchdog.name == "deadline-s-t" and watchdog.is_alive()
        assert s._roundtrip(b"d2", 2).stream_seq == 2
        a = client.calls[0]
        assert client.log == [("answered", 0, md_a)]               # the first reply of a call only
        assert s._roundtrip(b"d3", 3).stream_seq == 3               # A ended: reopened, d3 resent on B
        b = client.calls[1]
        assert (a.sent, a.cancels, b.sent[:1]) == ([b"d1", b"d2", b"d3"], 1, [b"d3"])
        with pytest.raises(StopIteration):
            next(a.requests)                                        # A's request stream was ended
        assert client.log[1:3] == [("failed", 0), client.log[2]] and client.log[2][0] == "pause"
        assert 0 < client.log[2][1] <= 0.05 and client.log[3] == ("answered", 0, md_b)
        assert s.reconnects == 1 and s._watchdog is watchdog       # one watchdog per stream
        assert s._roundtrip(b"d4", 4).stream_seq == 4               # B cancelled by the watchdog: C
        c = client.calls[2]
        assert (b.sent, b.cancels, c.sent[:1]) == ([b"d3", b"d4"], 1, [b"d4"])
        assert [e[0] for e in client.log[4:]] == ["failed", "pause", "answered"] and s.reconnects == 2
        s.seq = 4
        s.pending = s.start(b"body", False, False, None)            # request 5, pending
        with pytest.raises(ClientError) as err:                     # a refused call: final, and not applied
            s._roundtrip(s.pending.data, 5)
        assert (err.value.code, err.value.message) == (grpc.StatusCode.PERMISSION_DENIED,
                                                       "not yours (request 5 of stream s-t was not applied)")
        assert err.value.metadata == {"stream_id": "s-t", "stream_seq": "5"}
        assert s._call is None and s._queue is None and c.cancels == 1 and s.pending is None
        assert len(client.log) == 7 and client.log[-1] == ("answered", 0, md_c)
        for call in client.calls:
            assert call.metadata == (("authorization", "Bearer s"), ("kvservice-stream-id", "s-t"))
            assert all(0 < due <= 40.0 for due in call.due)         # each reply due within the step's deadline
        assert client.opened == [(0, "/kvservice.v1.BlockManager/StepStream", None, pb.StepReply.FromString)]
    finally:
        s.close()
    watchdog.join(10)
    assert not watchdog.is_alive()


def test_a_sync_stream_whose_policy_allows_one_attempt_raises_at_once_and_keeps_the_request_pending():
    client = StreamClient([([None], ())], retry=RetryPolicy(attempts=1))
    s = _sync_stream(client, "s-1")
    e = _pending_refused(s)
    assert (e.code, e.reason) == (grpc.StatusCode.UNAVAILABLE, "RETRIES_EXHAUSTED") and s.pending is not None
    assert e.message.startswith("StepStream s-1 (request 1) to mgr:1: no manager answered within its 40 s deadline "
                                "(1 attempt in ")
    assert "(last: UNAVAILABLE: the manager ended the stream)" in e.message
    assert "; request 1 of stream s-1 may or may not have been applied: it stays pending" in e.message
    assert (e.metadata["stream_id"], e.metadata["stream_seq"]) == ("s-1", "1")
    assert client.log == [("failed", 0)] and s.reconnects == 0 and s._call is None


# ---- AsyncStepStream's transport: _roundtrip and _exchange on hand-made grpc.aio calls -------------------------
def _aio_error(code, details):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class AioCall:
    """A grpc.aio StepStream call: write() then read(), each answering with its scripted outcome ("hang": never)."""

    def __init__(self, metadata, writes, reads, md):
        self.metadata, self.writes, self.reads, self.md = metadata, writes, reads, md
        self.sent, self.cancels = [], 0

    async def write(self, data):
        self.sent.append(data)
        got = self.writes.pop(0)
        if got is not None:
            raise got

    async def read(self):
        got = self.reads.pop(0)
        if got == "hang":
            await asyncio.Event().wait()
        if isinstance(got, Exception):
            raise got
        return got

    async def initial_metadata(self):
        return self.md

    def cancel(self):
        self.cancels += 1


class AioClient(StreamClient):
    def stream_stream(self, method, request_serializer=None, response_deserializer=None):
        self.opened.append((self.route, method, request_serializer, response_deserializer))

        def open_call(metadata=None):
            call = AioCall(metadata, *self.scripts.pop(0))
            self.calls.append(call)
            return call
        return open_call

    async def _pause(self, seconds):
        self.log.append(("pause", seconds))


def test_an_asyncio_stream_sends_each_request_on_its_call_and_reopens_a_broken_one_under_the_same_id():
    md = [(("e", str(i)),) for i in range(5)]
    client = AioClient([([None, asyncio.InvalidStateError()], [pb.StepReply(stream_seq=1), grpc.aio.EOF], md[0]),
                        ([_aio_error(grpc.StatusCode.INTERNAL, "broken pipe")], [], md[1]),
                        ([None], ["hang"], md[2]),
                        ([None, _aio_error(grpc.StatusCode.PERMISSION_DENIED, "not yours")],
                         [pb.StepReply(stream_seq=2)], md[3]),
                        ([None], ["hang"], md[4])],
                       retry=RetryPolicy(attempt_timeout=0.05))
    s = AsyncStepStream(client, "p", 4, stream_id="s-a")

    async def run():
        assert (await s._roundtrip(b"d1", 1)).stream_seq == 1
        assert client.log == [("answered", 0, md[0])]
        assert (await s._roundtrip(b"d2", 2)).stream_seq == 2      # EOF, a broken write, a silent call: 3 reopens
        assert s.reconnects == 3
        a, b, c, d = client.calls
        assert (a.sent, b.sent, c.sent, d.sent) == ([b"d1", b"d2"], [b"d2"], [b"d2"], [b"d2"])
        assert [x.cancels for x in (a, b, c, d)] == [1, 1, 1, 0]
        kinds = [e[0] for e in client.log]
        assert kinds == ["answered"] + ["failed", "pause"] * 3 + ["answered"]
        assert client.log[-1] == ("answered", 0, md[3]) and all(e[1] == 0 for e in client.log if e[0] == "failed")
        assert all(0 < e[1] <= 0.2 for e in client.log if e[0] == "pause")
        s.seq = 2
        s.pending = s.start(b"body", False, False, None)
        with pytest.raises(ClientError) as err:                     # a refused write: final, not applied
            await s._roundtrip(s.pending.data, 3)
        assert (err.value.code, err.value.message) == (grpc.StatusCode.PERMISSION_DENIED,
                                                       "not yours (request 3 of stream s-a was not applied)")
        assert s._call is None and d.cancels == 1 and s.pending is None and len(client.log) == 8
        client.retry = RetryPolicy()                                # no attempt cut: only the caller ends this one
        step = asyncio.ensure_future(s._roundtrip(b"d4", 4))        # the caller cancels a step waiting for its reply
        for _ in range(5):
            await asyncio.sleep(0)
        e = client.calls[4]
        assert e.sent == [b"d4"] and s._call is e
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert s._call is None and e.cancels == 1
    asyncio.run(run())
    assert client.opened == [(0, "/kvservice.v1.BlockManager/StepStream", None, pb.StepReply.FromString)]
    assert all(call.metadata == (("authorization", "Bearer s"), ("kvservice-stream-id", "s-a"))
               for call in client.calls)


def test_an_asyncio_streams_broken_write_says_why_and_a_silent_call_is_deadline_exceeded():
    client = AioClient([([_aio_error(grpc.StatusCode.INTERNAL, "broken pipe")], [], ()), ([None], ["hang"], ())],
                       retry=RetryPolicy(attempts=1, attempt_timeout=0.05))
    s = AsyncStepStream(client, "p", 4, stream_id="s-b")

    async def run():
        errs = []
        for seq in (1, 2):
            with pytest.raises(ClientError) as err:
                await s._roundtrip(b"x", seq)
            errs.append(err.value)
        return errs
    broke, silent = asyncio.run(run())
    assert (broke.code, broke.reason) == (grpc.StatusCode.UNAVAILABLE, "RETRIES_EXHAUSTED")
    assert ("(last: UNAVAILABLE: the stream's connection broke before the request was sent (broken pipe))"
            in broke.message)
    assert "(last: DEADLINE_EXCEEDED: no reply in time (the call was cancelled))" in silent.message
    assert silent.code == grpc.StatusCode.UNAVAILABLE and silent.metadata["last_code"] == "DEADLINE_EXCEEDED"


def test_a_sync_stream_whose_policy_allows_two_attempts_reopens_once_then_gives_up():
    """RetryPolicy(attempts=2): a broken stream is reopened within the step (only attempts=1 never is), and the
    step gives up once its two attempts were spent."""
    client = StreamClient([([None], ()), ([pb.StepReply(stream_seq=1), None], ()), ([None], ())],
                          retry=RetryPolicy(attempts=2))
    s = _sync_stream(client, "s-2")
    try:
        assert s._roundtrip(b"d1", 1).stream_seq == 1 and s.reconnects == 1
        with pytest.raises(ClientError) as err:
            s._roundtrip(b"d2", 2)
    finally:
        s.close()
    assert (err.value.code, err.value.reason, err.value.metadata["attempts"]) == (grpc.StatusCode.UNAVAILABLE,
                                                                                 "RETRIES_EXHAUSTED", "2")
    assert s.reconnects == 2
    assert [e[0] for e in client.log] == ["failed", "pause", "answered", "failed", "pause", "failed"]


def test_an_asyncio_stream_checks_a_calls_first_reply_only_and_names_the_request_when_the_manager_ends_it():
    client = AioClient([([None, None, None], [pb.StepReply(stream_seq=6), pb.StepReply(stream_seq=7), grpc.aio.EOF],
                         (("e", "9"),))], retry=RetryPolicy(attempts=1))
    s = AsyncStepStream(client, "p", 4, stream_id="s-c")

    async def run():
        assert (await s._roundtrip(b"a", 6)).stream_seq == 6
        assert (await s._roundtrip(b"b", 7)).stream_seq == 7
        assert client.log == [("answered", 0, (("e", "9"),))]         # once per call, not per reply
        with pytest.raises(ClientError) as err:
            await s._roundtrip(b"c", 8)
        return err.value
    e = asyncio.run(run())
    assert e.message.startswith("StepStream s-c (request 8) to mgr:1: no manager answered within its 40 s deadline")
    assert "(last: UNAVAILABLE: the manager ended the stream)" in e.message
    assert client.log[1:] == [("failed", 0)] and client.calls[0].sent == [b"a", b"b", b"c"]


def test_a_sync_stream_closed_while_waiting_is_not_reopened_and_a_silent_call_says_so():
    """close() from another thread while a step waits: the broken call is reported, not reopened, and the request
    stays pending; with one attempt allowed, a call the watchdog cancelled gives up as DEADLINE_EXCEEDED."""
    client = StreamClient([(["closing"], ())])
    s = _sync_stream(client, "s-z")
    s.close()                                                  # nothing open yet: closing is harmless
    assert (s._call, s._queue, s._closed) == (None, None, True)
    s._closed = False
    e = _pending_refused(s)
    assert e.code == grpc.StatusCode.UNAVAILABLE and e.message.startswith("gone; request 1 of stream")
    assert client.log == [("failed", 0)] and s.reconnects == 0 and s.pending is not None
    client = StreamClient([(["expired"], ())], retry=RetryPolicy(attempts=1))
    s = _sync_stream(client, "s-y")
    try:
        with pytest.raises(ClientError) as err:
            s._roundtrip(b"x", 1)
    finally:
        s.close()
    assert "(last: DEADLINE_EXCEEDED: no reply in time (the call was cancelled))" in err.value.message
    assert err.value.metadata["last_code"] == "DEADLINE_EXCEEDED"
