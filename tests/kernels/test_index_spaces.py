"""Disjoint index spaces (issue #10, NUMBERING.md) on the worker's NumPy ops and in the
emulated kernels: every table of every space is clean on its own layers and rejected, entry
for entry as wrong_index_space, on every layer of every other space, for every pool kind.
The same matrix runs under ASan in test_sanitizers.py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOL, lse_err, rel_err
from spaces import NUM_SLOTS, POOLS, check_matrix, layer_caches, matrix, rand_storage, space_table

from kvservice.contract.geometry import Geometry
from kvservice.worker import kernels_cpu, ops_numpy, reference
from kvservice.worker.caches import CacheSet


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_cross_space_matrix_numpy_and_emulated(pool: str) -> None:
    spec = POOLS[pool]
    got = {}
    for name, ops in (("numpy", ops_numpy), ("emu", kernels_cpu)):
        rows = matrix(ops, spec, layer_caches(ops, spec))
        check_matrix(rows, spec)
        got[name] = rows
    assert got["numpy"] == got["emu"]


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("ops", [ops_numpy, kernels_cpu], ids=["numpy", "emu"])
def test_own_space_decode_and_append_match_the_oracle(pool: str, ops) -> None:
    """On its own layers a space's table reads the right pages: decode equals the float64
    oracle, which finds pages by raw byte offsets from the geometry (RawLayer), and append
    writes exactly the pages the oracle names."""
    spec = POOLS[pool]
    geo = Geometry(spec, NUM_SLOTS)
    layouts = CacheSet(spec, NUM_SLOTS, 0, len(spec.layers), ops_numpy).layouts
    caches = layer_caches(ops_numpy, spec)
    rng = np.random.default_rng(3)
    for layer, layout in layouts.items():
        ls, buf = spec.layers[layer], caches[layer]
        raw = reference.RawLayer.from_geometry(geo, layer)
        t = space_table(geo.space_of_layer(layer), rng)
        q = rand_storage(rng, (4, 2 * ls.kv_heads, ls.head_dim), ls.dtype)
        res = ops.decode_attention(q, buf, layout, t.indptr, t.indices, t.last_page_len, kv_chunk_pages=1)
        out, lse = reference.decode_attention_ref(q, buf, raw, t.indptr, t.indices, t.last_page_len)
        assert res.record.count == 0
        assert rel_err(res.out, out) <= TOL[ls.dtype] and lse_err(res.lse, lse) <= TOL[ls.dtype], layer
        sm = t.indices[:3].astype(np.int64) * 8 + np.array([0, 7, 3])
        k, v = (rand_storage(rng, (3, ls.kv_heads, ls.head_dim), ls.dtype) for _ in range(2))
        expect = buf.copy()
        for i, s in enumerate(sm):
            page = reference.page_view(expect, raw, int(s) // 8)
            page[0, s % 8], page[1, s % 8] = k[i], v[i]
        assert ops.append_kv(buf, layout, k, v, sm).record.count == 0
        assert np.array_equal(buf.view(np.uint8), expect.view(np.uint8)), layer


def test_worker_refuses_a_layer_whose_pages_pass_int32_before_allocating() -> None:
    """Page tables reach the kernels as int32: a layer of a later index space whose range ends
    past 2^31 (its base counts) cannot run on the worker; a worker holding only that layer is
    refused before any buffer is allocated (the pool would be terabytes)."""
    from kvservice.contract.geometry import CacheSpec, LayerSpec

    n = 2**30 + 1
    spec = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=16)), 16)
    geo = Geometry(spec, n)
    assert geo.index_spaces[1].upper_bound - 1 > 2**31 - 1 >= geo.index_spaces[0].upper_bound - 1
    with pytest.raises(ValueError, match=r"layer 1 of this pool cannot run.*past the int32 page indices"):
        CacheSet(spec, n, 1, 2, ops_numpy)


@pytest.mark.parametrize(("fields", "ok"), [
    ({"offset": 1, "scale": 2, "upper_bound": 9, "base": 1, "pool_pages": 9}, True),
    ({"offset": 1, "scale": 2, "upper_bound": 9, "base": 1, "pool_pages": 8}, False),   # the pool is too small
    ({"offset": 1, "scale": 2, "upper_bound": 9, "base": -1, "pool_pages": 12}, False),
    ({"offset": 2, "scale": 2, "upper_bound": 9, "base": 0, "pool_pages": 9}, False),
    ({"offset": 0, "scale": 3, "upper_bound": 7, "base": 0, "pool_pages": 20}, True),
])
def test_an_index_space_outside_its_pool_is_refused(fields, ok):
    """docs/DESIGN.md's index space: 0 <= offset < scale, base >= 0, and the pool holds pages up to upper_bound;
    each condition alone refuses the layout."""
    from kvservice.worker.page_layout import PageLayout

    layout = PageLayout(page_size=4, kv_heads=2, head_dim=64, dtype="float32", page_stride=2 * 2 * 4 * 64, **fields)
    if ok:
        layout.validate()
    else:
        with pytest.raises(ValueError, match="index space needs 0 <= offset < scale, base >= 0 and pool_pages >= "
                                             "upper_bound"):
            layout.validate()
