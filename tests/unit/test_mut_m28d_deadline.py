"""RetryPolicy and CallBudget (kvservice/client/deadline.py) against their docstrings and gRFC A6, on a fake clock.

Oracles: the backoff formula of RetryPolicy's docstring (pause before issue k + 1 uniform in [d/2, d],
d = min(max_backoff, initial_backoff * multiplier**k)) evaluated by hand; the service config JSON of gRFC A6
written out literally; the deadline arithmetic of CallBudget worked out by hand on an injected clock.
"""

from __future__ import annotations

import json
import random

import grpc
import pytest

from kvservice.client import deadline
from kvservice.client.codec import ClientError
from kvservice.client.deadline import CallBudget, RetryPolicy
from kvservice.v1 import block_manager_pb2 as pb
from tests.clocks import ManualClock


@pytest.fixture
def clock(monkeypatch) -> ManualClock:
    c = ManualClock(1000.0)
    monkeypatch.setattr(deadline, "clock", c)
    return c


def test_the_old_deadline_name_becomes_failover_and_is_cleared():
    p = RetryPolicy(deadline=3.5)
    assert (p.failover, p.deadline) == (3.5, None)
    assert RetryPolicy(failover=6.0, deadline=2.0).failover == 6.0
    assert RetryPolicy(failover=1.0, deadline=2.0).failover == 2.0
    assert RetryPolicy().failover == 0.0 and RetryPolicy().deadline is None
    for n in (0, 6):
        with pytest.raises(ValueError) as e:
            RetryPolicy(grpc_attempts=n)
        assert str(e.value) == f"grpc_attempts must be 1..5 (gRPC's cap on maxAttempts), got {n}"
    for bad in (dict(attempts=-1), dict(failover=-0.1), dict(attempt_timeout=-1.0)):
        with pytest.raises(ValueError) as e:
            RetryPolicy(**bad)
        assert str(e.value) == "attempts, failover and attempt_timeout must be >= 0"
    for ok in (1, 5):
        assert RetryPolicy(grpc_attempts=ok).grpc_attempts == ok


@pytest.mark.parametrize("initial,mult,cap,want", [
    (0.05, 2.0, 1.0, [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]),
    (0.3, 3.0, 5.0, [0.3, 0.9, 2.7, 5.0, 5.0, 5.0, 5.0]),
    (0.25, 1.0, 0.2, [0.2] * 7),
])
def test_backoff_is_uniform_between_half_and_all_of_the_capped_exponential(initial, mult, cap, want, monkeypatch):
    policy = RetryPolicy(initial_backoff=initial, multiplier=mult, max_backoff=cap)
    calls = []
    monkeypatch.setattr(deadline.random, "uniform", lambda a, b: calls.append((a, b)) or b)
    for k, d in enumerate(want):
        assert policy.backoff(k) == pytest.approx(d)
        assert calls[-1] == pytest.approx((d / 2, d))
    monkeypatch.undo()
    random.seed(28)
    for k, d in enumerate(want):
        draws = [policy.backoff(k) for _ in range(64)]
        assert all(d / 2 - 1e-12 <= x <= d + 1e-12 for x in draws)
        assert min(draws) < 0.6 * d and max(draws) > 0.9 * d


SERVICE = pb.DESCRIPTOR.services_by_name["BlockManager"]
UNARY = [m.name for m in SERVICE.methods if not (m.client_streaming or m.server_streaming)]
FULL = "kvservice.v1.BlockManager"


def test_service_config_is_the_grfc_a6_json_of_the_policy():
    assert "Step" in UNARY and "StepStream" not in UNARY and "WatchEvents" not in UNARY
    p = RetryPolicy(initial_backoff=0.2, max_backoff=3.0, multiplier=4.0, grpc_attempts=4, wait_for_ready=True)
    got = json.loads(p.service_config(SERVICE))
    assert got == {"methodConfig": [
        {"name": [{"service": FULL, "method": m} for m in UNARY], "waitForReady": True,
         "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.2s", "maxBackoff": "0.8s", "backoffMultiplier": 4.0,
                         "retryableStatusCodes": ["UNAVAILABLE"]}},
        {"name": [{"service": FULL}], "waitForReady": True}]}
    some = json.loads(RetryPolicy(max_backoff=0.07).service_config(SERVICE, frozenset({"Step", "DeletePool"})))
    first = some["methodConfig"][0]
    assert sorted(n["method"] for n in first["name"]) == ["DeletePool", "Step"]
    assert first["retryPolicy"]["maxAttempts"] == 3 and first["retryPolicy"]["maxBackoff"] == "0.07s"
    assert first["waitForReady"] is False
    only = {"methodConfig": [{"name": [{"service": FULL}], "waitForReady": False}]}
    assert json.loads(RetryPolicy(grpc_attempts=1).service_config(SERVICE)) == only       # 1 = no retryPolicy
    assert json.loads(RetryPolicy(attempts=1).service_config(SERVICE)) == only            # once: no gRPC resends
    assert json.loads(RetryPolicy(grpc_attempts=2).service_config(SERVICE))["methodConfig"][0]["retryPolicy"][
        "maxAttempts"] == 2
    assert json.loads(RetryPolicy().service_config(SERVICE, frozenset())) == only


