"""kvservice.worker.caches.CacheSet pinned whole against layouts computed here by hand from docs/DESIGN.md's geometry
(per_layer: a buffer per layer, page = base + slot; interleaved: one buffer per group, pages of each layer at its
byte offset in a slot, page = base + slot * scale + offset): every field it keeps, every buffer (name, size, guard
canaries of guards.py's formula, payload zeroed), every layer's PageLayout, generation record and cache view, the
layers it holds, its groups' layers, what forgetting generations leaves, and each refusal's exact message (a layer
range, a plan rebuilt differently, a layer the kernels cannot run, an index space past int32)."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.worker import ops_numpy
from kvservice.worker.caches import GUARD_BYTES, CacheSet
from kvservice.worker.page_layout import PageLayout

G = 64        # guard bytes used here (a positive multiple of 16)


def _canary(n: int) -> np.ndarray:
    """Byte i of a guard zone: 0xA5 ^ (i * 29 & 0xff) (kvservice/worker/guards.py's documented formula)."""
    return np.array([0xA5 ^ ((i * 29) & 0xFF) for i in range(n)], dtype=np.uint8)


def _check_buffer(caches: CacheSet, name: str, payload: int) -> None:
    buf = caches.buffers[name]
    assert (buf.name, buf.payload_bytes) == (name, payload)
    assert buf.raw.dtype == np.uint8 and buf.raw.shape == (payload + 2 * G,)
    assert np.array_equal(buf.raw[:G], _canary(G)) and np.array_equal(buf.raw[payload + G:], _canary(G))
    assert not buf.raw[G:G + payload].any()


def _mixed_spec() -> CacheSpec:
    """Group 0 (full attention): layers 0 and 2 (2 x 64 float32); group 1 (window 8): layer 1 (1 x 32 float16)."""
    return CacheSpec((LayerSpec(2, 64, "float32"), LayerSpec(1, 32, "float16", sliding_window=8),
                      LayerSpec(2, 64, "float32")), 4, "per_layer")


def test_per_layer_caches_of_two_groups_sized_per_group():
    """Slots [10, 6] per group: index space 0 (group 0) is pages [0, 10), space 1 (group 1) [10, 16). Serving
    layers [1, 3): buffers layer1 (6 slots of 2 x 4 x 1 x 32 x 2 = 512 bytes) and layer2 (10 slots of 4096 bytes),
    max_seq_len by default the largest group's slots x page_size = 40."""
    spec = _mixed_spec()
    c = CacheSet(spec, [10, 6], 1, 3, ops_numpy, guard_bytes=G)
    assert c.spec is spec and c.geometry.spec is spec and c.geometry.group_slots == (10, 6)
    assert (c.layer_begin, c.layer_end, c.ops, c.xp, c.guard_bytes, c.max_seq_len) == (1, 3, ops_numpy, np, G, 40)
    assert sorted(c.buffers) == ["layer1", "layer2"]
    _check_buffer(c, "layer1", 6 * 512)
    _check_buffer(c, "layer2", 10 * 4096)
    assert c.cache_bytes == 6 * 512 + 10 * 4096
    assert c.layouts == {1: PageLayout(4, 1, 32, "float16", 256, 1, 0, 16, 10, 16, False),
                         2: PageLayout(4, 2, 64, "float32", 1024, 1, 0, 10, 0, 16, False)}
    for layer, pages, dtype, elems in ((1, 6, np.float16, 6 * 256), (2, 10, np.float32, 10 * 1024)):
        pg = c.page_gen(layer)
        assert pg.dtype == np.uint32 and pg.shape == (pages,) and not pg.any()
        view = c.cache(layer)
        assert view.dtype == dtype and view.shape == (elems,)
        assert np.shares_memory(view, c.buffers[f"layer{layer}"].raw)
    assert c.generation_bytes == 4 * (6 + 10)
    assert [c.holds(la) for la in range(-1, 5)] == [False, False, True, True, False, False]
    assert (c.group_layers(0), c.group_layers(1), c.group_layers(2)) == ([2], [1], [])
    full = CacheSet(spec, [10, 6], 0, 3, ops_numpy, guard_bytes=G, max_seq_len=12)
    assert full.max_seq_len == 12 and full.group_layers(0) == [0, 2] and full.group_layers(1) == [1]
    assert sorted(full.buffers) == ["layer0", "layer1", "layer2"] and full.guard_bytes == G


def test_interleaved_layers_share_their_groups_buffer():
    """One group of 2 x 64 float16 (2048-byte pages), 1 x 64 float16 (1024) and 2 x 32 float32 (2048): largest
    pages first at byte offsets 0, 2048 and 4096 of a 6144-byte slot; scales 3, 6, 3 and offsets 0, 4, 1; index
    spaces (in layer order of first appearance) [0, 15), [15, 45), [45, 60) for 5 slots. One buffer, group0."""
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(1, 64), LayerSpec(2, 32, "float32")), 4, "interleaved")
    c = CacheSet(spec, 5, 0, 3, ops_numpy, guard_bytes=G)
    assert list(c.buffers) == ["group0"] and c.max_seq_len == 20
    _check_buffer(c, "group0", 5 * 6144)
    assert c.layouts == {0: PageLayout(4, 2, 64, "float16", 1024, 3, 0, 15, 0, 60, False),
                         1: PageLayout(4, 1, 64, "float16", 512, 6, 4, 45, 15, 60, False),
                         2: PageLayout(4, 2, 32, "float32", 512, 3, 1, 60, 45, 60, False)}
    assert [c.page_gen(la).shape for la in range(3)] == [(15,), (30,), (15,)]
    assert (c.cache(0).dtype, c.cache(0).shape, c.cache(2).dtype, c.cache(2).shape) == \
        (np.float16, (15360,), np.float32, (7680,))
    assert np.shares_memory(c.cache(0), c.cache(2)) and np.shares_memory(c.cache(1), c.buffers["group0"].raw)
    assert c.group_layers(0) == [0, 1, 2] and c.cache_bytes == 5 * 6144


