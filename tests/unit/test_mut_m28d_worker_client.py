"""WorkerClient against a worker served in-process (CPU backend) with page generations (docs/KERNELS.md, "Page
generations"): KV written under each slot's generation, pages copied with their (src, dst) generations
[n, 2], then read through the copy's table with its generations: the result equals the source's read, bit for
bit, and a read under a wrong generation reports stale_page. The worker's status names its pool and sizes.
"""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient
from kvservice.client.codec import ClientError
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.pagetable import PageTable
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import from_tensor
from kvservice.server.app import serve
from kvservice.worker.server import serve_worker

HEADS, DIM, PAGE, SLOTS = 2, 32, 4, 24


@pytest.fixture(scope="module")
def cluster():
    mgr = serve("127.0.0.1:0")
    c = BlockManagerClient(f"127.0.0.1:{mgr.port}")
    c.create_pool("g", CacheSpec.uniform(1, HEADS, DIM, "float32", PAGE), Sizing(num_slots=SLOTS, max_seq_len=64))
    worker = serve_worker(c.target, "g", "wg")
    wc = WorkerClient(f"127.0.0.1:{worker.port}", "wg", timeout=20,
                      pool_incarnation=c.get_pool("g").incarnation)
    yield c, wc, worker
    wc.close()
    worker.stop()
    c.close()
    mgr.stop()


def test_the_workers_status_names_its_pool_and_sizes(cluster):
    c, wc, _ = cluster
    info = wc.info()
    assert (info.worker_id, info.pool) == ("wg", "g")
    assert info.cache_bytes == 2 * SLOTS * PAGE * HEADS * DIM * 4          # K and V, float32
    assert info.pool_incarnation == c.get_pool("g").incarnation


def test_pages_copied_with_their_generations_read_as_the_source(cluster):
    c, wc, _ = cluster
    rng = np.random.default_rng(2830)
    res = c.step("g", admit=[11, 12], admit_tokens=[8, 8])
    st = res.for_layer(0)
    t, gens = st.table, st.generations
    assert st.slot_generations is not None and gens is not None and len(gens) == len(t.indices) == 4
    k = rng.standard_normal((8, HEADS, DIM)).astype(np.float32)
    v = rng.standard_normal((8, HEADS, DIM)).astype(np.float32)
    wc.append_kv(0, k, v, st.slot_mapping[:8], slot_generations=st.slot_generations[:8])      # sequence 11 only
    q = rng.standard_normal((1, HEADS, DIM)).astype(np.float32)
    src = PageTable(t.indptr[:2], t.indices[:2], t.last_page_len[:1])
    want = wc.decode_attention(0, q, src, generations=gens[:2])
    assert want.violation.count == 0 and np.isfinite(want.out).all()
    space = st.space
    slots = (t.indices.astype(np.int64) - space.base - space.offset) // space.scale
    pairs = np.stack([slots[0:2], slots[2:4]], axis=1)
    pair_gens = np.stack([gens[0:2], gens[2:4]], axis=1).astype(np.uint32)
    assert all(r.count == 0 for r in wc.copy_blocks(0, pairs, generations=pair_gens).violations)
    dst = PageTable(np.array([0, 2], np.int32), t.indices[2:4], t.last_page_len[1:2])
    got = wc.decode_attention(0, q, dst, generations=gens[2:4])
    assert got.violation.count == 0
    np.testing.assert_array_equal(got.out, want.out)
    np.testing.assert_array_equal(got.lse, want.lse)
    wrong = gens[2:4] + np.uint32(1)
    stale = wc.decode_attention(0, q, dst, generations=wrong)          # policy nan: reported, row 0 poisoned
    assert (stale.violation.reason, stale.violation.count, stale.violation.row) == ("stale_page", 2, 0)
    assert stale.violation.value == int(t.indices[2])
    nan = wc.decode_attention(0, q, dst, generations=wrong, policy="nan")               # worker.proto's policies
    assert np.isnan(nan.out).all() and nan.violation.reason == "stale_page"
    zeros = wc.decode_attention(0, q, dst, generations=wrong, policy="zeros")
    assert (zeros.out == 0).all() and np.isneginf(zeros.lse).all() and zeros.violation.count == 2
    with pytest.raises(ClientError) as e:
        wc.decode_attention(0, q, dst, generations=wrong, policy="error")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "stale_page" in e.value.message
    assert wc.validate(0, dst, gens[2:4]).ok and wc.validate(0, dst).ok
    bad = wc.validate(0, dst, wrong)
    assert not bad.ok and (bad.violation.reason, bad.violation.count) == ("stale_page", 2)
    assert from_tensor(bad.row_status, "row_status").tolist() == [1 << (6 - 1)]          # code 6: stale_page
    c.step("g", free=[11, 12])


