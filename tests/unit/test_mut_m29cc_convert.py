"""Proto <-> domain conversions (kvservice/contract/convert.py) checked whole against hand-computed messages.

Oracles: the field comments of protos/kvservice/v1/block_manager.proto (LayerPlan.bytes is the layer's group's
num_slots x page_bytes, page index = base + slot x scale + offset, pool_pages the last space's upper_bound, ...)
and page sizes worked out by hand (K and V x page_size x kv_heads x head_dim x dtype bytes) for a hybrid model in
both layouts; random specs and sizings for the round trips and the run-length encoding."""

from __future__ import annotations

import random

import pytest

from kvservice.contract import convert
from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import MAX_LAYERS, CacheSpec, Geometry, LayerSpec
from kvservice.contract.sizing import Plan, Sizing
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb

# Four layers, page_size 16: full, sliding 64, full, sliding 64.
#   L0 2 heads x 64 fp16:  2 x 16 x 2 x 64 x 2 =  8192 B     L1 same, window 64
#   L2 4 heads x 32 bf16:  2 x 16 x 4 x 32 x 2 =  8192 B     L3 1 head x 128 fp32, window 64: 16384 B
# Groups in order of first appearance: G0 = full (L0, L2), G1 = window 64 (L1, L3); slots 40 and 12.
HYBRID = CacheSpec((LayerSpec(2, 64, "float16"), LayerSpec(2, 64, "float16", 64), LayerSpec(4, 32, "bfloat16"),
                    LayerSpec(1, 128, "float32", 64)), 16)
PAGE = {0: 8192, 1: 8192, 2: 8192, 3: 16384}
SLOTS = (40, 12)


def _layer(msg: pb.LayerPlan) -> tuple:
    return (msg.layer, msg.group, msg.index_space, msg.page_bytes, msg.bytes, msg.scale, msg.offset,
            msg.upper_bound, msg.base)


def _group(msg: pb.GroupPlan) -> tuple:
    return (msg.group, msg.sliding_window, list(msg.layers), msg.slot_bytes, msg.buffer_bytes, msg.num_slots)


def _space(msg: pb.IndexSpace) -> tuple:
    return (msg.id, msg.group, msg.scale, msg.offset, msg.upper_bound, list(msg.layers), msg.base, msg.index_dtype)


def _plan(layout: str, max_seq_len: int = 300) -> pb.PlanReply:
    spec = CacheSpec(HYBRID.layers, HYBRID.page_size, layout)
    geo = Geometry(spec, SLOTS)
    return convert.plan_to_proto(Plan(geo, max_seq_len, backends=("cpu", "triton"),
                                      warnings=tuple(geo.warnings), notes=("n-0", "n-1")))


def test_a_per_layer_plan_reply_is_the_hand_computed_message():
    r = _plan("per_layer")
    # per_layer: one space per group; space 1 starts where space 0 ends (base 40, upper_bound 40 + 12).
    assert [_layer(v) for v in r.layers] == [
        (0, 0, 0, 8192, 8192 * 40, 1, 0, 40, 0),
        (1, 1, 1, 8192, 8192 * 12, 1, 0, 52, 40),
        (2, 0, 0, 8192, 8192 * 40, 1, 0, 40, 0),
        (3, 1, 1, 16384, 16384 * 12, 1, 0, 52, 40)]
    assert [_group(g) for g in r.groups] == [(0, 0, [0, 2], 16384, 8192 * 40, 40),
                                             (1, 64, [1, 3], 24576, 16384 * 12, 12)]
    assert [_space(s) for s in r.index_spaces] == [(0, 0, 1, 0, 40, [0, 2], 0, cpb.INT32),
                                                   (1, 1, 1, 0, 52, [1, 3], 40, cpb.INT32)]
    total = 40 * 16384 + 12 * 24576
    assert (r.num_slots, r.page_size, r.max_seq_len, r.max_pages_per_seq) == (40, 16, 300, 19)    # ceil(300/16)
    assert (r.bytes_per_layer, r.bytes_per_slot, r.total_bytes) == (8192 * 40, 16384 + 24576, total)
    assert (r.max_byte_offset, r.pool_pages, r.equal_sizing_bytes) == (8192 * 40 - 1, 52, 40 * (16384 + 24576))
    assert (r.offsets_exceed_int32, r.offsets_exceed_uint32, r.indices_need_int64) == (False, False, False)
    assert (list(r.backends), list(r.warnings), list(r.notes)) == (["cpu", "triton"], [], ["n-0", "n-1"])


