"""Layer groups, layouts and index spaces (seed 004)."""

import itertools

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec, Geometry, LayerSpec


def test_per_layer_one_space_per_group():
    spec = CacheSpec((LayerSpec(8, 128),) * 3 + (LayerSpec(8, 128, sliding_window=512),) * 2, 16)
    g = Geometry(spec, 100)
    assert [gr.layers for gr in g.groups] == [(0, 1, 2), (3, 4)]
    assert [(gr.id, gr.sliding_window) for gr in g.groups] == [(0, 0), (1, 512)]
    # Disjoint ranges: space 1 starts where space 0 ends.
    assert [(s.group, s.scale, s.offset, s.base, s.upper_bound) for s in g.index_spaces] == \
        [(0, 1, 0, 0, 100), (1, 1, 0, 100, 200)]
    assert g.pool_pages == 200 and [s.num_pages for s in g.index_spaces] == [100, 100]
    assert g.layer_space.tolist() == [0, 0, 0, 1, 1]
    assert g.groups[0].slot_bytes == 3 * 2 * 16 * 8 * 128 * 2
    page = 2 * 16 * 8 * 128 * 2                           # K and V of one page, float16
    assert [(v.layer, v.group, v.index_space, v.page_bytes, v.byte_offset, v.scale, v.offset, v.upper_bound, v.base)
            for v in g.layers] == [(i, int(i >= 3), int(i >= 3), page, 0, 1, 0, 100 * (1 + (i >= 3)), 100 * (i >= 3))
                                   for i in range(5)]


def test_interleaved_two_sizes_differ_in_scale_and_every_page_is_aligned():
    spec = CacheSpec((LayerSpec(2, 256), LayerSpec(2, 512)), 16, "interleaved")
    g = Geometry(spec, 1000)
    small, big = g.layers
    assert big.page_bytes == 2 * small.page_bytes
    assert small.scale != big.scale
    assert (g.groups[0].slot_bytes, big.scale, small.scale) == (4 * small.page_bytes, 2, 4)
    for v in g.layers:
        assert v.byte_offset % v.page_bytes == 0 and g.groups[0].slot_bytes % v.page_bytes == 0
        assert v.upper_bound - v.base == 1000 * v.scale
        assert v.byte_offset == v.offset * v.page_bytes
    # No two layers' pages overlap inside a slot.
    spans = sorted((v.byte_offset, v.byte_offset + v.page_bytes) for v in g.layers)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_interleaved_padding_for_odd_sizes_warns():
    spec = CacheSpec((LayerSpec(3, 64), LayerSpec(4, 64)), 16, "interleaved")
    g = Geometry(spec, 10)
    x = 2 * 16 * 64 * 2                    # page bytes per kv head
    assert [v.page_bytes for v in g.layers] == [3 * x, 4 * x]
    assert [v.byte_offset for v in g.layers] == [6 * x, 0]   # 3x page aligned to 3x after the 4x page
    assert g.groups[0].slot_bytes == 12 * x                  # lcm(3x, 4x)
    assert g.warnings and "padded from" in g.warnings[0]


