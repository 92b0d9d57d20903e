"""AsyncBlockManagerClient's calls read at the stub (kvservice/client/aio.py): for every call, the request it sends
(every field, hand-built protos and little-endian bytes), the gRPC deadline of its attempt (the call's own timeout,
else the client's: the sync client's class docstring, which aio.py's module doc says it follows exactly), the
metadata (the bearer token), and what it returns; one request_id per logical call (given, else a fresh uuid4 hex);
the channel's service config (RetryPolicy's defaults: gRPC resends every unary call, 3 tries, 0.05 s then 0.1 s).
A call that met no manager is issued again after a backoff (RetryPolicy: uniform in [d/2, d], d = 0.05 s first);
one whose reply is behind what was seen is refused StateRolledBack naming the call and its request_id.
"""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import numpy as np
import pytest

from kvservice.client import aio
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.codec import ClientError
from kvservice.client.deadline import RetryPolicy
from kvservice.client.position import StateRolledBack
from kvservice.contract.pagetable import PageTable, ValidationReport, Violation
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
    AsyncQueuedStub,
    RpcErr,
    at_position,
    check_pool_requests,
    check_read_calls,
)
from tests.unit.test_mut_r7cli_clients import DEFAULT_CONFIG, Tap
from tests.unit.test_mut_s21a_client import DEAD, _le

TOKEN = (("authorization", "Bearer at"),)


def _run(coro_fn, stub, **kw):
    async def run():
        c = AsyncBlockManagerClient(DEAD, timeout=300.0, token="at", **kw)
        c._stub = stub
        try:
            return await coro_fn(c)
        finally:
            await c.close()
    return asyncio.run(run())


def _own_then_clients(t1, t2, own):
    assert 0 < t1 <= own < t2 <= 300.0        # its own timeout, else the client's (no elapsed-time bound)


def test_the_read_calls_send_their_requests_and_return_the_replies():
    stub = AsyncQueuedStub(**READ_REPLIES)

    async def calls(c):
        assert await c.plan(SPEC, SIZING, ("native", "flashinfer"), timeout=2.0) == PLAN
        assert await c.plan(SPEC, SIZING) == PLAN
        assert await c.get_pool("b", timeout=3.0) == POOLS[1]
        assert await c.list_pools(timeout=4.0) == POOLS
        assert await c.sequences("a", limit=17, timeout=5.0) == SEQS
        assert await c.sequences("b") == SEQS
        got = await c.stats("a", timeout=6.0)
        assert got == {"a": STATS.pools["a"]} and type(got) is dict
        assert await c.stats() == {"a": STATS.pools["a"]}
        assert await c.echo(b"\x01ping", timeout=7.0) == b"\x01pong"
        assert await c.echo() == b"\x01pong"
    _run(calls, stub)
    check_read_calls(stub.calls, TOKEN)


def test_validate_sends_the_table_and_layer_asks_for_100_reports_by_default_and_returns_the_report():
    rng = np.random.default_rng(7070)
    indices = rng.integers(1, 2**20, 4).astype(np.int32)
    table = PageTable(np.array([0, 1, 4], dtype=np.int32), indices, np.array([5, 2], dtype=np.int32))
    reply = pb.ValidatePageTableReply(num_violations=321, violations=[
        pb.Violation(reason="wrong_index_space", row=1, position=2, value=int(indices[2]), detail="space 1")])
    stub = AsyncQueuedStub(ValidatePageTable=reply)

    async def calls(c):
        return await c.validate("va", 5, table), await c.validate("vb", 1, table, max_reports=3, timeout=2.5)
    first, second = _run(calls, stub)
    assert first == second == ValidationReport(321, [Violation("wrong_index_space", 1, 2, int(indices[2]),
                                                               "space 1")])
    (m1, r1, t1, md1), (m2, r2, t2, md2) = stub.calls
    assert (m1, m2) == ("ValidatePageTable", "ValidatePageTable") and md1 == md2 == TOKEN
    assert (r1.pool, r1.layer, r1.max_reports) == ("va", 5, 100)
    assert (r2.pool, r2.layer, r2.max_reports) == ("vb", 1, 3)
    for r in (r1, r2):
        assert (r.indptr.dtype, r.indptr.data) == (cpb.INT32, _le("i", [0, 1, 4]))
        assert (r.indices.dtype, r.indices.data) == (cpb.INT32, _le("i", indices))
        assert (r.last_page_len.dtype, r.last_page_len.data) == (cpb.INT32, _le("i", [5, 2]))
    _own_then_clients(t2, t1, 2.5)


