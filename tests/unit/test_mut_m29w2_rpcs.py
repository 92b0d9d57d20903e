"""The worker's kernel RPCs through gRPC in process (NumPy kernels, float32 caches): K/V appended at random slots then
attended by DecodeAttention equal a plain NumPy softmax attention over those tokens (docs/KERNELS.md: natural-log
lse, default sm_scale 1/sqrt(head_dim), a sliding layer attends its last `window` tokens); CopyBlocks copies
pages of every layer of a group and names a bad slot as sent; each violation is reported and counted by kernel,
layer and reason; the guard hooks, the layer bound, the reply-size bound and the tensor checks answer in words."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.serving import grpc_server
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker import kernels_cpu, ops_numpy
from kvservice.worker.caches import CacheSet
from kvservice.worker.metrics import WorkerMetrics
from kvservice.worker.server import SERVICE_NAME
from kvservice.worker.service import WorkerServicer

PS, SLOTS, KH, QH, D, WINDOW = 4, 40, 2, 4, 32, 6
# layers 0 and 2: full attention (layer group 0); layer 1: sliding window (its own group)
SPEC = CacheSpec((LayerSpec(KH, D, "float32"), LayerSpec(KH, D, "float32", sliding_window=WINDOW),
                  LayerSpec(KH, D, "float32")), PS, "per_layer")


@pytest.fixture
def world(request):
    ops = getattr(request, "param", ops_numpy)
    caches = CacheSet(SPEC, SLOTS, 0, 3, ops, max_seq_len=PS * SLOTS)
    metrics = WorkerMetrics("p")
    servicer = WorkerServicer(caches, metrics, {"worker_id": "w-2", "pool": "p", "epoch": 4, "incarnation": 0,
                                                "backend": "cpu", "device_name": "cpu"}, test_hooks=True)
    server, port, _ = grpc_server(SERVICE_NAME, servicer, "127.0.0.1:0", max_workers=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield wpb_grpc.WorkerStub(channel), servicer, metrics
    finally:
        channel.close()
        server.stop(None)


def _count(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    fams = text_string_to_metric_families(generate_latest(metrics.registry).decode())
    want = tuple(sorted(labels.items()))
    return next(s.value for f in fams for s in f.samples if s.name == name and tuple(sorted(s.labels.items())) == want)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Plain softmax attention of one row: q [QH, D], k/v [T, KH, D] -> out [QH, D], natural-log lse [QH]."""
    out, lse = np.zeros((QH, D)), np.zeros(QH)
    for h in range(QH):
        kv = h // (QH // KH)
        s = (k[:, kv, :].astype(np.float64) @ q[h].astype(np.float64)) * scale
        w = np.exp(s - s.max())
        out[h] = (w[:, None] * v[:, kv, :]).sum(0) / w.sum()
        lse[h] = s.max() + np.log(w.sum())
    return out, lse


