"""One attempt of a leader-following client (kvservice/client/ha.py, aio_ha.py `_invoke`, through LeaderStub), read
at per-address stubs: the call goes to the current address's stub under the method's name with the request, the
attempt's deadline and the call's metadata as given; the reply's kvservice-leader-epoch is recorded with its
kvservice-leader-node, and a reply below the highest epoch seen is refused (StaleLeader) and moves the client on
(docs/HA.md); a call that broke with UNAVAILABLE or DEADLINE_EXCEEDED moves the client to the next address, any
other status leaves it where it is, and the error is raised unchanged either way (the caller's retry decides).
LeaderClient.wait_ready: one readiness wait per address, returning as soon as any connects, every wait cancelled
after, UNAVAILABLE naming the addresses and the timeout if none did. A readiness watch (grpc.health.v1 Watch of
the BlockManager service) goes to that address's channel and is kept so that close() can cancel it.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvservice.client import aio_ha
from kvservice.client.codec import ClientError
from kvservice.client.ha import LeaderClient, LeaderStub, StaleLeader
from kvservice.v1 import block_manager_pb2 as pb

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
EPOCH, NODE = "kvservice-leader-epoch", "kvservice-leader-node"


class Err(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return self._code.name.lower()


class Call:
    def __init__(self, md):
        self.md = md

    def initial_metadata(self):
        return self.md


class SyncStub:
    """One address's stub: each method's with_call records (address, method, request, timeout, metadata) and answers
    with the next outcome: (reply, initial metadata) or an error."""

    def __init__(self, name, log, outcomes):
        self.name, self.log, self.outcomes = name, log, outcomes

    def __getattr__(self, method):
        stub = self

        class Method:
            def with_call(self, request, timeout=None, metadata=None):
                stub.log.append((stub.name, method, request, timeout, metadata))
                got = stub.outcomes.pop(0)
                if isinstance(got, Exception):
                    raise got
                reply, md = got
                return reply, Call(md)
        return Method()


def _outcomes():
    """What addresses a, b, c answer, in turn, in the attempt tests: a leads at epoch 5 then answers as epoch 4 (a
    deposed leader); b refuses (NOT_FOUND), then is unreachable; c is silent (DEADLINE_EXCEEDED), then leads at 6."""
    return ([(pb.EchoReply(payload=b"1"), ((EPOCH, "5"), (NODE, "n-a"))),
             (pb.EchoReply(payload=b"3"), ((EPOCH, "4"), (NODE, "old")))],
            [Err(grpc.StatusCode.NOT_FOUND), Err(grpc.StatusCode.UNAVAILABLE)],
            [Err(grpc.StatusCode.DEADLINE_EXCEEDED), (pb.EchoReply(payload=b"6"), ((EPOCH, "6"),))])


def _calls_made(md):
    """(address, method, request, timeout, metadata) of each attempt the attempt tests make, in order."""
    return [("a", "Echo", pb.EchoRequest(payload=b"q"), 1.25, md),
            ("a", "Echo", pb.EchoRequest(payload=b"r"), 2.0, None),
            ("b", "GetPool", pb.GetPoolRequest(pool="p"), 0.5, md),
            ("b", "Echo", pb.EchoRequest(), 0.75, md),
            ("c", "Echo", pb.EchoRequest(), 0.75, md),
            ("c", "Echo", pb.EchoRequest(payload=b"s"), 9.0, md)]


def test_a_sync_attempt_goes_to_the_current_address_and_its_reply_epoch_is_checked():
    log = []
    c = LeaderClient([A, B, C], timeout=3.0)
    try:
        c._stubs = [SyncStub(name, log, got) for name, got in zip("abc", _outcomes(), strict=True)]
        stub = c._stub                                            # what BlockManagerClient's calls go through
        assert isinstance(stub, LeaderStub) and stub._client is c
        md = (("authorization", "Bearer x"),)
        assert stub.Echo(pb.EchoRequest(payload=b"q"), timeout=1.25, metadata=md) == pb.EchoReply(payload=b"1")
        assert (c.epoch, c.leader_node, c.current_target) == (5, "n-a", A)
        with pytest.raises(StaleLeader) as stale:                 # a deposed leader's reply: refused, move on
            c._invoke("Echo", pb.EchoRequest(payload=b"r"), 2.0, None)
        assert stale.value.details().startswith(f"{A} answered as leader epoch 4, but epoch 5 was already seen")
        assert (c.epoch, c.stale_replies, c.current_target, c.leader_node) == (5, 1, B, "n-a")
        with pytest.raises(Err) as refused:                       # a refusal: raised, the client stays
            c._invoke("GetPool", pb.GetPoolRequest(pool="p"), 0.5, md)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and c.current_target == B
        for code, moved_to in ((grpc.StatusCode.UNAVAILABLE, C), (grpc.StatusCode.DEADLINE_EXCEEDED, A)):
            with pytest.raises(Err) as broke:
                c._invoke("Echo", pb.EchoRequest(), 0.75, md)
            assert broke.value.code() == code and c.current_target == moved_to
        c._current = 2
        assert c._invoke("Echo", pb.EchoRequest(payload=b"s"), 9.0, md).payload == b"6"
        assert (c.epoch, c.leader_node, c.current_target) == (6, "", C)
    finally:
        c.close()
    assert log == _calls_made(md)


class AsyncCall:
    def __init__(self, outcome):
        self.outcome = outcome

    def __await__(self):
        async def reply():
            if isinstance(self.outcome, Exception):
                raise self.outcome
            return self.outcome[0]
        return reply().__await__()

    async def initial_metadata(self):
        return self.outcome[1]


class AsyncStub:
    def __init__(self, name, log, outcomes):
        self.name, self.log, self.outcomes = name, log, outcomes

    def __getattr__(self, method):
        def call(request, timeout=None, metadata=None):
            self.log.append((self.name, method, request, timeout, metadata))
            return AsyncCall(self.outcomes.pop(0))
        return call


def test_an_async_attempt_goes_to_the_current_address_and_its_reply_epoch_is_checked():
    log = []
    md = (("authorization", "Bearer y"),)

    async def run():
        c = aio_ha.AsyncLeaderClient([A, B, C], timeout=3.0)
        try:
            c._stubs = [AsyncStub(name, log, got) for name, got in zip("abc", _outcomes(), strict=True)]
            assert await c._stub.Echo(pb.EchoRequest(payload=b"q"), timeout=1.25, metadata=md) == \
                pb.EchoReply(payload=b"1")
            assert (c.epoch, c.leader_node, c.current_target) == (5, "n-a", A)
            with pytest.raises(StaleLeader):
                await c._invoke("Echo", pb.EchoRequest(payload=b"r"), 2.0, None)
            assert (c.epoch, c.stale_replies, c.current_target, c.leader_node) == (5, 1, B, "n-a")
            with pytest.raises(Err) as refused:
                await c._invoke("GetPool", pb.GetPoolRequest(pool="p"), 0.5, md)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND and c.current_target == B
            for code, moved_to in ((grpc.StatusCode.UNAVAILABLE, C), (grpc.StatusCode.DEADLINE_EXCEEDED, A)):
                with pytest.raises(Err) as broke:
                    await c._invoke("Echo", pb.EchoRequest(), 0.75, md)
                assert broke.value.code() == code and c.current_target == moved_to
            c._current = 2
            assert (await c._invoke("Echo", pb.EchoRequest(payload=b"s"), 9.0, md)).payload == b"6"
            assert (c.epoch, c.leader_node, c.current_target) == (6, "", C)
        finally:
            await c.close()
    asyncio.run(run())
    assert log == _calls_made(md)


class Ready:
    """A channel_ready_future: calls its done-callbacks at once if its channel is ready, else never."""

    def __init__(self, channel, ready):
        self.channel, self.ready, self.cancelled = channel, ready, 0

    def add_done_callback(self, fn):
        if self.ready:
            fn(self)

    def cancel(self):
        self.cancelled += 1


def test_wait_ready_returns_once_any_address_connects_and_cancels_every_wait(monkeypatch):
    futures = []
    ready = {B}

    def future(channel):
        f = Ready(channel, channel is not None and targets[id(channel)] in ready)
        futures.append(f)
        return f
    monkeypatch.setattr(grpc, "channel_ready_future", future)
    with LeaderClient([A, B, C], timeout=3.0) as c:
        targets = {id(ch): t for ch, t in zip(c._channels, c.targets, strict=True)}
        c.wait_ready(600.0)                                          # B is ready: returns at once
        assert [f.channel for f in futures] == c._channels and [f.cancelled for f in futures] == [1, 1, 1]
        ready.clear()
        futures.clear()
        with pytest.raises(ClientError) as err:
            c.wait_ready(0.01)
        assert [f.channel for f in futures] == c._channels and [f.cancelled for f in futures] == [1, 1, 1]
    assert (err.value.code, err.value.message) == (grpc.StatusCode.UNAVAILABLE,
                                                   f"no manager answered at {A},{B},{C} within 0 s")


def test_a_health_watch_asks_the_addresss_channel_about_the_block_manager_and_is_kept_to_cancel(monkeypatch):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    watched = []

    class HealthStub:
        def __init__(self, channel):
            self.channel = channel

        def Watch(self, request):
            call = (self.channel, request)
            watched.append(call)
            return call
    monkeypatch.setattr(health_pb2_grpc, "HealthStub", HealthStub)
    c = LeaderClient([A, B], timeout=3.0)
    try:
        got = c._health_watch(1)
        ask = health_pb2.HealthCheckRequest(service="kvservice.v1.BlockManager")
        assert got == (c._channels[1], ask) and watched == [got] and c._health_calls == {1: got}
        c._health_watch(0)
        assert c._health_calls == {1: got, 0: (c._channels[0], ask)}
    finally:
        c._health_calls = {}                                          # nothing real to cancel
        c.close()


def test_a_leader_client_needs_an_address():
    for empty in ("", " ,, ", [], [" "]):
        with pytest.raises(ValueError) as err:
            LeaderClient(empty)
        assert str(err.value) == "a leader-following client needs at least one manager address"


def test_wait_readys_default_timeout_is_ten_seconds(monkeypatch):
    from kvservice.client import ha

    waited = []

    class Never:
        def set(self):
            pass

        def wait(self, timeout):
            waited.append(timeout)
            return False
    with LeaderClient([A], timeout=3.0) as c:
        monkeypatch.setattr(ha.threading, "Event", Never)
        monkeypatch.setattr(grpc, "channel_ready_future", lambda ch: Ready(ch, False))
        with pytest.raises(ClientError) as err:
            c.wait_ready()
        monkeypatch.undo()
    assert waited == [10.0] and err.value.message == f"no manager answered at {A} within 10 s"


def test_a_reply_below_epoch_zero_is_refused_too():
    """Any epoch below the highest seen is refused, even below the 0 of a client that has seen none."""
    c = LeaderClient([A, B], timeout=3.0)
    try:
        with pytest.raises(StaleLeader) as err:
            c.stream_answered(0, ((EPOCH, "-1"),))
        assert err.value.details().startswith(f"{A} answered as leader epoch -1, but epoch 0 was already seen")
        assert (c.epoch, c.stale_replies, c.current_target) == (0, 1, B)
    finally:
        c.close()
