"""Client calls the seed-21 survivors showed unpinned (kvservice/client), checked at the stub: the request each
sends, the gRPC deadline and metadata each attempt carries, and what it returns.

- BlockManagerClient.workers / score_prefix: a ListWorkersRequest of the pool asked for; a ScorePrefixRequest of
  the prompt (INT32 when every id fits, else INT64: the method's docstring), salt, extra key, pools and model.
  A call's own timeout is its deadline (the class docstring: "a call may pass its own"), else the client's.
- WorkerClient.decode_attention: the request's every field as the proto documents it; q goes in the cache dtype
  asked for (dtype "float16": converted; "bfloat16": q holds raw bit patterns, sent as BFLOAT16), and the reply's
  out / lse come back as float32 arrays.
The oracles are hand-built protos and byte strings (struct, little-endian), not the client's codec.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvservice.client.client import BlockManagerClient
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.pagetable import PageTable
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from kvservice.v1 import worker_pb2 as wpb

DEAD = "127.0.0.1:1"                  # never dialled: every call goes to the recording stub


class Stub:
    """Records each call (method, request, timeout, metadata) and answers with the reply given for the method."""

    def __init__(self, **replies):
        self.replies, self.calls = replies, []

    def __getattr__(self, method):
        def call(request, timeout=None, metadata=None):
            self.calls.append((method, request, timeout, metadata))
            return self.replies[method]
        return call


def _le(fmt: str, values) -> bytes:
    values = [int(v) for v in values]
    return struct.pack(f"<{len(values)}{fmt}", *values)


def test_workers_sends_the_pool_under_the_calls_deadline_and_returns_every_worker():
    infos = [pb.WorkerInfo(worker_id="w1", pool="p", layer_begin=0, layer_end=3, tp_size=2, backend="cpu"),
             pb.WorkerInfo(worker_id="w2", pool="p", layer_begin=3, layer_end=6, tp_rank=1, tp_size=2)]
    with BlockManagerClient(DEAD, timeout=300.0, token="tok") as c:
        c._stub = stub = Stub(ListWorkers=pb.ListWorkersReply(workers=infos))
        assert c.workers("p", timeout=7.5) == infos
        assert c.workers() == infos
    (m1, r1, t1, md1), (m2, r2, t2, md2) = stub.calls
    assert (m1, m2) == ("ListWorkers", "ListWorkers")
    assert r1 == pb.ListWorkersRequest(pool="p") and r2 == pb.ListWorkersRequest()
    assert 0 < t1 <= 7.5 and 7.5 < t2 <= 300.0             # its own timeout, else the client's (no elapsed-time bound)
    assert md1 == md2 == (("authorization", "Bearer tok"),)


@pytest.mark.parametrize("wide", [False, True])
def test_score_prefix_sends_the_prompt_and_its_keys_under_the_calls_deadline(wide):
    rng = np.random.default_rng(2121 + wide)
    ids = [int(x) for x in rng.integers(1, 2**31 - 1, 9)]
    if wide:
        ids[4] = 2**31                                                     # one id past int32: all go as INT64
    scores = [pb.PrefixScore(pool="a", cached_tokens=32, cached_pages=2, page_size=16)]
    reply = pb.ScorePrefixReply(scores=scores)
    with BlockManagerClient(DEAD, timeout=300.0) as c:
        c._stub = stub = Stub(ScorePrefix=reply)
        got = c.score_prefix(np.asarray(ids), salt="s1", extra_key="lora-7", pools=("a", "b"), model="m",
                             timeout=6.25)
        assert got == reply and list(got.scores) == scores
        assert c.score_prefix(ids) == reply
    (m1, r1, t1, md1), (m2, r2, t2, _) = stub.calls
    assert (m1, m2) == ("ScorePrefix", "ScorePrefix") and md1 is None
    want = cpb.Tensor(dtype=cpb.INT64, data=_le("q", ids)) if wide else \
        cpb.Tensor(dtype=cpb.INT32, data=_le("i", ids))
    for r in (r1, r2):
        assert (r.token_ids.dtype, r.token_ids.data) == (want.dtype, want.data)
        assert np.prod(list(r.token_ids.shape) or [len(ids)]) == len(ids)
    assert (r1.cache_salt, r1.extra_key, list(r1.pools), r1.model) == ("s1", "lora-7", ["a", "b"], "m")
    assert (r2.cache_salt, r2.extra_key, list(r2.pools), r2.model) == ("", "", [], "")
    assert 0 < t1 <= 6.25 and 6.25 < t2 <= 300.0           # its own timeout, else the client's (no elapsed-time bound)


def _attention_reply(rng, b, heads, dim):
    out = rng.standard_normal((b, heads, dim)).astype(np.float32)
    lse = rng.standard_normal((b, heads)).astype(np.float32)
    reply = wpb.DecodeAttentionReply(out=cpb.Tensor(dtype=cpb.FLOAT32, shape=[b, heads, dim], data=out.tobytes()),
                                     lse=cpb.Tensor(dtype=cpb.FLOAT32, shape=[b, heads], data=lse.tobytes()),
                                     violation=wpb.ViolationRecord(kernel="decode_attention", layer=3, count=1,
                                                                   row=1, position=4, value=7,
                                                                   reason="stale_page"))
    return reply, out, lse


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", None])
def test_decode_attention_sends_q_in_the_cache_dtype_with_the_table_and_returns_out_and_lse(dtype):
    rng = np.random.default_rng(2122)
    b, heads, dim = 2, 4, 8
    if dtype == "bfloat16":
        q = rng.integers(1, 2**16, (b, heads, dim)).astype(np.uint16)          # raw bf16 bit patterns
        want_q = (cpb.BFLOAT16, q.astype("<u2").tobytes())
    elif dtype == "float16":
        q = rng.standard_normal((b, heads, dim))                               # float64: converted to float16
        want_q = (cpb.FLOAT16, q.astype("<f2").tobytes())
    else:
        q = rng.standard_normal((b, heads, dim)).astype(np.float32)            # its own dtype
        want_q = (cpb.FLOAT32, q.astype("<f4").tobytes())
    table = PageTable(np.array([0, 2, 5], dtype=np.int32), np.array([9, 4, 11, 2, 7], dtype=np.int32),
                      np.array([3, 16], dtype=np.int32))
    gens = np.array([5, 6, 7, 8, 2**32 - 1], dtype=np.uint32)
    reply, out, lse = _attention_reply(rng, b, heads, dim)
    wc = WorkerClient(DEAD, "w9", timeout=12.5, pool_incarnation=77, leader_epoch=4)
    try:
        wc._stub = stub = Stub(DecodeAttention=reply)
        att = wc.decode_attention(3, q, table, dtype=dtype, sm_scale=0.125, policy="zeros", generations=gens)
    finally:
        wc.close()
    [(method, req, timeout, metadata)] = stub.calls
    assert (method, timeout, metadata) == ("DecodeAttention", 12.5, (("kvservice-leader-epoch", "4"),))
    assert (req.q.dtype, req.q.data) == want_q and list(req.q.shape) == [b, heads, dim]
    assert (req.layer, req.sm_scale, req.policy, req.table_id, req.pool_incarnation) == \
        (3, 0.125, wpb.POLICY_ZEROS, "", 77)
    assert (req.indptr.dtype, req.indptr.data) == (cpb.INT32, _le("i", [0, 2, 5]))
    assert (req.indices.dtype, req.indices.data) == (cpb.INT32, _le("i", [9, 4, 11, 2, 7]))
    assert (req.last_page_len.dtype, req.last_page_len.data) == (cpb.INT32, _le("i", [3, 16]))
    assert (req.generations.dtype, req.generations.data) == (cpb.UINT32, _le("I", gens))
    assert att.out.dtype == np.float32 and np.array_equal(att.out, out)
    assert att.lse.dtype == np.float32 and np.array_equal(att.lse, lse)
    assert att.violation == reply.violation
