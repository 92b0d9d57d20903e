"""Persistent page tables on a worker: StepStream replies forwarded with UpdateTables, kernels by table_id.

Two CPU workers hold the same pool. Worker A gets every step's slot mappings and CSR tables (as
today); worker B gets only the stream's replies (incremental after the first) and runs AppendKV and
DecodeAttention by table_id. Same kernels, same K/V, same queries: B's outputs must equal A's bit for
bit on every step (a page written or read elsewhere would show), through decode, prefill chunks,
batch changes, forks with copy-on-write and frees.
"""

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from kvservice.worker.server import serve_worker

pytestmark = pytest.mark.integration
SPEC = CacheSpec.uniform(2, 2, 32, "float32", 16)
Q_HEADS = 4


@pytest.fixture(scope="module")
def cluster():
    running = serve("127.0.0.1:0")
    target = f"127.0.0.1:{running.port}"
    client = BlockManagerClient(target, timeout=20)
    client.create_pool("wt", SPEC, Sizing(num_slots=64, max_seq_len=512))
    workers = [serve_worker(target, "wt", name, backend="cpu") for name in ("wa", "wb")]
    clients = [WorkerClient(f"127.0.0.1:{w.port}", w.identity["worker_id"]) for w in workers]
    yield client, clients
    for c in clients:
        c.close()
    for w in workers:
        w.stop()
    client.close()
    running.stop()


def test_kernels_by_table_id_equal_kernels_with_shipped_tables(cluster):
    client, (wa, wb) = cluster
    rng = np.random.default_rng(5)
    ops = [{"admit": [1, 2, 3, 4], "admit_tokens": [5, 17, 33, 2]}] + [{"extend": [1, 2, 3, 4]}] * 12 + \
        [{"extend": [1, 2, 3, 4], "extend_tokens": [1, 7, 1, 20]}, {"free": [4], "admit": [5], "admit_tokens": [9]},
         {"extend": [1, 2, 3, 5]}, {"fork": [(2, 6)], "extend": [2]}, {"extend": [2, 6, 1]}, {"extend": [2, 6, 1]}]
    kinds = set()
    with client.step_stream("wt") as stream:
        for i, op in enumerate(ops):
            kw = dict(op)
            if "extend" in kw:
                kw.setdefault("extend_tokens", 1)
            r = stream.step(**kw)
            reply = stream.last_reply
            kinds.add("delta" if reply.HasField("delta") else "full")
            up = wb.update_tables("sched", reply)
            assert (up.stream_seq, up.batch_size) == (stream.mirror.seq, len(r.seq_ids))
            assert up.pages_held == sum(len(t.table.indices) for t in r.tables.values())
            for group, pairs in (r.copies or {}).items():
                wa.copy_blocks(group, pairs)
                wb.copy_blocks(group, pairs, generations=r.copy_generations[group])   # dst recorded for B's reads
            n_new, b = int(r.new_token_indptr[-1]), len(r.seq_ids)
            for layer in range(2):
                k, v = (rng.standard_normal((n_new, 2, 32)).astype(np.float32) for _ in range(2))
                wa.append_kv(layer, k, v, r.for_layer(layer).slot_mapping)
                wb.append_kv(layer, k, v, table_id="sched")
                q = rng.standard_normal((b, Q_HEADS, 32)).astype(np.float32)
                out_a = wa.decode_attention(layer, q, r.for_layer(layer).table)
                out_b = wb.decode_attention(layer, q, table_id="sched")
                assert out_b.violation.count == 0
                assert np.array_equal(out_a.out, out_b.out) and np.array_equal(out_a.lse, out_b.lse), (i, layer)
    assert kinds == {"full", "delta"}


