"""CallBudget.pause_or_raise at its edges (kvservice/client/deadline.py), on a hand-moved clock: a deadline with
2 * MIN_ATTEMPT_SECONDS (10 ms) or less left is not worth another attempt (given up), more is; and the failover
bound applies to a call that met no manager even when the UNAVAILABLE status carried no message.
"""

from __future__ import annotations

import grpc
import pytest

from kvservice.client import deadline
from kvservice.client.codec import ClientError
from kvservice.client.deadline import CallBudget, RetryPolicy
from tests.clocks import ManualClock


@pytest.fixture
def clock(monkeypatch) -> ManualClock:
    c = ManualClock(0.0)
    monkeypatch.setattr(deadline, "clock", c)
    return c


def _down(message="down"):
    return ClientError(grpc.StatusCode.UNAVAILABLE, message)


@pytest.mark.parametrize("timeout, gives_up", [(0.01, True), (0.008, True), (0.012, False), (0.02, False)])
def test_a_deadline_with_ten_ms_or_less_left_is_given_up(clock, timeout, gives_up):
    b = CallBudget(RetryPolicy(initial_backoff=1.0, max_backoff=1.0), timeout, "Echo", None)
    b.attempt_timeout()
    if gives_up:
        with pytest.raises(ClientError) as err:
            b.pause_or_raise(_down())
        assert err.value.reason == "RETRIES_EXHAUSTED"
    else:                                                         # the backoff, cut to what the deadline leaves
        assert b.pause_or_raise(_down()) == pytest.approx(timeout - 0.005)


def test_the_failover_bound_applies_after_an_unavailable_without_a_message(clock):
    b = CallBudget(RetryPolicy(initial_backoff=0.01, max_backoff=0.01, failover=5.0), 1.0, "Echo", None)
    b.attempt_timeout()
    clock.now = 0.5
    assert 0.005 <= b.pause_or_raise(_down("")) <= 0.01
    assert b.deadline == 5.0 and b.remaining() == 4.5