def test_attempt_timeout_is_what_remains_capped_by_the_policy(clock):
    b = CallBudget(RetryPolicy(attempt_timeout=0.5), 2.0, "Step", None)
    assert b.attempt_timeout() == pytest.approx(0.5) and b.cut is True and b.tries == 1
    clock.now += 1.7                                  # 0.3 s left: less than the cap, not cut
    assert b.attempt_timeout() == pytest.approx(0.3) and b.cut is False and b.tries == 2
    clock.now += 0.5                                  # past the deadline: the smallest attempt
    assert b.attempt_timeout() == 0.001 and b.cut is False and b.tries == 3
    u = CallBudget(RetryPolicy(), 2.0, "Step", None)
    assert u.attempt_timeout() == pytest.approx(2.0) and u.cut is False
    e = CallBudget(RetryPolicy(attempt_timeout=2.0), 2.0, "Step", None)
    assert e.attempt_timeout() == pytest.approx(2.0) and e.cut is False      # not less than what is left


def test_a_cut_attempt_counts_as_meeting_no_manager(clock):
    b = CallBudget(RetryPolicy(attempt_timeout=0.5, failover=9.0), 2.0, "Step", "rid")
    b.attempt_timeout()
    assert b.no_manager(grpc.StatusCode.DEADLINE_EXCEEDED)
    b.pause_or_raise(ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert b.deadline == pytest.approx(1009.0)        # the failover bound applies to a cut attempt
    n = CallBudget(RetryPolicy(failover=9.0), 2.0, "Step", "rid")
    n.attempt_timeout()
    assert not n.no_manager(grpc.StatusCode.DEADLINE_EXCEEDED)
    n.pause_or_raise(ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert n.deadline == pytest.approx(1002.0)


def test_pause_or_raise_remembers_why_no_manager_answered_and_says_it_when_giving_up(clock, monkeypatch):
    monkeypatch.setattr(deadline.random, "uniform", lambda a, b: b)
    b = CallBudget(RetryPolicy(initial_backoff=0.1, multiplier=3.0, max_backoff=10.0), 5.0, "Step", "rq-1",
                   target="h:1")
    b.attempt_timeout()
    down = ClientError(grpc.StatusCode.UNAVAILABLE, "Connection refused by h:1")
    assert b.pause_or_raise(down) == pytest.approx(0.1) and b.unavailable == "Connection refused by h:1"
    b.attempt_timeout()
    assert b.pause_or_raise(down) == pytest.approx(0.3)
    b.attempt_timeout()
    assert b.no_manager(grpc.StatusCode.DEADLINE_EXCEEDED)       # once no manager answered, it stays so
    clock.now += 4.95                                             # 0.05 s left: the pause is cut to it
    assert b.pause_or_raise(ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "DL")) == pytest.approx(0.045)
    clock.now += 0.045
    with pytest.raises(ClientError) as e:
        b.pause_or_raise(ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "DL"))
    err = e.value
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.reason == "RETRIES_EXHAUSTED"
    assert "(last: DEADLINE_EXCEEDED: DL; before: UNAVAILABLE: Connection refused by h:1)" in err.message
    assert err.metadata["last_code"] == "DEADLINE_EXCEEDED" and err.metadata["attempts"] == "3"
    assert err.metadata["target"] == "h:1" and err.request_id == "rq-1"
    other = CallBudget(RetryPolicy(), 5.0, "Step", "rq-2")
    with pytest.raises(ClientError) as e:
        other.pause_or_raise(ClientError(grpc.StatusCode.NOT_FOUND, "no pool"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.message == "no pool" and other.unavailable == ""


def test_the_attempt_limit_stops_the_call(clock):
    b = CallBudget(RetryPolicy(attempts=2), 60.0, "Step", None)
    down = ClientError(grpc.StatusCode.UNAVAILABLE, "down")
    b.attempt_timeout()
    assert b.pause_or_raise(down) > 0
    b.attempt_timeout()
    with pytest.raises(ClientError) as e:
        b.pause_or_raise(down)
    assert e.value.metadata["attempts"] == "2" and "2 attempts in 0.0 s" in e.value.message


def test_client_policy_from_a_clients_arguments():
    base = RetryPolicy(initial_backoff=0.3)
    assert deadline.client_policy(None, None, None, base) is base
    assert deadline.client_policy(None, 0, None, base) == RetryPolicy(initial_backoff=0.3, attempts=1)
    assert deadline.client_policy(None, 4, None, base) == RetryPolicy(initial_backoff=0.3, attempts=5)
    assert deadline.client_policy(None, -2, None, base).attempts == 1
    mine = RetryPolicy(attempts=7)
    assert deadline.client_policy(mine, 2, None, base) is mine                  # retry wins over retries
    assert deadline.client_policy(mine, None, 12.5, base) == RetryPolicy(attempts=7, failover=12.5)
    assert deadline.client_policy(None, 1, 0.0, base) == RetryPolicy(initial_backoff=0.3, attempts=2, failover=0.0)
    assert deadline.client_policy(None, None, None) == RetryPolicy()


class _Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ()


def test_code_of_and_client_error_read_rpc_errors_and_client_errors():
    ce = ClientError(grpc.StatusCode.ABORTED, "x")
    assert deadline.code_of(ce) == grpc.StatusCode.ABORTED
    assert deadline.code_of(_Rpc(grpc.StatusCode.UNAVAILABLE, "d")) == grpc.StatusCode.UNAVAILABLE
    assert deadline.code_of(ValueError("v")) == grpc.StatusCode.UNKNOWN
    assert deadline.client_error(ce, "rid") is ce
    got = deadline.client_error(_Rpc(grpc.StatusCode.NOT_FOUND, "no pool"), "rid-3")
    assert (got.code, got.message, got.reason, got.request_id) == (grpc.StatusCode.NOT_FOUND, "no pool", "", "rid-3")
    assert got.metadata == {"request_id": "rid-3"}
    assert deadline.client_error(_Rpc(grpc.StatusCode.INTERNAL, None)).message == ""


def test_gave_up_says_what_happened_in_each_case(clock):
    slow = CallBudget(RetryPolicy(), 3.0, "GetPool", None)
    slow.attempt_timeout()
    clock.now += 3.0
    err = slow.gave_up(ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "R0", {"m": "1"}))
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.reason == "RETRIES_EXHAUSTED"
    assert err.message == ("GetPool: no reply within its 3 s deadline (1 attempt in 3.0 s) "
                           "(last: DEADLINE_EXCEEDED: Deadline Exceeded)")
    assert err.metadata == {"m": "1", "attempts": "1", "last_reason": "R0", "last_code": "DEADLINE_EXCEEDED",
                            "deadline_seconds": "3.000"}
    assert err.request_id is None
    other = CallBudget(RetryPolicy(), 2.5, "Step", "rid-9", target="m:1")
    other.attempt_timeout()
    other.attempt_timeout()
    clock.now += 1.25
    err = other.gave_up(ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.request_id == "rid-9"
    assert err.message == ("Step to m:1: gave up after 2 attempts in 1.2 s of its 2.5 s deadline "
                           "(last: RESOURCE_EXHAUSTED: full); it may or may not have been applied: call again "
                           "with request_id='rid-9' (safe: the manager answers a retry with the original reply)")
    assert err.metadata["target"] == "m:1" and err.metadata["request_id"] == "rid-9"
    assert err.metadata["deadline_seconds"] == "2.500"
    down = CallBudget(RetryPolicy(failover=8.0), 2.0, "Step", None)
    down.attempt_timeout()
    down.pause_or_raise(ClientError(grpc.StatusCode.UNAVAILABLE, "refused"))
    err = down.gave_up(ClientError(grpc.StatusCode.UNAVAILABLE, "refused"))
    assert err.message == "Step: no manager answered within its 8 s deadline (1 attempt in 0.0 s) " \
                          "(last: UNAVAILABLE: refused)"                    # the same message is not repeated


def test_retry_after_counts_a_broken_watch_as_an_attempt_that_met_no_manager(clock, monkeypatch):
    monkeypatch.setattr(deadline.random, "uniform", lambda a, b: a)
    b = CallBudget(RetryPolicy(initial_backoff=0.2, multiplier=2.0, max_backoff=5.0), 30.0, "WatchEvents", None,
                   (grpc.StatusCode.UNAVAILABLE,))
    assert b.retry_after(ClientError(grpc.StatusCode.UNAVAILABLE, "gone")) == pytest.approx(0.1)
    assert (b.tries, b.cut) == (1, True)
    assert b.retry_after(ClientError(grpc.StatusCode.UNAVAILABLE, "gone")) == pytest.approx(0.2)
    with pytest.raises(ClientError) as e:                       # not one of its codes: final
        b.retry_after(ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"))
    assert e.value.message == "late"


def test_the_default_policies_are_the_documented_ones():
    p = RetryPolicy()
    assert (p.attempts, p.initial_backoff, p.max_backoff, p.multiplier, p.failover, p.attempt_timeout,
            p.grpc_attempts, p.wait_for_ready, p.deadline) == (0, 0.05, 1.0, 2.0, 0.0, 0.0, 3, False, None)
    from kvservice.client.ha import FAILOVER_RETRY, HEALTH_RETRY
    f = FAILOVER_RETRY                                     # ha.py: a silent manager left after 3 s, no gRPC resend
    assert (f.attempt_timeout, f.grpc_attempts, f.initial_backoff, f.max_backoff) == (3.0, 1, 0.05, 0.25)
    assert HEALTH_RETRY == (0.05, 1.0)
    assert deadline.RETRY_CODES == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert deadline.MIN_ATTEMPT_SECONDS == 0.005