def test_forgetting_generations_zeroes_every_record_and_keeps_its_type():
    c = CacheSet(_mixed_spec(), [10, 6], 0, 3, ops_numpy, guard_bytes=G)
    rng = np.random.default_rng()
    for la in range(3):
        c.page_gen(la)[:] = rng.integers(1, 2**32, c.page_gen(la).shape[0], dtype=np.uint32)
    records = [c.page_gen(la) for la in range(3)]
    c.forget_generations()
    assert all(c.page_gen(la) is records[la] and not records[la].any() and records[la].dtype == np.uint32
               for la in range(3))


@pytest.mark.parametrize(("begin", "end"), [(0, 0), (3, 3), (2, 2), (0, 3)])
def test_every_range_within_the_pool_is_served(begin, end):
    c = CacheSet(_mixed_spec(), [10, 6], begin, end, ops_numpy, guard_bytes=G)
    assert sorted(c.layouts) == list(range(begin, end)) and (c.layer_begin, c.layer_end) == (begin, end)
    assert c.guard_bytes == G and CacheSet(_mixed_spec(), 2, 0, 1, ops_numpy).guard_bytes == GUARD_BYTES == 4096


@pytest.mark.parametrize(("begin", "end"), [(2, 1), (-1, 2), (0, 4), (4, 4)])
def test_a_range_outside_the_pool_is_refused_by_its_rule(begin, end):
    with pytest.raises(ValueError) as e:
        CacheSet(_mixed_spec(), [10, 6], begin, end, ops_numpy)
    assert str(e.value) == (f"layers [{begin}, {end}) are not a range of this pool's 3 layers: serve layers [b, e) "
                            "with 0 <= b <= e <= the pool's layer count")


