"""A StepStream request whose reply never came stays pending: the caller's retry gets its original reply, a
different step settles it first (issue 27, item 2), for the sync and asyncio clients, against a real server.

The only thing injected is the loss: a reply the server sent is dropped before the client sees it
(the connection broke after the server applied the step), or a request never reaches the server.
The clients run with RetryPolicy(attempts=1), so the loss reaches the caller as UNAVAILABLE (the
outcome unknown), as it does when a restart outlasts a step's deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

import grpc
import pytest

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.client import RetryPolicy
from kvservice.client.codec import StepResult
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve
from tests.support_stream import SPECS, assert_same_tables

pytestmark = pytest.mark.integration
_names = itertools.count()
SPEC = SPECS["per_layer"][0]
SIZING = Sizing(num_slots=256, max_seq_len=512)
ONCE = RetryPolicy(attempts=1)


class _Lost(grpc.RpcError):
    """What the client sees when the connection broke: UNAVAILABLE."""

    def __init__(self, why: str) -> None:
        super().__init__()
        self.why = why

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"connection reset (injected: {self.why})"

    def trailing_metadata(self) -> tuple:
        return ()

    def initial_metadata(self) -> tuple:
        return ()


class Loss(grpc.StreamStreamClientInterceptor):
    """Drops the next `replies` replies after the server sent them, or the next `requests` requests before they
    are sent (the call then breaks UNAVAILABLE). sent: requests that reached the server."""

    def __init__(self) -> None:
        self.replies = self.requests = self.sent = 0
        self._swallowed = threading.Event()

    def intercept_stream_stream(self, continuation, details, request_iterator):
        def requests():
            for item in request_iterator:
                if self.requests > 0:
                    self._swallowed.set()           # before the count drops: __next__ looks at both
                    self.requests -= 1
                    continue
                self.sent += 1
                yield item
        return _LossyCall(continuation(details, requests()), self)


class _LossyCall:
    def __init__(self, call, loss: Loss) -> None:
        self._call, self._loss = call, loss

    def __iter__(self):
        return self

    def __next__(self):
        loss = self._loss
        if (loss.requests > 0 or loss._swallowed.is_set()) and loss._swallowed.wait(30):     # never sent: no reply
            loss._swallowed.clear()
            self._call.cancel()
            raise _Lost("request not sent")
        reply = next(self._call)
        if loss.replies > 0:
            loss.replies -= 1
            self._call.cancel()
            raise _Lost("reply dropped")
        return reply

    def cancel(self):
        return self._call.cancel()

    def initial_metadata(self):
        return self._call.initial_metadata()


@pytest.fixture(scope="module")
def server():
    running = serve("127.0.0.1:0")
    yield f"127.0.0.1:{running.port}"
    running.stop()


@pytest.fixture
def lossy(server):
    """(stream client through a Loss, the Loss, a plain client, pool name, twin pool name)."""
    loss = Loss()
    channel = grpc.intercept_channel(grpc.insecure_channel(server), loss)
    with BlockManagerClient(server, channel=channel, retry=ONCE) as c, BlockManagerClient(server) as plain:
        a, b = f"pa{next(_names)}", f"pb{next(_names)}"
        for name in (a, b):
            plain.create_pool(name, SPEC, SIZING)
        yield c, loss, plain, a, b


def _steps(plain, pool):
    return plain.stats(pool)[pool].steps


def test_a_retry_of_a_step_whose_reply_was_lost_gets_the_original_reply(lossy):
    c, loss, plain, a, b = lossy
    s = c.step_stream(a)
    s.step(admit=[1, 2], admit_tokens=[5, 30])
    plain.step(b, admit=[1, 2], admit_tokens=[5, 30])
    loss.replies = 1
    with pytest.raises(ClientError) as exc:
        s.step(extend=[1, 2], extend_tokens=3)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE and "stays pending" in exc.value.message
    assert exc.value.metadata["stream_seq"] == "2" and s.pending is not None and s.pending.seq == 2
    assert _steps(plain, a) == 2                        # the server applied it; the client does not know
    r = s.step(extend=[1, 2], extend_tokens=3)          # the caller's retry: the same request
    assert r.num_tokens.tolist() == [8, 33]             # applied once (twice would say [11, 36])
    assert _steps(plain, a) == 2 and s.pending is None and s.seq == 2 and s.resolved == 1
    full = plain.step(b, extend=[1, 2], extend_tokens=3, block_table=True)
    assert_same_tables(s.mirror, full, "after the retry")
    r = s.step(extend=[1, 2], extend_tokens=3)          # a new step with the same arguments is a new step
    assert r.num_tokens.tolist() == [11, 36] and _steps(plain, a) == 3 and s.seq == 3


def test_a_different_step_settles_the_pending_one_first(lossy):
    c, loss, plain, a, b = lossy
    s = c.step_stream(a)
    s.step(admit=[1], admit_tokens=[5])
    loss.replies = 1
    with pytest.raises(ClientError):
        s.step(extend=[1], extend_tokens=20)
    r = s.step(admit=[2], admit_tokens=[7])             # the scheduler moved on: the pending step comes first
    assert r.seq_ids.tolist() == [2] and r.num_tokens.tolist() == [7]
    assert {q.seq_id: q.num_tokens for q in plain.sequences(a).sequences} == {1: 25, 2: 7}
    seq, outcome = s.settled
    assert seq == 2 and isinstance(outcome, StepResult) and outcome.num_tokens.tolist() == [25]
    assert _steps(plain, a) == 3 and s.seq == 3 and s.pending is None
    for kw in ({"admit": [1], "admit_tokens": [5]}, {"extend": [1], "extend_tokens": 20},
               {"admit": [2], "admit_tokens": [7]}):
        full = plain.step(b, block_table=True, **kw)
    assert_same_tables(s.mirror, full, "after the settled step and the new one")


def test_a_pending_step_that_never_reached_the_manager_is_applied_once(lossy):
    c, loss, plain, a, _ = lossy
    s = c.step_stream(a)
    s.step(admit=[1], admit_tokens=[5])
    loss.requests = 1
    with pytest.raises(ClientError) as exc:
        s.step(extend=[1], extend_tokens=4)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE and _steps(plain, a) == 1     # not applied
    r = s.step(extend=[1], extend_tokens=4)
    assert r.num_tokens.tolist() == [9] and _steps(plain, a) == 2
    loss.requests = 1                                   # and a different step after one that was never sent
    with pytest.raises(ClientError):
        s.step(extend=[1], extend_tokens=4)
    r = s.step(free=[1], admit=[2], admit_tokens=[3])
    assert s.settled[1].num_tokens.tolist() == [13] and r.seq_ids.tolist() == [2] and _steps(plain, a) == 4


def test_a_refused_pending_step_raises_its_refusal_on_retry_and_is_kept_when_settled(lossy):
    c, loss, plain, a, _ = lossy
    s = c.step_stream(a)
    s.step(admit=[1], admit_tokens=[5])
    loss.replies = 1
    with pytest.raises(ClientError) as exc:
        s.step(extend=[99], extend_tokens=1)            # refused by the manager; the refusal was lost
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ClientError) as exc:             # the retry learns the refusal, not UNAVAILABLE
        s.step(extend=[99], extend_tokens=1)
    assert exc.value.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert s.pending is None and _steps(plain, a) == 1
    loss.replies = 1
    with pytest.raises(ClientError):
        s.step(extend=[99], extend_tokens=1)
    r = s.step(extend=[1], extend_tokens=2)             # moved on: the refusal is settled, the step applied
    assert isinstance(s.settled[1], ClientError) and s.settled[1].code == exc.value.code
    assert r.num_tokens.tolist() == [7] and _steps(plain, a) == 2


def test_a_pending_step_stays_pending_while_the_manager_does_not_answer(lossy):
    c, loss, plain, a, _ = lossy
    s = c.step_stream(a)
    s.step(admit=[1], admit_tokens=[5])
    loss.replies = 1
    with pytest.raises(ClientError):
        s.step(extend=[1], extend_tokens=2)
    loss.replies = 1                                    # its resend's reply is lost too
    with pytest.raises(ClientError) as exc:
        s.step(admit=[2], admit_tokens=[3])             # the new step is not sent while the old one is unsettled
    assert exc.value.metadata["stream_seq"] == "2" and s.pending.seq == 2 and s.seq == 2 and s.settled is None
    assert s.resolve().num_tokens.tolist() == [7]       # explicitly: its original reply
    assert s.resolve() is None and _steps(plain, a) == 2
    r = s.step(admit=[2], admit_tokens=[3])
    assert r.num_tokens.tolist() == [3] and s.seq == 3 and _steps(plain, a) == 3


def test_the_default_policy_reconnects_and_resends_within_the_step(server):
    """With the default RetryPolicy (attempts=0: as many as the deadline allows) a lost reply never reaches the
    caller: the stream reopens and resends the request under its seq, and gets its original reply."""
    loss = Loss()
    channel = grpc.intercept_channel(grpc.insecure_channel(server), loss)
    with BlockManagerClient(server, channel=channel) as c, BlockManagerClient(server) as plain:
        a = f"pa{next(_names)}"
        plain.create_pool(a, SPEC, SIZING)
        s = c.step_stream(a)
        s.step(admit=[1], admit_tokens=[5])
        loss.replies = 2
        r = s.step(extend=[1], extend_tokens=2)
        assert r.num_tokens.tolist() == [7] and s.reconnects == 2 and _steps(plain, a) == 2 and loss.sent == 3 + 1


def _lose_async_replies(s, n: int) -> list[int]:
    """Make the asyncio stream `s` drop its next n replies after the server sent them; returns a counter list."""
    left = [n]
    exchange = s._exchange

    async def lossy(data: bytes):
        reply = await exchange(data)
        if left[0] > 0:
            left[0] -= 1
            raise ClientError(grpc.StatusCode.UNAVAILABLE, "connection reset (injected: reply dropped)")
        return reply
    s._exchange = lossy
    return left


def test_async_stream_retry_gets_the_original_reply_and_a_different_step_settles_first(server):
    async def run() -> None:
        async with AsyncBlockManagerClient(server, retry=ONCE) as c:
            a = f"pa{next(_names)}"
            await c.create_pool(a, SPEC, SIZING)
            s = await c.step_stream(a)
            await s.step(admit=[1], admit_tokens=[5])
            _lose_async_replies(s, 1)
            with pytest.raises(ClientError) as exc:
                await s.step(extend=[1], extend_tokens=3)
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE and s.pending.seq == 2
            r = await s.step(extend=[1], extend_tokens=3)           # the same: its original reply
            assert r.num_tokens.tolist() == [8] and (await c.stats(a))[a].steps == 2
            _lose_async_replies(s, 1)
            with pytest.raises(ClientError):
                await s.step(extend=[1], extend_tokens=3)
            r = await s.step(admit=[2], admit_tokens=[4])           # different: the pending one first
            assert s.settled[0] == 3 and s.settled[1].num_tokens.tolist() == [11]
            assert r.num_tokens.tolist() == [4] and (await c.stats(a))[a].steps == 4
            _lose_async_replies(s, 1)
            with pytest.raises(ClientError):
                await s.step(extend=[1, 2], extend_tokens=1)
            assert (await s.resolve()).num_tokens.tolist() == [12, 5] and await s.resolve() is None
            await s.close()
    asyncio.run(run())


def test_a_cancelled_async_step_is_resolved_on_a_new_call_and_applied_once(server):
    """A caller that cancels a step (asyncio.wait_for) leaves its reply on the call: the stream drops the call, the
    request stays pending, and the retry gets its original reply; the next step is not answered by a stale one."""
    async def run() -> None:
        async with AsyncBlockManagerClient(server) as c:
            a = f"pa{next(_names)}"
            await c.create_pool(a, SPEC, SIZING)
            s = await c.step_stream(a)
            await s.step(admit=[1], admit_tokens=[5])
            exchange = s._exchange

            async def slow(data: bytes):              # the request goes out; its reply is read too late
                await s._call.write(data)
                await asyncio.sleep(30)
            s._exchange = slow
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(s.step(extend=[1], extend_tokens=2), 0.5)
            s._exchange = exchange
            assert s.pending.seq == 2 and s._call is None
            for _ in range(100):                      # the server applied it (it never waits for the client)
                if (await c.stats(a))[a].steps == 2:
                    break
                await asyncio.sleep(0.05)
            r = await s.step(extend=[1], extend_tokens=2)         # the caller's retry: the original reply
            assert r.num_tokens.tolist() == [7] and s.pending is None
            r = await s.step(extend=[1], extend_tokens=2)         # a new step, answered by its own reply
            assert r.num_tokens.tolist() == [9] and (await c.stats(a))[a].steps == 3 and s.seq == 3
            await s.close()
    asyncio.run(run())


def test_a_reply_to_another_request_is_never_taken_for_this_one(server):
    """A reply left on a sync call by an interrupted step (here: read and put back, as if unread) has another
    stream_seq: the stream reopens and resends instead of returning it."""
    with BlockManagerClient(server) as c:
        a = f"pa{next(_names)}"
        c.create_pool(a, SPEC, SIZING)
        s = c.step_stream(a)
        s.step(admit=[1], admit_tokens=[5])
        stale = s.last_reply
        call = s._call
        replies = iter([stale])
        s._call = type("Call", (), {"__next__": lambda self: next(replies, None) or next(call),
                                    "cancel": lambda self: call.cancel(),
                                    "initial_metadata": lambda self: call.initial_metadata()})()
        r = s.step(extend=[1], extend_tokens=1)
        assert r.num_tokens.tolist() == [6] and s.reconnects == 1 and c.stats(a)[a].steps == 2
        s.close()