def test_the_mutating_calls_send_one_request_id_each_given_or_fresh():
    info = pb.PoolInfo(name="np", incarnation=77)
    step = pb.StepReply(seq_ids=cpb.Tensor(dtype=cpb.UINT64, shape=[1], data=_le("Q", [2**40 + 3])),
                        num_tokens=cpb.Tensor(dtype=cpb.INT64, shape=[1], data=_le("q", [6])),
                        new_token_indptr=cpb.Tensor(dtype=cpb.INT64, shape=[2], data=_le("q", [0, 6])),
                        num_free_slots=41, pool_incarnation=77)
    stub = AsyncQueuedStub(CreatePool=info, DeletePool=pb.DeletePoolReply(), Step=step)

    async def calls(c):
        assert await c.create_pool("np", SPEC, SIZING, ("native",), timeout=2.0, request_id="cp-1",
                                   prefix_caching=True, model="m7") == info
        assert await c.create_pool("np2", SPEC, SIZING) == info
        assert await c.delete_pool("np", force=True, timeout=3.0, request_id="dp-1") is None
        assert await c.delete_pool("np2") is None
        r = await c.step("np", admit=[2**40 + 3], admit_tokens=[6], timeout=4.0, request_id="st-1", salts=["s-a"],
                         extra_keys=["k-a"])
        assert (r.seq_ids.tolist(), r.num_tokens.tolist(), r.new_token_indptr.tolist()) == ([2**40 + 3], [6], [0, 6])
        assert (r.num_free_slots, r.pool_incarnation) == (41, 77)
        await c.step("np", free=[9], tables=False, block_table=True)
    _run(calls, stub)
    (_, c1, tc1, _), (_, c2, tc2, _), (_, d1, td1, _), (_, d2, td2, _), (_, s1, ts1, _), (_, s2, ts2, _) = stub.calls
    check_pool_requests(c1, c2, d1, d2)
    assert (s1.pool, s1.request_id, s1.omit_tables, s1.include_block_table) == ("np", "st-1", False, False)
    assert (s1.admit_seq_ids.dtype, s1.admit_seq_ids.data) == (cpb.UINT64, _le("Q", [2**40 + 3]))
    assert (s1.admit_num_tokens.dtype, s1.admit_num_tokens.data) == (cpb.INT32, _le("i", [6]))
    assert (list(s1.admit_cache_salts), list(s1.admit_extra_keys)) == (["s-a"], ["k-a"])       # extra: passed on
    assert HEX.fullmatch(s2.request_id) and (s2.omit_tables, s2.include_block_table) == (True, True)
    assert (s2.free_seq_ids.dtype, s2.free_seq_ids.data) == (cpb.UINT64, _le("Q", [9]))
    assert len({c2.request_id, d2.request_id, s2.request_id}) == 3
    _own_then_clients(tc1, tc2, 2.0)
    _own_then_clients(td1, td2, 3.0)
    _own_then_clients(ts1, ts2, 4.0)


def test_step_stream_learns_the_page_size_with_one_get_pool_under_the_streams_deadline():
    stub = AsyncQueuedStub(GetPool=pb.PoolInfo(name="sp", plan=pb.PlanReply(page_size=32)))

    async def calls(c):
        s = await c.step_stream("sp", deltas=False, timeout=1.5, stream_id="s-aio")
        d = await c.step_stream("sp")
        return [(x.client is c, x.pool, x.deltas, x.timeout, x.mirror.page_size) for x in (s, d)], s.stream_id, d
    got, sid, d = _run(calls, stub)
    assert got == [(True, "sp", False, 1.5, 32), (True, "sp", True, 300.0, 32)]
    assert sid == "s-aio" and re.fullmatch(r"s-[0-9a-f]{32}", d.stream_id)
    (_, r1, t1, _), (_, r2, t2, _) = stub.calls
    assert r1 == r2 == pb.GetPoolRequest(pool="sp")
    _own_then_clients(t1, t2, 1.5)


