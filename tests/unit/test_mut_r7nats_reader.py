"""StreamReader's consumer set-up on a recording stand-in JetStream context (kvservice/state/nats/reader.py): poll
subscribes once, at max(1, first_stream_seq, last_stream_seq + 1), through one link.call waited max(10 s, 3 x
request_seconds) and named "subscribing to the journal stream"; _subscribe asks for an ordered consumer of the
journal subject ON THE JOURNAL STREAM (named: no lookup of the stream by subject) delivering from that stream
sequence, with a callback that queues each message and wakes the reader."""

from __future__ import annotations

import asyncio
import collections
import secrets

import pytest
from nats.js import api

from kvservice.state.nats.config import NatsConfig
from kvservice.state.nats.reader import StreamReader


class RecordingJS:
    def __init__(self) -> None:
        self.subscribed = []

    async def subscribe(self, subject, **kw):
        self.subscribed.append((subject, kw))
        return ("subscription", len(self.subscribed))


class Link:
    def __init__(self, config: NatsConfig) -> None:
        self.config, self.js = config, RecordingJS()


def _reader(request_seconds: float = 2.0) -> StreamReader:
    r = StreamReader()
    r.config = NatsConfig(("nats://127.0.0.1:4222",), name="t" + secrets.token_hex(5),
                          request_seconds=request_seconds, append_seconds=max(15.0, request_seconds))
    r.link = Link(r.config)
    r._inbox, r._wake, r._sub = collections.deque(["stale"]), None, None
    return r


def test_subscribe_asks_for_an_ordered_consumer_on_the_named_stream_from_the_given_sequence():
    r = _reader()
    start = 2 + secrets.randbelow(10_000)
    asyncio.run(r._subscribe(start))
    ((subject, kw),) = r.link.js.subscribed
    assert subject == f"kvs.{r.config.name}.journal"
    assert set(kw) == {"cb", "ordered_consumer", "stream", "config"}
    assert kw["ordered_consumer"] is True and kw["stream"] == f"KVS_{r.config.name}"
    cfg = kw["config"]
    assert (cfg.deliver_policy, cfg.opt_start_seq) == (api.DeliverPolicy.BY_START_SEQUENCE, start)
    assert r._sub == ("subscription", 1) and list(r._inbox) == []      # what an older consumer queued is gone
    assert not r._wake.is_set()
    msgs = [object(), object()]
    for m in msgs:
        asyncio.run(kw["cb"](m))
    assert list(r._inbox) == msgs and r._wake.is_set()


@pytest.mark.parametrize(("first", "last", "start"), [(0, 0, 1), (5, 0, 5), (5, 9, 10), (12, 11, 12), (0, 3, 4)])
@pytest.mark.parametrize(("request_seconds", "wait"), [(2.0, 10.0), (4.5, 13.5)])
def test_poll_subscribes_once_from_the_first_unread_stream_sequence(first, last, start, request_seconds, wait):
    r = _reader(request_seconds)
    r.first_stream_seq, r.last_stream_seq, r.pending = first, last, None
    calls = []

    def call(coro, timeout=None, what="a request"):
        calls.append((coro.__qualname__, timeout, what))
        if coro.__qualname__.endswith("_subscribe"):
            return asyncio.run(coro)
        coro.close()
        return []
    r._call = call
    assert r.poll(0.25) == [] and r.pending is None
    assert calls[0] == ("StreamReader._subscribe", wait, "subscribing to the journal stream")
    assert calls[1] == ("StreamReader._take", 0.25 + request_seconds + 1.0, "reading the journal stream")
    assert r.link.js.subscribed[0][1]["config"].opt_start_seq == start
    assert r.poll(0.5) == [] and len(r.link.js.subscribed) == 1 and len(calls) == 3


def test_poll_decodes_what_arrived_and_counts_what_is_still_pending():
    """The messages a take returned are decoded in order (fences and incomplete parts give no entry); pending is
    the server's count after the last one plus what this reader has queued; the take asks for up to 1024."""
    import threading

    from .test_mut_r7nats_decode import _entry, _msg

    r = _reader()
    r.path, r.seq, r.last_stream_seq, r.first_stream_seq, r.lineage, r.max_epoch = "p", 0, 0, 1, 0, 0
    r._parts, r._stream_at, r._at_lock, r._sub = None, {}, threading.Lock(), "subscribed"
    msgs = [_msg(1, {"Kvs-Kind": "fence", "Kvs-Epoch": "2"}), _entry(2, 1, "0/1", b"one"),
            _entry(3, 2, "0/2", b"t"), _entry(4, 2, "1/2", b"wo")]
    msgs[-1].metadata.num_pending = 7
    r._inbox.clear()
    r._inbox.extend(["queued", "queued"])
    asked = []

    def take(wait, max_messages):          # what poll asks the take for (mutmut wraps _take, so not its frame)
        asked.append({"wait": wait, "max_messages": max_messages})

        async def nothing():
            return msgs
        return nothing()

    def call(coro, timeout=None, what="a request"):
        coro.close()
        return msgs
    r._take, r._call = take, call
    got = r.poll(0.5)
    assert [(e.seq, e.request) for e in got] == [(1, b"one"), (2, b"two")]
    assert r.pending == 9 and r.max_epoch == 2 and r.last_stream_seq == 4
    assert (asked[0]["wait"], asked[0]["max_messages"]) == (0.5, 1024)
    r.poll(0.5, max_messages=3)
    assert asked[1]["max_messages"] == 3


def test_poll_is_strict_unless_told():
    """poll's default is strict (a standby's tail): an entry that does not follow is a JournalGap; strict=False
    passes it on (recovery: the journal refuses the gap)."""
    import threading

    from kvservice.state.nats.config import JournalGap

    from .test_mut_r7nats_decode import _entry

    def reader():
        r = _reader()
        r.path, r.seq, r.last_stream_seq, r.first_stream_seq, r.lineage, r.max_epoch = "p", 0, 0, 1, 0, 0
        r._parts, r._stream_at, r._at_lock, r._sub = None, {}, threading.Lock(), "subscribed"
        r._snapshot_newer_than = lambda s: False
        msg = _entry(1, 3, "0/1", b"x")
        msg.metadata.num_pending = 0

        def call(coro, timeout=None, what="a request"):
            coro.close()
            return [msg]
        r._call = call
        return r
    with pytest.raises(JournalGap):
        reader().poll(0.1)
    assert [e.seq for e in reader().poll(0.1, strict=False)] == [3]
