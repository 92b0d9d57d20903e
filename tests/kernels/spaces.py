"""Pools of every kind and the cross-space matrix (issue #10, NUMBERING.md): a table built for
each index space with kvservice.contract.geometry must be clean on that space's layers and rejected,
entry for entry as ``wrong_index_space``, on every layer of every other space; append and
copy through another space's pages must write nothing. Shared by test_index_spaces.py
(NumPy ops and the emulated kernels), asan_driver.py (the same under ASan) and
tests/integration/test_worker.py (the worker's ValidatePageTable RPC)."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from kvservice.contract.geometry import CacheSpec, Geometry, IndexSpace, LayerSpec
from kvservice.contract.pagetable import PageTable

NUM_SLOTS = 6
PAGE = 8
NNZ = 6                          # entries of a space_table: rows of 2, 0, 3 and 1 pages
STATUS_ROWS = [1, 0, 1, 1]       # rows of a space_table that hold a page
POOLS: dict[str, CacheSpec] = {
    "per_layer-full": CacheSpec.uniform(2, 2, 32, "float32", PAGE),
    "per_layer-sliding": CacheSpec((LayerSpec(2, 32, "float16"), LayerSpec(2, 32, "float16", sliding_window=16)),
                                   PAGE),
    "per_layer-mixed": CacheSpec((LayerSpec(2, 32, "float16"), LayerSpec(1, 64, "bfloat16"),
                                  LayerSpec(2, 32, "float32", sliding_window=16)), PAGE),
    "interleaved-full": CacheSpec((LayerSpec(2, 32, "float16"), LayerSpec(1, 64, "float16"),
                                   LayerSpec(1, 32, "float16")), PAGE, "interleaved"),
    "interleaved-sliding": CacheSpec((LayerSpec(2, 32, "bfloat16"), LayerSpec(2, 32, "bfloat16", sliding_window=16)),
                                     PAGE, "interleaved"),
    "interleaved-mixed": CacheSpec((LayerSpec(2, 32, "float16"), LayerSpec(2, 64, "float16"),
                                    LayerSpec(1, 32, "bfloat16", sliding_window=16),
                                    LayerSpec(2, 32, "bfloat16", sliding_window=16), LayerSpec(1, 128, "float32")),
                                   PAGE, "interleaved"),
}


def space_table(space: IndexSpace, rng: np.random.Generator) -> PageTable:
    """A clean table of 4 rows (one empty) over distinct random slots of ``space``, int32."""
    pages = [2, 0, 3, 1]
    slots = rng.permutation(NUM_SLOTS)[: sum(pages)]
    indices = space.page_indices(slots).astype(np.int32)
    indptr = np.concatenate(([0], np.cumsum(pages))).astype(np.int32)
    lpl = np.array([rng.integers(1, PAGE + 1) if n else 0 for n in pages], dtype=np.int32)
    return PageTable(indptr, indices, lpl)


def record(r) -> list:
    return [r.count, r.row, r.position, r.value, r.reason]


def matrix(ops: ModuleType, spec: CacheSpec, caches: dict[int, np.ndarray], seed: int = 0) -> list[dict]:
    """Run validate, decode (split and not), append and copy with every space's pages on every
    layer. ``caches``: layer -> its buffer (an exact-size array, so a sanitizer sees any stray
    access). Returns one row per (space, layer, kernel) with the record and whether the
    layer's buffer kept every byte (append/copy through another space)."""
    from kvservice.worker.caches import CacheSet

    geo = Geometry(spec, NUM_SLOTS)
    layouts = CacheSet(spec, NUM_SLOTS, 0, len(spec.layers), ops).layouts
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    for space in geo.index_spaces:
        t = space_table(space, rng)
        for layer, layout in layouts.items():
            ls, buf = spec.layers[layer], caches[layer]
            own = geo.layers[layer].index_space == space.id
            before = buf.copy()
            res = ops.validate_page_table(t.indptr, t.indices, t.last_page_len, layout)
            out = {"space": space.id, "layer": layer, "own": own}
            rows.append({**out, "kernel": "validate", "record": record(res.record), "first": int(t.indices[0]),
                         "row_status": np.asarray(res.row_status).tolist()})
            q = rand_storage(rng, (4, 2 * ls.kv_heads, ls.head_dim), ls.dtype)
            for split in (0, 1):
                d = ops.decode_attention(q, buf, layout, t.indptr, t.indices, t.last_page_len, kv_chunk_pages=split)
                rows.append({**out, "kernel": f"decode-{split}", "record": record(d.record), "first": int(t.indices[0]),
                             "nan_rows": np.isnan(d.lse).all(axis=1).tolist(),
                             "finite_rows": np.isfinite(d.out).all(axis=(1, 2)).tolist()})
            # append: one token into each of the first 3 pages, at distinct offsets
            sm = t.indices[:3].astype(np.int64) * PAGE + np.arange(3)
            kv = rand_storage(rng, (3, ls.kv_heads, ls.head_dim), ls.dtype)
            a = ops.append_kv(buf, layout, kv, kv, sm)
            kept = np.array_equal(buf.view(np.uint8), before.view(np.uint8))
            rows.append({**out, "kernel": "append", "record": record(a.record), "kept": kept, "first": int(sm[0])})
            buf[...] = before
            pairs = np.stack([t.indices[:2], t.indices[4:6]], axis=1).astype(np.int64)
            c = ops.copy_blocks([buf], layout, pairs)
            kept = np.array_equal(buf.view(np.uint8), before.view(np.uint8))
            rows.append({**out, "kernel": "copy", "record": record(c.record), "kept": kept,
                         "first": int(pairs[0, 0])})
            buf[...] = before
    return rows


