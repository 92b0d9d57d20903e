"""AsyncLeaderClient's pause between attempts and its close (kvservice/client/aio_ha.py), on addresses never dialled.

The pause (as LeaderClient._pause, ha.py's module doc): the backoff, ended early once an address reports SERVING
after the last break (the next attempt then goes there), not at all if one already did, and never on a closed
client; close() ends every pause in progress, cancels the readiness watches and closes every address's channel.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvservice.client.aio_ha import AsyncLeaderClient

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
LONG = 600.0                         # a pause no test waits out: only a report or close() ends it


async def _started(coro):
    task = asyncio.ensure_future(coro)
    for _ in range(5):
        await asyncio.sleep(0)
    return task


def test_a_serving_report_ends_the_pause_and_sends_the_next_attempt_there():
    async def run():
        c = AsyncLeaderClient([A, B, C], timeout=3.0)
        try:
            c._rotate(0)                                       # a call broke on A: the next goes to B
            assert c.current_target == B and not c._report_due()
            pauses = [await _started(c._pause(LONG)) for _ in range(2)]
            assert len(c._waiters) == 2 and not any(p.done() for p in pauses)
            c._reported_serving(2)
            await asyncio.wait_for(asyncio.gather(*pauses), 30)
            assert (c.current_target, c.serving_reports, c._waiters) == (C, 1, set())
            assert c._report_due()
            await asyncio.wait_for(c._pause(LONG), 30)          # a report came after the break: no pause at all
            assert c._waiters == set()
            c._rotate(2)
            assert c.current_target == A and not c._report_due()
            await c._pause(0.001)                              # no report: the whole (short) backoff, then on
            assert c._waiters == set() and c.current_target == A
        finally:
            for t in c._watchers:
                t.cancel()
            await c.close()
    asyncio.run(run())


def test_close_ends_every_pause_cancels_the_watches_and_closes_every_channel():
    async def run():
        c = AsyncLeaderClient([A, B], timeout=3.0)
        c._rotate(0)                                           # starts the readiness watches
        watchers = list(c._watchers)
        assert len(watchers) == 2
        pause = await _started(c._pause(LONG))
        await c.close()
        await asyncio.wait_for(pause, 30)
        assert c._closed and c._report_due()
        await asyncio.wait_for(c._pause(LONG), 30)              # a closed client never waits
        await asyncio.gather(*watchers, return_exceptions=True)
        assert all(t.cancelled() or t.done() for t in watchers)
        for ch in c._channels:
            with pytest.raises(grpc.aio.UsageError):
                await ch.unary_unary("/kvservice.v1.BlockManager/Echo")(b"")
    asyncio.run(run())