def test_a_failed_call_names_the_worker_its_address_and_why(cluster):
    """_call's ClientError: "worker <id> at <address> <what>: <worker's message>", the code, reason and metadata
    kept (UNAVAILABLE: is unreachable; others: refused the call)."""
    c, _, worker = cluster
    mine = c.get_pool("g").incarnation
    address = f"127.0.0.1:{worker.port}"
    with WorkerClient(address, "wg", pool_incarnation=mine + 3) as stale:
        with pytest.raises(ClientError) as err:
            stale.copy_blocks(0, np.array([[0, 1]]))
    e = err.value
    assert (e.code, e.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "STALE_INCARNATION")
    assert e.metadata == {"pool": "g", "incarnation": str(mine)}
    assert e.message.startswith(f"worker wg at {address} refused the call: ")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    with WorkerClient(dead, timeout=5) as gone:
        with pytest.raises(ClientError) as err:
            gone.info()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.message.startswith(f"worker {dead} at {dead} is unreachable: ")


def test_the_leader_epoch_is_read_at_each_call_and_sent_only_when_set(cluster):
    """leader_epoch: an int or a callable read at every call, sent as kvservice-leader-epoch when non-zero; this
    worker's manager is unreplicated, so it checks only that a stamp is a valid epoch (>= 1)."""
    c, _, worker = cluster
    address = f"127.0.0.1:{worker.port}"
    epochs = iter([0, -4, 7])
    incarnation = c.get_pool("g").incarnation
    with WorkerClient(address, "wg", pool_incarnation=incarnation, leader_epoch=lambda: next(epochs)) as wc:
        pairs = np.array([[SLOTS - 2, SLOTS - 1]])
        assert all(r.count == 0 for r in wc.copy_blocks(0, pairs).violations)          # 0: nothing sent
        with pytest.raises(ClientError) as e:
            wc.copy_blocks(0, pairs)                                                    # -4: sent, refused
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "kvservice-leader-epoch must be >= 1, got -4" in e.value.message
        assert all(r.count == 0 for r in wc.copy_blocks(0, pairs).violations)          # 7: accepted
    with WorkerClient(address, "wg", pool_incarnation=incarnation, leader_epoch=-2) as wc:
        with pytest.raises(ClientError, match="got -2"):
            wc.copy_blocks(0, pairs)


def test_cache_tensors_carry_the_arrays_dtype_or_bfloat16_bits():
    from kvservice.client.worker_client import _cache_tensor
    rng = np.random.default_rng(2831)
    bits = rng.integers(1, 2**16, (3, 2, 4)).astype(np.uint16)
    t = _cache_tensor(bits, "bfloat16")
    assert (t.dtype, list(t.shape), t.data) == (2, [3, 2, 4], bits.tobytes())           # DType BFLOAT16 = 2
    f = rng.standard_normal((2, 2, 4)).astype(np.float32)
    t = _cache_tensor(f[:, :, ::2], None)                                              # a strided view: copied
    assert (t.dtype, list(t.shape), t.data) == (3, [2, 2, 2], np.ascontiguousarray(f[:, :, ::2]).tobytes())
    t = _cache_tensor(f, "float16")
    assert (t.dtype, t.data) == (1, f.astype(np.float16).tobytes())                    # FLOAT16 = 1


def test_only_the_calls_that_change_nothing_are_resent_by_grpc():
    from kvservice.client import worker_client as w
    unary = {m.name for m in w.SERVICE.methods if not (m.client_streaming or m.server_streaming)}
    assert w.RESENDABLE == {"Info", "DecodeAttention", "ValidatePageTable", "CheckGuards"} and w.RESENDABLE <= unary
    assert {"AppendKV", "CopyBlocks", "UpdateTables", "CorruptGuard"} <= unary - w.RESENDABLE
    assert w.POLICIES == {"nan": 0, "zeros": 1, "error": 2}


def test_a_persistent_table_reads_as_the_explicit_table(cluster):
    """update_tables: a StepStream reply kept on the worker under a table id; decode through table_id equals decode
    through the same CSR sent in the request, bit for bit."""
    c, wc, _ = cluster
    rng = np.random.default_rng(2832)
    with c.step_stream("g", deltas=False) as s:
        res = s.step(admit=[21, 22], admit_tokens=[6, 9])
        reply = s.last_reply
    st = res.for_layer(0)
    n = len(st.slot_mapping)
    k = rng.standard_normal((n, HEADS, DIM)).astype(np.float32)
    v = rng.standard_normal((n, HEADS, DIM)).astype(np.float32)
    wc.append_kv(0, k, v, st.slot_mapping, slot_generations=st.slot_generations)
    up = wc.update_tables("tbl-2832", reply)
    assert (up.stream_seq, up.batch_size, up.pages_held) == (1, 2, 2 + 3)          # ceil(6/4) + ceil(9/4)
    assert up.pool_incarnation == c.get_pool("g").incarnation
    q = rng.standard_normal((2, HEADS, DIM)).astype(np.float32)
    want = wc.decode_attention(0, q, st.table, generations=st.generations)
    got = wc.decode_attention(0, q, table_id="tbl-2832")
    np.testing.assert_array_equal(got.out, want.out)
    np.testing.assert_array_equal(got.lse, want.lse)
    c.step("g", free=[21, 22])
