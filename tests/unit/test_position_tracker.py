"""The clients' rollback check (kvservice/client/position.py) on real reply messages: a lower position of the same
lineage is refused and counted, a new lineage accepted and reported, an equal position (a retry) accepted."""

import threading

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvservice.client.client import BlockManagerClient, position_tracker
from kvservice.client.position import MAX_LINEAGES, PositionTracker, StateRolledBack, journal_position
from kvservice.v1 import block_manager_pb2 as pb

L1, L2 = 0x1111_2222_3333_4444, 0xFEDC_BA98_7654_3210


def step_reply(lineage: int, seq: int, incarnation: int = 1) -> pb.StepReply:
    return pb.StepReply(position=pb.JournalPosition(lineage=lineage, incarnation=incarnation, seq=seq))


def call(t: PositionTracker, reply, name: str = "Step", rid: str | None = "rid-1"):
    """One call: what was seen is taken before sending, the reply checked after."""
    seen = t.seen()
    t.check(name, reply, seen, rid)
    return reply


def test_the_same_lineage_at_a_lower_position_is_refused_counted_and_sticky():
    registry = CollectorRegistry()
    t = position_tracker(registry)
    for seq in (3, 7, 12):
        call(t, step_reply(L1, seq))
    assert (t.lineage, t.incarnation, t.seq) == (L1, 1, 12)
    with pytest.raises(StateRolledBack) as exc:
        call(t, step_reply(L1, 9, incarnation=2), rid="rid-9")
    err = exc.value
    assert err.code == grpc.StatusCode.DATA_LOSS and err.reason == "STATE_ROLLED_BACK" and err.request_id == "rid-9"
    assert err.metadata == {"lineage": f"{L1:016x}", "seen_seq": "12", "seq": "9", "incarnation": "2",
                            "rollbacks": "1", "request_id": "rid-9"}
    assert "position 9" in err.message and "already seen position 12" in err.message
    assert "reset_position()" in err.message
    assert err.reply.position.seq == 9 and err.got == (L1, 2, 9)
    with pytest.raises(StateRolledBack) as again:          # the lineage went back once: its later positions too
        call(t, step_reply(L1, 13, incarnation=2))
    assert again.value.metadata["seen_seq"] == "-1" and again.value.metadata["rollbacks"] == "2"
    assert t.rollbacks == 2 and registry.get_sample_value("kvservice_client_state_rollbacks_total") == 2
    assert t.seq == 12                                     # nothing refused was recorded
    t.reset()                                              # the scheduler resynchronised
    call(t, step_reply(L1, 13, incarnation=2))
    assert (t.lineage, t.seq) == (L1, 13) and t.rollbacks == 2


def test_an_equal_position_is_fine_a_retried_request_or_a_read_with_nothing_committed():
    t = PositionTracker()
    call(t, step_reply(L1, 5))
    call(t, step_reply(L1, 5))                                                  # the retry's original reply
    call(t, pb.StatsReply(position=pb.JournalPosition(lineage=L1, incarnation=1, seq=5)), "GetStats", None)
    assert t.seq == 5 and t.rollbacks == 0


def test_a_new_lineage_is_accepted_and_reported_and_never_compared_with_the_old_one(caplog):
    registry = CollectorRegistry()
    t = position_tracker(registry)
    seen_lineages = []
    on_new = t.on_new_lineage
    t.on_new_lineage = lambda old, new: (seen_lineages.append((old, new)), on_new(old, new))
    call(t, step_reply(L1, 400))
    assert t.lineage_changes == 0 and not seen_lineages               # the first lineage is no change
    with caplog.at_level("WARNING", logger="kvservice.client"):
        call(t, step_reply(L2, 1))                                     # a fresh state: position 1 < 400 is fine
    (rec,) = [r for r in caplog.records if r.name == "kvservice.client"]
    assert rec.levelname == "WARNING" and rec.getMessage() == (
        "Step: the manager's state is of lineage fedcba9876543210, not 1111222233334444 seen before: a state that "
        "does not continue the history this client saw (started from nothing, or repaired); positions start over")
    assert (t.lineage, t.seq, t.lineage_changes) == (L2, 1, 1) and seen_lineages == [(L1, L2)]
    assert registry.get_sample_value("kvservice_client_lineage_changes_total") == 1
    call(t, step_reply(L1, 401))                                       # back to the first: compared with its own
    with pytest.raises(StateRolledBack):
        call(t, step_reply(L2, 0))
    assert t.rollbacks == 1


def test_only_what_was_seen_before_the_call_was_sent_counts():
    """Concurrent calls: a reply lower than a position seen *after* this call was sent is not a rollback."""
    t = PositionTracker()
    call(t, step_reply(L1, 10))
    before = t.seen()                                      # call A sent
    call(t, step_reply(L1, 12))                            # call B sent later, answered first
    t.check("Step", step_reply(L1, 11), before, "a")       # A was applied before B: fine
    assert t.seq == 12
    with pytest.raises(StateRolledBack):
        t.check("Step", step_reply(L1, 9), before, "a")


def test_replies_without_a_position_and_a_manager_from_before_lineages():
    t = PositionTracker()
    call(t, pb.PlanReply(), "Plan", None)                  # no position field
    call(t, pb.StepReply(), "Step")                        # the field unset (a refused stream request)
    assert journal_position(pb.StepReply()) is None and t.seq == 0
    call(t, step_reply(0, 8))                              # lineage 0: positions still compared
    with pytest.raises(StateRolledBack):
        call(t, step_reply(0, 7))


def test_a_hostile_manager_cannot_grow_what_a_client_remembers():
    t = PositionTracker()
    for i in range(1, 10_000):
        call(t, step_reply(i, 1))
    assert len(t.seen()) == MAX_LINEAGES and t.lineage_changes == 9_998
    for i in range(20_000, 20_100):                       # and refusals of many lineages stay bounded too
        call(t, step_reply(i, 5))
        with pytest.raises(StateRolledBack):
            call(t, step_reply(i, 4))
    assert len(t._refused) <= MAX_LINEAGES


def test_checks_from_many_threads_count_every_refusal_once():
    t = PositionTracker()
    call(t, step_reply(L1, 1000))
    refused = []

    def worker(k: int) -> None:
        for s in range(200):
            try:
                call(t, step_reply(L1, 1000 + s if k % 2 else 500))
            except StateRolledBack:
                refused.append(1)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.rollbacks == len(refused) >= 3 * 200


def test_clients_share_one_set_of_counters_per_registry():
    registry = CollectorRegistry()
    a = BlockManagerClient("127.0.0.1:1", registry=registry)
    b = BlockManagerClient("127.0.0.1:1", registry=registry)       # no duplicate registration error
    try:
        call(a.position, step_reply(L1, 5))
        with pytest.raises(StateRolledBack):
            call(a.position, step_reply(L1, 4))
        call(b.position, step_reply(L2, 5))
        with pytest.raises(StateRolledBack):
            call(b.position, step_reply(L2, 1))
        assert registry.get_sample_value("kvservice_client_state_rollbacks_total") == 2
        a.reset_position()                                 # resets the tracker, keeps its counters
        assert a.position.seq == 0 and a.position.rollbacks == 1
    finally:
        a.close()
        b.close()
