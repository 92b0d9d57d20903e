"""LeaderRoute (kvservice/client/ha.py) on a LeaderClient whose addresses are never dialled: the address list, the
epoch check of docs/HA.md (a reply below the highest epoch seen is refused and the next call goes to the next
address), the metadata keys kvservice-leader-epoch / kvservice-leader-node, and the SERVING hint.
"""

from __future__ import annotations

import grpc
import pytest

from kvservice.client.deadline import RetryPolicy
from kvservice.client.ha import FAILOVER_RETRY, LeaderClient, StaleLeader, leader_epoch, leader_node, manager_addresses

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"


def test_manager_addresses_split_and_strip():
    assert manager_addresses(f" {A}, {B} ,,{C} ") == [A, B, C]
    assert manager_addresses([A, " ", f" {B}"]) == [A, B]
    for empty in ("", " , ", []):
        with pytest.raises(ValueError, match="at least one manager address"):
            manager_addresses(empty)


def test_epoch_and_node_are_read_from_their_own_keys():
    md = (("x", "9"), ("kvservice-leader-node", "node-7"), ("kvservice-leader-epoch", "31"))
    assert leader_epoch(md) == 31 and leader_node(md) == "node-7"
    assert leader_epoch(None) is None and leader_node(None) == "" and leader_node((("x", "y"),)) == ""
    assert leader_epoch((("kvservice-leader-epoch", None),)) is None
    assert leader_epoch((("kvservice-leader-epoch", "5"), ("kvservice-leader-epoch", "8"))) == 5   # the first


def test_a_stale_leader_is_unavailable_and_names_both_epochs():
    err = StaleLeader(3, 5, B)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == (f"{B} answered as leader epoch 3, but epoch 5 was already seen: a deposed manager; "
                             "its reply was refused")
    assert err.trailing_metadata() == () and err.initial_metadata() == ()


def test_the_leader_client_refuses_lower_epochs_and_moves_on():
    c = LeaderClient(f"{A},{B},{C}", timeout=3.0)
    try:
        assert c.targets == [A, B, C] and c.target == f"{A},{B},{C}" and c.retry == FAILOVER_RETRY
        assert (c.epoch, c.leader_node, c.stale_replies, c.current_target) == (0, "", 0, A)
        c.stream_answered(0, (("kvservice-leader-epoch", "4"), ("kvservice-leader-node", "n-a")))
        assert (c.epoch, c.leader_node, c.current_target) == (4, "n-a", A)
        c.stream_answered(0, (("kvservice-leader-epoch", "4"),))                  # the same epoch: accepted
        assert (c.epoch, c.leader_node, c.stale_replies) == (4, "", 0)
        c.stream_answered(0, ())                                                  # no epoch: unreplicated
        assert c.epoch == 4 and c.current_target == A
        with pytest.raises(StaleLeader) as e:
            c.stream_answered(0, (("kvservice-leader-epoch", "2"), ("kvservice-leader-node", "old")))
        assert f"{A} answered as leader epoch 2, but epoch 4 was already seen" in e.value.details()
        assert (c.epoch, c.stale_replies, c.current_target, c.leader_node) == (4, 1, B, "")
        c.stream_answered(1, (("kvservice-leader-epoch", "9"),))
        assert c.epoch == 9 and c.current_target == B
        assert c.stream_channel() == (1, c._channels[1])
        c.stream_failed(1)
        assert c.current_target == C
        c.stream_failed(1)                                                       # an old failure: stays
        assert c.current_target == C
        c.stream_failed(2)
        assert c.current_target == A                                             # round the list
    finally:
        c.close()


def test_only_unavailable_and_deadline_exceeded_move_to_the_next_address():
    class Err(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode) -> None:
            self._code = code

        def code(self) -> grpc.StatusCode:
            return self._code

    c = LeaderClient([A, B], timeout=3.0, retry=RetryPolicy(attempts=2))
    try:
        assert c.retry == RetryPolicy(attempts=2)
        for code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INTERNAL):
            c._failed(0, Err(code))
            assert c.current_target == A
        c._failed(0, Err(grpc.StatusCode.DEADLINE_EXCEEDED))
        assert c.current_target == B
        c._failed(1, Err(grpc.StatusCode.UNAVAILABLE))
        assert c.current_target == A
    finally:
        c.close()


def test_a_serving_report_sends_the_next_attempt_there_and_ends_the_pause():
    c = LeaderClient([A, B, C], timeout=3.0, retries=0)
    try:
        assert c.retry.attempts == 1 and c.retry.attempt_timeout == FAILOVER_RETRY.attempt_timeout
        c._rotate(0)
        assert c.current_target == B and not c._report_due()
        c._reported_serving(2)
        assert c.current_target == C and c.serving_reports == 1 and c._report_due()
        c._pause(30.0)                                   # returns at once: a report came after the break
        c._rotate(2)
        assert c.current_target == A and not c._report_due()
    finally:
        c.close()
    assert c._report_due()                               # a closed client never waits


def test_the_first_broken_call_starts_one_daemon_watch_per_address_and_close_ends_them():
    c = LeaderClient([A, B], timeout=3.0)
    try:
        assert c._watchers == []
        c._rotate(0)
        ws = list(c._watchers)
        assert [t.name for t in ws] == ["leader-watch-0", "leader-watch-1"]
        assert all(t.daemon for t in ws)          # never keeps a process alive that forgot close()
        c._rotate(1)
        assert c._watchers == ws                  # started once
    finally:
        c.close()
    for t in ws:
        t.join(20.0)
        assert not t.is_alive()
    closed = LeaderClient([A], timeout=3.0)
    closed.close()
    closed._rotate(0)
    assert closed._watchers == []                 # a closed client starts none


def test_only_a_serving_health_report_moves_the_client():
    from grpc_health.v1 import health_pb2

    c = LeaderClient([A, B, C], timeout=3.0)
    try:
        for status in (health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.UNKNOWN,
                       health_pb2.HealthCheckResponse.SERVICE_UNKNOWN):
            assert c._health_report(2, health_pb2.HealthCheckResponse(status=status)) == 0.05
            assert (c.current_target, c.serving_reports) == (A, 0)
        assert c._health_report(2, health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)) \
            == 0.05
        assert (c.current_target, c.serving_reports) == (C, 1)
    finally:
        c.close()


def test_the_export_list_names_the_modules_public_objects():
    from kvservice.client import ha
    assert set(ha.__all__) == {"EPOCH_METADATA", "FAILOVER_RETRY", "NODE_METADATA", "LeaderClient",
                            "LeaderEventStream", "LeaderRoute", "LeaderStub", "StaleLeader", "leader_epoch",
                            "leader_node", "manager_addresses"}
    assert all(hasattr(ha, name) for name in ha.__all__)


def test_a_closed_client_opens_no_health_watch():
    """Regression: a watch thread that made its stub on a channel close() was closing crashed the process (SIGSEGV
    in grpc, ~1 run in 8 of: rotate, close at once). _health_watch now checks `closed` under the lock close() takes."""
    c = LeaderClient([A, B], timeout=3.0)
    c.close()
    with pytest.raises(grpc.RpcError):
        c._health_watch(0)
    assert c._health_calls == {}
    c._health_loop(1)                                 # returns at once: the loop ends on a closed client
    assert c._health_calls == {}
