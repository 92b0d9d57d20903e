"""NatsLink's connection set-up, with nats.connect replaced by a recorder (kvservice/state/nats/link.py): one
nats-py connection to every configured server, named after the client, reconnecting forever (every 0.1 s, 1 s per
attempt) and pinging every 2 s (two unanswered pings: the connection is dead), with this link's callbacks; its
JetStream context waits request_seconds; the journal's direct connection is named <client>-journal and connects
within request_seconds; the server's version reads as MAJOR.MINOR.PATCH, or as it was given when not one."""

from __future__ import annotations

import secrets
import threading
from types import SimpleNamespace

import pytest
from nats.aio.client import ServerVersion

import kvservice.state.nats.link as link_module
from kvservice.state.nats.config import NatsConfig, StoreError
from kvservice.state.nats.link import NatsLink
from tests.clocks import until


class FakeNC:
    def __init__(self, version: str) -> None:
        self.connected_server_version = ServerVersion(version)
        self.is_closed, self.js_timeouts = False, []

    def jetstream(self, timeout):
        self.js_timeouts.append(timeout)
        return SimpleNamespace(timeout=timeout)

    async def close(self):
        self.is_closed = True


@pytest.mark.parametrize(("version", "shown"), [("2.10.22", "2.10.22"), ("v-dev", None)])
def test_the_link_connects_once_with_the_documented_options(monkeypatch, version, shown):
    seen = []
    nc = FakeNC(version)

    async def connect(**kw):
        seen.append(kw)
        return nc
    monkeypatch.setattr(link_module.nats, "connect", connect)
    request_seconds = 1.0 + secrets.randbelow(5)
    config = NatsConfig(("nats://127.0.0.1:1", "nats://127.0.0.1:2"), name="t" + secrets.token_hex(4),
                        request_seconds=request_seconds, append_seconds=30.0)
    name = "client-" + secrets.token_hex(3)
    lk = NatsLink(config, client_name=name, connect_seconds=5.0)
    try:
        (kw,) = seen
        callbacks = {k: kw.pop(k) for k in ("error_cb", "disconnected_cb", "reconnected_cb")}
        assert kw == {"servers": ["nats://127.0.0.1:1", "nats://127.0.0.1:2"], "name": name, "connect_timeout": 1,
                      "reconnect_time_wait": 0.1, "max_reconnect_attempts": -1, "ping_interval": 2,
                      "max_outstanding_pings": 2, "allow_reconnect": True}
        assert callbacks == {"error_cb": lk._on_error, "disconnected_cb": lk._on_disconnect,
                             "reconnected_cb": lk._on_reconnect}
        assert lk.nc is nc and nc.js_timeouts == [request_seconds] and lk.js.timeout == request_seconds
        assert (lk.direct.name, lk.direct.servers, lk.direct.connect_seconds) == (
            f"{name}-journal", config.servers, request_seconds)
        assert lk.server_version == (shown if shown is not None else repr(nc.connected_server_version))
        assert (lk.disconnects, lk.closing, lk.last_error) == (0, False, None)
    finally:
        lk.close()
    assert nc.is_closed and lk.closing and lk.loop.is_closed()


def test_the_defaults_name_the_client_kvservice_and_wait_fifteen_seconds_for_the_connection(monkeypatch):
    """NatsLink(config): client "kvservice" (direct: "kvservice-journal"), one call "connecting" waited
    connect_seconds (10) + 5 s; the loop runs on a daemon thread named nats-loop."""
    seen, calls = [], []
    original = NatsLink.call

    def recording_call(self, coro, timeout, what="a request"):
        calls.append((timeout, what))
        return original(self, coro, timeout, what)

    async def connect(**kw):
        seen.append(kw)
        return FakeNC("2.10.22")
    monkeypatch.setattr(link_module.nats, "connect", connect)
    monkeypatch.setattr(NatsLink, "call", recording_call)
    lk = NatsLink(NatsConfig(("nats://127.0.0.1:1",), name="t" + secrets.token_hex(4)))
    try:
        assert seen[0]["name"] == "kvservice" and lk.direct.name == "kvservice-journal"
        assert calls == [(15.0, "connecting")]
        assert (lk._thread.name, lk._thread.daemon) == ("nats-loop", True)
    finally:
        lk.close()


def test_a_failed_connection_stops_the_loop_it_started(monkeypatch):
    async def refuse(**kw):
        raise OSError("connection refused here")
    monkeypatch.setattr(link_module.nats, "connect", refuse)

    def loops():
        return [t for t in threading.enumerate() if t.name == "nats-loop" and t.is_alive()]
    before = len(loops())
    with pytest.raises(StoreError, match=r"^cannot reach NATS at nats://127.0.0.1:1: connecting gave up after 0.5 s "):
        NatsLink(NatsConfig(("nats://127.0.0.1:1",), name="t" + secrets.token_hex(4)), connect_seconds=0.5)
    assert until(lambda: len(loops()) == before, 10.0)
