"""BlockManagerClient's calls read at the stub (kvservice/client/client.py): every call's request (every field,
hand-built protos), its attempt's deadline (its own timeout, else the client's), the token, what it returns; one
request_id per mutating call (given, else a fresh uuid4 hex); the calls retried (UNAVAILABLE and DEADLINE_EXCEEDED;
a heartbeat on UNAVAILABLE only: its docstring) after a backoff (RetryPolicy: uniform in [d/2, d], d = 0.05 s
first), the rest raised at once; a rolled-back reply refused StateRolledBack naming the call; watch_events opens
one WatchEvents call with the stream's own timeout; the channel's service config (RetryPolicy's defaults).
"""

from __future__ import annotations

import json

import grpc
import pytest

from kvservice.client import client as client_mod
from kvservice.client.client import BlockManagerClient, EventStream, TLSOptions
from kvservice.client.codec import ClientError
from kvservice.client.deadline import RetryPolicy
from kvservice.client.position import StateRolledBack
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from tests.support_client import (
    HEX,
    PLAN,
    POOLS,
    READ_REPLIES,
    SEQS,
    SIZING,
    SPEC,
    STATS,
    QueuedStub,
    RpcErr,
    at_position,
    check_pool_requests,
    check_read_calls,
)
from tests.unit.test_mut_r7cli_clients import DEFAULT_CONFIG
from tests.unit.test_mut_s21a_client import DEAD, _le

TOKEN = (("authorization", "Bearer sy"),)


def _client(stub, **kw):
    c = BlockManagerClient(DEAD, timeout=300.0, token="sy", **kw)
    c._stub = stub
    return c


def test_the_read_calls_send_their_requests_and_return_the_replies():
    stub = QueuedStub(**READ_REPLIES)
    with _client(stub) as c:
        assert c.plan(SPEC, SIZING, ("native", "flashinfer"), timeout=2.0) == PLAN
        assert c.plan(SPEC, SIZING) == PLAN
        assert c.get_pool("b", timeout=3.0) == POOLS[1]
        got = c.list_pools(timeout=4.0)
        assert got == POOLS and type(got) is list
        assert c.sequences("a", limit=17, timeout=5.0) == SEQS
        assert c.sequences("b") == SEQS
        got = c.stats("a", timeout=6.0)
        assert got == {"a": STATS.pools["a"]} and type(got) is dict
        assert c.stats() == {"a": STATS.pools["a"]}
        assert c.echo(b"\x01ping", timeout=7.0) == b"\x01pong"
        assert c.echo() == b"\x01pong"
    check_read_calls(stub.calls, TOKEN)


