"""UpdateTables and the table_id forms of AppendKV / DecodeAttention through a worker's gRPC service in process, fed
the replies of a real in-process manager stream: the UpdateTables reply counts what the manager sent, and a kernel
call naming the table does what the same call carrying the manager's own tables does."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvservice.contract.serving import grpc_server
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker import ops_numpy
from kvservice.worker.caches import CacheSet
from kvservice.worker.metrics import WorkerMetrics
from kvservice.worker.server import SERVICE_NAME
from kvservice.worker.service import WorkerServicer
from tests.unit.test_mut_m29w2_tables import MAX_LEN, SPEC, Stream, _manager


@pytest.fixture
def world():
    stream = Stream(_manager(), False, "s1")
    pool = stream.pool
    caches = CacheSet(SPEC, [g.num_slots for g in pool.plan.geometry.groups], 0, 3, ops_numpy, max_seq_len=MAX_LEN)
    servicer = WorkerServicer(caches, WorkerMetrics("p"), {"worker_id": "w", "pool": "p", "epoch": 1,
                                                           "incarnation": pool.incarnation, "backend": "cpu"},
                              max_table_rows=8)
    server, port, _ = grpc_server(SERVICE_NAME, servicer, "127.0.0.1:0", max_workers=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield wpb_grpc.WorkerStub(channel), servicer, stream
    finally:
        channel.close()
        server.stop(None)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Plain softmax attention of one row, default scale: q [QH, D], k/v [T, KH, D] -> [QH, D]."""
    qh, kh = q.shape[0], k.shape[1]
    out = np.zeros(q.shape)
    for h in range(qh):
        s = k[:, h // (qh // kh), :].astype(np.float64) @ q[h].astype(np.float64) / np.sqrt(q.shape[1])
        w = np.exp(s - s.max())
        out[h] = (w[:, None] * v[:, h // (qh // kh), :]).sum(0) / w.sum()
    return out


def test_a_table_named_by_id_serves_the_kernels_as_the_managers_own_tables_do(world):
    """Two steps (admit 3, then extend 2 of them): UpdateTables counts the rows and pages the manager sent;
    AppendKV naming the table writes each new token where the manager's slot mapping says, so DecodeAttention
    naming it gives plain softmax attention over every token of each sequence (the sliding layer its last 8),
    and exactly what the same call carrying the manager's tables gives."""
    stub, servicer, stream = world
    rng = np.random.default_rng(606)
    tokens: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
    lens = [int(n) for n in rng.integers(1, MAX_LEN // 2, 3)]
    for step, kw in enumerate(({"admit_seq_ids": [1, 2, 3], "admit_num_tokens": lens},
                               {"extend_seq_ids": [1, 3], "extend_num_tokens": [2, 5]})):
        reply = stream.step(**kw)
        up = stub.UpdateTables(wpb.UpdateTablesRequest(table_id="t", step=reply, replace=True), timeout=60)
        held_pages = sum(len(st.indices.data) // 4 for st in reply.tables)
        seqs = from_tensor(reply.seq_ids, "ids").tolist()
        nti = from_tensor(reply.new_token_indptr, "nti").tolist()
        assert (up.stream_seq, up.batch_size, up.pages_held, up.pool_incarnation) == \
            (step + 1, len(seqs), held_pages, stream.pool.incarnation)
        assert up.table_bytes > 0 and up.tenant_bytes == up.table_bytes
        assert (up.max_table_bytes, up.tenant_quota_bytes) == (servicer.tables.plan.max_table_bytes,
                                                                4 * servicer.tables.plan.held_bytes)
        new_tokens = int(from_tensor(reply.new_token_indptr, "nti")[-1])
        for layer, space in enumerate(reply.layer_index_space):
            (st,) = [t for t in reply.tables if t.index_space == space]
            layout = servicer.caches.layouts[layer]
            k, v = (rng.standard_normal((new_tokens, layout.kv_heads, layout.head_dim)).astype(np.float16)
                    for _ in range(2))
            assert not stub.AppendKV(wpb.AppendKVRequest(layer=layer, table_id="t", k=to_tensor(k), v=to_tensor(v)),
                                     timeout=60).violations
            for r, seq in enumerate(seqs):
                tokens.setdefault((layer, seq), []).extend(zip(k[nti[r]:nti[r + 1]], v[nti[r]:nti[r + 1]],
                                                               strict=True))
            q = rng.standard_normal((len(seqs), 2 * layout.kv_heads, layout.head_dim)).astype(np.float16)
            by_id = stub.DecodeAttention(wpb.DecodeAttentionRequest(layer=layer, table_id="t", q=to_tensor(q)),
                                         timeout=60)
            sent = stub.DecodeAttention(wpb.DecodeAttentionRequest(
                layer=layer, q=to_tensor(q), indptr=to_tensor(from_tensor(st.indptr, "ip").astype(np.int32)),
                indices=st.indices, last_page_len=st.last_page_len, generations=st.generations), timeout=60)
            assert by_id.violation.count == 0 == sent.violation.count
            a, b = from_tensor(by_id.out, "o", kinds="f"), from_tensor(sent.out, "o", kinds="f")
            assert np.isfinite(a).all() and np.array_equal(a, b)
            window = SPEC.layers[layer].sliding_window
            for r, seq in enumerate(seqs):
                kv = tokens[(layer, seq)][-window:] if window else tokens[(layer, seq)]
                want = _attention(q[r], np.stack([t[0] for t in kv]), np.stack([t[1] for t in kv]))
                np.testing.assert_allclose(a[r], want, rtol=2e-2, atol=2e-2)


def test_another_streams_reply_takes_a_table_over_only_when_asked(world):
    """UpdateTables of a table held for stream s1 with a full reply of stream s2: FAILED_PRECONDITION STALE_TABLE
    unless replace is set, then the table is s2's (its batch)."""
    stub, _, stream = world
    stub.UpdateTables(wpb.UpdateTablesRequest(table_id="t", step=stream.step(admit_seq_ids=[1],
                                                                            admit_num_tokens=[5])), timeout=60)
    other = Stream(stream.api, False, "s2").step(admit_seq_ids=[7, 8], admit_num_tokens=[3, 9])
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateTables(wpb.UpdateTablesRequest(table_id="t", step=other), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "belong to stream 's1'; this reply comes from stream 's2'" in err.value.details()
    up = stub.UpdateTables(wpb.UpdateTablesRequest(table_id="t", step=other, replace=True), timeout=60)
    assert up.batch_size == 2
