"""append_kv and copy_blocks: emulated CUDA vs NumPy vs an explicit expectation."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_cache, rand

from kvservice.worker import kernels_cpu, ops_numpy, reference
from kvservice.worker.kernel_api import KernelViolationError, Policy


@pytest.mark.parametrize("kind", ["per_layer", "interleaved"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_append_writes_valid_tokens_only(kind: str, dtype: str) -> None:
    rng = np.random.default_rng(20)
    c = make_cache(rng, kind, 10, 4, 2, 64, dtype)
    L = c.layout
    slots = np.array([3, 9, 0, 7], dtype=np.int64)
    pages = np.asarray(L.page_index(slots), dtype=np.int64)
    offs = np.array([0, 3, 1, 2])
    sm = pages * L.page_size + offs
    bad = np.array([-2, L.upper_bound * L.page_size, (L.offset + 1) * L.page_size if L.scale > 1 else -5])
    sm = np.concatenate([sm[:2], bad[:1], sm[2:], bad[1:]]).astype(np.int64)  # tokens 2, 5, 6 bad
    k, v = rand(rng, (7, 2, 64), dtype), rand(rng, (7, 2, 64), dtype)
    caches = {}
    for name, ops in (("emu", kernels_cpu), ("numpy", ops_numpy)):
        buf = c.buf.copy()
        rec = ops.append_kv(buf, L, k, v, sm).record
        assert (rec.count, rec.row, rec.position, rec.value, rec.reason) == (3, 2, 2, -2, "out_of_bounds")
        caches[name] = buf
    assert np.array_equal(caches["emu"], caches["numpy"])
    expect = c.buf.copy()
    for i, s in enumerate(sm):
        if i in (2, 5, 6):
            continue
        page = reference.page_view(expect, c.raw, int(s) // L.page_size)
        page[0, int(s) % L.page_size], page[1, int(s) % L.page_size] = k[i], v[i]
    assert np.array_equal(caches["emu"], expect)


def test_append_off_lattice_record_and_error_policy(ops) -> None:
    rng = np.random.default_rng(21)
    c = make_cache(rng, "interleaved", 8, 4, 1, 64, "float16")
    sm = np.array([(c.layout.offset + 4) * 4, (c.layout.offset + 5) * 4 + 1], dtype=np.int64)
    k = rand(rng, (2, 1, 64), "float16")
    with pytest.raises(KernelViolationError) as ei:
        ops.append_kv(c.buf, c.layout, k, k, sm, policy=Policy.ERROR)
    r = ei.value.record
    assert (r.count, r.row, r.value, r.reason) == (1, 1, int(sm[1]), "off_lattice")
    assert str(ei.value).startswith("append_kv: 1 page-table violation(s); first at row 1")   # names the kernel


def test_append_checks_arguments(ops) -> None:
    rng = np.random.default_rng(22)
    c = make_cache(rng, "per_layer", 4, 4, 2, 64, "float16")
    k = rand(rng, (2, 2, 64), "float16")
    with pytest.raises(TypeError, match="slot_mapping"):
        ops.append_kv(c.buf, c.layout, k, k, np.zeros(2, dtype=np.int32))
    with pytest.raises(ValueError, match=r"k: expected shape \[n, kv_heads, head_dim\]"):
        ops.append_kv(c.buf, c.layout, k[:, :1], k, np.zeros(2, dtype=np.int64))
    with pytest.raises(TypeError, match="v: expected dtype"):
        ops.append_kv(c.buf, c.layout, k, k.astype(np.float32), np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="layout needs"):
        ops.append_kv(c.buf[:3], c.layout, k, k, np.zeros(2, dtype=np.int64))


def test_misshapen_slot_mapping_and_pairs_are_named_with_the_shape_wanted(ops) -> None:
    """A 2-D slot_mapping or a pairs array that is not [n, 2] is refused naming the argument and its shape."""
    rng = np.random.default_rng(24)
    c = make_cache(rng, "per_layer", 4, 4, 2, 64, "float16")
    k = rand(rng, (2, 2, 64), "float16")
    with pytest.raises(ValueError, match=r"^slot_mapping: expected shape \[n\] = \(-?\d+,\), got \(2, 1\)$"):
        ops.append_kv(c.buf, c.layout, k, k, np.zeros((2, 1), dtype=np.int64))
    with pytest.raises(ValueError, match=r"^pairs: expected shape \[n, 2\] = \(3, 2\), got \(3, 3\)$"):
        ops.copy_blocks([c.buf], c.layout, np.zeros((3, 3), dtype=np.int64))


@pytest.mark.parametrize("kind", ["per_layer", "interleaved"])
def test_copy_blocks_all_layers(kind: str) -> None:
    rng = np.random.default_rng(23)
    layers = [make_cache(rng, kind, 12, 4, 2, 64, "float16") for _ in range(3)]
    L = layers[0].layout
    p = lambda s: int(L.page_index(s))  # noqa: E731
    pairs = np.array([[p(1), p(5)], [p(2), L.upper_bound], [p(3), p(6)], [-1, p(7)]], dtype=np.int64)
    results = {}
    for name, ops in (("emu", kernels_cpu), ("numpy", ops_numpy)):
        bufs = [c.buf.copy() for c in layers]
        rec = ops.copy_blocks(bufs, L, pairs).record
        assert (rec.count, rec.row, rec.position, rec.value, rec.reason) == (2, 1, 1, L.upper_bound, "out_of_bounds")
        results[name] = bufs
    for i, c in enumerate(layers):
        expect = c.buf.copy()
        for s, d in ((1, 5), (3, 6)):
            reference.page_view(expect, c.raw, p(d))[...] = reference.page_view(c.buf, c.raw, p(s))
        assert np.array_equal(results["emu"][i], expect)
        assert np.array_equal(results["numpy"][i], expect)


def test_copy_blocks_off_lattice(ops) -> None:
    rng = np.random.default_rng(24)
    c = make_cache(rng, "interleaved", 6, 4, 1, 32, "float32")
    before = c.buf.copy()
    pairs = np.array([[c.layout.offset, c.layout.offset + 1]], dtype=np.int64)
    rec = ops.copy_blocks([c.buf], c.layout, pairs).record
    assert (rec.count, rec.row, rec.position, rec.reason) == (1, 0, 1, "off_lattice")
    assert np.array_equal(c.buf, before)


@pytest.mark.parametrize("policy", [Policy.NAN, Policy.ZEROS, Policy.ERROR])
def test_copy_blocks_policy_error_raises_with_the_record_and_the_others_return_it(ops, policy) -> None:
    """A pair with an off-lattice destination is skipped and recorded under every policy; Policy.ERROR raises
    KernelViolationError with that record (naming copy_blocks), the others return it. The good pair is copied."""
    rng = np.random.default_rng(27)
    c = make_cache(rng, "interleaved", 6, 4, 1, 32, "float32")
    p = c.layout.page_index
    before = c.buf.copy()
    pairs = np.array([[p(1), p(3)], [c.layout.offset, c.layout.offset + 1]], dtype=np.int64)
    if policy == Policy.ERROR:
        with pytest.raises(KernelViolationError) as ei:
            ops.copy_blocks([c.buf], c.layout, pairs, policy=policy)
        rec = ei.value.record
        assert str(ei.value).startswith("copy_blocks: 1 page-table violation(s); first at row 1")
    else:
        rec = ops.copy_blocks([c.buf], c.layout, pairs, policy=policy).record
    assert (rec.kernel, rec.count, rec.row, rec.position, rec.reason) == ("copy_blocks", 1, 1, 1, "off_lattice")
    expect = before.copy()
    reference.page_view(expect, c.raw, p(3))[...] = reference.page_view(before, c.raw, p(1))
    assert np.array_equal(c.buf, expect)


def test_copy_blocks_of_no_pairs_copies_nothing_and_records_a_clean_copy_blocks(ops) -> None:
    """n = 0 pairs: nothing is launched or written; the record names the kernel (copy_blocks) with no violation."""
    rng = np.random.default_rng(25)
    c = make_cache(rng, "per_layer", 6, 4, 1, 32, "float32")
    before = c.buf.copy()
    rec = ops.copy_blocks([c.buf], c.layout, np.zeros((0, 2), dtype=np.int64)).record
    assert (rec.kernel, rec.count, rec.reason) == ("copy_blocks", 0, None)
    assert not rec and np.array_equal(c.buf, before)


def test_append_refuses_duplicate_slots_and_writes_nothing(ops) -> None:
    """Two tokens to one slot land in an undefined order on a GPU: INVALID_ARGUMENT (ValueError)."""
    rng = np.random.default_rng(25)
    c = make_cache(rng, "interleaved", 8, 4, 1, 64, "float16", base=12)
    L = c.layout
    sm = np.array([L.page_index(1) * 4, L.page_index(5) * 4 + 3, L.page_index(1) * 4], dtype=np.int64)
    k = rand(rng, (3, 1, 64), "float16")
    before = c.buf.copy()
    with pytest.raises(ValueError, match=f"slot {sm[0]} appears more than once"):
        ops.append_kv(c.buf, L, k, k, sm)
    with pytest.raises(ValueError, match="appears more than once"):   # also among invalid values
        ops.append_kv(c.buf, L, k[:2], k[:2], np.array([-2, -2], dtype=np.int64))
    assert np.array_equal(c.buf, before)


def test_copy_refuses_duplicate_destinations_and_sources_that_are_destinations(ops) -> None:
    rng = np.random.default_rng(26)
    c = make_cache(rng, "per_layer", 10, 4, 1, 32, "float32", base=30)
    p = c.layout.page_index
    before = c.buf.copy()
    with pytest.raises(ValueError, match=f"destination page {p(4)} appears more than once"):
        ops.copy_blocks([c.buf], c.layout, np.array([[p(1), p(4)], [p(2), p(4)]], dtype=np.int64))
    with pytest.raises(ValueError, match=f"page {p(2)} is both a source and a destination"):
        ops.copy_blocks([c.buf], c.layout, np.array([[p(1), p(2)], [p(2), p(3)]], dtype=np.int64))
    with pytest.raises(ValueError, match="both a source and a destination"):
        ops.copy_blocks([c.buf], c.layout, np.array([[p(6), p(6)]], dtype=np.int64))
    assert np.array_equal(c.buf, before)
    # distinct destinations, sources shared: allowed
    rec = ops.copy_blocks([c.buf], c.layout, np.array([[p(1), p(7)], [p(1), p(8)]], dtype=np.int64)).record
    assert rec.count == 0
    assert np.array_equal(reference.page_view(c.buf, c.raw, p(7)), reference.page_view(before, c.raw, p(1)))
    assert np.array_equal(reference.page_view(c.buf, c.raw, p(8)), reference.page_view(before, c.raw, p(1)))


@pytest.mark.parametrize("kind", ["per_layer", "interleaved"])
def test_append_and_copy_with_a_base_address_page_minus_base(ops, kind: str) -> None:
    """A later index space (base 50): page p is buffer page p - base; pages below base are
    another space's (wrong_index_space), pages at or past the pool's end out_of_bounds."""
    rng = np.random.default_rng(27)
    c = make_cache(rng, kind, 6, 4, 2, 32, "bfloat16", base=50)
    L = c.layout
    sm = np.array([L.page_index(0) * 4 + 1, L.page_index(5) * 4 + 3, (L.base - 1) * 4, L.pool_pages * 4],
                  dtype=np.int64)
    k, v = rand(rng, (4, 2, 32), "bfloat16"), rand(rng, (4, 2, 32), "bfloat16")
    expect = c.buf.copy()
    for i in (0, 1):
        page = reference.page_view(expect, c.raw, int(sm[i]) // 4)
        page[0, sm[i] % 4], page[1, sm[i] % 4] = k[i], v[i]
    rec = ops.append_kv(c.buf, L, k, v, sm).record
    assert (rec.count, rec.row, rec.value, rec.reason) == (2, 2, int(sm[2]), "wrong_index_space")
    assert np.array_equal(c.buf, expect)
    pairs = np.array([[L.page_index(0), L.page_index(3)], [L.base - 1, L.page_index(4)]], dtype=np.int64)
    rec = ops.copy_blocks([c.buf], L, pairs).record
    assert (rec.count, rec.row, rec.position, rec.value, rec.reason) == (1, 1, 0, L.base - 1, "wrong_index_space")
    reference.page_view(expect, c.raw, L.page_index(3))[...] = reference.page_view(expect, c.raw, L.page_index(0))
    assert np.array_equal(c.buf, expect)


def test_skip_slots_are_written_nowhere_and_are_not_violations(ops):
    """-1 in slot_mapping (a prefix hit's tokens before a sliding window): nothing written, no violation;
    -2 is still out_of_bounds. Repeated -1 entries are fine (they write nothing)."""
    rng = np.random.default_rng(11)
    c = make_cache(rng, "per_layer", 8, 4, 2, 32, "float32")
    before = c.buf.copy()
    k = rand(rng, (4, 2, 32), "float32")
    v = rand(rng, (4, 2, 32), "float32")
    call = ops.append_kv(c.buf, c.layout, k, v, np.array([-1, 5, -1, 9], dtype=np.int64))
    assert call.record.count == 0
    changed = np.argwhere(c.buf != before)
    assert sorted({(int(x[0]), int(x[2])) for x in changed}) == [(1, 1), (2, 1)]   # slots 5 and 9 only
    assert np.array_equal(c.buf[1, 0, 1], k[1]) and np.array_equal(c.buf[2, 1, 1], v[3])
    call = ops.append_kv(c.buf, c.layout, k, v, np.array([-1, 6, -2, 10], dtype=np.int64))
    assert (call.record.count, call.record.reason, call.record.value) == (1, "out_of_bounds", -2)


@pytest.mark.parametrize("kind", ["per_layer", "interleaved"])
def test_k_only_latent_pages_append_and_copy(kind: str) -> None:
    """A multi-head latent attention layer: pages of [1, page_size, 1, 576] latents (bfloat16), written from k alone
    (v is None), copied as whole pages; emulated CUDA and NumPy agree with an explicit expectation, a bad slot is
    not written, and decode attention refuses the layer naming MLA."""
    from kvservice.worker.kernel_api import PageLayout

    rng = np.random.default_rng(29)
    ps, d, n_slots = 4, 576, 9
    pe = ps * d
    if kind == "per_layer":
        layout = PageLayout.per_layer(n_slots, ps, 1, d, "bfloat16", k_only=True)
        buf0 = rand(rng, (n_slots * pe,), "bfloat16")
    else:                          # this layer's page second in a slot of three pages: scale 3, offset 1
        layout = PageLayout.interleaved(n_slots, 3 * pe * 2, pe * 2, ps, 1, d, "bfloat16", k_only=True)
        buf0 = rand(rng, (n_slots * 3 * pe,), "bfloat16")
    assert layout.page_elems == layout.page_stride == pe     # pages of the layer's own size; scale 3 in the index
    slots = np.array([2, 7, 0, 5], dtype=np.int64)
    sm = np.asarray(layout.page_index(slots), dtype=np.int64) * ps + np.array([0, 3, 1, 2])
    sm = np.concatenate([sm[:2], [layout.upper_bound * ps], sm[2:]]).astype(np.int64)     # token 2 bad
    k = rand(rng, (5, 1, d), "bfloat16")
    got = {}
    for name, ops in (("emu", kernels_cpu), ("numpy", ops_numpy)):
        buf = buf0.copy()
        rec = ops.append_kv(buf, layout, k, None, sm).record
        assert (rec.count, rec.row, rec.value, rec.reason) == (1, 2, layout.upper_bound * ps, "out_of_bounds")
        with pytest.raises(ValueError, match="K-only"):
            ops.append_kv(buf, layout, k, k, sm)
        got[name] = buf
    assert np.array_equal(got["emu"], got["numpy"])
    expect = buf0.copy()
    for i, s in enumerate(sm.tolist()):
        if i != 2:
            at = (s // ps - layout.base) * layout.page_stride + (s % ps) * d
            expect[at:at + d] = k[i, 0]
    assert np.array_equal(got["emu"], expect)
    pages = np.asarray(layout.page_index(np.array([[2, 4], [7, 8]])), dtype=np.int64)
    for ops in (kernels_cpu, ops_numpy):
        buf = expect.copy()
        assert ops.copy_blocks([buf], layout, pages).record.count == 0
        for src, dst in pages.tolist():
            a, b = (src - layout.base) * layout.page_stride, (dst - layout.base) * layout.page_stride
            assert np.array_equal(buf[b:b + pe], expect[a:a + pe])
        untouched = np.ones(len(buf), dtype=bool)
        for _, dst in pages.tolist():
            b = (dst - layout.base) * layout.page_stride
            untouched[b:b + pe] = False
        assert np.array_equal(buf[untouched], expect[untouched])       # nothing else moved (the V half included)
        ip, idx, lpl = (np.array([0, 1], dtype=np.int32), np.array([int(pages[0, 0])], dtype=np.int32),
                        np.array([ps], dtype=np.int32))
        with pytest.raises(ValueError, match=r"multi-head latent attention \(MLA\)"):
            ops.decode_attention(rand(rng, (1, 16, d), "bfloat16"), buf, layout, ip, idx, lpl)
        assert ops.validate_page_table(ip, idx, lpl, layout).record.count == 0


def test_the_oracles_page_view_refuses_a_page_past_the_end_of_a_short_buffer() -> None:
    """reference.page_view over a buffer cut short: 6 slots of 4 tokens x 2 heads x 64 float32 (4096-byte
    pages) but 5 pages + 1000 bytes of memory. Page 4 is its bytes 16384..20480; page 5 (a slot of the layer)
    would end at byte 24576, past the 21480 bytes: IndexError saying so, never a short view."""
    rng = np.random.default_rng(16)
    raw = reference.RawLayer.per_layer(6, 4, 2, 64, "float32")
    buf = rng.standard_normal((5 * 4096 + 1000) // 4).astype(np.float32)
    page = reference.page_view(buf, raw, 4)
    assert page.shape == (2, 4, 2, 64) and np.array_equal(page.reshape(-1), buf[4096:5120])
    with pytest.raises(IndexError) as err:
        reference.page_view(buf, raw, 5)
    assert str(err.value) == "page 5 ends at byte 24576, past the 21480-byte buffer"
