"""The readiness watch's backoff (LeaderClient._health_loop in kvservice/client/ha.py and its asyncio twin in
aio_ha.py): after a watch breaks, wait 50 ms, then twice as long after each further break, at most 1 s; a watch that
delivered a message starts over from 50 ms; a closed client stops watching.

Oracle: the delays worked out by hand from that rule for a scripted sequence of broken watches (below), recorded by
a stand-in for the wait each loop makes (asyncio.sleep; the condition's wait_for).
"""

from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2

from kvservice.client import aio_ha
from kvservice.client.aio_ha import AsyncLeaderClient
from kvservice.client.ha import LeaderClient
from tests.support_client import RpcErr

A, B = "127.0.0.1:1", "127.0.0.1:2"
SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
# Watch k (1-based) breaks at once, except watch 4, which first delivers one SERVING message.
# Waits: 0.05, 0.1, 0.2 (doubling), then 0.05 after watch 4 (a message came), then doubling up to the 1 s cap.
EXPECTED = [0.05, 0.1, 0.2, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def _broken():
    return RpcErr(grpc.StatusCode.UNAVAILABLE, "connection refused")


def test_the_async_watch_backs_off_doubling_to_one_second_and_restarts_after_a_message(monkeypatch):
    waits: list = []
    real_sleep = asyncio.sleep

    async def run():
        c = AsyncLeaderClient([A, B], timeout=3.0)
        watches = []

        async def watch(index):
            watches.append(index)
            if len(watches) == 4:
                yield SERVING
            raise _broken()

        async def sleep(delay, *args):
            waits.append(delay)
            if len(waits) == len(EXPECTED):
                c._closed = True
            await real_sleep(0)

        c._health_watch = watch
        monkeypatch.setattr(aio_ha.asyncio, "sleep", sleep)
        try:
            await asyncio.wait_for(c._health_loop(1), 30)
        finally:
            monkeypatch.setattr(aio_ha.asyncio, "sleep", real_sleep)
            c._closed = False
            await c.close()
        return watches, c.serving_reports

    watches, reports = asyncio.run(run())
    assert waits == EXPECTED
    assert watches == [1] * len(EXPECTED) and reports == 1


class _Recording(threading.Condition):
    """The client's condition, with wait_for recording its timeout and returning at once."""

    def __init__(self, client, waits):
        super().__init__()
        self.client, self.waits = client, waits

    def wait_for(self, predicate, timeout=None):
        self.waits.append(timeout)
        if len(self.waits) == len(EXPECTED):
            self.client._closed = True
        return predicate()


def test_the_sync_watch_backs_off_doubling_to_one_second_and_restarts_after_a_message():
    c = LeaderClient([A, B], timeout=3.0)
    waits: list = []
    watches = []

    def watch(index):
        watches.append(index)
        if len(watches) == 4:
            yield SERVING
        raise _broken()

    c._health_watch = watch
    c._serving = _Recording(c, waits)
    c._health_loop(0)
    assert waits == EXPECTED
    assert watches == [0] * len(EXPECTED) and c.serving_reports == 1
    c._closed = False
    c.close()
