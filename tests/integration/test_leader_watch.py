"""LeaderClient waits out a failover on the addresses' readiness, not on its backoff (kvservice/client/ha.py).

After a call breaks, the client watches every address's grpc.health.v1 status of the BlockManager
service; a report of SERVING after the break ends the pause before the next attempt and sends it
there. Two in-process managers behind the leader gate (server/leader_gate.py) stand for a standby
and a leader; no NATS is needed: what is tested is the client. The backoff is 10 minutes, so a call
that finishes within the join bound was woken by the report (progress is counted, never timed).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvservice.client.deadline import RetryPolicy
from kvservice.client.ha import LeaderClient
from kvservice.server.app import SERVICE_NAME, serve
from kvservice.server.leader_gate import LeaderGate

#: A pause no test waits out: only a SERVING report can end it.
SLOW = RetryPolicy(initial_backoff=600.0, max_backoff=600.0, grpc_attempts=1, failover=1200.0)


class Counted(grpc.UnaryUnaryClientInterceptor):
    def __init__(self) -> None:
        self.sent = 0

    def intercept_unary_unary(self, continuation, client_call_details, request):
        self.sent += 1
        return continuation(client_call_details, request)


def manager(node: str) -> tuple:
    """A manager that refuses every BlockManager call UNAVAILABLE (a standby) until promote(); health NOT_SERVING."""
    gate = LeaderGate()
    gate.node = node
    return serve("127.0.0.1:0", interceptors=[gate], serving=False), gate


def take_over(running, gate: LeaderGate, epoch: int) -> None:
    """What HAController._take_over does last: the gate lets calls through, readiness turns SERVING."""
    gate.promote(epoch)
    running.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)


def until(cond, what: str, bound: float = 60.0) -> None:
    deadline = time.monotonic() + bound
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def managers():
    made = [manager("a"), manager("b")]
    yield made
    for running, _ in made:
        running.stop(0)


def test_a_call_waiting_out_a_failover_is_answered_once_a_standby_reports_serving(managers):
    (a, _), (b, gate_b) = managers
    counted = Counted()
    with LeaderClient([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], timeout=1200, retry=SLOW,
                      interceptors=[counted]) as c:
        got: dict = {}
        th = threading.Thread(target=lambda: got.update(reply=c.echo(b"x")), daemon=True)
        th.start()
        until(lambda: counted.sent == 1 and len(c._health_calls) == 2, "a refused, both addresses watched")
        assert c.serving_reports == 0 and th.is_alive()           # nobody serves: the call pauses
        take_over(b, gate_b, epoch=7)
        th.join(60)
        assert not th.is_alive(), "the pause outlasted b's SERVING report"
        assert got["reply"] == b"x" and c.epoch == 7 and c.leader_node == "b"
        assert counted.sent == 2 and c.serving_reports == 1       # one attempt after the report, at b


def test_a_serving_report_from_before_the_break_does_not_end_the_pause(managers):
    """A leader whose lease lapsed (cut off from NATS) still reports SERVING but refuses: the client tries it
    once on that report, then waits for a later one (no spin between a stale report and its refusals)."""
    (a, gate_a), (b, gate_b) = managers
    take_over(a, gate_a, epoch=3)
    gate_a.valid = lambda: False                                  # lapsed: refuses UNAVAILABLE
    counted = Counted()
    with LeaderClient([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], timeout=1200, retry=SLOW,
                      interceptors=[counted]) as c:
        got: dict = {}
        th = threading.Thread(target=lambda: got.update(reply=c.echo(b"y")), daemon=True)
        th.start()
        until(lambda: c.serving_reports == 1 and counted.sent == 2, "a reported SERVING and was tried again")
        time.sleep(0.5)                                           # a spinning client would send more meanwhile
        assert counted.sent == 2 and th.is_alive()
        take_over(b, gate_b, epoch=4)
        th.join(60)
        assert not th.is_alive(), "the pause outlasted b's SERVING report"
        assert got["reply"] == b"y" and c.epoch == 4 and counted.sent == 3


def test_close_ends_the_watches_and_a_pause():
    running, _ = manager("a")
    try:
        c = LeaderClient(f"127.0.0.1:{running.port}", timeout=1200, retry=SLOW)
        got: dict = {}

        def call() -> None:
            try:
                c.echo()
            except Exception as err:            # the channel closed under it
                got["error"] = err
        th = threading.Thread(target=call, daemon=True)
        th.start()
        until(lambda: len(c._health_calls) == 1, "the address watched")
        c.close()
        th.join(60)
        assert not th.is_alive() and "error" in got
        for w in c._watchers:
            w.join(60)
            assert not w.is_alive()
    finally:
        running.stop(0)


def test_the_asyncio_client_is_answered_once_a_standby_reports_serving(managers):
    """AsyncLeaderClient, the same: a call waits for the report, not for its 10-minute backoff."""
    import asyncio

    from kvservice.client.aio_ha import AsyncLeaderClient
    (a, _), (b, gate_b) = managers
    targets = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]

    async def main() -> tuple[bytes, int, int]:
        c = AsyncLeaderClient(targets, timeout=1200, retry=SLOW)
        try:
            call = asyncio.ensure_future(c.echo(b"z"))
            for _ in range(6000):                                 # a refused, both addresses watched
                if len(c._health_calls) == 2 or call.done():
                    break
                await asyncio.sleep(0.01)
            assert len(c._health_calls) == 2 and not call.done() and c.serving_reports == 0
            await asyncio.sleep(0.2)
            assert not call.done()                                 # nobody serves: the call pauses
            take_over(b, gate_b, epoch=9)
            reply = await asyncio.wait_for(call, 60)
            return reply, c.epoch, c.serving_reports
        finally:
            await c.close()
    reply, epoch, reports = asyncio.run(main())
    assert reply == b"z" and epoch == 9 and reports == 1
