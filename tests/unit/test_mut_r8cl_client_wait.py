"""BlockManagerClient.wait_ready and _pause (kvservice/client/client.py, their docstrings): wait_ready blocks on the
channel's readiness future for `timeout` seconds (10 by default) and, when it times out, raises
ClientError(UNAVAILABLE) "no manager answered at <target> within <timeout, whole seconds> s"; _pause sleeps the
seconds a retry waits. Oracle: the timeouts handed to a recording readiness future and sleep, and the message
written out by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from kvservice.client import client as client_mod
from kvservice.client.client import BlockManagerClient
from kvservice.client.codec import ClientError


class Future:
    """grpc.channel_ready_future's result: records each wait; `ready` False times out."""

    def __init__(self, ready):
        self.ready, self.waits = ready, []

    def result(self, timeout=None):
        self.waits.append(timeout)
        if not self.ready:
            raise grpc.FutureTimeoutError()


def test_wait_ready_waits_its_timeout_on_the_channel_and_names_the_target_when_none_answers(monkeypatch):
    with BlockManagerClient("127.0.0.1:1", 4.0) as c:
        futures = []

        def ready_future(channel, ready=True):
            assert channel is c._channel
            futures.append(Future(ready))
            return futures[-1]
        monkeypatch.setattr(client_mod.grpc, "channel_ready_future", ready_future)
        assert c.wait_ready() is None and c.wait_ready(2.5) is None
        monkeypatch.setattr(client_mod.grpc, "channel_ready_future", lambda ch: ready_future(ch, False))
        with pytest.raises(ClientError) as err:
            c.wait_ready(2.6)
        with pytest.raises(ClientError) as err_default:
            c.wait_ready()
    assert [f.waits for f in futures] == [[10.0], [2.5], [2.6], [10.0]]
    assert (err.value.code, err.value.message) == (grpc.StatusCode.UNAVAILABLE,
                                                   "no manager answered at 127.0.0.1:1 within 3 s")
    assert err_default.value.message == "no manager answered at 127.0.0.1:1 within 10 s"


def test_a_pause_sleeps_the_seconds_it_is_given(monkeypatch):
    slept = []
    monkeypatch.setattr(client_mod, "time", SimpleNamespace(sleep=slept.append))
    with BlockManagerClient("127.0.0.1:1") as c:
        c._pause(0.375)
        c._pause(1.5)
    assert slept == [0.375, 1.5]


class ReadyFuture:
    """A readiness future for LeaderClient.wait_ready: `ready` ones run a done-callback at once (as grpc's do for a
    future already done); the rest never do. Records its callbacks and whether it was cancelled."""

    def __init__(self, ready):
        self.ready, self.callbacks, self.cancelled = ready, 0, False

    def add_done_callback(self, fn):
        self.callbacks += 1
        if self.ready:
            fn(self)

    def cancel(self):
        self.cancelled = True


def test_a_leader_client_is_ready_once_any_address_is_and_cancels_every_wait(monkeypatch):
    """LeaderClient.wait_ready: one address of three ready is enough (not necessarily the leader); every readiness
    wait is cancelled afterwards; none ready raises UNAVAILABLE naming every address and the timeout."""
    from kvservice.client import ha as ha_mod
    from kvservice.client.ha import LeaderClient

    addrs = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    c = LeaderClient(addrs, timeout=3.0)
    try:
        made = []

        def ready_future(channel, ready_at=1):
            made.append(ReadyFuture(len(made) % 3 == ready_at))
            return made[-1]
        monkeypatch.setattr(ha_mod.grpc, "channel_ready_future", ready_future)
        assert c.wait_ready(5.0) is None
        assert [(f.ready, f.callbacks, f.cancelled) for f in made] == [(False, 1, True), (True, 1, True),
                                                                       (False, 1, True)]
        made.clear()
        monkeypatch.setattr(ha_mod.grpc, "channel_ready_future", lambda ch: ready_future(ch, ready_at=-1))
        with pytest.raises(ClientError) as err:
            c.wait_ready(0.2)
        assert all(f.cancelled and f.callbacks == 1 for f in made) and len(made) == 3
        assert (err.value.code, err.value.message) == (grpc.StatusCode.UNAVAILABLE,
                                                       f"no manager answered at {c.target} within 0 s")
        assert c.target == ",".join(addrs)
    finally:
        c.close()
