"""Manager + two real worker processes on loopback: kernels through RPCs, violations on /metrics, guards, leases."""

import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.geometry import CacheSpec, Geometry, IndexSpace, LayerSpec
from kvservice.contract.pagetable import REASONS, PageTable, validate_page_table
from kvservice.contract.serving import grpc_server
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.examples.generate import Cluster, generate
from kvservice.examples.tiny_model import TinyConfig, TinyModel
from kvservice.v1 import common_pb2 as cpb
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker import ops_numpy, reference
from kvservice.worker.caches import CacheSet
from kvservice.worker.metrics import WorkerMetrics
from kvservice.worker.server import SERVICE_NAME
from kvservice.worker.service import WorkerServicer
from tests.kernels.spaces import NNZ, NUM_SLOTS, POOLS, STATUS_ROWS, space_table

from .conftest import ROOT, ManagerProcess, WorkerProcess

pytestmark = pytest.mark.integration
CFG = TinyConfig(num_layers=4, seed=3)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("system")
    mgr = ManagerProcess(tmp, "--no-pools", "--lease-seconds", "1.5")
    c = BlockManagerClient(mgr.target, timeout=10)
    c.wait_ready()
    c.create_pool("tiny", CacheSpec.uniform(CFG.num_layers, CFG.kv_heads, CFG.head_dim, "float32", 16),
                  Sizing(num_slots=128, max_seq_len=512))
    c.create_pool("hybrid", CacheSpec((LayerSpec(2, 64), LayerSpec(2, 128)), 16, "interleaved"),
                  Sizing(num_slots=16, max_seq_len=128))
    w0 = WorkerProcess(tmp, mgr.target, "tiny", "w0", "0:2")
    w1 = WorkerProcess(tmp, mgr.target, "tiny", "w1", "2:4")
    wh = WorkerProcess(tmp, mgr.target, "hybrid", "wh")
    yield {"mgr": mgr, "client": c, "w0": w0, "w1": w1, "wh": wh, "tmp": tmp}
    for w in (w0, w1, wh):
        if w.proc.poll() is None:
            w.stop()
    c.close()
    mgr.stop()


def test_workers_registered_with_their_layers(system):
    ws = {w.worker_id: w for w in system["client"].workers()}
    assert (ws["w0"].layer_begin, ws["w0"].layer_end, ws["w1"].layer_begin, ws["w1"].layer_end) == (0, 2, 2, 4)
    assert all(w.alive and w.epoch == 1 and w.backend == "cpu" for w in ws.values())
    info = system["w1"].client.info()
    assert info.buffers == ["layer2", "layer3"] and info.cache_bytes == 2 * 128 * 2 * 16 * 2 * 32 * 4


def test_batch_equals_single_and_the_float64_reference(system):
    c, model = system["client"], TinyModel(CFG)
    cluster = Cluster.of(c, "tiny", [(range(0, 2), system["w0"].client), (range(2, 4), system["w1"].client)])
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, CFG.vocab, int(n)).tolist() for n in (7, 16, 17, 40)]
    batch = generate(c, "tiny", cluster, model, prompts, 5, 100)
    singles = [generate(c, "tiny", cluster, model, [p], 5, 200 + i) for i, p in enumerate(prompts)]
    assert np.abs(batch.logits - np.concatenate([s.logits for s in singles])).max() < 1e-4
    for i, p in enumerate(prompts):
        ref = model.reference_logits(p + batch.tokens[i, :-1].tolist())[len(p) - 1:]
        assert np.abs(ref - batch.logits[i]).max() < 1e-4
    assert c.stats("tiny")["tiny"].num_sequences == 0


def test_out_of_bounds_rows_are_nan_and_counted_exactly(system):
    w = system["w1"]
    before = w.metrics()
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, CFG.q_heads, CFG.head_dim)).astype(np.float32)
    idx = np.array([1, 2, 3, 128, 4, -1, 129], dtype=np.int32)
    table = PageTable(np.array([0, 2, 4, 7], np.int32), idx, np.array([5, 16, 1], np.int32))
    att = w.client.decode_attention(3, q, table)
    assert not np.isnan(att.out[0]).any() and np.isnan(att.out[1]).all() and np.isnan(att.out[2]).all()
    v = att.violation
    assert (v.count, v.row, v.position, v.value, v.reason) == (3, 1, 3, 128, "out_of_bounds")
    assert dict(v.counts_by_reason) == {"out_of_bounds": 3}
    zeros = w.client.decode_attention(3, q, table, policy="zeros")
    assert (zeros.out[1:] == 0).all() and np.array_equal(zeros.out[0], att.out[0])
    with pytest.raises(ClientError) as exc:
        w.client.decode_attention(3, q, table, policy="error")
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION and "worker w1" in exc.value.message
    after = w.metrics()
    key = 'kvworker_bounds_violations_total{kernel="decode_attention",layer="3",reason="out_of_bounds"}'
    assert after[key] - before.get(key, 0) == 9
    assert all(after[k] == before.get(k, 0) for k in after if "violations_total" in k and k != key)