def rand_storage(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    x = rng.uniform(0.1, 1.0, shape).astype(np.float32) * rng.choice([-1.0, 1.0], shape).astype(np.float32)
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(dtype)


def layer_caches(ops: ModuleType, spec: CacheSpec, seed: int = 1) -> dict[int, np.ndarray]:
    """Each layer's buffer as its own exact-size array (a copy of the CacheSet payload with random data)."""
    from kvservice.worker.caches import CacheSet

    cs = CacheSet(spec, NUM_SLOTS, 0, len(spec.layers), ops)
    rng = np.random.default_rng(seed)
    out = {}
    for layer in cs.layouts:
        view = cs.cache(layer)
        out[layer] = rand_storage(rng, view.shape, spec.layers[layer].dtype)
    return out


WRONG = 1 << 4   # row_status bit of wrong_index_space (reason code 5)


def check_matrix(rows: list[dict], spec) -> None:
    geo = Geometry(spec, NUM_SLOTS)
    assert len(geo.index_spaces) >= 1 and {r["space"] for r in rows} == {s.id for s in geo.index_spaces}
    for r in rows:
        what = (r["space"], r["layer"], r["kernel"])
        if r["own"]:
            assert r["record"][0] == 0, (what, r["record"])
            if r["kernel"].startswith("decode"):
                assert all(r["finite_rows"]), what
            if r["kernel"] == "validate":
                assert r["row_status"] == [0, 0, 0, 0], what
            continue
        n = {"append": 3, "copy": 4}.get(r["kernel"], NNZ)
        assert r["record"] == [n, 0, 0, r["first"], "wrong_index_space"], (what, r["record"])
        if r["kernel"] == "validate":
            assert r["row_status"] == [WRONG * x for x in STATUS_ROWS], what
        if r["kernel"].startswith("decode"):
            assert r["nan_rows"] == [bool(x) for x in STATUS_ROWS], what
        if r["kernel"] in ("append", "copy"):
            assert r["kept"], f"{what}: another space's pages changed the buffer"
    # every layer saw every other space's table
    others = {(r["space"], r["layer"]) for r in rows if not r["own"]}
    assert len(others) == sum(len(spec.layers) - len(s.layers) for s in geo.index_spaces)