def test_page_indices_conversion():
    spec = CacheSpec((LayerSpec(2, 256), LayerSpec(2, 512)), 16, "interleaved")
    g = Geometry(spec, 10)
    slots = np.array([0, 3, 9])
    for space in g.index_spaces:
        pages = space.page_indices(slots)
        assert pages.dtype == np.int32
        assert pages.tolist() == [space.base + s * space.scale + space.offset for s in slots.tolist()]
        assert ((pages - space.base - space.offset) % space.scale == 0).all()
        assert ((pages >= space.base) & (pages < space.upper_bound)).all()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"kv_heads": 0, "head_dim": 64}, "kv_heads > 0"),
    ({"kv_heads": 1, "head_dim": 64, "dtype": "int4"}, "unknown cache dtype"),
    ({"kv_heads": 1, "head_dim": 64, "sliding_window": -1}, "sliding_window"),
])
def test_bad_layer_specs(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        LayerSpec(**kwargs)


def test_bad_cache_specs():
    with pytest.raises(InvalidArgument, match="no layers"):
        CacheSpec((), 16)
    with pytest.raises(InvalidArgument, match="page_size"):
        CacheSpec.uniform(2, 1, 64, page_size=0)
    with pytest.raises(InvalidArgument, match="layout"):
        CacheSpec.uniform(2, 1, 64, layout="paged")
    with pytest.raises(InvalidArgument, match="layer 5 does not exist"):
        Geometry(CacheSpec.uniform(2, 1, 64), 4).space_of_layer(5)


@pytest.mark.parametrize("spec", [
    CacheSpec((LayerSpec(8, 128),) * 3 + (LayerSpec(8, 128, sliding_window=512),) * 2, 16),
    CacheSpec((LayerSpec(2, 256), LayerSpec(2, 512), LayerSpec(2, 256, sliding_window=64)), 16, "interleaved"),
    CacheSpec((LayerSpec(3, 64), LayerSpec(4, 64), LayerSpec(4, 64)), 8, "interleaved"),
])
def test_index_spaces_occupy_disjoint_consecutive_ranges(spec):
    g = Geometry(spec, 37)
    spaces = g.index_spaces
    assert spaces[0].base == 0 and g.pool_pages == spaces[-1].upper_bound
    for a, b in itertools.pairwise(spaces):
        assert b.base == a.upper_bound
    every = np.arange(37)
    pages = [set(s.page_indices(every).tolist()) for s in spaces]
    for (i, a), (j, b) in itertools.combinations(enumerate(pages), 2):
        assert not a & b, f"spaces {i} and {j} share a page index"
    for v in g.layers:
        s = spaces[v.index_space]
        assert (v.base, v.upper_bound, v.scale, v.offset) == (s.base, s.upper_bound, s.scale, s.offset)


def test_index_dtype_switches_to_int64_exactly_past_int32():
    from kvservice.contract.geometry import IndexSpace
    assert IndexSpace(0, 0, 1, 0, 2**31, (0,)).index_dtype == np.int32        # largest page 2^31 - 1
    assert IndexSpace(0, 0, 1, 0, 2**31 + 1, (0,)).index_dtype == np.int64    # largest page 2^31
    big = IndexSpace(1, 0, 1, 0, 2**31 + 1, (0,), base=2**31 - 4)
    pages = big.page_indices(np.array([0, 4, 5]))
    assert pages.dtype == np.int64 and pages.tolist() == [2**31 - 4, 2**31, 2**31 + 1]


@pytest.mark.parametrize("spec", [
    CacheSpec((LayerSpec(2, 64), LayerSpec(2, 64, sliding_window=32), LayerSpec(1, 128)), 16),
    CacheSpec((LayerSpec(2, 64), LayerSpec(2, 128), LayerSpec(3, 64, sliding_window=64),
               LayerSpec(2, 64, sliding_window=64)), 16, "interleaved"),
    CacheSpec.uniform(3, 2, 64),
], ids=["per_layer-mixed", "interleaved-mixed", "uniform"])
def test_index_spaces_are_disjoint_consecutive_ranges(spec):
    """NUMBERING.md: base_0 = 0, base_{s+1} = upper_bound_s = base_s + num_slots * scale_s; the
    pages of every slot of a space lie in its own range, on its lattice, and nowhere else."""
    n = 7
    g = Geometry(spec, n)
    expect_base = 0
    for s in g.index_spaces:
        assert s.base == expect_base and s.upper_bound == s.base + n * s.scale and s.num_pages == n * s.scale
        assert 0 <= s.offset < s.scale
        expect_base = s.upper_bound
        for la in s.layers:
            v = g.layers[la]
            assert (v.base, v.upper_bound, v.scale, v.offset) == (s.base, s.upper_bound, s.scale, s.offset)
    assert g.pool_pages == expect_base
    pages = {s.id: s.page_indices(np.arange(n)) for s in g.index_spaces}
    for sid, p in pages.items():
        s = g.index_spaces[sid]
        assert p.tolist() == [s.base + x * s.scale + s.offset for x in range(n)]
        for other in g.index_spaces:
            inside = (p >= other.base) & (p < other.upper_bound)
            assert inside.all() == (other.id == sid) and (inside.any() == (other.id == sid))
    # a single-space pool is numbered exactly as before: page = slot * scale + offset
    if len(g.index_spaces) == 1:
        assert g.index_spaces[0].base == 0 and pages[0].tolist() == list(range(n))


@pytest.mark.parametrize(("num_slots", "dtype"), [(2**31 - 1, np.int32), (2**31, np.int32), (2**31 + 1, np.int64)])
def test_index_dtype_at_the_2_31_boundary(num_slots, dtype):
    """int32 iff upper_bound - 1 <= 2^31 - 1: the last page 2^31 - 1 still fits, 2^31 does not."""
    g = Geometry(CacheSpec.uniform(1, 1, 64), num_slots)
    (s,) = g.index_spaces
    assert s.index_dtype == np.dtype(dtype)
    last = s.page_indices(np.array([num_slots - 1]))
    assert last.dtype == np.dtype(dtype) and int(last[0]) == num_slots - 1     # no wrap-around


def test_index_dtype_of_a_later_space_counts_its_base():
    """Space 1 of a two-group pool starts at base = num_slots: its pages need int64 although
    its own slot count would fit, and page_indices never wraps."""
    n = 2**30 + 1
    g = Geometry(CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=16)), 16), n)
    s0, s1 = g.index_spaces
    assert (s0.index_dtype, s1.index_dtype) == (np.dtype(np.int32), np.dtype(np.int64))
    assert s1.base == n and int(s1.page_indices(np.array([n - 1], np.int32))[0]) == 2 * n - 1


