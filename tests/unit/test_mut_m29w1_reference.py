"""kvservice.worker.reference (the float64 oracle of the kernel tests) against hand-computed byte offsets, a
geometry whose offsets are worked out by hand from docs/DESIGN.md's rules, and a plain-NumPy attention: an oracle
that is wrong would let a wrong kernel pass, so it is checked on its own."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvservice.contract.geometry import CacheSpec, Geometry, LayerSpec
from kvservice.worker import reference
from kvservice.worker.reference import RawLayer


def _np_attention(q, k_rows, v_rows, scale, window=0):
    """q [hq, d] float64, k_rows/v_rows [T, kh, d] float64: out [hq, d], lse [hq] by plain NumPy."""
    if window:
        k_rows, v_rows = k_rows[-window:], v_rows[-window:]
    hq, kh = q.shape[0], k_rows.shape[1]
    out, lse = np.zeros(q.shape), np.zeros(hq)
    for h in range(hq):
        s = k_rows[:, h // (hq // kh)] @ q[h] * scale
        m = s.max()
        e = np.exp(s - m)
        out[h], lse[h] = e @ v_rows[:, h // (hq // kh)] / e.sum(), m + math.log(e.sum())
    return out, lse


def test_tolerance_is_the_documented_1e_5_for_every_cache_dtype():
    assert reference.TOLERANCE == {"float32": 1e-5, "float16": 1e-5, "bfloat16": 1e-5}


def test_raw_layer_constructors_by_hand():
    """per_layer: a slot is one page of 2 x page_size x kv_heads x head_dim x itemsize bytes; interleaved: scale =
    slot_bytes / page bytes, offset = byte_offset / page bytes."""
    r = RawLayer.per_layer(7, 4, 2, 64, "float16", base=3)
    assert r == RawLayer(7, 2048, 0, 1, 0, 3, 4, 2, 64, "float16") and r.page_bytes == 2048
    assert RawLayer.per_layer(2, 8, 1, 32, "float32").page_bytes == 2 * 8 * 32 * 4
    r = RawLayer.interleaved(6, 8192, 4096, 4, 2, 64, "bfloat16", base=11)
    assert r == RawLayer(6, 8192, 4096, 4, 2, 11, 4, 2, 64, "bfloat16")
    assert type(r.scale) is int and type(r.offset) is int
    r = RawLayer.interleaved(3, 3 * 1024, 2048, 2, 1, 64, "float32")          # page 2*2*64*4 = 1024 bytes
    assert (r.scale, r.offset, r.page_bytes) == (3, 2, 1024)


def test_from_geometry_matches_the_hand_worked_pool():
    """Two layers at page_size 4, float16: layer 0 (2 kv heads, head_dim 64) has 2048-byte pages, layer 1 (1 kv head)
    1024. Interleaved: largest first, layer 0 at byte 0, layer 1 at 2048, slot 4096 bytes; layer 0's space
    (scale 2, offset 0) numbers pages [0, 10), layer 1's (scale 4, offset 2) [10, 30). Per layer: one space,
    each layer's buffer is its own pages."""
    layers = (LayerSpec(2, 64, "float16"), LayerSpec(1, 64, "float16"))
    geo = Geometry(CacheSpec(layers, 4, "interleaved"), 5)
    assert RawLayer.from_geometry(geo, 0) == RawLayer(5, 4096, 0, 2, 0, 0, 4, 2, 64, "float16")
    assert RawLayer.from_geometry(geo, 1) == RawLayer(5, 4096, 2048, 4, 2, 10, 4, 1, 64, "float16")
    geo = Geometry(CacheSpec(layers, 4, "per_layer"), 5)
    assert RawLayer.from_geometry(geo, 0) == RawLayer(5, 2048, 0, 1, 0, 0, 4, 2, 64, "float16")
    assert RawLayer.from_geometry(geo, 1) == RawLayer(5, 1024, 0, 1, 0, 0, 4, 1, 64, "float16")


