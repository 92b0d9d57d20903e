"""Decode attention: emulated CUDA and NumPy paths vs the float64 torch reference.

Tolerances are kvservice.worker.reference.TOLERANCE, per row, for output and lse: the
oracle widens the same 16-bit inputs exactly, so only float32 arithmetic differs.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOL, lse_err, make_cache, make_table, poisoned, rand, rel_err

from kvservice.worker import kernel_api as api
from kvservice.worker import kernels_cpu, ops_numpy, reference
from kvservice.worker.kernel_api import KernelViolationError, Policy


def run(ops, c, q, table, **kw):
    b, hq, d = q.shape
    return ops.decode_attention(q, c.buf, c.layout, *table, out=poisoned((b, hq, d)), lse=poisoned((b, hq)), **kw)


def check(res, c, q, table, dtype: str, **kw) -> None:
    """Output and lse within the dtype's tolerance of the oracle, per row."""
    out, lse = reference.decode_attention_ref(q, c.buf, c.raw, *table, **kw)
    assert rel_err(res.out, out) <= TOL[dtype], rel_err(res.out, out)
    assert lse_err(res.lse, lse) <= TOL[dtype], lse_err(res.lse, lse)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["per_layer", "interleaved"])
@pytest.mark.parametrize("split", [0, 2])
@pytest.mark.parametrize("base", [0, 77])
def test_matches_reference(ops, dtype: str, kind: str, split: int, base: int) -> None:
    """base 77: the layer's index space is a later one of its pool (pages [77, ...))."""
    rng = np.random.default_rng(1)
    c = make_cache(rng, kind, 40, 8, 2, 64, dtype, base=base)
    table = make_table(rng, c, [37, 8, 1, 150])
    q = rand(rng, (4, 8, 64), dtype)
    res = run(ops, c, q, table, kv_chunk_pages=split)
    check(res, c, q, table, dtype)
    assert res.record.count == 0


@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 4, 4), (256, 16, 2), (32, 12, 1)])
def test_head_dims_and_gqa(ops, head_dim: int, hq: int, hkv: int) -> None:
    rng = np.random.default_rng(2)
    c = make_cache(rng, "per_layer", 12, 16, hkv, head_dim, "float16")
    table = make_table(rng, c, [40, 130])
    q = rand(rng, (2, hq, head_dim), "float16")
    check(run(ops, c, q, table, kv_chunk_pages=3), c, q, table, "float16")


def test_head_dim_512_float32() -> None:
    rng = np.random.default_rng(3)
    c = make_cache(rng, "interleaved", 8, 4, 1, 512, "float32")
    table = make_table(rng, c, [9, 14])
    q = rand(rng, (2, 2, 512), "float32")
    check(run(kernels_cpu, c, q, table, sm_scale=0.03), c, q, table, "float32", sm_scale=0.03)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["per_layer", "interleaved"])
@pytest.mark.parametrize("window", [1, 5, 16, 1000])
@pytest.mark.parametrize("split", [0, 1])
def test_sliding_window_and_sm_scale(ops, dtype: str, kind: str, window: int, split: int) -> None:
    rng = np.random.default_rng(4)
    c = make_cache(rng, kind, 30, 4, 2, 64, dtype, base=9)
    table = make_table(rng, c, [3, 22, 41])
    q = rand(rng, (3, 4, 64), dtype)
    res = run(ops, c, q, table, window=window, kv_chunk_pages=split, sm_scale=0.37)
    check(res, c, q, table, dtype, window=window, sm_scale=0.37)
    # the window changes the answer (the test would notice a kernel that ignores it)
    if window < 22:
        full, _ = reference.decode_attention_ref(q, c.buf, c.raw, *table, sm_scale=0.37)
        assert rel_err(res.out[1:], full[1:]) > 100 * TOL[dtype]