def test_an_interleaved_plan_reply_is_the_hand_computed_message():
    r = _plan("interleaved", 16 * 7)
    # G0: L0 at byte 0, L2 at 8192 of a 16384-byte slot: scale 2, offsets 0 and 1, one space each (40 x 2 pages).
    # G1: L3 (16384 B, largest first) at 0, L1 at 16384; 24576 B padded to 32768 (a multiple of 16384):
    #     L1 scale 4 offset 2, L3 scale 2 offset 0. Spaces in member order: L1's, then L3's.
    assert [_layer(v) for v in r.layers] == [
        (0, 0, 0, 8192, 8192 * 40, 2, 0, 80, 0),
        (1, 1, 2, 8192, 8192 * 12, 4, 2, 160 + 48, 160),
        (2, 0, 1, 8192, 8192 * 40, 2, 1, 160, 80),
        (3, 1, 3, 16384, 16384 * 12, 2, 0, 208 + 24, 208)]
    assert [_group(g) for g in r.groups] == [(0, 0, [0, 2], 16384, 16384 * 40, 40),
                                             (1, 64, [1, 3], 32768, 32768 * 12, 12)]
    assert [_space(s) for s in r.index_spaces] == [
        (0, 0, 2, 0, 80, [0], 0, cpb.INT32), (1, 0, 2, 1, 160, [2], 80, cpb.INT32),
        (2, 1, 4, 2, 208, [1], 160, cpb.INT32), (3, 1, 2, 0, 232, [3], 208, cpb.INT32)]
    assert (r.pool_pages, r.max_pages_per_seq, r.max_byte_offset) == (232, 7, 16384 * 40 - 1)   # G0's buffer
    assert (r.total_bytes, r.bytes_per_slot) == (40 * 16384 + 12 * 32768, 16384 + 32768)
    assert len(r.warnings) == 1 and "padded from 24576 to 32768" in r.warnings[0]


def test_a_plan_past_32_bit_offsets_and_indices_says_so_and_names_int64_spaces():
    spec = CacheSpec((LayerSpec(8, 128, "float16"),), 16)           # 2 x 16 x 8 x 128 x 2 = 65536 B a page
    n = 2**31 + 5                                                     # pages; > INT32_MAX + 1
    r = convert.plan_to_proto(Plan(Geometry(spec, n), 16 * n))
    assert r.max_byte_offset == 65536 * n - 1 and r.offsets_exceed_int32 and r.offsets_exceed_uint32
    assert r.indices_need_int64 and r.index_spaces[0].index_dtype == cpb.INT64 and r.pool_pages == n
    assert r.layers[0].bytes == 65536 * n and r.num_slots == n


def _random_spec(rng: random.Random) -> CacheSpec:
    kinds = [LayerSpec(rng.choice([1, 2, 8]), rng.choice([64, 128, 576]), rng.choice(list(convert.DTYPE_CODES)),
                       rng.choice([0, 0, 128, 4096]), rng.random() < 0.2) for _ in range(rng.randint(1, 4))]
    layers: list[LayerSpec] = []
    while len(layers) < rng.randint(1, 40):
        layers.extend([rng.choice(kinds)] * rng.randint(1, 6))
    return CacheSpec(tuple(layers), rng.choice([1, 16, 64]), rng.choice(["per_layer", "interleaved"]))


def _runs(layers: tuple[LayerSpec, ...]) -> list[tuple[LayerSpec, int]]:
    """Plain-Python run-length encoding (the oracle of cache_spec_to_proto's counts)."""
    out: list[tuple[LayerSpec, int]] = []
    for la in layers:
        if out and out[-1][0] == la:
            out[-1] = (la, out[-1][1] + 1)
        else:
            out.append((la, 1))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_a_cache_spec_crosses_the_wire_run_length_encoded_and_comes_back_equal(seed):
    rng = random.Random(seed)
    spec = _random_spec(rng)
    msg = convert.cache_spec_to_proto(spec)
    assert (msg.page_size, msg.layout) == (spec.page_size, convert.LAYOUT_CODES[spec.layout])
    assert [(m.kv_heads, m.head_dim, m.dtype, m.sliding_window, m.k_only, m.count) for m in msg.layers] == [
        (la.kv_heads, la.head_dim, convert.DTYPE_CODES[la.dtype], la.sliding_window, la.k_only, n)
        for la, n in _runs(spec.layers)]
    back = convert.cache_spec_from_proto(pb.CacheSpec.FromString(msg.SerializeToString()))
    assert back == spec