def test_byte_offset_of_and_page_view():
    r = RawLayer(4, 96, 32, 3, 1, 10, 2, 1, 4, "float16")   # 2 x 2 x 1 x 4 x 2 = 32-byte pages, page 10 + 3x + 1
    assert [r.byte_offset_of(p) for p in (11, 14, 17, 20)] == [32, 128, 224, 320]
    for bad in (10, 12, 8, 23, 26):
        with pytest.raises(IndexError, match=f"^page {bad} is no slot of this layer \\(base 10, scale 3, offset 1, "
                                             f"4 slots\\)$"):
            r.byte_offset_of(bad)
    buf = np.arange(4 * 96 // 2, dtype=np.uint16).view(np.float16)    # element i holds bit pattern i
    view = reference.page_view(buf, r, 14)
    assert view.shape == (2, 2, 1, 4) and view.dtype == np.float16
    assert view.view(np.uint16).reshape(-1).tolist() == list(range(64, 80))
    view[1, 0, 0, 2] = 7.0                                            # a view: writes reach the buffer
    assert buf[64 + 10] == np.float16(7.0)
    assert reference.page_view(buf[:176], r, 20).shape == (2, 2, 1, 4)       # ends exactly at the buffer's end
    with pytest.raises(IndexError, match=r"^page 20 ends at byte 352, past the 320-byte buffer$"):
        reference.page_view(buf[:160], r, 20)
    with pytest.raises(ValueError, match="C-contiguous"):
        reference.page_view(np.zeros((192, 2), np.float16)[:, 0], r, 11)


def test_to_float64_widens_each_storage_dtype_exactly():
    rng = np.random.default_rng(5)
    f = rng.uniform(-3, 3, 50).astype(np.float32)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)
    got = reference.to_float64(bits, "bfloat16")
    assert got.dtype == torch.float64
    assert got.numpy().tolist() == (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64).tolist()
    h = f.astype(np.float16)
    assert reference.to_float64(h, "float16").numpy().tolist() == [float(x) for x in h]
    assert reference.to_float64(f, "float32").numpy().tolist() == [float(x) for x in f]


def _pool(rng, slots=9, ps=4, kh=2, d=32):
    buf = (rng.uniform(0.1, 1.0, (slots, 2, ps, kh, d)) * rng.choice([-1, 1], (slots, 2, ps, kh, d)))
    return buf.astype(np.float32), RawLayer.per_layer(slots, ps, kh, d, "float32")


def test_gather_pages_concatenates_whole_pages_and_the_last_pages_tokens():
    rng = np.random.default_rng(6)
    buf, raw = _pool(rng)
    ip, idx, lpl = np.array([0, 3, 3, 4]), np.array([5, 0, 7, 2]), np.array([2, 4, 1])
    k, v = reference.gather_pages(buf, raw, ip, idx, lpl, 0)
    assert k.dtype == torch.float64 and k.shape == (10, 2, 32)
    assert np.array_equal(k.numpy(), np.concatenate([buf[5, 0], buf[0, 0], buf[7, 0, :2]]))
    assert np.array_equal(v.numpy(), np.concatenate([buf[5, 1], buf[0, 1], buf[7, 1, :2]]))
    k, v = reference.gather_pages(buf, raw, ip, idx, lpl, 1)
    assert k.shape == v.shape == (0, 2, 32)
    k, v = reference.gather_pages(buf, raw, ip, idx, lpl, 2)
    assert np.array_equal(k.numpy(), buf[2, 0, :1]) and np.array_equal(v.numpy(), buf[2, 1, :1])