@pytest.mark.parametrize("n", [0, -2])
def test_uniform_spec_names_a_bad_layer_count(n):
    with pytest.raises(InvalidArgument) as e:
        CacheSpec.uniform(n, 8, 128)
    assert e.value.message == f"num_layers must be > 0, got {n}"


def test_uniform_spec_passes_every_layer_field_on():
    spec = CacheSpec.uniform(3, 4, 64, "bfloat16", page_size=8, layout="interleaved", sliding_window=512)
    assert spec.layers == (LayerSpec(4, 64, "bfloat16", 512),) * 3
    assert (spec.page_size, spec.layout) == (8, "interleaved")
    assert [gr.sliding_window for gr in Geometry(spec, 50).groups] == [512]


def test_unknown_layout_lists_the_valid_ones():
    with pytest.raises(InvalidArgument) as e:
        CacheSpec((LayerSpec(2, 64),), 16, "paged")
    assert e.value.message == "unknown layout 'paged'; use one of per_layer, interleaved"


@pytest.mark.parametrize(("scale", "offset", "base"), [(1, 0, 1), (1, 0, 7), (1, 1, 0), (2, 0, 0), (4, 2, 9)])
def test_page_indices_of_any_space_against_the_formula(scale, offset, base):
    """page = base + slot * scale + offset for every (scale, offset, base), the identity space's shortcut aside."""
    from kvservice.contract.geometry import IndexSpace
    rng = np.random.default_rng(base * 10 + scale)
    slots = rng.integers(0, 50, 12)
    space = IndexSpace(0, 0, scale, offset, base + 50 * scale + offset, (0,), base)
    pages = space.page_indices(slots)
    assert pages.dtype == np.int32
    assert pages.tolist() == [base + s * scale + offset for s in slots.tolist()]


def test_one_slot_is_a_pool_and_zero_is_refused_by_name():
    g = Geometry(CacheSpec.uniform(2, 2, 64), 1)
    assert g.num_slots == 1 and [s.num_pages for s in g.index_spaces] == [1]
    with pytest.raises(InvalidArgument) as e:
        Geometry(CacheSpec.uniform(2, 2, 64), 0)
    assert e.value.message == "a pool needs at least one slot, got num_slots=0"


def test_interleaved_without_padding_does_not_warn():
    g = Geometry(CacheSpec((LayerSpec(2, 128), LayerSpec(2, 128), LayerSpec(4, 64)), 16, "interleaved"), 10)
    assert g.groups[0].slot_bytes == 3 * g.layers[0].page_bytes and g.warnings == []