def _unavailable():
    return RpcErr(grpc.StatusCode.UNAVAILABLE, "connection refused")


def test_a_call_that_met_no_manager_is_issued_again_after_the_backoff_and_a_rolled_back_reply_is_refused():
    stub = AsyncQueuedStub(CreatePool=[_unavailable(), _unavailable(), at_position(0xAB, 50), at_position(0xAB, 20)])
    pauses = []

    async def calls(c):
        async def pause(seconds):
            pauses.append(seconds)
        c._pause = pause
        assert (await c.create_pool("p", SPEC, SIZING, request_id="rid-9")).position.seq == 50
        assert (c.position.lineage, c.position.incarnation, c.position.seq) == (0xAB, 2, 50)
        with pytest.raises(StateRolledBack) as err:
            await c.create_pool("p", SPEC, SIZING, request_id="rid-10", timeout=8.0)
        return err.value
    err = _run(calls, stub)
    assert len(stub.calls) == 4 and {r.request_id for _, r, _, _ in stub.calls[:3]} == {"rid-9"}
    assert len(pauses) == 2 and 0.025 <= pauses[0] <= 0.05 and 0.05 <= pauses[1] <= 0.1   # d = 0.05, then 0.1
    assert (err.code, err.reason, err.request_id) == (grpc.StatusCode.DATA_LOSS, "STATE_ROLLED_BACK", "rid-10")
    assert err.message.startswith("CreatePool: the manager answered at journal position 20 of state lineage "
                                  "00000000000000ab (incarnation 2), but this client had already seen position 50")
    assert (err.metadata["seen_seq"], err.metadata["seq"], err.metadata["request_id"]) == ("50", "20", "rid-10")


def test_a_refusal_is_raised_at_once_with_the_request_id_and_a_gave_up_call_names_its_target():
    stub = AsyncQueuedStub(CreatePool=RpcErr(grpc.StatusCode.ALREADY_EXISTS, "pool p exists"), GetPool=_unavailable())

    async def calls(c):
        with pytest.raises(ClientError) as refused:
            await c.create_pool("p", SPEC, SIZING, request_id="rid-r")
        n = len(stub.calls)
        with pytest.raises(ClientError) as gave_up:
            await c.get_pool("p", timeout=5.0)
        return refused.value, gave_up.value, n
    refused, gave_up, n = _run(calls, stub, retry=RetryPolicy(attempts=2, initial_backoff=0.001))
    assert n == 1 and (refused.code, refused.message, refused.request_id) == (grpc.StatusCode.ALREADY_EXISTS,
                                                                              "pool p exists", "rid-r")
    assert refused.metadata == {"request_id": "rid-r"}
    assert len(stub.calls) == 3 and (gave_up.code, gave_up.reason) == (grpc.StatusCode.UNAVAILABLE,
                                                                       "RETRIES_EXHAUSTED")
    assert gave_up.message.startswith(f"GetPool to {DEAD}: no manager answered within its 5 s deadline (2 attempts")
    assert gave_up.request_id is None and gave_up.metadata["target"] == DEAD
    assert gave_up.metadata["attempts"] == "2" and gave_up.metadata["last_code"] == "UNAVAILABLE"


def test_the_channel_resends_every_unary_call_under_the_default_policy(monkeypatch):
    made = []

    def record(target, tls, config, interceptors):
        made.append((target, tls, json.loads(config), interceptors))
        return grpc.aio.insecure_channel(target)
    monkeypatch.setattr(aio, "make_aio_channel", record)
    tap = Tap()

    async def run():
        c = AsyncBlockManagerClient(DEAD, 6.0, 4, interceptors=[tap])
        assert (c.target, c.timeout, c.retry, c._metadata) == (DEAD, 6.0, RetryPolicy(attempts=5), None)
        await c.close()
    asyncio.run(run())
    assert made == [(DEAD, None, DEFAULT_CONFIG, [tap])]