def test_a_plan_that_the_geometry_rebuilt_here_does_not_match_is_refused_naming_the_first_difference():
    """expected: the manager's (scale, offset, upper_bound) per layer (lists or tuples). Equal: accepted. One entry
    different: named with both triples; a plan of fewer or more layers: the first missing entry, None on the side
    that has none."""
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(1, 64), LayerSpec(2, 32, "float32")), 4, "interleaved")
    good = [[3, 0, 15], [6, 4, 45], [3, 1, 60]]
    CacheSet(spec, 5, 0, 3, ops_numpy, guard_bytes=G, expected=good)
    head = "the pool geometry rebuilt here differs from the manager's plan (first at layer "
    tail = "; manager and worker run different versions"
    cases = [([[3, 0, 15], [6, 5, 45], [3, 1, 60]], "1: worker (scale, offset, upper_bound) (6, 4, 45), manager "
                                                     "(6, 5, 45))"),
             ([[3, 0, 15], [6, 4, 45], [3, 1, 61]], "2: worker (scale, offset, upper_bound) (3, 1, 60), manager "
                                                     "(3, 1, 61))"),
             (good[:2], "2: worker (scale, offset, upper_bound) (3, 1, 60), manager None)"),
             ([*good, [1, 0, 70]], "3: worker (scale, offset, upper_bound) None, manager (1, 0, 70))")]
    for expected, middle in cases:
        with pytest.raises(ValueError) as e:
            CacheSet(spec, 5, 0, 3, ops_numpy, guard_bytes=G, expected=expected)
        assert str(e.value) == head + middle + tail


def test_a_layer_the_kernels_cannot_run_is_named():
    spec = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 48)), 4)
    CacheSet(spec, 3, 0, 1, ops_numpy, guard_bytes=G)
    with pytest.raises(ValueError) as e:
        CacheSet(spec, 3, 0, 2, ops_numpy, guard_bytes=G)
    assert str(e.value) == ("layer 1 of this pool cannot run on the worker's kernels: head_dim must be one of "
                            "(32, 64, 128, 256, 512), got 48")
    with pytest.raises(ValueError) as e:
        CacheSet(CacheSpec((LayerSpec(1, 64, "float8_e4m3"),), 4), 3, 0, 1, ops_numpy, guard_bytes=G)
    assert str(e.value) == ("layer 0 of this pool cannot run on the worker's kernels: dtype must be one of "
                            "['bfloat16', 'float16', 'float32'], got 'float8_e4m3'")


def test_an_index_space_may_end_at_page_2_to_the_31_and_not_past_it():
    """Page tables are int32: a layer whose index space ends at 2^31 (last page 2^31 - 1) runs; one ending at 2^31
    + 1 is refused naming that end. Group 0 (not served) takes the pages below; the layer served holds 2 slots."""
    spec = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=16)), 16)
    ok = CacheSet(spec, [2**31 - 2, 2], 1, 2, ops_numpy, guard_bytes=G)
    assert (ok.layouts[1].base, ok.layouts[1].upper_bound, ok.layouts[1].num_pages) == (2**31 - 2, 2**31, 2)
    with pytest.raises(ValueError) as e:
        CacheSet(spec, [2**31 - 1, 2], 1, 2, ops_numpy, guard_bytes=G)
    assert str(e.value) == ("layer 1 of this pool cannot run on the worker's kernels: its index space ends at page "
                            "2147483649, past the int32 page indices of the worker's page tables")


def test_a_k_only_layer_holds_one_tensor_per_page_in_either_layout():
    """A multi-head latent attention layer (k_only): pages of [1, page_size, kv_heads, head_dim]. per_layer: 1 x 4 x 1 x
    64 float16 = 512-byte pages. interleaved beside a 2 x 64 float16 layer (2048-byte pages): bytes 2048.. of a
    4096-byte slot, scale 8, offset 4, its own index space [6, 30) after [0, 6) for 3 slots."""
    per = CacheSet(CacheSpec((LayerSpec(1, 64, k_only=True),), 4), 7, 0, 1, ops_numpy, guard_bytes=G)
    assert per.layouts == {0: PageLayout(4, 1, 64, "float16", 256, 1, 0, 7, 0, 7, True)}
    _check_buffer(per, "layer0", 7 * 512)
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(1, 64, k_only=True)), 4, "interleaved")
    il = CacheSet(spec, 3, 0, 2, ops_numpy, guard_bytes=G)
    assert il.layouts == {0: PageLayout(4, 2, 64, "float16", 1024, 2, 0, 6, 0, 30, False),
                          1: PageLayout(4, 1, 64, "float16", 256, 8, 4, 30, 6, 30, True)}
    _check_buffer(il, "group0", 3 * 4096)
