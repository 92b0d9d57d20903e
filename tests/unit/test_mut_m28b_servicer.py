"""kvservice/server/servicer.py's unary adapter through a real in-process gRPC server: what it journals, what it logs
and counts for an unexpected failure, and which handler each RPC reaches.

Oracles: stores.entry_request's documented layout (a Step's bytes as received, then its request_id field as the
server set it, written even when empty), the INTERNAL status text and the metric series of docs (method, code,
reason = the code without an ErrorInfo reason), and the requests sent.
"""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest

from kvservice.client.codec import create_pool_request, step_request
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.status import error_info
from kvservice.contract.wire import to_tensor
from kvservice.server.app import serve
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

SPEC = CacheSpec.uniform(2, 2, 8, "float16", 4)


@pytest.fixture
def served():
    running = serve("127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield running, pb_grpc.BlockManagerStub(channel)
    finally:
        channel.close()
        running.stop(0)


def _request_id_field(n: int) -> bytes:
    """The StepRequest request_id field (a string of n < 128 bytes) as the wire writes it: tag, length."""
    number = pb.StepRequest.DESCRIPTOR.fields_by_name["request_id"].number
    assert number < 16                                    # a one-byte tag
    return bytes([number << 3 | 2, n])


def test_a_step_is_journaled_as_the_bytes_it_arrived_as_then_its_request_id(served) -> None:
    running, stub = served
    rng = np.random.default_rng(23)
    stub.CreatePool(create_pool_request("q", SPEC, Sizing(num_slots=128)), timeout=10)
    lens = [int(x) for x in rng.integers(1, 30, 3)]
    plain = step_request("q", admit=[11, 12, 13], admit_tokens=lens)
    stub.Step(plain, timeout=10)
    keyed = step_request("q", extend=[11], extend_tokens=[2])
    keyed.request_id = "rid-" + str(int(rng.integers(1, 10**6)))
    stub.Step(keyed, timeout=10)
    entries = list(running.journal.store.entries_after(0))
    assert [e.method for e in entries] == ["CreatePool", "Step", "Step"]
    assert entries[1].request == plain.SerializeToString() + _request_id_field(0)
    assert entries[2].request == keyed.SerializeToString() + _request_id_field(len(keyed.request_id)) \
        + keyed.request_id.encode()
    assert pb.StepRequest.FromString(entries[2].request) == keyed


def _samples(running, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for fam in running.metrics.registry.collect()
            for s in fam.samples if s.name == name and s.value}      # series touched (some are pre-created at 0)


@pytest.mark.parametrize(("method", "request_of", "fields"), [
    ("GetPool", lambda: pb.GetPoolRequest(pool="q"), {"pool": "q", "request_id": None}),
    ("DeletePool", lambda: pb.DeletePoolRequest(pool="q", request_id="del-7"), {"pool": "q", "request_id": "del-7"}),
    ("ListPools", lambda: pb.ListPoolsRequest(), {"pool": None, "request_id": None}),
])
def test_an_unexpected_failure_is_internal_logged_with_its_pool_and_request_id_and_counted(
        served, caplog, method, request_of, fields) -> None:
    running, stub = served
    stub.CreatePool(create_pool_request("q", SPEC, Sizing(num_slots=128)), timeout=10)

    def boom(*_a, **_k):
        raise RuntimeError("a bug")
    setattr(running.servicer.api, method, boom)           # a fault injected in the handler of `method`
    with caplog.at_level(logging.ERROR, logger="kvservice"), pytest.raises(grpc.RpcError) as err:
        getattr(stub, method)(request_of(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == f"internal error in {method}; see the manager's log"
    (rec,) = [r for r in caplog.records if r.name == "kvservice"]
    assert rec.getMessage() == f"{method} failed" and rec.exc_info[0] is RuntimeError
    assert {"pool": rec.pool, "request_id": rec.request_id} == fields
    assert _samples(running, "kvservice_requests_refused_total") == {
        (("code", "INTERNAL"), ("method", method), ("reason", "INTERNAL")): 1.0}
    counts = _samples(running, "kvservice_rpc_duration_seconds_count")
    assert counts[(("code", "INTERNAL"), ("method", method))] == 1.0
    assert counts[(("code", "OK"), ("method", "CreatePool"))] == 1.0


def test_each_rpc_reaches_its_own_handler(served) -> None:
    """Only ScorePrefix goes through the servicer's own (token-scoped) handler; the others reach ManagerAPI's."""
    running, stub = served
    rng = np.random.default_rng(31)
    stub.CreatePool(create_pool_request("q", SPEC, Sizing(num_slots=128)), timeout=10)
    lens = [int(x) for x in rng.integers(1, 30, 2)]
    stub.Step(step_request("q", admit=[4, 9], admit_tokens=lens), timeout=10)
    assert [p.name for p in stub.ListPools(pb.ListPoolsRequest(), timeout=10).pools] == ["q"]
    assert stub.GetPool(pb.GetPoolRequest(pool="q"), timeout=10).name == "q"
    tokens = to_tensor(rng.integers(1, 1000, 9).astype(np.int64))
    reply = stub.ScorePrefix(pb.ScorePrefixRequest(token_ids=tokens), timeout=10)
    assert isinstance(reply, pb.ScorePrefixReply)
    ok = _samples(running, "kvservice_rpc_duration_seconds_count")
    assert {m for (_code, (_k, m)) in ok} == {"CreatePool", "Step", "ListPools", "GetPool", "ScorePrefix"}


def test_a_refusal_is_counted_by_its_code_and_reason_and_a_failed_journal_refuses_unavailable(served) -> None:
    running, stub = served
    stub.CreatePool(create_pool_request("q", SPEC, Sizing(num_slots=128)), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        stub.GetPool(pb.GetPoolRequest(pool="absent"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(step_request("q", admit=[1], admit_tokens=[0]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reason = error_info(err.value).reason
    running.journal._fail("disk gone")
    with pytest.raises(grpc.RpcError) as err:
        stub.ListPools(pb.ListPoolsRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == "the manager stopped serving: disk gone"
    assert _samples(running, "kvservice_requests_refused_total") == {
        (("code", "NOT_FOUND"), ("method", "GetPool"), ("reason", "NOT_FOUND")): 1.0,
        (("code", "INVALID_ARGUMENT"), ("method", "Step"), ("reason", reason)): 1.0,
        (("code", "UNAVAILABLE"), ("method", "ListPools"), ("reason", "UNAVAILABLE")): 1.0}


def test_echo_stream_returns_each_payload_in_order_counts_each_as_echo_and_closes_its_slot(served) -> None:
    running, stub = served
    rng = np.random.default_rng(37)
    payloads = [rng.integers(0, 256, int(n)).astype(np.uint8).tobytes() for n in rng.integers(1, 200, 7)]
    replies = list(stub.EchoStream(iter(pb.EchoRequest(payload=p) for p in payloads), timeout=10))
    assert [r.payload for r in replies] == payloads
    assert _samples(running, "kvservice_rpc_duration_seconds_count") == {(("code", "OK"), ("method", "Echo")): 7.0}
    assert running.servicer.streams.active == 0
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel, pytest.raises(grpc.RpcError) as err:
        raw = channel.stream_stream("/kvservice.v1.BlockManager/EchoStream", request_serializer=None,
                                    response_deserializer=pb.EchoReply.FromString)
        list(raw(iter([pb.EchoRequest(payload=b"ok").SerializeToString(), b"\xff\xff\xff"]), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "request is not a valid kvservice.v1.EchoRequest message"


def test_positioned_reads_carry_the_journal_position(served) -> None:
    """Module docs: Heartbeat, ListWorkers and ScorePrefix replies carry the journal position (incarnation, seq,
    lineage) a client checks against what it saw before."""
    running, stub = served
    rng = np.random.default_rng(71)
    stub.CreatePool(create_pool_request("q", SPEC, Sizing(num_slots=128)), timeout=10)
    for i in range(int(rng.integers(1, 4))):
        stub.Step(step_request("q", admit=[i + 1], admit_tokens=[int(rng.integers(1, 9))]), timeout=10)
    j = running.journal
    want = (j.incarnation, j.seq, j.store.lineage)
    assert j.seq >= 2
    for reply in (stub.ListWorkers(pb.ListWorkersRequest(), timeout=10),
                  stub.ScorePrefix(pb.ScorePrefixRequest(token_ids=to_tensor(np.arange(1, 9, dtype=np.int64))),
                                   timeout=10)):
        assert reply.HasField("position")
        assert (reply.position.incarnation, reply.position.seq, reply.position.lineage) == want