def test_append_violations_are_not_written(system):
    w = system["w0"]
    before = w.metrics()
    k = np.ones((3, CFG.kv_heads, CFG.head_dim), np.float32)
    rep = w.client.append_kv(1, k, k, np.array([5, 128 * 16, -2], np.int64))   # -1 would be SKIP_SLOT
    (v,) = rep.violations
    assert (v.count, v.row, v.value, v.kernel) == (2, 1, 128 * 16, "append_kv")
    key = 'kvworker_bounds_violations_total{kernel="append_kv",layer="1",reason="out_of_bounds"}'
    assert w.metrics()[key] - before.get(key, 0) == 2
    assert w.client.check_guards().ok


def test_off_lattice_on_an_interleaved_worker(system):
    c, w = system["client"], system["wh"]
    r = c.step("hybrid", admit=[1, 2], admit_tokens=[40, 9])
    q = np.random.default_rng(1).standard_normal((2, 2, 128)).astype(np.float16)
    good = w.client.decode_attention(1, q, r.for_layer(1).table)
    assert good.violation.count == 0 and np.isfinite(good.out).all()
    assert w.client.validate(1, r.for_layer(1).table).ok
    # Seed 004: layer 1's table (scale 2) fed to layer 0 (scale 4, offset 2). The two index spaces
    # number disjoint page ranges (NUMBERING.md), so every entry is another space's page; the
    # manager's validator must agree entry for entry.
    table = r.for_layer(1).table
    wrong = w.client.validate(0, table)
    plan = c.get_pool("hybrid").plan
    spaces = {s.id: s for s in plan.index_spaces}
    s0 = spaces[r.layer_index_space[0]]
    base = s0.upper_bound - plan.num_slots * s0.scale          # the proto carries the range's end
    host = validate_page_table(table, IndexSpace(s0.id, s0.group, s0.scale, s0.offset, s0.upper_bound, (), base),
                               16, pool_pages=max(s.upper_bound for s in plan.index_spaces))
    nnz = len(table.indices)
    assert not wrong.ok and wrong.violation.count == host.num_violations == nnz
    assert dict(wrong.violation.counts_by_reason) == host.counts() == {"wrong_index_space": nnz}
    v = host.violations[0]
    assert (wrong.violation.row, wrong.violation.position, wrong.violation.value, wrong.violation.reason) == \
        (v.row, v.position, v.value, v.reason)
    text = urllib.request.urlopen(w.metrics_url, timeout=5).read().decode()
    assert f'kvworker_bounds_violations_total{{kernel="validate_page_table",layer="0",reason="wrong_index_space"}} ' \
        f'{float(nnz)}' in text
    assert 'kvworker_bounds_violations_total{kernel="validate_page_table",layer="0",reason="off_lattice"} 0.0' \
        in text
    c.step("hybrid", free=[1, 2])


