"""WorkerClient against a worker served in-process (kvservice.worker.server.serve_worker, CPU backend, NumPy kernels)
registered with an in-process manager: decode attention checked against a float64 softmax written here, block
copies checked by reading the copies, and a refusal's ErrorInfo kept in the ClientError naming the worker."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient
from kvservice.client.codec import ClientError
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.pagetable import PageTable
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve
from kvservice.worker.server import serve_worker

HEADS, DIM, PAGE = 2, 32, 4


@pytest.fixture(scope="module")
def cluster():
    mgr = serve("127.0.0.1:0")
    target = f"127.0.0.1:{mgr.port}"
    c = BlockManagerClient(target)
    c.create_pool("w", CacheSpec.uniform(1, HEADS, DIM, "float32", PAGE), Sizing(num_slots=16, max_seq_len=64))
    worker = serve_worker(target, "w", "w0")
    wc = WorkerClient(f"127.0.0.1:{worker.port}", "w0", timeout=20)
    yield c, wc, worker
    wc.close()
    worker.stop()
    c.close()
    mgr.stop()


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """softmax(q k^T / sqrt(d)) v and the natural-log sum of exp of the scores, per head, in float64."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    s = np.einsum("hd,nhd->hn", q, k) / np.sqrt(q.shape[-1])
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    return np.einsum("hn,nhd->hd", p / p.sum(axis=1, keepdims=True), v), (m[:, 0] + np.log(p.sum(axis=1)))


def _slots(space, pages: np.ndarray) -> np.ndarray:
    """The group slots of an index space's pages (page = base + slot * scale + offset, docs/DESIGN.md)."""
    return (pages.astype(np.int64) - space.base - space.offset) // space.scale


def test_decode_attention_and_block_copies_match_a_float64_reference(cluster):
    c, wc, _ = cluster
    rng = np.random.default_rng(17)
    res = c.step("w", admit=[1, 2], admit_tokens=[8, 8])
    st = res.for_layer(0)
    t = st.table
    k = rng.standard_normal((16, HEADS, DIM)).astype(np.float32)
    v = rng.standard_normal((16, HEADS, DIM)).astype(np.float32)
    wc.append_kv(0, k[:8], v[:8], st.slot_mapping[:8])                 # sequence 1 only; 2 holds nothing yet
    q = rng.standard_normal((1, HEADS, DIM)).astype(np.float32)
    one = PageTable(t.indptr[:2], t.indices[:2], t.last_page_len[:1])
    att = wc.decode_attention(0, q, one)
    want_out, want_lse = _attention(q[0], k[:8], v[:8])
    assert att.out.shape == (1, HEADS, DIM) and att.lse.shape == (1, HEADS)
    np.testing.assert_allclose(att.out[0], want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(att.lse[0], want_lse, rtol=1e-4, atol=1e-5)
    # copy both pages of sequence 1 onto sequence 2's: reading 2 then gives what reading 1 gives
    pairs = np.stack([_slots(st.space, t.indices[0:2]), _slots(st.space, t.indices[2:4])], axis=1)
    assert pairs.shape == (2, 2)
    wc.copy_blocks(0, pairs)
    two = PageTable(np.array([0, 2], np.int32), t.indices[2:4], t.last_page_len[1:2])
    copied = wc.decode_attention(0, q, two)
    np.testing.assert_array_equal(copied.out, att.out)
    np.testing.assert_array_equal(copied.lse, att.lse)
    c.step("w", free=[1, 2])


def test_a_refusal_keeps_the_workers_error_info_and_names_the_worker(cluster):
    """A call planned in another incarnation of the pool is refused FAILED_PRECONDITION (STALE_INCARNATION); the
    ClientError names the worker and its address and keeps the reason and metadata the worker sent."""
    c, _, worker = cluster
    mine = c.get_pool("w").incarnation
    address = f"127.0.0.1:{worker.port}"
    with WorkerClient(address, "w0", pool_incarnation=mine + 1) as stale:
        with pytest.raises(ClientError) as err:
            stale.append_kv(0, np.zeros((1, HEADS, DIM), np.float32), np.zeros((1, HEADS, DIM), np.float32),
                            np.array([0]))
    e = err.value
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION and e.reason == "STALE_INCARNATION"
    assert e.metadata == {"pool": "w", "incarnation": str(mine)}
    assert e.message.startswith(f"worker w0 at {address} refused the call: worker w0 holds memory planned for "
                                f"incarnation {mine} of pool 'w'")


@pytest.mark.parametrize("after", [False, True])
def test_corrupt_guard_flips_the_byte_of_the_guard_it_names(cluster, after):
    """CorruptGuard (test hook) flips byte `offset` of the guard before the buffer or after it (worker.proto); the
    guarded allocation is guard, cache bytes, guard, so the byte after is at guard_bytes + cache_bytes + offset."""
    c, _, _ = cluster
    pool = f"g{int(after)}"
    c.create_pool(pool, CacheSpec.uniform(1, HEADS, DIM, "float32", PAGE), Sizing(num_slots=16, max_seq_len=64))
    worker = serve_worker(c.target, pool, "hooked", test_hooks=True)
    try:
        with WorkerClient(f"127.0.0.1:{worker.port}", "hooked", timeout=20) as wc:
            info = wc.info()
            (buffer,) = info.buffers
            assert info.cache_bytes == 2 * 16 * PAGE * HEADS * DIM * 4       # K and V, float32, 16 slots of a page
            assert wc.check_guards().ok
            offset = 7 + int(after) * 4
            wc.corrupt_guard(buffer, after=after, offset=offset)
            rep = wc.check_guards()
    finally:
        worker.stop()
        c.delete_pool(pool)
    (st,) = rep.buffers
    assert not rep.ok and st.corrupted_bytes == 1
    assert st.first_offset == (info.guard_bytes + info.cache_bytes + offset if after else offset)