def test_each_head_keeps_its_own_softmax_max(ops) -> None:
    """With a large sm_scale the heads' score ranges lie hundreds apart: each head's softmax must subtract its
    own max (one max over all heads would underflow every exp of the lower heads to 0 and give NaN)."""
    rng = np.random.default_rng(7)
    c = make_cache(rng, "per_layer", 16, 8, 2, 64, "float32")
    table = make_table(rng, c, [29, 50])
    q = rand(rng, (2, 4, 64), "float32")
    q[:, 2:] *= 0.01                                      # kv head 1's queries: scores far below kv head 0's
    res = run(ops, c, q, table, sm_scale=400.0)
    assert np.isfinite(res.out).all() and np.isfinite(res.lse).all()
    check(res, c, q, table, "float32", sm_scale=400.0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("split", [0, 3])
def test_scores_far_apart_rescale_the_earlier_tiles(ops, dtype: str, split: int) -> None:
    """A large sm_scale spreads a row's scores over hundreds of units (log2 domain), far more than the
    lazy-rescale slack (2^8): every lane group's reference max moves up many times along the row, and each
    move must rescale what the earlier tiles summed (a kernel that skips it is off by orders of magnitude)."""
    rng = np.random.default_rng(17)
    c = make_cache(rng, "per_layer", 48, 8, 2, 64, dtype)
    table = make_table(rng, c, [150, 61, 9])
    q = rand(rng, (3, 4, 64), dtype)
    check(run(ops, c, q, table, sm_scale=60.0, kv_chunk_pages=split), c, q, table, dtype, sm_scale=60.0)


def test_bad_queries_are_named_with_what_they_need(ops) -> None:
    """q of the wrong dtype, or with a head count that is not a multiple of kv_heads, is refused by name."""
    rng = np.random.default_rng(8)
    c = make_cache(rng, "per_layer", 16, 8, 2, 64, "float16")
    table = make_table(rng, c, [9, 20])
    with pytest.raises(TypeError, match=r"^q: expected dtype float16, got float32$"):
        ops.decode_attention(rand(rng, (2, 4, 64), "float32"), c.buf, c.layout, *table)
    with pytest.raises(ValueError, match=r"^q: num_q_heads 3 must be a positive multiple of kv_heads 2$"):
        ops.decode_attention(rand(rng, (2, 3, 64), "float16"), c.buf, c.layout, *table)


def test_split_equals_reference_at_many_split_sizes() -> None:
    rng = np.random.default_rng(5)
    c = make_cache(rng, "per_layer", 64, 4, 1, 64, "float32")
    table = make_table(rng, c, [250])
    q = rand(rng, (1, 2, 64), "float32")
    for pps in (1, 5, 63, 64):
        check(run(kernels_cpu, c, q, table, kv_chunk_pages=pps), c, q, table, "float32")


def test_max_pages_plans_splits_without_reading_indptr_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker passes a host-side bound on a row's pages (``max_pages``: the shipped indptr's longest row,
    or a table copy's width): split planning then reads nothing back from the device. A bound below the
    longest row still covers it (the last split takes the rest); one above only splits differently."""
    rng = np.random.default_rng(16)
    c = make_cache(rng, "per_layer", 80, 4, 1, 64, "float32")
    table = make_table(rng, c, [250, 7])  # 63 pages and 2
    q = rand(rng, (2, 2, 64), "float32")
    be = kernels_cpu.backend()
    reads: list[bool] = []
    to_host = be.to_host
    monkeypatch.setattr(be, "to_host", lambda a: (reads.append(a is table[0]), to_host(a))[1])
    grids: list[tuple] = []
    launch = be.launch
    monkeypatch.setattr(be, "launch", lambda name, grid, *a: (grids.append(grid), launch(name, grid, *a))[1])
    for bound in (8, 63, 300):
        reads.clear()
        grids.clear()
        res = api.decode_attention(be, q, c.buf, c.layout, *table, max_pages=bound)
        assert not any(reads), f"max_pages={bound}: indptr read back"
        assert grids[0][2] > 1  # split (with a bound of 8, row 0's last split holds most of its 63 pages)
        check(res, c, q, table, "float32")
    reads.clear()
    api.decode_attention(be, q, c.buf, c.layout, *table)
    assert any(reads)  # without the bound the planner reads indptr back (the spy sees it)


def test_numpy_backend_ignores_kv_chunk_pages() -> None:
    """ops_numpy does not split (kv_chunk_pages and max_pages are accepted and ignored):
    every setting gives the same bits; the split path is the compiled kernels' alone."""
    rng = np.random.default_rng(15)
    c = make_cache(rng, "per_layer", 64, 4, 1, 64, "float16")
    table = make_table(rng, c, [200, 7])
    q = rand(rng, (2, 2, 64), "float16")
    ref = run(ops_numpy, c, q, table, kv_chunk_pages=0)
    assert ref.record.count == 0 and np.isfinite(ref.out).all()
    for pps in (None, 1, 3, 64):
        res = run(ops_numpy, c, q, table, kv_chunk_pages=pps)
        assert np.array_equal(res.out, ref.out) and np.array_equal(res.lse, ref.lse)


def test_empty_row_gives_zeros(ops) -> None:
    rng = np.random.default_rng(6)
    c = make_cache(rng, "per_layer", 8, 4, 1, 64, "float32")
    indptr, indices, lpl = make_table(rng, c, [5, 0, 3])
    q = rand(rng, (3, 1, 64), "float32")
    res = run(ops, c, q, (indptr, indices, lpl))
    assert np.all(res.out[1] == 0) and np.all(np.isneginf(res.lse[1]))
    assert res.record.count == 0


@pytest.mark.parametrize("split", [0, 1])
@pytest.mark.parametrize("policy", [Policy.NAN, Policy.ZEROS])
def test_page_past_buffer_poisons_only_that_row(ops, split: int, policy: Policy) -> None:
    rng = np.random.default_rng(7)
    c = make_cache(rng, "per_layer", 24, 4, 2, 64, "float16")
    indptr, indices, lpl = make_table(rng, c, [9, 30, 5])
    q = rand(rng, (3, 4, 64), "float16")
    clean = run(ops, c, q, (indptr, indices, lpl), kv_chunk_pages=split)
    bad = indices.copy()
    bad[indptr[1] + 5] = c.layout.upper_bound  # one page past the buffer
    res = run(ops, c, q, (indptr, bad, lpl), kv_chunk_pages=split, policy=policy)
    rec = res.record
    assert (rec.count, rec.row, rec.position, rec.value, rec.reason) == (
        1, 1, int(indptr[1]) + 5, c.layout.upper_bound, "out_of_bounds")
    if policy == Policy.NAN:
        assert np.isnan(res.out[1]).all() and np.isnan(res.lse[1]).all()
    else:
        assert (res.out[1] == 0).all() and np.isneginf(res.lse[1]).all()
    for r in (0, 2):  # bit-for-bit unaffected
        assert np.array_equal(res.out[r], clean.out[r]) and np.array_equal(res.lse[r], clean.lse[r])
    out, _ = reference.decode_attention_ref(q, c.buf, c.raw, indptr, bad, lpl)
    assert rel_err(res.out[[0, 2]], out[[0, 2]]) <= TOL["float16"]


@pytest.mark.parametrize("policy", [Policy.NAN, Policy.ZEROS])
@pytest.mark.parametrize("window", [0, 13])
@pytest.mark.parametrize("where", ["last page", "first page of the last split"])
def test_bad_page_in_the_last_split_poisons_the_merged_row(ops, policy: Policy, window: int, where: str) -> None:
    """Row 1 has 14 pages; kv_chunk_pages=2 gives it 7 splits, the last one pages [12, 14) (window
    13 tokens: pages [10, 14) in 2 of the grid's 3 splits). A bad page that only the row's LAST
    split reads must reach the merge (its flag), so the row comes back poisoned, with the exact
    record, on the emulated kernels as on NumPy."""
    rng = np.random.default_rng(11)
    c = make_cache(rng, "interleaved", 24, 4, 2, 64, "bfloat16")
    indptr, indices, lpl = make_table(rng, c, [10, 54, 7])
    npages = int(indptr[2] - indptr[1])
    assert npages == 14
    first_pp = (54 - window) // 4 if window else 0           # first page of the window
    last_split_start = first_pp + 2 * ((npages - 1 - first_pp) // 2)
    pos = int(indptr[1]) + (npages - 1 if where == "last page" else last_split_start)
    bad = indices.copy()
    bad[pos] = c.layout.page_index(3) + 1                      # off the lattice
    q = rand(rng, (3, 4, 64), "bfloat16")
    clean = run(ops, c, q, (indptr, indices, lpl), kv_chunk_pages=2, window=window)
    res = run(ops, c, q, (indptr, bad, lpl), kv_chunk_pages=2, window=window, policy=policy)
    rec = res.record
    assert (rec.count, rec.row, rec.position, rec.value, rec.reason) == (1, 1, pos, int(bad[pos]), "off_lattice")
    if policy == Policy.NAN:
        assert np.isnan(res.out[1]).all() and np.isnan(res.lse[1]).all()
    else:
        assert (res.out[1] == 0).all() and np.isneginf(res.lse[1]).all()
    for r in (0, 2):
        assert np.array_equal(res.out[r], clean.out[r]) and np.array_equal(res.lse[r], clean.lse[r])
    check(clean, c, q, (indptr, indices, lpl), "bfloat16", window=window)


def test_error_policy_raises_with_record(ops) -> None:
    rng = np.random.default_rng(8)
    c = make_cache(rng, "per_layer", 10, 4, 1, 64, "float32")
    indptr, indices, lpl = make_table(rng, c, [6, 6])
    indices[3] = -2
    with pytest.raises(KernelViolationError) as ei:
        run(ops, c, rand(rng, (2, 1, 64), "float32"), (indptr, indices, lpl), policy=Policy.ERROR)
    rec = ei.value.record
    assert (rec.count, rec.row, rec.position, rec.value, rec.reason) == (1, 1, 3, -2, "out_of_bounds")
    assert str(ei.value) == "decode_attention: 1 page-table violation(s); first at row 1, position 3: value -2 " \
                            "(out_of_bounds)"


@pytest.mark.parametrize("split", [0, 1])
def test_off_lattice_interleaved_counts_once(ops, split: int) -> None:
    rng = np.random.default_rng(9)
    c = make_cache(rng, "interleaved", 16, 4, 2, 64, "bfloat16")
    indptr, indices, lpl = make_table(rng, c, [13, 11, 7])
    indices[indptr[2]] += 1  # in bounds, off the lattice (scale 4, offset 2)
    indices[indptr[1] + 1] = c.layout.upper_bound + 7  # and one past the end, earlier row
    q = rand(rng, (3, 16, 64), "bfloat16")  # 8 q heads per kv head, 2 kv heads: many readers
    res = run(ops, c, q, (indptr, indices, lpl), kv_chunk_pages=split)
    rec = res.record
    assert rec.count == 2
    assert (rec.row, rec.position, rec.reason) == (1, int(indptr[1]) + 1, "out_of_bounds")
    assert np.isnan(res.out[1]).all() and np.isnan(res.out[2]).all() and np.isfinite(res.out[0]).all()


def test_row_level_violations(ops) -> None:
    rng = np.random.default_rng(10)
    c = make_cache(rng, "per_layer", 20, 4, 1, 64, "float32")
    indptr, indices, lpl = make_table(rng, c, [5, 6, 7, 8])
    lpl[1] = 0
    lpl[3] = 5
    indptr[3] = indptr[2] - 1  # row 2 ends before it starts
    res = run(ops, c, rand(rng, (4, 1, 64), "float32"), (indptr, indices, lpl))
    rec = res.record
    assert (rec.row, rec.position, rec.value, rec.reason) == (1, -1, 0, "bad_last_page_len")
    assert rec.count == 3  # row 1 lpl, row 2 indptr, row 3 lpl (row 3 starts at the bad indptr too)
    assert np.isfinite(res.out[0]).all() and np.isnan(res.out[1:]).all()


def test_default_splits_fill_the_device() -> None:
    """Split-KV from residency: blocks run in waves of `slots` (SMs x blocks per SM)."""
    from kvservice.worker.launch_plan import MIN_SPLIT_PAGES, default_splits

    assert default_splits(512, 256, 528) == 0  # 512 of 528 slots busy: one wave, no split
    # 512 blocks on 396 slots: 2 waves at 65 %; 3 splits of 86 pages -> 4 waves at 97 %
    assert default_splits(512, 256, 396) == 86
    # 8 blocks on 528 slots: split down to the minimum pages per split (64 splits, 97 %)
    assert default_splits(8, 256, 528) == MIN_SPLIT_PAGES
    assert default_splits(8, 2 * MIN_SPLIT_PAGES - 1, 528) == 0  # too short to split
    for blocks, pages, slots in [(3, 40, 8), (64, 4096, 264), (1, 9, 1000), (700, 300, 528)]:
        pps = default_splits(blocks, pages, slots)
        assert pps == 0 or MIN_SPLIT_PAGES <= pps < pages
