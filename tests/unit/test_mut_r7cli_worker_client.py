"""Every WorkerClient call read at the stub (kvservice/client/worker_client.py): the request it sends, field by field
as worker.proto documents it (hand-built tensors: little-endian bytes, the documented dtypes), the client's
timeout as each call's deadline, pool_incarnation on every kernel request that has the field, the token and the
leader epoch (kvservice-leader-epoch, only when non-zero) as metadata; and a failed call's ClientError: "worker
<id> at <address> <what>: <message>" (UNAVAILABLE: is unreachable; DEADLINE_EXCEEDED: did not answer within the
<timeout> s deadline; anything else: refused the call), its code, ErrorInfo reason and metadata kept.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from kvservice.client.codec import ClientError
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.errors import InvalidArgument
from kvservice.contract.pagetable import PageTable
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from kvservice.v1 import worker_pb2 as wpb
from tests.support_client import RpcErr
from tests.unit.test_mut_s21a_client import DEAD, Stub, _le


def _client(**kw):
    return WorkerClient(DEAD, "w3", 6.5, token="wk", pool_incarnation=41, leader_epoch=8, **kw)


MD = (("authorization", "Bearer wk"), ("kvservice-leader-epoch", "8"))


def test_append_kv_sends_k_v_the_slots_and_their_generations():
    rng = np.random.default_rng(7171)
    k = rng.standard_normal((3, 2, 4)).astype(np.float32)               # sent as the cache dtype asked for
    v = rng.standard_normal((3, 2, 4)).astype(np.float32)
    slots = [int(x) for x in rng.integers(1, 2**32, 3)]
    gens = [int(x) for x in rng.integers(1, 2**32, 3)]
    reply = wpb.KernelReply(kernel_seconds=0.5)
    with _client() as wc:
        wc._stub = stub = Stub(AppendKV=reply)
        assert wc.append_kv(7, k, v, np.asarray(slots, dtype=np.uint32), dtype="float16", policy="error",
                            slot_generations=gens) is reply
        wc.append_kv(2, k, None, table_id="tab-1")                       # K-only, the persistent table's slots
    (m1, r1, t1, md1), (m2, r2, t2, md2) = stub.calls
    assert (m1, m2, t1, t2, md1, md2) == ("AppendKV", "AppendKV", 6.5, 6.5, MD, MD)
    assert (r1.layer, r1.policy, r1.table_id, r1.pool_incarnation) == (7, wpb.POLICY_ERROR, "", 41)
    assert (r1.k.dtype, list(r1.k.shape), r1.k.data) == (cpb.FLOAT16, [3, 2, 4], k.astype("<f2").tobytes())
    assert (r1.v.dtype, list(r1.v.shape), r1.v.data) == (cpb.FLOAT16, [3, 2, 4], v.astype("<f2").tobytes())
    assert (r1.slot_mapping.dtype, r1.slot_mapping.data) == (cpb.INT64, _le("q", slots))
    assert (r1.slot_generations.dtype, r1.slot_generations.data) == (cpb.UINT32, _le("I", gens))
    assert (r2.layer, r2.policy, r2.table_id, r2.pool_incarnation) == (2, wpb.POLICY_NAN, "tab-1", 41)
    assert (r2.k.dtype, r2.k.data) == (cpb.FLOAT32, k.astype("<f4").tobytes())           # no dtype: the array's own
    assert not r2.HasField("v") and not r2.HasField("slot_mapping") and not r2.HasField("slot_generations")


def test_validate_sends_the_csr_as_int32_and_the_generations_as_uint32():
    rng = np.random.default_rng(7172)
    indices = rng.integers(1, 2**30, 5)                                  # int64 in: sent as INT32
    table = PageTable(np.array([0, 3, 5]), indices, np.array([4, 1]))
    gens = rng.integers(1, 2**32, 5)
    reply = wpb.WorkerValidateReply(ok=True)
    with _client() as wc:
        wc._stub = stub = Stub(ValidatePageTable=reply)
        assert wc.validate(3, table, gens) is reply
        wc.validate(0, table)
    (m1, r1, t1, md1), (_, r2, _, _) = stub.calls
    assert (m1, t1, md1) == ("ValidatePageTable", 6.5, MD)
    for r, layer in ((r1, 3), (r2, 0)):
        assert (r.layer, r.pool_incarnation) == (layer, 41)
        assert (r.indptr.dtype, r.indptr.data) == (cpb.INT32, _le("i", [0, 3, 5]))
        assert (r.indices.dtype, r.indices.data) == (cpb.INT32, _le("i", indices))
        assert (r.last_page_len.dtype, r.last_page_len.data) == (cpb.INT32, _le("i", [4, 1]))
    assert (r1.generations.dtype, r1.generations.data) == (cpb.UINT32, _le("I", gens))
    assert not r2.HasField("generations")


def test_copy_blocks_update_tables_and_the_guard_calls_send_what_they_are_given():
    rng = np.random.default_rng(7173)
    pairs = rng.integers(0, 2**33, 6)                                    # flat: reshaped to [n, 2]
    gens = rng.integers(1, 2**32, (3, 2))
    small = rng.integers(0, 2**31, (3, 2)).astype(np.int32)
    step = pb.StepReply(stream_id="s-9", stream_seq=4, num_free_slots=3)
    with _client() as wc:
        wc._stub = stub = Stub(CopyBlocks=wpb.KernelReply(), UpdateTables=wpb.UpdateTablesReply(batch_size=2),
                               Info=wpb.WorkerStatus(worker_id="w3"), CheckGuards=wpb.CheckGuardsReply(ok=True),
                               CorruptGuard=wpb.CorruptGuardReply())
        assert wc.copy_blocks(5, pairs, "zeros", gens) == wpb.KernelReply()
        wc.copy_blocks(1, small)                                          # int32 in: sent as INT64
        assert wc.update_tables("tab-2", step, replace=True).batch_size == 2
        wc.update_tables("tab-3", step)
        assert wc.info().worker_id == "w3"
        assert wc.check_guards().ok
        assert wc.corrupt_guard("layer1", after=True, offset=9) is None
        wc.corrupt_guard("group0")
    reqs = [r for _, r, _, _ in stub.calls]
    assert [m for m, _, _, _ in stub.calls] == ["CopyBlocks", "CopyBlocks", "UpdateTables", "UpdateTables", "Info",
                                                "CheckGuards", "CorruptGuard", "CorruptGuard"]
    assert all(t == 6.5 and md == MD for _, _, t, md in stub.calls)
    c1, c2 = reqs[:2]
    assert (c1.group, c1.policy, c1.pool_incarnation) == (5, wpb.POLICY_ZEROS, 41)
    assert (c1.pairs.dtype, list(c1.pairs.shape), c1.pairs.data) == (cpb.INT64, [3, 2], _le("q", pairs))
    assert (c1.generations.dtype, list(c1.generations.shape), c1.generations.data) == (cpb.UINT32, [3, 2],
                                                                                       _le("I", gens.ravel()))
    assert (c2.group, c2.policy, c2.pool_incarnation, c2.HasField("generations")) == (1, wpb.POLICY_NAN, 41, False)
    assert (c2.pairs.dtype, list(c2.pairs.shape), c2.pairs.data) == (cpb.INT64, [3, 2], _le("q", small.ravel()))
    assert reqs[2] == wpb.UpdateTablesRequest(table_id="tab-2", step=step, replace=True)
    assert reqs[3] == wpb.UpdateTablesRequest(table_id="tab-3", step=step)
    assert reqs[4] == wpb.WorkerInfoRequest() and reqs[5] == wpb.CheckGuardsRequest()
    assert reqs[6] == wpb.CorruptGuardRequest(buffer="layer1", after=True, offset=9)
    assert reqs[7] == wpb.CorruptGuardRequest(buffer="group0")


class Failed(RpcErr):
    def __init__(self, code, message, reason="", metadata=None):
        trailing = ()
        if reason:                       # the rich status a server attaches: google.rpc.Status with an ErrorInfo
            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="kvservice.v1", metadata=metadata))
            status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
            trailing = (("grpc-status-details-bin", status.SerializeToString()),)
        super().__init__(code, message, trailing)


@pytest.mark.parametrize("code, what", [
    (grpc.StatusCode.UNAVAILABLE, "is unreachable"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "did not answer within the 6.5 s deadline"),
    (grpc.StatusCode.FAILED_PRECONDITION, "refused the call"),
    (grpc.StatusCode.INTERNAL, "refused the call"),
])
def test_a_failed_call_names_the_worker_and_keeps_the_workers_code_reason_and_metadata(code, what):
    class Raising:
        def __getattr__(self, method):
            def call(request, timeout=None, metadata=None):
                raise Failed(code, "it went wrong", "WHY_NOT", {"k": "v"})
            return call
    with _client() as wc:
        wc._stub = Raising()
        with pytest.raises(ClientError) as err:
            wc.check_guards()
    e = err.value
    assert (e.code, e.message, e.reason, e.metadata) == (code, f"worker w3 at {DEAD} {what}: it went wrong",
                                                         "WHY_NOT", {"k": "v"})
    assert e.request_id is None


def test_the_epoch_is_read_at_each_call_sent_only_when_set_and_a_whole_timeout_is_written_plainly():
    epochs = iter([3, 0, 12])
    with WorkerClient(DEAD, timeout=30.0, leader_epoch=lambda: next(epochs)) as wc:
        wc._stub = stub = Stub(Info=wpb.WorkerStatus())
        for _ in range(3):
            wc.info()
    assert [md for _, _, _, md in stub.calls] == [(("kvservice-leader-epoch", "3"),), None,
                                                 (("kvservice-leader-epoch", "12"),)]
    with WorkerClient(DEAD, "w0", timeout=30.0) as wc:
        wc._stub = Stub()

        class Slow:
            def __getattr__(self, method):
                def call(request, timeout=None, metadata=None):
                    raise Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")
                return call
        wc._stub = Slow()
        with pytest.raises(ClientError) as err:
            wc.info()
    assert err.value.message == f"worker w0 at {DEAD} did not answer within the 30 s deadline: deadline"
    assert (err.value.reason, err.value.metadata) == ("", {})


def test_decode_attention_converts_the_table_to_int32_and_the_generations_to_uint32_whatever_they_come_as():
    rng = np.random.default_rng(7174)
    q = rng.standard_normal((2, 2, 4)).astype(np.float32)
    indices = [int(x) for x in rng.integers(1, 2**30, 3)]
    table = PageTable([0, 1, 3], indices, [2, 4])                        # plain lists: converted
    gens = [int(x) for x in rng.integers(2**31, 2**32, 3)]               # past int32: only uint32 holds them
    out = rng.standard_normal((2, 2, 4)).astype(np.float32)
    lse = rng.standard_normal((2, 2)).astype(np.float32)
    reply = wpb.DecodeAttentionReply(out=cpb.Tensor(dtype=cpb.FLOAT32, shape=[2, 2, 4], data=out.tobytes()),
                                     lse=cpb.Tensor(dtype=cpb.FLOAT32, shape=[2, 2], data=lse.tobytes()),
                                     violation=wpb.ViolationRecord(kernel="decode_attention", count=2, row=1))
    with _client() as wc:
        wc._stub = stub = Stub(DecodeAttention=reply)
        att = wc.decode_attention(1, q, table, generations=np.asarray(gens, dtype=np.int64))
        wc.decode_attention(0, q, table_id="tab-4", dtype="float16", sm_scale=0.25, policy="error",
                            generations=gens)
        for field in ("out", "lse"):                                    # a malformed reply names its field
            bad = wpb.DecodeAttentionReply()
            bad.CopyFrom(reply)
            getattr(bad, field).CopyFrom(cpb.Tensor(dtype=cpb.INT32, shape=[1], data=_le("i", [1])))
            wc._stub = Stub(DecodeAttention=bad)
            with pytest.raises(InvalidArgument) as err:
                wc.decode_attention(1, q, table)
            assert str(err.value) == f"{field}: dtype INT32 not allowed here"
    assert np.array_equal(att.out, out) and np.array_equal(att.lse, lse) and att.violation == reply.violation
    (m1, r1, t1, md1), (_, r2, _, _) = stub.calls
    assert (m1, t1, md1, r1.layer, r1.pool_incarnation, r1.policy) == ("DecodeAttention", 6.5, MD, 1, 41,
                                                                       wpb.POLICY_NAN)
    assert (r1.sm_scale, r1.table_id) == (0.0, "")                     # the defaults: 1/sqrt(head_dim), no table
    assert (r1.q.dtype, list(r1.q.shape), r1.q.data) == (cpb.FLOAT32, [2, 2, 4], q.astype("<f4").tobytes())
    assert (r2.q.dtype, r2.q.data, r2.sm_scale, r2.policy) == (cpb.FLOAT16, q.astype("<f2").tobytes(), 0.25,
                                                               wpb.POLICY_ERROR)
    assert (r1.indptr.dtype, r1.indptr.data) == (cpb.INT32, _le("i", [0, 1, 3]))
    assert (r1.indices.dtype, r1.indices.data) == (cpb.INT32, _le("i", indices))
    assert (r1.last_page_len.dtype, r1.last_page_len.data) == (cpb.INT32, _le("i", [2, 4]))
    for r in (r1, r2):
        assert (r.generations.dtype, r.generations.data) == (cpb.UINT32, _le("I", gens))
    assert (r2.layer, r2.table_id) == (0, "tab-4")
    assert not (r2.HasField("indptr") or r2.HasField("indices") or r2.HasField("last_page_len"))
