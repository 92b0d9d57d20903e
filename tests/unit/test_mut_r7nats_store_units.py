"""NatsStore's routing of appends, on stand-ins (kvservice/state/nats/journal.py, prefer_stream_leader and
_relearn_stream_leader docstrings): the stream's info is read with one call named "reading the stream's leader"
(the default wait), and the direct connection is told to prefer the server the info names as the stream's Raft
leader, or any server (None) when the stream reports no cluster; a relearning whose reading fails (the store
closed meanwhile) logs that at DEBUG, naming the store and the error, and a later relearning can run again."""

from __future__ import annotations

import logging
import secrets
import threading
from types import SimpleNamespace

from kvservice.state.nats.journal import NatsStore
from tests.clocks import until


class Direct:
    def __init__(self) -> None:
        self.preferred = []

    def prefer(self, name):
        self.preferred.append(name)


def _store(info):
    calls = []
    stream = "KVS_t" + secrets.token_hex(3)

    def call(coro, timeout=None, what="a request"):
        calls.append((coro, timeout, what))
        return info
    link = SimpleNamespace(js=SimpleNamespace(stream_info=lambda name: ("stream_info", name)), direct=Direct())
    return SimpleNamespace(_call=call, link=link, config=SimpleNamespace(stream=stream), path="p"), calls


def test_the_stream_leader_the_info_names_is_preferred():
    leader = "n-" + secrets.token_hex(3)
    store, calls = _store(SimpleNamespace(cluster=SimpleNamespace(leader=leader)))
    NatsStore.prefer_stream_leader(store)
    assert calls == [(("stream_info", store.config.stream), None, "reading the stream's leader")]
    assert store.link.direct.preferred == [leader]


def test_a_stream_without_cluster_info_is_published_to_through_any_server():
    store, calls = _store(SimpleNamespace(cluster=None))
    NatsStore.prefer_stream_leader(store)
    assert store.link.direct.preferred == [None] and len(calls) == 1


def test_a_failed_relearning_is_logged_at_debug_and_frees_the_next_one(caplog):
    why = "loop gone " + secrets.token_hex(3)
    ran = []

    def fail():
        ran.append(threading.current_thread().name)
        raise RuntimeError(why)
    store = SimpleNamespace(_relearning=threading.Lock(), path="nats://x (stream S)", prefer_stream_leader=fail)
    with caplog.at_level(logging.DEBUG, logger="kvservice.nats"):
        NatsStore._relearn_stream_leader(store)
        assert until(lambda: ran and not store._relearning.locked(), 30.0)
        NatsStore._relearn_stream_leader(store)
        assert until(lambda: len(ran) == 2 and not store._relearning.locked(), 30.0)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvservice.nats"]
    assert said == [(logging.DEBUG, f"nats://x (stream S): stream leader not read again: {why}")] * 2
    assert ran == ["kvs-stream-leader"] * 2