def test_a_cache_spec_message_is_read_with_count_zero_as_one_and_every_dtype_and_layout():
    wire = pb.CacheSpec(page_size=32, layout=pb.LAYOUT_UNSPECIFIED, layers=[
        pb.LayerSpec(kv_heads=3, head_dim=80, dtype=cpb.BFLOAT16, count=0),
        pb.LayerSpec(kv_heads=1, head_dim=576, dtype=cpb.FLOAT8_E4M3, k_only=True, count=2),
        pb.LayerSpec(kv_heads=2, head_dim=64, dtype=cpb.FLOAT8_E5M2, sliding_window=512, count=1),
        pb.LayerSpec(kv_heads=5, head_dim=16, dtype=cpb.FLOAT32, count=1),
        pb.LayerSpec(kv_heads=4, head_dim=8, dtype=cpb.FLOAT16, count=3)])
    spec = convert.cache_spec_from_proto(wire)
    assert spec == CacheSpec((LayerSpec(3, 80, "bfloat16"),) + (LayerSpec(1, 576, "float8_e4m3", 0, True),) * 2 +
                             (LayerSpec(2, 64, "float8_e5m2", 512), LayerSpec(5, 16, "float32")) +
                             (LayerSpec(4, 8, "float16"),) * 3, 32, "per_layer")
    wire.layout = pb.INTERLEAVED
    assert convert.cache_spec_from_proto(wire).layout == "interleaved"
    wire.layout = pb.PER_LAYER
    assert convert.cache_spec_from_proto(wire).layout == "per_layer"


def test_a_bad_cache_spec_message_is_refused_naming_what_is_wrong():
    ok = pb.LayerSpec(kv_heads=2, head_dim=64, dtype=cpb.FLOAT16)
    with pytest.raises(InvalidArgument, match=r"cache\.layout 77 is not a known layout"):
        convert.cache_spec_from_proto(pb.CacheSpec(page_size=16, layout=77, layers=[ok]))
    bad = pb.LayerSpec(kv_heads=2, head_dim=64, dtype=cpb.INT32)
    with pytest.raises(InvalidArgument, match=r"cache.layers\[1\].dtype must be a cache dtype .* got "
                                              f"{cpb.INT32}$"):
        convert.cache_spec_from_proto(pb.CacheSpec(page_size=16, layers=[ok, bad]))
    at_limit = pb.LayerSpec(kv_heads=2, head_dim=64, dtype=cpb.FLOAT16, count=MAX_LAYERS - 1)
    assert len(convert.cache_spec_from_proto(pb.CacheSpec(page_size=16, layers=[ok, at_limit])).layers) == MAX_LAYERS
    with pytest.raises(InvalidArgument, match=f"cache spec has more than {MAX_LAYERS} layers"):
        convert.cache_spec_from_proto(pb.CacheSpec(page_size=16, layers=[ok, ok, at_limit]))
    huge = pb.LayerSpec(kv_heads=2, head_dim=64, dtype=cpb.FLOAT16, count=2**32 - 1)    # refused before it is built
    with pytest.raises(InvalidArgument, match="more than"):
        convert.cache_spec_from_proto(pb.CacheSpec(page_size=16, layers=[huge]))


@pytest.mark.parametrize("seed", range(6))
def test_a_sizing_crosses_the_wire_field_by_field(seed):
    rng = random.Random(100 + seed)
    s = Sizing(rng.randint(1, 10**4), rng.randint(1, 10**6), rng.randint(1, 2**50), rng.randint(1, 10**6),
               rng.randint(1, 10**5), rng.randint(1, 999), rng.random() < 0.5,
               tuple(rng.randint(1, 10**6) for _ in range(rng.randint(1, 5))))
    msg = pb.Sizing.FromString(convert.sizing_to_proto(s).SerializeToString())
    assert (msg.max_batch, msg.max_seq_len, msg.memory_budget_bytes, msg.num_slots, msg.max_num_batched_tokens,
            msg.prefix_headroom_slots, msg.equal_groups, list(msg.group_slots)) == (
        s.max_batch, s.max_seq_len, s.memory_budget_bytes, s.num_slots, s.max_num_batched_tokens,
        s.prefix_headroom_slots, s.equal_groups, list(s.group_slots))
    assert convert.sizing_from_proto(msg) == s


def test_a_sizing_with_more_slot_counts_than_a_pool_has_groups_is_refused():
    assert convert.sizing_from_proto(pb.Sizing(group_slots=[7] * convert.MAX_GROUPS)).group_slots == \
        (7,) * convert.MAX_GROUPS
    with pytest.raises(InvalidArgument, match=f"has {convert.MAX_GROUPS + 1} entries; a pool has at most "
                                              f"{convert.MAX_GROUPS} layer groups"):
        convert.sizing_from_proto(pb.Sizing(group_slots=[7] * (convert.MAX_GROUPS + 1)))
