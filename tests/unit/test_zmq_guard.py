"""The replay limiter's token buckets and the loopback rule, on a clock the test moves (no waiting)."""

from __future__ import annotations

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.events.zmq_guard import ALL_PEERS_FACTOR, ReplayLimiter, endpoint_is_local
from tests.clocks import ManualClock


def test_each_peer_has_its_own_bucket_refilled_at_the_rate():
    clock = ManualClock(100.0)
    lim = ReplayLimiter(rate=2.0, burst=3, clock=clock)
    assert [lim.allow(b"a") for _ in range(5)] == [True, True, True, False, False]
    assert [lim.allow(b"b") for _ in range(4)] == [True, True, True, False]      # a's flood costs b nothing
    clock.now += 0.5                                                              # one token back (2/s)
    assert [lim.allow(b"a") for _ in range(3)] == [True, False, False]
    clock.now += 60                                                               # full again, never more
    assert [lim.allow(b"a") for _ in range(4)] == [True, True, True, False]
    assert (lim.allowed, lim.refused) == (3 + 3 + 1 + 3, 2 + 1 + 2 + 1)


def test_a_refused_request_takes_nothing_and_rate_zero_is_the_burst_for_ever():
    clock = ManualClock(100.0)
    lim = ReplayLimiter(rate=0.0, burst=2, clock=clock)
    assert [lim.allow(b"a") for _ in range(100)].count(True) == 2
    clock.now += 10**6
    assert not lim.allow(b"a")


def test_the_peers_remembered_are_bounded():
    clock = ManualClock(100.0)
    lim = ReplayLimiter(rate=1000.0, burst=1, max_peers=8, clock=clock)
    for i in range(1000):
        clock.now += 1.0                             # the shared bucket refills; each new peer's is full
        assert lim.allow(f"peer{i}".encode())
    assert len(lim._buckets) == 8
    assert not lim.allow(b"peer999")                 # the most recent ones are still remembered


def test_many_peers_together_get_a_bounded_multiple_of_one():
    clock = ManualClock(100.0)
    lim = ReplayLimiter(rate=1.0, burst=2, clock=clock)
    got = [lim.allow(f"10.0.0.{i}".encode()) for i in range(100)]      # 100 addresses, 2 each allowed alone
    assert got.count(True) == 2 * ALL_PEERS_FACTOR
    clock.now += 1.0                                                   # the shared bucket gets 8 back
    assert [lim.allow(f"10.0.1.{i}".encode()) for i in range(20)].count(True) == ALL_PEERS_FACTOR


def test_bad_settings_are_refused():
    with pytest.raises(InvalidArgument, match="--kv-events-replay-burst >= 1"):
        ReplayLimiter(rate=1.0, burst=0)
    with pytest.raises(InvalidArgument, match="--kv-events-replay-rate must be >= 0"):
        ReplayLimiter(rate=-1.0, burst=1)


@pytest.mark.parametrize(("endpoint", "local"), [
    ("tcp://127.0.0.1:5557", True), ("tcp://127.9.9.9:*", True), ("tcp://[::1]:5557", True),
    ("tcp://localhost:5557", True), ("ipc:///run/kv.sock", True), ("inproc://kv", True),
    ("tcp://eth0;127.0.0.1:5557", True), ("tcp://*:5557", False), ("tcp://0.0.0.0:5557", False),
    ("tcp://[::]:5557", False), ("tcp://10.0.0.5:5557", False), ("tcp://eth0:5557", False),
    ("tcp://indexer:5557", False), ("ws://*:5557", False), ("not-an-endpoint", False),
])
def test_what_counts_as_loopback(endpoint, local):
    assert endpoint_is_local(endpoint) is local
