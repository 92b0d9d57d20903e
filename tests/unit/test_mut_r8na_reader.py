"""StreamReader's catch-up pacing and message taking on stand-ins (kvservice/state/nats/reader.py docstrings,
CATCH_UP_WAIT = (0.2, 2.0)): a catch-up that gets nothing waits 0.2 s first and doubles the wait after each empty
poll up to 2 s (hand-computed: 0.2, 0.4, 0.8, 1.6, 2.0, 2.0), logging each restart of its consumer; the stream's
first and last sequences are read from its info; _take returns [] when nothing comes within its wait, and at most
max_messages of what is queued."""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from types import SimpleNamespace

from kvservice.state.nats.reader import CATCH_UP_WAIT
from tests.unit.test_mut_r7nats_reader import _reader


def test_an_empty_catch_up_doubles_its_wait_up_to_two_seconds_and_says_so(caplog):
    r = _reader()
    last = 5 + secrets.randbelow(100)
    r.last_stream_seq, r.seq, r.path = 3, 3, "nats://x (stream S)"
    waits, stops = [], []

    def poll(wait, strict=True):
        waits.append(wait)
        if len(waits) == 7:
            r.last_stream_seq = last
            return ["e"]
        return []

    def call(coro, timeout=None, what="a request"):
        coro.close()
        return 1
    r.stream_last_seq, r.poll, r._call, r.stop_reading = (lambda: last), poll, call, lambda: stops.append(1)
    with caplog.at_level(logging.INFO, logger="kvservice.nats"):
        assert list(r.catch_up()) == ["e"]
    assert CATCH_UP_WAIT == (0.2, 2.0)
    assert waits == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0] and len(stops) == 6
    said = [rec.getMessage() for rec in caplog.records if "nothing delivered" in rec.getMessage()]
    assert said == [f"nats://x (stream S): nothing delivered for {w:.1f} s at message 3 of {last}; reading on with "
                    "a new consumer" for w in (0.2, 0.4, 0.8, 1.6, 2.0, 2.0)]


def test_the_streams_first_and_last_sequences_come_from_its_info():
    r = _reader()
    first, last = 1 + secrets.randbelow(50), 100 + secrets.randbelow(50)
    asked = []

    async def stream_info(name):
        asked.append(name)
        return SimpleNamespace(state=SimpleNamespace(first_seq=first, last_seq=last))
    r.link.js = SimpleNamespace(stream_info=stream_info)
    assert asyncio.run(r._stream_first_seq()) == first
    assert asyncio.run(r._stream_last_seq()) == last
    assert asked == [r.config.stream] * 2


def test_take_returns_nothing_after_its_wait_and_at_most_max_messages():
    r = _reader()

    async def go():
        r._wake, r._inbox = asyncio.Event(), collections.deque()
        empty = await r._take(0.01, 5)
        r._inbox.extend(["m1", "m2", "m3"])
        return empty, await r._take(0.01, 2), await r._take(0.01, 2)
    assert asyncio.run(go()) == ([], ["m1", "m2"], ["m3"])