def _rows(rng: np.random.Generator, layer: int, lens: list[int], free: list[int]):
    """Pages (from random free slots) of sequences of `lens` tokens in `layer`; (indptr, indices, last_page_len,
    slot mapping of every token, the slots taken)."""
    layout_pages = []
    taken = []
    for n in lens:
        k = -(-n // PS)
        slots = [free.pop() for _ in range(k)]
        taken += slots
        layout_pages.append([int(SPEC_BASE[layer] + s * SPEC_SCALE[layer] + SPEC_OFFSET[layer]) for s in slots])
    indptr = np.cumsum([0] + [len(p) for p in layout_pages]).astype(np.int32)
    indices = np.array([p for ps in layout_pages for p in ps], np.int32)
    lpl = np.array([n - (len(p) - 1) * PS for n, p in zip(lens, layout_pages, strict=True)], np.int32)
    sm = np.array([p[t // PS] * PS + t % PS for n, p in zip(lens, layout_pages, strict=True) for t in range(n)],
                  np.int64)
    return indptr, indices, lpl, sm, taken


SPEC_BASE: dict[int, int] = {}
SPEC_SCALE: dict[int, int] = {}
SPEC_OFFSET: dict[int, int] = {}


@pytest.fixture(autouse=True)
def _lattice(world):
    """Each layer's (base, scale, offset) page lattice, from the pool geometry (docs/DESIGN.md: page = base +
    offset + slot * scale)."""
    _, servicer, _ = world
    for layer, view in enumerate(servicer.caches.geometry.layers):
        SPEC_BASE[layer], SPEC_SCALE[layer], SPEC_OFFSET[layer] = view.base, view.scale, view.offset


@pytest.mark.parametrize(("world", "long_rows"), [(ops_numpy, False), (kernels_cpu, False), (kernels_cpu, True)],
                         indirect=["world"], ids=["numpy", "emulated", "emulated-long-rows"])
def test_appended_tokens_are_attended_as_plain_softmax_attention_on_every_layer(world, long_rows):
    """Rows of random lengths (one longer than the window; short rows beside one of many pages, or only rows of
    several pages: the emulated kernels plan their splits from the longest row) on each layer, sm_scale given or
    default."""
    stub, _, metrics = world
    rng = np.random.default_rng(909)
    for layer in range(3):
        free = [int(s) for s in rng.permutation(SLOTS)]
        if long_rows:
            lens = [int(rng.integers(3 * PS, 4 * PS)), int(rng.integers(6 * PS, 7 * PS)),
                    int(rng.integers(12 * PS, 13 * PS))]
        else:
            lens = [int(n) for n in rng.integers(1, PS, 2)] + [int(rng.integers(1, 5 * PS))] + \
                [int(rng.integers(5 * PS, 6 * PS))]
        ip, idx, lpl, sm, _ = _rows(rng, layer, lens, free)
        k, v = (rng.standard_normal((len(sm), KH, D)).astype(np.float32) for _ in range(2))
        reply = stub.AppendKV(wpb.AppendKVRequest(layer=layer, slot_mapping=to_tensor(sm), k=to_tensor(k),
                                                  v=to_tensor(v)), timeout=60)
        assert not reply.violations
        q = rng.standard_normal((len(lens), QH, D)).astype(np.float32)
        scale = float(rng.uniform(0.05, 0.3)) if layer == 2 else 0.0          # 0: the default, 1/sqrt(D)
        got = stub.DecodeAttention(wpb.DecodeAttentionRequest(
            layer=layer, q=to_tensor(q), indptr=to_tensor(ip), indices=to_tensor(idx), last_page_len=to_tensor(lpl),
            sm_scale=scale), timeout=60)
        assert got.violation.count == 0 and got.violation.reason == ""
        out, lse = from_tensor(got.out, "out", kinds="f"), from_tensor(got.lse, "lse", kinds="f")
        assert out.shape == (len(lens), QH, D) and out.dtype == np.float32 and lse.shape == (len(lens), QH)
        start = np.cumsum([0, *lens])
        for r, n in enumerate(lens):
            first = max(0, n - WINDOW) if layer == 1 else 0
            toks = slice(start[r] + first, start[r] + n)
            want_out, want_lse = _attention(q[r], k[toks], v[toks], scale or 1 / np.sqrt(D))
            np.testing.assert_allclose(out[r], want_out, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(lse[r], want_lse, rtol=1e-4, atol=1e-5)
    for kernel in ("append_kv", "decode_attention"):
        assert _count(metrics, "kvworker_kernel_duration_seconds_count", kernel=kernel) == 3


def test_append_skips_skip_slots_and_reports_a_slot_past_the_pool_by_reason(world):
    """-1 in slot_mapping writes nowhere and is no violation; a slot past the layer's pages is out_of_bounds: one
    violation named with its kernel and layer, counted by reason in the reply and the metrics."""
    stub, servicer, metrics = world
    rng = np.random.default_rng(31)
    layer = int(rng.integers(0, 3))
    upper = servicer.caches.geometry.pool_pages                 # past every index space: out_of_bounds
    sm = np.array([SPEC_BASE[layer] * PS + 1, -1, (upper + int(rng.integers(1, 100))) * PS, -1], np.int64)
    k, v = (rng.standard_normal((4, KH, D)).astype(np.float32) for _ in range(2))
    reply = stub.AppendKV(wpb.AppendKVRequest(layer=layer, slot_mapping=to_tensor(sm), k=to_tensor(k),
                                              v=to_tensor(v)), timeout=60)
    (rec,) = reply.violations
    assert (rec.kernel, rec.layer, rec.count, rec.reason, dict(rec.counts_by_reason)) == \
        ("append_kv", layer, 1, "out_of_bounds", {"out_of_bounds": 1})
    assert _count(metrics, "kvworker_bounds_violations_total", kernel="append_kv", layer=str(layer),
                  reason="out_of_bounds") == 1
    for r in ("off_lattice", "wrong_index_space", "stale_page"):
        assert _count(metrics, "kvworker_bounds_violations_total", kernel="append_kv", layer=str(layer),
                      reason=r) == 0


def test_copy_blocks_copies_every_layer_of_the_group_and_names_a_bad_slot_as_sent(world):
    """CopyBlocks of group 0 (layers 0 and 2): after it, a table of the destination pages attends exactly like
    one of the sources in both layers; a pair whose source slot is past the group is skipped, reported
    out_of_bounds per layer with the slot as sent, and counted per layer."""
    stub, _, metrics = world
    rng = np.random.default_rng(77)
    slots = [int(s) for s in rng.permutation(SLOTS)]
    src, dst = slots[:3], slots[3:6]
    bad = SLOTS                                             # the first slot past the group
    for layer in (0, 2):
        sm = np.array([(SPEC_BASE[layer] + s * SPEC_SCALE[layer] + SPEC_OFFSET[layer]) * PS + t
                       for s in src for t in range(PS)], np.int64)
        k, v = (rng.standard_normal((len(sm), KH, D)).astype(np.float32) for _ in range(2))
        assert not stub.AppendKV(wpb.AppendKVRequest(layer=layer, slot_mapping=to_tensor(sm), k=to_tensor(k),
                                                     v=to_tensor(v)), timeout=60).violations
    pairs = np.array([[s, d] for s, d in zip(src, dst, strict=True)] + [[bad, slots[6]]], np.int64)
    reply = stub.CopyBlocks(wpb.CopyBlocksRequest(group=0, pairs=to_tensor(pairs)), timeout=60)
    # the reply's time is both layers' kernels, as observed one by one in the duration histogram
    assert reply.kernel_seconds == pytest.approx(
        _count(metrics, "kvworker_kernel_duration_seconds_sum", kernel="copy_blocks"), rel=1e-9, abs=0)
    assert _count(metrics, "kvworker_kernel_duration_seconds_count", kernel="copy_blocks") == 2
    assert [(r.kernel, r.layer, r.count, r.reason, r.value, r.row, dict(r.counts_by_reason))
            for r in reply.violations] == [("copy_blocks", la, 1, "out_of_bounds", bad, 3, {"out_of_bounds": 1})
                                           for la in (0, 2)]
    q = rng.standard_normal((1, QH, D)).astype(np.float32)
    for layer in (0, 2):
        outs = []
        for chosen in (src, dst):
            pages = np.array([SPEC_BASE[layer] + s * SPEC_SCALE[layer] + SPEC_OFFSET[layer] for s in chosen], np.int32)
            got = stub.DecodeAttention(wpb.DecodeAttentionRequest(
                layer=layer, q=to_tensor(q), indptr=to_tensor(np.array([0, 3], np.int32)), indices=to_tensor(pages),
                last_page_len=to_tensor(np.array([PS], np.int32))), timeout=60)
            assert got.violation.count == 0
            outs.append(from_tensor(got.out, "out", kinds="f"))
        assert np.array_equal(outs[0], outs[1]) and np.isfinite(outs[0]).all()
        assert _count(metrics, "kvworker_bounds_violations_total", kernel="copy_blocks", layer=str(layer),
                      reason="out_of_bounds") == 1
    with pytest.raises(grpc.RpcError) as err:
        stub.CopyBlocks(wpb.CopyBlocksRequest(group=7, pairs=to_tensor(pairs[:1])), timeout=60)
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert err.value.details() == "worker w-2 holds no layer of group 7"


def test_guards_layers_and_tensors_are_checked_in_words(world):
    """Info names what is served; CheckGuards lists every buffer clean (first offset -1); CorruptGuard flips a byte
    of a front zone, which CheckGuards then names at that offset and counts; a bad buffer, an offset past the
    guard, a layer not held, a wrong dtype and a reply past the message limit are refused with what to do."""
    stub, servicer, metrics = world
    g = servicer.caches.guard_bytes
    info = stub.Info(wpb.WorkerInfoRequest(), timeout=30)
    assert (info.worker_id, info.pool, info.epoch, info.layer_begin, info.layer_end, info.backend, info.guard_bytes,
            list(info.buffers)) == ("w-2", "p", 4, 0, 3, "cpu", g, ["layer0", "layer1", "layer2"])
    assert info.cache_bytes == 3 * SLOTS * 2 * PS * KH * D * 4
    clean = stub.CheckGuards(wpb.CheckGuardsRequest(), timeout=30)
    assert clean.ok and [(b.buffer, b.corrupted_bytes, b.first_offset) for b in clean.buffers] == \
        [(f"layer{i}", 0, -1) for i in range(3)]
    at = int(np.random.default_rng(5).integers(0, g - 1))
    stub.CorruptGuard(wpb.CorruptGuardRequest(buffer="layer1", offset=at + 1), timeout=30)
    stub.CorruptGuard(wpb.CorruptGuardRequest(buffer="layer1", offset=at), timeout=30)
    hit = stub.CheckGuards(wpb.CheckGuardsRequest(), timeout=30)
    assert not hit.ok and [(b.buffer, b.corrupted_bytes, b.first_offset) for b in hit.buffers] == \
        [("layer0", 0, -1), ("layer1", 2, at), ("layer2", 0, -1)]
    assert _count(metrics, "kvworker_guard_corruptions_total", buffer="layer1") == 2
    assert _count(metrics, "kvworker_guard_corruptions_total", buffer="layer0") == 0

    def refused(call, request, code, text):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=30)
        assert (err.value.code(), err.value.details()) == (code, text)

    bad = grpc.StatusCode.INVALID_ARGUMENT
    refused(stub.CorruptGuard, wpb.CorruptGuardRequest(buffer="layer9"), bad,
            "no buffer 'layer9'; buffers: layer0, layer1, layer2")
    refused(stub.CorruptGuard, wpb.CorruptGuardRequest(buffer="layer0", offset=g), bad,
            f"offset {g} is outside the {g}-byte guard")
    refused(stub.AppendKV, wpb.AppendKVRequest(layer=3), grpc.StatusCode.OUT_OF_RANGE,
            "worker w-2 holds layers [0, 3) of pool 'p', not layer 3")
    sm = np.array([SPEC_BASE[0] * PS], np.int64)
    refused(stub.AppendKV, wpb.AppendKVRequest(layer=0, slot_mapping=to_tensor(sm),
                                               k=to_tensor(np.ones((1, KH, D), np.float16))), bad,
            f"k must be FLOAT32 [n, kv_heads, head_dim] = [1, {KH}, {D}], got FLOAT16")
    refused(stub.AppendKV, wpb.AppendKVRequest(layer=0, slot_mapping=to_tensor(sm),
                                               k=to_tensor(np.ones((1, KH, D), np.float32))), bad,
            f"v is required: [n, kv_heads, head_dim] = [1, {KH}, {D}]")
    # the DecodeAttention reply: out float32 [B, QH, D] and lse float32 [B, QH], and 256 bytes of framing
    b = 3
    need = 4 * b * QH * D + 4 * b * QH + 256
    q = np.zeros((b, QH, D), np.float32)
    req = wpb.DecodeAttentionRequest(layer=0, q=to_tensor(q), indptr=to_tensor(np.zeros(b + 1, np.int32)),
                                     indices=to_tensor(np.zeros(0, np.int32)),
                                     last_page_len=to_tensor(np.zeros(b, np.int32)))
    servicer.max_reply_bytes = need
    out = stub.DecodeAttention(req, timeout=30)                       # empty rows: zeros, lse -inf
    assert not from_tensor(out.out, "out", kinds="f").any()
    assert np.isneginf(from_tensor(out.lse, "lse", kinds="f")).all()
    servicer.max_reply_bytes = need - 1
    with pytest.raises(grpc.RpcError) as err:
        stub.DecodeAttention(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"would take {need} bytes, more than the message limit of {need - 1} bytes" in err.value.details()

    refused(stub.DecodeAttention, wpb.DecodeAttentionRequest(layer=0, q=to_tensor(np.zeros((b, KH + 1, D), np.float32)),
                                                             indptr=req.indptr, indices=req.indices,
                                                             last_page_len=req.last_page_len), bad,
            f"DecodeAttention: q: num_q_heads {KH + 1} must be a positive multiple of kv_heads {KH}")
    refused(stub.ValidatePageTable, wpb.WorkerValidateRequest(layer=0, indptr=to_tensor(np.zeros(0, np.int32)),
                                                              indices=req.indices, last_page_len=req.last_page_len),
            bad, "indptr must have B + 1 >= 1 entries")


@pytest.mark.parametrize("stale", [1, 2, 4])
def test_pages_read_under_another_generation_are_counted_stale_one_by_one(world, stale):
    """docs/KERNELS.md, page generations: tokens appended under generation g; a table expecting g for some pages
    and another generation for k >= 2 others reads those k stale_page: the violation's count is k, counted by
    reason in the reply and k in the metrics (validate and decode alike); the rows hit are flagged."""
    stub, _, metrics = world
    rng = np.random.default_rng(12)
    layer = 0
    slots = [int(s) for s in rng.permutation(SLOTS)[:6]]
    pages = np.array([SPEC_BASE[0] + s * SPEC_SCALE[0] + SPEC_OFFSET[0] for s in slots], np.int32)
    gen = int(rng.integers(2, 2**31))
    sm = np.array([p * PS + t for p in pages for t in range(PS)], np.int64)
    k, v = (rng.standard_normal((len(sm), KH, D)).astype(np.float32) for _ in range(2))
    assert not stub.AppendKV(wpb.AppendKVRequest(layer=layer, slot_mapping=to_tensor(sm), k=to_tensor(k),
                                                 v=to_tensor(v), slot_generations=to_tensor(
                                                     np.full(len(sm), gen, np.uint32))), timeout=60).violations
    gens = np.full(6, gen, np.uint32)
    hit = [0, *rng.choice(np.arange(1, 6), stale - 1, replace=False).tolist()]   # rows 0 and 1 (3 pages each)
    gens[hit] = gen - 1
    ip, lpl = np.array([0, 3, 6], np.int32), np.array([PS, PS], np.int32)
    val = stub.ValidatePageTable(wpb.WorkerValidateRequest(layer=layer, indptr=to_tensor(ip), indices=to_tensor(pages),
                                                           last_page_len=to_tensor(lpl), generations=to_tensor(gens)),
                                 timeout=60)
    assert not val.ok and (val.violation.count, val.violation.reason) == (stale, "stale_page")
    assert dict(val.violation.counts_by_reason) == {"stale_page": stale}
    rows_hit = [any(h // 3 == r for h in hit) for r in range(2)]
    assert [x != 0 for x in from_tensor(val.row_status, "rs").tolist()] == rows_hit
    q = rng.standard_normal((2, QH, D)).astype(np.float32)
    dec = stub.DecodeAttention(wpb.DecodeAttentionRequest(layer=layer, q=to_tensor(q), indptr=to_tensor(ip),
                                                          indices=to_tensor(pages), last_page_len=to_tensor(lpl),
                                                          generations=to_tensor(gens)), timeout=60)
    assert (dec.violation.count, dict(dec.violation.counts_by_reason)) == (stale, {"stale_page": stale})
    out = from_tensor(dec.out, "out", kinds="f")
    assert [bool(np.isnan(out[r]).all()) for r in range(2)] == rows_hit      # a row hit is NaN (the default)
    assert [bool(np.isfinite(out[r]).all()) for r in range(2)] == [not h for h in rows_hit]
    for kernel in ("validate_page_table", "decode_attention"):
        assert _count(metrics, "kvworker_bounds_violations_total", kernel=kernel, layer="0",
                      reason="stale_page") == stale


def test_each_bad_entry_is_counted_under_its_own_reason_and_an_error_policy_refuses_after_counting(world):
    """On the sliding layer (its own index space): a page of layer 0's space is wrong_index_space there (not a
    stale page), two pages past the pool are out_of_bounds twice; AppendKV with two slots past the pool counts
    2. Under policy ERROR the call is refused FAILED_PRECONDITION naming the violation, and still counted."""
    stub, servicer, metrics = world
    rng = np.random.default_rng(55)
    own = [SPEC_BASE[1] + int(s) * SPEC_SCALE[1] + SPEC_OFFSET[1] for s in rng.choice(SLOTS, 2, replace=False)]
    other = SPEC_BASE[0] + int(rng.integers(SLOTS)) * SPEC_SCALE[0] + SPEC_OFFSET[0]
    far = servicer.caches.geometry.pool_pages + int(rng.integers(1, 50))             # past every index space
    pages = np.array([own[0], other, far, own[1], far + 1], np.int32)
    rep = stub.ValidatePageTable(wpb.WorkerValidateRequest(
        layer=1, indptr=to_tensor(np.array([0, 2, 5], np.int32)), indices=to_tensor(pages),
        last_page_len=to_tensor(np.array([PS, 1], np.int32))), timeout=60)
    assert (rep.violation.count, rep.violation.position, rep.violation.reason) == (3, 1, "wrong_index_space")
    assert dict(rep.violation.counts_by_reason) == {"wrong_index_space": 1, "out_of_bounds": 2}
    for reason, n in (("wrong_index_space", 1), ("out_of_bounds", 2), ("stale_page", 0)):
        assert _count(metrics, "kvworker_bounds_violations_total", kernel="validate_page_table", layer="1",
                      reason=reason) == n
    upper = servicer.caches.geometry.pool_pages
    sm = np.array([upper * PS, SPEC_BASE[2] * PS, (upper + 3) * PS + 1], np.int64)
    k, v = (rng.standard_normal((3, KH, D)).astype(np.float32) for _ in range(2))
    req = wpb.AppendKVRequest(layer=2, slot_mapping=to_tensor(sm), k=to_tensor(k), v=to_tensor(v))
    (rec,) = stub.AppendKV(req, timeout=60).violations
    assert (rec.count, rec.position, dict(rec.counts_by_reason)) == (2, 0, {"out_of_bounds": 2})
    req.policy = wpb.POLICY_ERROR if hasattr(wpb, "POLICY_ERROR") else 2
    with pytest.raises(grpc.RpcError) as err:
        stub.AppendKV(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "out_of_bounds" in err.value.details()
    assert _count(metrics, "kvworker_bounds_violations_total", kernel="append_kv", layer="2",
                  reason="out_of_bounds") == 4
    q = rng.standard_normal((2, QH, D)).astype(np.float32)
    dec = wpb.DecodeAttentionRequest(layer=1, q=to_tensor(q), indptr=to_tensor(np.array([0, 2, 5], np.int32)),
                                     indices=to_tensor(pages), last_page_len=to_tensor(np.array([PS, 1], np.int32)),
                                     policy=req.policy)
    with pytest.raises(grpc.RpcError) as err:
        stub.DecodeAttention(dec, timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    for reason, n in (("wrong_index_space", 1), ("out_of_bounds", 2)):
        assert _count(metrics, "kvworker_bounds_violations_total", kernel="decode_attention", layer="1",
                      reason=reason) == n


def test_copy_pairs_and_incarnations_are_checked_before_any_copy(world):
    """Two pairs whose destinations are both past the group are two out_of_bounds (each bad slot its own page, never
    equal); two pairs with one destination are INVALID_ARGUMENT naming it; a call planned in another incarnation
    of the pool is FAILED_PRECONDITION naming both; incarnation 0 is not checked."""
    stub, servicer, _ = world
    rng = np.random.default_rng(71)
    a, b, c = (int(s) for s in rng.choice(SLOTS, 3, replace=False))
    two_bad = np.array([[a, SLOTS], [b, SLOTS + 5]], np.int64)
    reply = stub.CopyBlocks(wpb.CopyBlocksRequest(group=1, pairs=to_tensor(two_bad)), timeout=60)
    (rec,) = reply.violations
    assert (rec.layer, rec.count, rec.reason, rec.value, dict(rec.counts_by_reason)) == \
        (1, 2, "out_of_bounds", SLOTS, {"out_of_bounds": 2})
    dup = np.array([[a, c], [b, c]], np.int64)
    with pytest.raises(grpc.RpcError) as err:
        stub.CopyBlocks(wpb.CopyBlocksRequest(group=1, pairs=to_tensor(dup)), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"destination slot {c} appears more than once" in err.value.details()
    servicer.identity["incarnation"] = mine = int(rng.integers(1, 2**62))
    ok = wpb.CopyBlocksRequest(group=1, pairs=to_tensor(np.array([[a, c]], np.int64)))
    assert not stub.CopyBlocks(ok, timeout=60).violations                    # no incarnation named: not checked
    ok.pool_incarnation = mine
    assert not stub.CopyBlocks(ok, timeout=60).violations
    ok.pool_incarnation = mine + 1
    with pytest.raises(grpc.RpcError) as err:
        stub.CopyBlocks(ok, timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"holds memory planned for incarnation {mine} of pool 'p'; this request was planned in incarnation " \
           f"{mine + 1}" in err.value.details()


def test_an_mla_layer_takes_latents_in_k_only_and_refuses_decode():
    """A K-only (multi-head latent attention) layer: AppendKV with the latents in k and no v (or an empty v) writes
    them; a non-empty v is INVALID_ARGUMENT saying how to send them; DecodeAttention is FAILED_PRECONDITION (the
    worker's kernels attend K and V per head)."""
    spec = CacheSpec((LayerSpec(1, 64, "float32", k_only=True),), PS, "per_layer")
    caches = CacheSet(spec, 16, 0, 1, ops_numpy, max_seq_len=64)
    servicer = WorkerServicer(caches, WorkerMetrics("m"), {"worker_id": "w-m", "pool": "m", "epoch": 1,
                                                           "incarnation": 0, "backend": "cpu"})
    server, port, _ = grpc_server(SERVICE_NAME, servicer, "127.0.0.1:0", max_workers=2)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = wpb_grpc.WorkerStub(ch)
            layout = caches.layouts[0]
            sm = np.array([int(layout.page_index(3)) * PS + 1], np.int64)
            lat = np.random.default_rng(4).standard_normal((1, 1, 64)).astype(np.float32)
            for v in (None, np.zeros((0,), np.float32)):
                req = wpb.AppendKVRequest(layer=0, slot_mapping=to_tensor(sm), k=to_tensor(lat))
                if v is not None:
                    req.v.CopyFrom(to_tensor(v))
                assert not stub.AppendKV(req, timeout=30).violations
            req.v.CopyFrom(to_tensor(lat))
            with pytest.raises(grpc.RpcError) as err:
                stub.AppendKV(req, timeout=30)
            assert (err.value.code(), err.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT, "layer 0 caches multi-head latent attention (MLA) latents (K only): "
                "send them as k and leave v empty")
            with pytest.raises(grpc.RpcError) as err:
                stub.DecodeAttention(wpb.DecodeAttentionRequest(layer=0), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert err.value.details().startswith("layer 0 caches multi-head latent attention (MLA) latents; decode")
    finally:
        server.stop(None)