@pytest.mark.parametrize("seed", [7, 8])
def test_decode_attention_ref_equals_plain_numpy_attention(seed: int):
    """Rows of 1..3 pages with GQA (4 q heads over 2 kv heads), an sm_scale, a window; an empty row gives 0 and
    lse -inf; a row with a page no slot holds is NaN. float64 throughout (1e-12)."""
    rng = np.random.default_rng(seed)
    buf, raw = _pool(rng)
    ip, idx, lpl = np.array([0, 3, 3, 4, 6]), np.array([5, 0, 7, 2, 8, 40]), np.array([2, 4, 3, 1])
    q = rng.uniform(-1, 1, (4, 4, 32)).astype(np.float32)
    rows = [np.concatenate([buf[5], buf[0], buf[7][:, :2]], axis=1), None, buf[2][:, :3]]
    for kw, scale in (({}, 1 / math.sqrt(32)), ({"sm_scale": 0.61}, 0.61), ({"sm_scale": 0.61, "window": 5}, 0.61)):
        out, lse = reference.decode_attention_ref(q, buf, raw, ip, idx, lpl, **kw)
        assert out.dtype == np.float64 and lse.dtype == np.float64
        assert out.shape == (4, 4, 32) and lse.shape == (4, 4)
        for r in (0, 2):
            o, s = _np_attention(q[r].astype(np.float64), rows[r][0].astype(np.float64),
                                 rows[r][1].astype(np.float64), scale, kw.get("window", 0))
            np.testing.assert_allclose(out[r], o, rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(lse[r], s, rtol=1e-12, atol=1e-14)
        assert (out[1] == 0).all() and (lse[1] == -np.inf).all()
        assert np.isnan(out[3]).all() and np.isnan(lse[3]).all()


def test_decode_attention_ref_window_keeps_the_last_tokens():
    """A window of 1 attends the row's last token only: out = its V, lse = its score."""
    rng = np.random.default_rng(9)
    buf, raw = _pool(rng, kh=1)
    ip, idx, lpl = np.array([0, 2]), np.array([3, 6]), np.array([3])
    q = rng.uniform(-1, 1, (1, 2, 32)).astype(np.float32)
    out, lse = reference.decode_attention_ref(q, buf, raw, ip, idx, lpl, window=1, sm_scale=0.5)
    last_k, last_v = buf[6, 0, 2, 0].astype(np.float64), buf[6, 1, 2, 0].astype(np.float64)
    np.testing.assert_allclose(out[0], np.stack([last_v, last_v]), rtol=1e-12)
    np.testing.assert_allclose(lse[0], q[0].astype(np.float64) @ last_k * 0.5, rtol=1e-12)


def test_row_rel_err_by_hand():
    ref = np.array([[1.0, 2.5, -1.0], [3.0, 4.0, 0.5]])
    a = np.array([[1.0, 2.0, -1.0], [3.0, 4.4, 0.5]])
    assert reference.row_rel_err(a, ref) == pytest.approx(max(0.5 / 2.5, 0.4 / 4.0), rel=1e-15)
    assert reference.row_rel_err(ref, ref) == 0.0
    # rows are axis 0 of any shape: [2, 2, 3] -> 2 rows of 6
    ref3 = np.stack([ref, 10 * ref])
    a3 = ref3.copy()
    a3[1, 0, 1] += 2.0                                               # 2 / 40 in row 1
    assert reference.row_rel_err(a3, ref3) == pytest.approx(2.0 / 40.0, rel=1e-15)
    # 1-D: one value per row
    assert reference.row_rel_err(np.array([2.0, 5.5]), np.array([2.0, 5.0])) == pytest.approx(0.1, rel=1e-15)
    # non-finite entries must match exactly; an all-NaN reference row is skipped
    lse_ref = np.array([[-np.inf, 1.0], [np.nan, np.nan], [2.0, 3.0]])
    assert reference.row_rel_err(np.array([[-np.inf, 1.0], [7.0, 7.0], [2.0, 3.0]]), lse_ref) == 0.0
    assert reference.row_rel_err(np.array([[0.0, 1.0], [7.0, 7.0], [2.0, 3.0]]), lse_ref) == math.inf
    assert reference.row_rel_err(np.array([[-np.inf, 1.0], [7.0, 7.0], [2.0, np.inf]]), lse_ref) == math.inf
    assert reference.row_rel_err(np.array([[np.inf, 1.0], [7.0, 7.0], [2.0, 3.0]]), lse_ref) == math.inf
    # floor: a reference near 0 is judged by the absolute error when floor=1
    small, off = np.array([[1e-3, -2e-3]]), np.array([[1e-3, -2e-3 + 1e-4]])
    assert reference.row_rel_err(off, small) == pytest.approx(1e-4 / 2e-3, rel=1e-9)
    assert reference.row_rel_err(off, small, floor=1.0) == pytest.approx(1e-4, rel=1e-9)
    with pytest.raises(ValueError):
        reference.row_rel_err(np.zeros((3, 2)), np.zeros((2, 2)))     # rows must pair up