def test_the_mutating_calls_send_one_request_id_each_given_or_fresh():
    info = pb.PoolInfo(name="np", incarnation=77)
    reg = pb.RegisterWorkerReply(epoch=4)
    step = pb.StepReply(seq_ids=cpb.Tensor(dtype=cpb.UINT64, shape=[1], data=_le("Q", [4])),
                        num_tokens=cpb.Tensor(dtype=cpb.INT64, shape=[1], data=_le("q", [2])),
                        new_token_indptr=cpb.Tensor(dtype=cpb.INT64, shape=[2], data=_le("q", [0, 1])),
                        num_free_slots=5, pool_incarnation=3)
    stub = QueuedStub(CreatePool=info, DeletePool=pb.DeletePoolReply(), RegisterWorker=reg,
                Heartbeat=pb.HeartbeatReply(), Step=step)
    with _client(stub) as c:
        assert c.create_pool("np", SPEC, SIZING, ("native",), timeout=2.0, request_id="cp-1", prefix_caching=True,
                             model="m7") == info
        assert c.create_pool("np2", SPEC, SIZING) == info
        assert c.delete_pool("np", force=True, timeout=3.0, request_id="dp-1") is None
        assert c.delete_pool("np2") is None
        ask = pb.RegisterWorkerRequest(worker_id="w1", pool="np")
        assert c.register_worker(ask, timeout=4.0) == reg
        assert c.heartbeat("w1", 4, timeout=5.0) == pb.HeartbeatReply()
        got = c.step("np", free=[3], tables=False, block_table=True, timeout=6.0, request_id="st-9",
                     salts=["s-b"], extra_keys=["k-b"])
        assert (got.num_free_slots, got.pool_incarnation, got.seq_ids.tolist(), got.num_tokens.tolist()) == (5, 3, [4],
                                                                                                          [2])
        c.step("np", extend=[4])
    (_, c1, tc1, _), (_, c2, tc2, _), (_, d1, td1, _), (_, d2, td2, _), (_, r1, tr1, _), (_, h1, th1, _), \
        (_, s1, ts1, _), (_, s2, ts2, _) = stub.calls
    assert (s1.pool, s1.request_id, s1.omit_tables, s1.include_block_table) == ("np", "st-9", True, True)
    assert (list(s1.admit_cache_salts), list(s1.admit_extra_keys)) == (["s-b"], ["k-b"])       # extra: passed on
    assert (s1.free_seq_ids.dtype, s1.free_seq_ids.data) == (cpb.UINT64, _le("Q", [3]))
    assert HEX.fullmatch(s2.request_id) and (s2.omit_tables, s2.include_block_table) == (False, False)
    assert (s2.extend_seq_ids.data, s2.extend_num_tokens.data) == (_le("i", [4]), _le("i", [1]))
    assert 0 < ts1 <= 6.0 < ts2 <= 300.0
    check_pool_requests(c1, c2, d1, d2)
    assert c2.request_id != d2.request_id
    assert r1 == ask and h1 == pb.HeartbeatRequest(worker_id="w1", epoch=4)
    for t, own in ((tc1, 2.0), (td1, 3.0), (tr1, 4.0), (th1, 5.0)):
        assert 0 < t <= own
    assert 5.0 < tc2 <= 300.0 and 5.0 < td2 <= 300.0


def test_a_call_that_met_no_manager_is_issued_again_after_the_backoff_and_a_rolled_back_reply_is_refused():
    stub = QueuedStub(GetPool=[RpcErr(grpc.StatusCode.UNAVAILABLE, "down"),
                               RpcErr(grpc.StatusCode.DEADLINE_EXCEEDED, "down"), at_position(0xCD, 50),
                               at_position(0xCD, 20)])
    pauses = []
    with _client(stub) as c:
        c._pause = pauses.append
        assert c.get_pool("p").position.seq == 50
        with pytest.raises(StateRolledBack) as err:
            c.get_pool("p")
    assert len(stub.calls) == 4
    assert len(pauses) == 2 and 0.025 <= pauses[0] <= 0.05 and 0.05 <= pauses[1] <= 0.1   # d = 0.05, then 0.1
    e = err.value
    assert (e.code, e.reason, e.request_id) == (grpc.StatusCode.DATA_LOSS, "STATE_ROLLED_BACK", None)
    assert e.message.startswith("GetPool: the manager answered at journal position 20 of state lineage "
                                "00000000000000cd (incarnation 2), but this client had already seen position 50")


def test_a_heartbeat_is_retried_on_unavailable_only_and_a_refusal_is_raised_at_once_with_its_request_id():
    stub = QueuedStub(Heartbeat=[RpcErr(grpc.StatusCode.UNAVAILABLE, "down"),
                                 RpcErr(grpc.StatusCode.DEADLINE_EXCEEDED, "slow")],
                      DeletePool=RpcErr(grpc.StatusCode.FAILED_PRECONDITION, "pool d has live sequences"))
    pauses = []
    with _client(stub) as c:
        c._pause = pauses.append
        with pytest.raises(ClientError) as hb:
            c.heartbeat("w1", 3)
        with pytest.raises(ClientError) as refused:
            c.delete_pool("d", request_id="del-7")
    assert [m for m, _, _, _ in stub.calls] == ["Heartbeat", "Heartbeat", "DeletePool"] and len(pauses) == 1
    assert (hb.value.code, hb.value.message, hb.value.request_id) == (grpc.StatusCode.DEADLINE_EXCEEDED, "slow", None)
    r = refused.value
    assert (r.code, r.message, r.request_id, r.metadata) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                             "pool d has live sequences", "del-7",
                                                             {"request_id": "del-7"})


