"""The asyncio clients (kvservice/client/aio.py, aio_ha.py) seen from outside, on loopback gRPC: what each attempt
of a call carries (read by a grpc.aio interceptor, as the AsyncBlockManagerClient doc says tests do), the failover
bound of deadline.py's doc ("a call that met no manager keeps trying until failover seconds after it started"),
one channel per address, all closed by close(), and the readiness watch's doubling pauses (ha.py HEALTH_RETRY:
0.05 s doubling up to 1 s), read from the pauses asked for, not timed."""

from __future__ import annotations

import asyncio
import socket

import grpc
import numpy as np
import pytest

from kvservice.client import aio_ha
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.aio_ha import AsyncLeaderClient
from kvservice.client.codec import ClientError
from kvservice.client.deadline import RetryPolicy

ECHO = "/kvservice.v1.BlockManager/Echo"
DELETE = "/kvservice.v1.BlockManager/DeletePool"
FAST = RetryPolicy(initial_backoff=0.01, max_backoff=0.02)


def _dead_address() -> str:
    """An address nothing listens on (a port the kernel just handed out and that was closed again)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


class Enough(Exception):
    """Ends a call from its interceptor once enough attempts were seen."""


class Record(grpc.aio.UnaryUnaryClientInterceptor):
    """Each attempt: (method, timeout, metadata, request); raises Enough at attempt `stop` (0: never)."""

    def __init__(self, stop: int = 0) -> None:
        self.stop = stop
        self.attempts: list[tuple] = []

    async def intercept_unary_unary(self, continuation, details, request):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        self.attempts.append((method, details.timeout, tuple(details.metadata or ()), request))
        if len(self.attempts) == self.stop:
            raise Enough
        return await continuation(details, request)


def test_each_attempt_carries_the_method_the_token_one_request_id_and_what_remains_of_the_deadline():
    rec = Record()
    token = "tok-" + np.random.default_rng(5).bytes(8).hex()

    async def run() -> ClientError:
        async with AsyncBlockManagerClient(_dead_address(), timeout=1.0, token=token, retry=FAST,
                                           interceptors=[rec]) as c:
            with pytest.raises(ClientError) as err:
                await c.delete_pool("p-7", force=True)
            return err.value
    err = asyncio.run(run())
    assert err.code == grpc.StatusCode.UNAVAILABLE and len(rec.attempts) >= 2
    rid = rec.attempts[0][3].request_id
    assert rid and err.request_id == rid
    for method, timeout, metadata, request in rec.attempts:
        assert (method, request.pool, request.force, request.request_id) == (DELETE, "p-7", True, rid)
        assert ("authorization", f"Bearer {token}") in metadata
        assert 0 < timeout <= 1.0
    timeouts = [a[1] for a in rec.attempts]
    assert timeouts == sorted(timeouts, reverse=True)          # each attempt gets what remains, never more


def test_the_failover_bound_keeps_a_call_that_met_no_manager_trying_past_its_timeout():
    async def attempts(**kw) -> list[float]:
        rec = Record(stop=3)
        async with AsyncBlockManagerClient(_dead_address(), timeout=0.3, retry=FAST, interceptors=[rec], **kw) as c:
            with pytest.raises((Enough, ClientError)):
                await c.echo(b"x")
        assert all(a[0] == ECHO for a in rec.attempts)
        return [a[1] for a in rec.attempts]
    with_failover = asyncio.run(attempts(failover=8.0))
    # First attempt: within the call's 0.3 s; once it met no manager, the deadline is 8 s after the start.
    assert len(with_failover) == 3 and with_failover[0] <= 0.3 and min(with_failover[1:]) > 2.0
    without = asyncio.run(attempts())
    assert max(without) <= 0.3


def test_a_leader_client_opens_one_channel_per_address_and_closes_every_one(monkeypatch):
    made: list = []
    real = grpc.aio.insecure_channel

    def spy(*args, **kwargs):
        ch = real(*args, **kwargs)
        made.append((args[0], ch))
        return ch
    monkeypatch.setattr(grpc.aio, "insecure_channel", spy)
    targets = [_dead_address(), _dead_address(), _dead_address()]

    async def run() -> None:
        c = AsyncLeaderClient(targets, timeout=5)
        assert [t for t, _ in made] == targets          # one channel per address, none for the joined string
        await c.close()
        for _, ch in made:                               # closed: a call on it is refused at once
            with pytest.raises(grpc.aio.UsageError):
                await ch.unary_unary(ECHO)(b"")
    asyncio.run(run())


def test_the_async_readiness_watch_pauses_double_up_to_the_maximum(monkeypatch):
    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def run() -> None:
        c = AsyncLeaderClient(_dead_address(), timeout=5)
        done = asyncio.Event()

        async def sleep(delay, *args):
            if asyncio.current_task() in c._watchers:
                pauses.append(delay)
                if len(pauses) == 8:
                    done.set()
                return await real_sleep(0)
            return await real_sleep(delay, *args)
        monkeypatch.setattr(aio_ha.asyncio, "sleep", sleep)
        try:
            c._watch_health()
            await asyncio.wait_for(done.wait(), 60)
        finally:
            await c.close()
            monkeypatch.setattr(aio_ha.asyncio, "sleep", real_sleep)
    asyncio.run(run())
    assert pauses[:8] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