def test_update_tables_refuses_what_it_cannot_apply(cluster):
    client, (_, wb) = cluster
    with client.step_stream("wt") as stream:
        stream.step(admit=[101, 102], admit_tokens=[3, 40])
        r = stream.step(extend=[101, 102], extend_tokens=1)
        delta = stream.last_reply
        assert delta.HasField("delta")
        with pytest.raises(ClientError) as exc:                       # no copy yet to apply a delta to
            wb.update_tables("fresh", delta)
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION and exc.value.reason == "TABLES_OUT_OF_SYNC"
        up = wb.update_tables("fresh", stream.mirror.full_reply())    # resync from the scheduler's own mirror
        assert up.stream_seq == stream.mirror.seq and up.batch_size == 2
        with pytest.raises(ClientError) as exc:                       # the same delta again: its base is gone
            wb.update_tables("fresh", delta)
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
        q = np.ones((2, Q_HEADS, 32), np.float32)
        # This worker never wrote these sequences' K/V: every page of the resynced copy is stale_page (NaN rows),
        # where the same table sent without its generations reads whatever the pages hold.
        got = wb.decode_attention(0, q, table_id="fresh")
        assert (got.violation.reason, got.violation.count) == ("stale_page", up.pages_held) and np.isnan(got.out).all()
        assert np.isfinite(wb.decode_attention(0, q, r.for_layer(0).table).out).all()
        assert wb.decode_attention(0, q, r.for_layer(0).table, generations=r.for_layer(0).generations) \
            .violation.count == up.pages_held          # the same check from the raw path with the generations
        stream.step(free=[101, 102])
    for table_id, reply, code in (("bad id!", stream.mirror.full_reply(), grpc.StatusCode.INVALID_ARGUMENT),
                                  ("x", pb.StepReply(error=pb.RequestStatus(code=5)),
                                   grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(ClientError) as exc:
            wb.update_tables(table_id, reply)
        assert exc.value.code == code
    with pytest.raises(ClientError) as exc:
        wb.decode_attention(0, np.ones((1, Q_HEADS, 32), np.float32), table_id="never-sent")
    assert exc.value.code == grpc.StatusCode.NOT_FOUND and "UpdateTables" in exc.value.message


def _tensor(draw, dtype_codes=(10, 11)):
    """A small integer Tensor: any of the given dtype codes, values near the interesting range or extreme."""
    code = draw(st.sampled_from(dtype_codes))
    n = draw(st.integers(0, 6))
    vals = draw(st.lists(st.one_of(st.integers(-2, 40), st.sampled_from([2**31 - 1, -2**31])), min_size=n, max_size=n))
    dt = np.int32 if code == 10 else np.int64
    return cpb.Tensor(dtype=code, data=np.array(vals, dtype=dt).tobytes())


@st.composite
def hostile_replies(draw):
    """StepReplies a misbehaving scheduler could forward: deltas and full tables with arbitrary sizes and rows."""
    r = pb.StepReply(stream_seq=draw(st.integers(0, 5)))
    r.num_tokens.CopyFrom(_tensor(draw, (11,)))
    r.new_token_indptr.CopyFrom(_tensor(draw, (11,)))
    if draw(st.booleans()):
        r.num_tokens.CopyFrom(cpb.Tensor(dtype=11, data=np.array([2**62], np.int64).tobytes()))   # a huge row
    for sid in draw(st.sampled_from([[0], [0], [1], [0, 0], []])):
        t = r.tables.add(index_space=sid)
        if draw(st.booleans()):
            t.delta.pages.CopyFrom(_tensor(draw))
            t.delta.replaced.CopyFrom(_tensor(draw))
        else:
            t.indptr.CopyFrom(_tensor(draw))
            t.indices.CopyFrom(_tensor(draw))
            t.last_page_len.CopyFrom(_tensor(draw, (10,)))
    if draw(st.booleans()):
        r.delta.base_seq = draw(st.sampled_from([1, 1, 2]))
        if draw(st.booleans()):
            r.delta.base_rows.CopyFrom(_tensor(draw, (10,)))
            r.seq_ids.CopyFrom(cpb.Tensor(dtype=12, data=np.arange(len(r.delta.base_rows.data) // 4,
                                                                   dtype=np.uint64).tobytes()))
        for _ in range(draw(st.integers(0, 2))):
            gd = r.delta.groups.add(group=draw(st.integers(0, 1)))
            for f in ("first_rows", "first_pages", "replaced_rows"):
                if draw(st.booleans()):
                    getattr(gd, f).CopyFrom(_tensor(draw, (10,) if f.endswith("rows") else (11,)))
    return r


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hostile_replies())
def test_update_tables_survives_hostile_replies(cluster, reply):
    """Never INTERNAL, never a huge allocation; a copy that took a bad reply is dropped, never half-applied."""
    _, (_, wb) = cluster
    base = pb.StepReply(stream_seq=1)
    base.num_tokens.CopyFrom(cpb.Tensor(dtype=11, data=np.array([5, 20], np.int64).tobytes()))
    base.new_token_indptr.CopyFrom(cpb.Tensor(dtype=11, data=np.array([0, 5, 25], np.int64).tobytes()))
    base.seq_ids.CopyFrom(cpb.Tensor(dtype=12, data=np.array([1, 2], np.uint64).tobytes()))
    t = base.tables.add(index_space=0, upper_bound=64, scale=1)
    t.indptr.CopyFrom(cpb.Tensor(dtype=10, data=np.array([0, 1, 3], np.int32).tobytes()))
    t.indices.CopyFrom(cpb.Tensor(dtype=10, data=np.array([7, 8, 9], np.int32).tobytes()))
    t.last_page_len.CopyFrom(cpb.Tensor(dtype=10, data=np.array([5, 4], np.int32).tobytes()))
    t.generations.CopyFrom(cpb.Tensor(dtype=cpb.UINT32, data=np.array([1, 1, 2], np.uint32).tobytes()))
    wb.update_tables("hostile", base)
    q2 = np.ones((2, Q_HEADS, 32), np.float32)
    before = wb.decode_attention(0, q2, table_id="hostile")
    assert before.violation.reason == "stale_page"          # pages 7-9 were never written under these generations
    try:
        up = wb.update_tables("hostile", reply)
    except ClientError as err:
        assert err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.RESOURCE_EXHAUSTED), err
        try:                      # the copy is as it was (refused up front) or gone, never half-applied
            again = wb.decode_attention(0, q2, table_id="hostile")
            assert np.array_equal(again.out, before.out, equal_nan=True) and again.violation == before.violation
        except ClientError as gone:
            assert gone.code == grpc.StatusCode.NOT_FOUND, gone
        return
    q = np.ones((up.batch_size, Q_HEADS, 32), np.float32)
    try:                          # whatever was accepted is a table the kernels check, never a crash
        wb.decode_attention(0, q, table_id="hostile")
    except ClientError as err:
        assert err.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), err
