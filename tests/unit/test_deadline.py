"""CallBudget's arithmetic on a fake clock, and RetryPolicy as a gRPC service config (kvservice/client/deadline.py)."""

from __future__ import annotations

import json

import grpc
import pytest

from kvservice.client import deadline
from kvservice.client.codec import ClientError
from kvservice.client.deadline import CallBudget, RetryPolicy, client_policy
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import worker_pb2 as wpb
from tests.clocks import ManualClock

UNAVAILABLE = ClientError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; Connection refused")
EXPIRED = ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")




@pytest.fixture
def clock(monkeypatch) -> ManualClock:
    c = ManualClock(100.0)
    monkeypatch.setattr(deadline, "clock", c)
    return c


def run(budget: CallBudget, clock: ManualClock, fail_after: float, err: ClientError = UNAVAILABLE,
        ) -> tuple[list[tuple[float, float]], ClientError]:
    """Attempts that each fail `fail_after` seconds after being sent (or at their deadline, if sooner), the pauses
    slept on the fake clock; the (send time, timeout) of every attempt and the final error."""
    sent = []
    while True:
        t = budget.attempt_timeout()
        sent.append((clock.now, t))
        clock.now += min(fail_after, t)
        try:
            clock.now += budget.pause_or_raise(err if fail_after < t else EXPIRED)
        except ClientError as final:
            return sent, final


def test_every_attempt_gets_what_remains_and_the_call_ends_at_its_deadline(clock):
    budget = CallBudget(RetryPolicy(), 2.0, "Step", "rid-1", target="10.0.0.1:50051")
    sent, err = run(budget, clock, fail_after=0.3)
    assert len(sent) > 2
    for at, timeout in sent:
        assert at + timeout == pytest.approx(102.0)          # each attempt: what the 2 s had left
    assert clock.now <= 102.0 + 1e-9                         # pauses never run past the deadline
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.reason == "RETRIES_EXHAUSTED"
    assert "Step to 10.0.0.1:50051: no manager answered within its 2 s deadline" in err.message
    assert "Connection refused" in err.message and "request_id='rid-1'" in err.message


def test_a_slow_manager_ends_the_call_at_its_timeout_even_with_a_failover_bound(clock):
    budget = CallBudget(RetryPolicy(failover=30.0), 2.0, "Step", None)
    sent, err = run(budget, clock, fail_after=10.0)           # the manager never answers in time
    assert sent == [(100.0, 2.0)] and clock.now == 102.0
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "no reply within its 2 s deadline" in err.message


def test_the_failover_bound_applies_once_the_call_met_no_manager(clock):
    budget = CallBudget(RetryPolicy(failover=10.0), 2.0, "Step", None)
    sent, err = run(budget, clock, fail_after=0.4)
    assert sent[0] == (100.0, 2.0)                            # sent under the timeout...
    assert all(at + t == pytest.approx(110.0) for at, t in sent[1:])   # ...then under the failover bound
    assert 108.0 < clock.now <= 110.0 and err.metadata["deadline_seconds"] == "10.000"


def test_attempt_timeout_cuts_an_attempt_and_the_call_goes_on(clock):
    budget = CallBudget(RetryPolicy(attempt_timeout=3.0), 10.0, "Step", None)
    sent, err = run(budget, clock, fail_after=100.0)          # a silent (paused) manager
    assert [t for _, t in sent[:3]] == [3.0, 3.0, 3.0]
    assert all(at + t <= 110.0 + 1e-9 for at, t in sent) and clock.now <= 110.0 + 1e-9
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "no reply within its 10 s deadline" in err.message


def test_attempts_caps_the_issues_and_other_codes_stop_at_once(clock):
    budget = CallBudget(RetryPolicy(attempts=2), 60.0, "Step", None)
    sent, err = run(budget, clock, fail_after=0.1)
    assert len(sent) == 2 and err.metadata["attempts"] == "2"
    refused = ClientError(grpc.StatusCode.NOT_FOUND, "pool 'x' does not exist", "POOL_NOT_FOUND")
    budget = CallBudget(RetryPolicy(), 60.0, "Step", "r")
    budget.attempt_timeout()
    with pytest.raises(ClientError) as exc:
        budget.pause_or_raise(refused)
    assert exc.value is refused


def test_the_policy_is_a_grpc_service_config():
    bm = pb.DESCRIPTOR.services_by_name["BlockManager"]
    doc = json.loads(RetryPolicy().service_config(bm))
    retried, rest = doc["methodConfig"]
    names = {n["method"] for n in retried["name"]}
    assert {"Step", "CreatePool", "ListPools", "Heartbeat"} <= names
    assert not names & {"StepStream", "EchoStream", "WatchEvents"}        # streams reconnect themselves
    policy = retried["retryPolicy"]
    assert policy["maxAttempts"] == 3 and policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert policy["initialBackoff"] == "0.05s" and policy["maxBackoff"] == "0.1s"
    assert retried["waitForReady"] is False and rest == {"name": [{"service": "kvservice.v1.BlockManager"}],
                                                         "waitForReady": False}
    assert len(json.loads(RetryPolicy(attempts=1).service_config(bm))["methodConfig"]) == 1   # never resent
    worker = json.loads(RetryPolicy().service_config(wpb.DESCRIPTOR.services_by_name["Worker"],
                                                     frozenset({"Info", "DecodeAttention"})))
    assert {n["method"] for n in worker["methodConfig"][0]["name"]} == {"Info", "DecodeAttention"}


def test_client_arguments_make_the_policy():
    assert client_policy(None, None, None) == RetryPolicy()
    assert client_policy(None, 0, None).attempts == 1 and client_policy(None, 2, 15.0).failover == 15.0
    leader = RetryPolicy(attempt_timeout=3.0, grpc_attempts=1)
    assert client_policy(None, 1, None, leader) == RetryPolicy(attempts=2, attempt_timeout=3.0, grpc_attempts=1)
    assert RetryPolicy(deadline=60).failover == 60.0          # the name of the bound before issue 24
    with pytest.raises(ValueError, match="grpc_attempts"):
        RetryPolicy(grpc_attempts=6)