def test_bad_requests(system):
    w = system["w0"]
    with pytest.raises(ClientError) as exc:
        w.client.decode_attention(3, np.zeros((1, 4, 32), np.float32),
                                  PageTable(np.array([0, 1], np.int32), np.array([0], np.int32),
                                            np.array([1], np.int32)))
    assert exc.value.code == grpc.StatusCode.OUT_OF_RANGE and "holds layers [0, 2)" in exc.value.message
    with grpc.insecure_channel(w.address) as ch:
        stub = wpb_grpc.WorkerStub(ch)
        bad_shape = wpb.AppendKVRequest(layer=0, k=to_tensor(np.zeros((2, 2, 16), np.float32)),
                                        v=to_tensor(np.zeros((2, 2, 16), np.float32)),
                                        slot_mapping=to_tensor(np.zeros(2, np.int64)))
        with pytest.raises(grpc.RpcError) as e:
            stub.AppendKV(bad_shape, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[n, kv_heads, head_dim]" in e.value.details()
        bad_dtype = wpb.AppendKVRequest(layer=0, k=to_tensor(np.zeros((1, 2, 32), np.float16)),
                                        v=to_tensor(np.zeros((1, 2, 32), np.float16)),
                                        slot_mapping=to_tensor(np.zeros(1, np.int64)))
        with pytest.raises(grpc.RpcError) as e:
            stub.AppendKV(bad_dtype, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "FLOAT32" in e.value.details()
        no_table = wpb.DecodeAttentionRequest(layer=0, q=cpb.Tensor(dtype=cpb.FLOAT32, data=b""))
        with pytest.raises(grpc.RpcError) as e:
            stub.DecodeAttention(no_table, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "indptr is required" in e.value.details()


def test_guard_corruption_is_detected(system):
    w = system["w0"]
    assert w.client.check_guards().ok
    w.client.corrupt_guard("layer1", after=True, offset=7)
    rep = w.client.check_guards()
    assert not rep.ok
    bad = {b.buffer: b for b in rep.buffers if b.corrupted_bytes}
    assert list(bad) == ["layer1"] and bad["layer1"].corrupted_bytes == 1
    m = w.metrics()
    assert m['kvworker_guard_corruptions_total{buffer="layer1"}'] == 1.0
    assert m['kvworker_cache_bytes{pool="tiny"}'] == 2 * 128 * 2 * 16 * 2 * 32 * 4


def test_killed_worker_is_marked_dead_and_its_clients_told(system):
    c, tmp, mgr = system["client"], system["tmp"], system["mgr"]
    victim = WorkerProcess(tmp, mgr.target, "tiny", "victim", "0:1")
    assert {w.worker_id: w.alive for w in c.workers()}["victim"]
    victim.proc.kill()
    victim.proc.wait(5)
    deadline = time.time() + 10
    while {w.worker_id: w.alive for w in c.workers()}["victim"]:
        assert time.time() < deadline, "manager never marked the killed worker dead"
        time.sleep(0.2)
    with pytest.raises(ClientError) as exc:
        victim.client.info()
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    assert "worker victim at 127.0.0.1:" in exc.value.message and "unreachable" in exc.value.message
    again = WorkerProcess(tmp, mgr.target, "tiny", "victim", "0:1")      # comes back: a new epoch
    rec = {w.worker_id: w for w in c.workers()}["victim"]
    assert rec.alive and rec.epoch == 2 and rec.address == again.address
    again.stop()
    victim.log.close()


def test_kvctl_workers_lists_them(system):
    import json

    out = subprocess.run([sys.executable, "-m", "kvservice.tools.kvctl", "--target", system["mgr"].target, "workers",
                          "tiny"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "w0" in out.stdout and "0-1" in out.stdout and "alive" in out.stdout
    doc = json.loads(subprocess.run([sys.executable, "-m", "kvservice.tools.kvctl", "--target", system["mgr"].target,
                                     "--json", "workers"], cwd=ROOT, capture_output=True, text=True,
                                    timeout=60).stdout)
    assert {w["worker_id"] for w in doc} >= {"w0", "w1", "wh"}


# ---- a worker service in this process (no manager): every pool kind, hostile slots ---------
@pytest.fixture
def local_worker():
    """Start a WorkerServicer over the NumPy kernels for a CacheSpec on a loopback port."""
    started = []

    def start(spec: CacheSpec, num_slots: int = NUM_SLOTS) -> tuple[WorkerClient, WorkerServicer]:
        caches = CacheSet(spec, num_slots, 0, len(spec.layers), ops_numpy)
        servicer = WorkerServicer(caches, WorkerMetrics("local"), {"worker_id": "local", "pool": "local",
                                                                   "backend": "cpu"})
        server, port, _ = grpc_server(SERVICE_NAME, servicer, "127.0.0.1:0")
        server.start()
        client = WorkerClient(f"127.0.0.1:{port}", "local", timeout=20)
        started.append((server, client))
        return client, servicer

    yield start
    for server, client in started:
        client.close()
        server.stop(0)


def violations(servicer: WorkerServicer, kernel: str, layer: int, reason: str) -> float:
    return servicer.metrics.registry.get_sample_value(
        "kvworker_bounds_violations_total", {"kernel": kernel, "layer": str(layer), "reason": reason})


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_every_space_table_on_every_layer_over_the_validate_rpc(local_worker, pool):
    """NUMBERING.md over the wire: each space's table is clean on its layers and all
    wrong_index_space on every other space's layers (the counter starts at 0 and counts each)."""
    spec = POOLS[pool]
    client, servicer = local_worker(spec)
    geo = Geometry(spec, NUM_SLOTS)
    for layer in range(len(spec.layers)):         # every series exists at 0 before anything happened
        for reason in REASONS:
            assert violations(servicer, "decode_attention", layer, reason) == 0.0, (layer, reason)
    rng = np.random.default_rng(12)
    for space in geo.index_spaces:
        t = space_table(space, rng)
        for layer in range(len(spec.layers)):
            before = violations(servicer, "validate_page_table", layer, "wrong_index_space")
            rep = client.validate(layer, t)
            v = rep.violation
            if layer in space.layers:
                assert rep.ok and v.count == 0, (space.id, layer)
                continue
            assert not rep.ok and (v.count, v.row, v.position, v.value, v.reason) == (
                NNZ, 0, 0, int(t.indices[0]), "wrong_index_space"), (space.id, layer)
            assert dict(v.counts_by_reason) == {"wrong_index_space": NNZ}
            assert from_tensor(rep.row_status, "row_status").tolist() == [16 * x for x in STATUS_ROWS]
            assert violations(servicer, "validate_page_table", layer, "wrong_index_space") - before == NNZ


def test_copy_blocks_checks_slots_before_any_arithmetic(local_worker):
    """Slot -2^63 + 5 times scale 2 wraps to 10 = page of slot 5 in int64: it must be refused as
    out_of_bounds (value = the slot sent), and nothing copied; so must 2^62 + 5 and num_slots."""
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 128)), 16, "interleaved")     # scales 4 and 2
    client, servicer = local_worker(spec)
    caches = servicer.caches
    rng = np.random.default_rng(13)
    for layer in (0, 1):
        caches.cache(layer)[...] = rng.standard_normal(caches.cache(layer).shape).astype(np.float16)
    before = {la: caches.cache(la).copy() for la in (0, 1)}
    hostile = [-(2**63) + 5, 2**62 + 5, NUM_SLOTS, -1]
    pairs = np.array([[h, 2 + i] for i, h in enumerate(hostile)], dtype=np.int64)
    rep = client.copy_blocks(0, pairs)
    assert [v.layer for v in rep.violations] == [0, 1]
    for v in rep.violations:
        assert (v.count, v.row, v.position, v.value, v.reason) == (4, 0, 0, -(2**63) + 5, "out_of_bounds")
        assert dict(v.counts_by_reason) == {"out_of_bounds": 4}
    for la in (0, 1):
        assert np.array_equal(caches.cache(la), before[la]), f"layer {la} changed"
    with pytest.raises(ClientError) as exc:
        client.copy_blocks(0, pairs, policy="error")
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION and str(-(2**63) + 5) in exc.value.message
    # a good pair next to a hostile one is still copied, in every layer of the group
    rep = client.copy_blocks(0, np.array([[1, 4], [-(2**63) + 5, 5]], dtype=np.int64))
    assert [v.count for v in rep.violations] == [1, 1]
    for la in (0, 1):
        layout = caches.layouts[la]
        raw = reference.RawLayer.from_geometry(caches.geometry, la)
        got, src = caches.cache(la), before[la]
        assert np.array_equal(reference.page_view(got, raw, int(layout.page_index(4))),
                              reference.page_view(src, raw, int(layout.page_index(1))))
        assert np.array_equal(reference.page_view(got, raw, int(layout.page_index(5))),
                              reference.page_view(src, raw, int(layout.page_index(5))))
        assert not np.array_equal(reference.page_view(src, raw, int(layout.page_index(5))),
                                  reference.page_view(src, raw, int(layout.page_index(0))))


def test_duplicate_destinations_are_invalid_argument(local_worker):
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 128)), 16, "interleaved")
    client, servicer = local_worker(spec)
    before = servicer.caches.cache(0).copy()
    for pairs, what in (([[1, 4], [2, 4]], "destination slot 4 appears more than once"),
                        ([[1, 2], [2, 3]], "slot 2 is both a source and a destination")):
        with pytest.raises(ClientError) as exc:
            client.copy_blocks(0, np.array(pairs, dtype=np.int64))
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and what in exc.value.message
    k = np.ones((2, 2, 64), np.float16)
    with pytest.raises(ClientError) as exc:
        client.append_kv(0, k, k, np.array([16 * 5 + 3, 16 * 5 + 3], np.int64))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "slot 83 appears more than once" in exc.value.message
    assert np.array_equal(servicer.caches.cache(0), before)