def test_a_call_that_gives_up_names_the_call_its_target_and_its_request_id():
    stub = QueuedStub(CreatePool=RpcErr(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    with _client(stub, retry=RetryPolicy(attempts=3)) as c:
        c._pause = lambda s: None
        with pytest.raises(ClientError) as err:
            c.create_pool("p", SPEC, SIZING, timeout=8.0, request_id="rid-g")
    e = err.value
    assert len(stub.calls) == 3 and (e.code, e.reason, e.request_id) == (grpc.StatusCode.UNAVAILABLE,
                                                                         "RETRIES_EXHAUSTED", "rid-g")
    assert e.message.startswith(f"CreatePool to {DEAD}: no manager answered within its 8 s deadline (3 attempts in ")
    assert e.message.endswith("(last: UNAVAILABLE: connection refused); it may or may not have been applied: call "
                              "again with request_id='rid-g' (safe: the manager answers a retry with the original "
                              "reply)")
    assert (e.metadata["attempts"], e.metadata["target"], e.metadata["request_id"]) == ("3", DEAD, "rid-g")


def test_watch_events_opens_one_call_with_the_streams_timeout_and_token():
    opened = []
    batches = [pb.KVEventBatch(sequence=12), pb.KVEventBatch(sequence=13)]

    class Watch:
        def WatchEvents(self, request, timeout=None, metadata=None):
            opened.append((request, timeout, metadata))
            return iter(batches)
    with _client(Watch()) as c:
        s = c.watch_events("p", 12, timeout=9.5)
        assert isinstance(s, EventStream) and list(s) == batches
        c.watch_events("q")
    assert opened == [(pb.WatchEventsRequest(pool="p", from_sequence=12), 9.5, TOKEN),
                      (pb.WatchEventsRequest(pool="q"), None, TOKEN)]


def test_the_channel_resends_every_unary_call_under_the_default_policy(monkeypatch):
    made = []

    def record(target, tls, config):
        made.append((target, tls, json.loads(config)))
        return grpc.insecure_channel(target)
    monkeypatch.setattr(client_mod, "make_channel", record)
    tls = TLSOptions(ca=b"ca")
    with BlockManagerClient(DEAD, 6.0, 4, tls=tls) as c:
        assert (c.target, c.timeout, c.retry, c._metadata) == (DEAD, 6.0, RetryPolicy(attempts=5), None)
    assert made == [(DEAD, tls, DEFAULT_CONFIG)]
    own = grpc.insecure_channel(DEAD)
    with BlockManagerClient(DEAD, channel=own) as c:                  # a channel given: none is made
        assert c._channel is own and len(made) == 1


def test_a_rolled_back_reply_to_a_mutating_call_is_refused_with_that_calls_request_id():
    """The refusal of a rolled-back DeletePool names the call's request_id (what a scheduler needs to ask the
    manager later whether that deletion was applied), in the error and in its metadata."""
    pos = pb.JournalPosition(lineage=0xAB, incarnation=2, seq=9)
    stub = QueuedStub(GetPool=[at_position(0xAB, 40)], DeletePool=[pb.DeletePoolReply(position=pos)])
    with _client(stub) as c:
        c.get_pool("p")
        with pytest.raises(StateRolledBack) as err:
            c.delete_pool("p", request_id="del-rb-1")
    e = err.value
    assert (e.code, e.reason, e.request_id, e.seen, e.got.seq) == (grpc.StatusCode.DATA_LOSS, "STATE_ROLLED_BACK",
                                                                   "del-rb-1", 40, 9)
    assert e.metadata["request_id"] == "del-rb-1" and e.message.startswith("DeletePool: the manager answered at "
                                                                           "journal position 9 of state lineage")
