"""Proto messages <-> domain objects (CacheSpec, Sizing, Plan, pool stats)."""

from __future__ import annotations

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import MAX_LAYERS, CacheSpec, LayerSpec
from kvservice.contract.sizing import Plan, Sizing
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb

CACHE_DTYPES = {cpb.FLOAT16: "float16", cpb.BFLOAT16: "bfloat16", cpb.FLOAT32: "float32",
                cpb.FLOAT8_E4M3: "float8_e4m3", cpb.FLOAT8_E5M2: "float8_e5m2"}
DTYPE_CODES = {v: k for k, v in CACHE_DTYPES.items()}
LAYOUTS = {pb.LAYOUT_UNSPECIFIED: "per_layer", pb.PER_LAYER: "per_layer", pb.INTERLEAVED: "interleaved"}
LAYOUT_CODES = {"per_layer": pb.PER_LAYER, "interleaved": pb.INTERLEAVED}


def cache_spec_from_proto(msg: pb.CacheSpec) -> CacheSpec:
    if msg.layout not in LAYOUTS:
        raise InvalidArgument(f"cache.layout {msg.layout} is not a known layout")
    layers: list[LayerSpec] = []
    for i, ls in enumerate(msg.layers):
        if ls.dtype not in CACHE_DTYPES:
            raise InvalidArgument(f"cache.layers[{i}].dtype must be a cache dtype "
                                  f"(FLOAT16, BFLOAT16, FLOAT32, FLOAT8_E4M3, FLOAT8_E5M2), got {ls.dtype}")
        count = ls.count or 1
        if len(layers) + count > MAX_LAYERS:
            raise InvalidArgument(f"cache spec has more than {MAX_LAYERS} layers")
        layers.extend([LayerSpec(ls.kv_heads, ls.head_dim, CACHE_DTYPES[ls.dtype], ls.sliding_window,
                                 ls.k_only)] * count)
    return CacheSpec(tuple(layers), msg.page_size, LAYOUTS[msg.layout])


def cache_spec_to_proto(spec: CacheSpec) -> pb.CacheSpec:
    out = pb.CacheSpec(page_size=spec.page_size, layout=LAYOUT_CODES[spec.layout])
    for layer in spec.layers:    # run-length encode identical consecutive layers
        if out.layers and _same(out.layers[-1], layer):
            out.layers[-1].count += 1
        else:
            out.layers.add(kv_heads=layer.kv_heads, head_dim=layer.head_dim, dtype=DTYPE_CODES[layer.dtype],
                           sliding_window=layer.sliding_window, count=1, k_only=layer.k_only)
    return out


def _same(msg: pb.LayerSpec, layer: LayerSpec) -> bool:
    return (msg.kv_heads, msg.head_dim, msg.dtype, msg.sliding_window, msg.k_only) == (
        layer.kv_heads, layer.head_dim, DTYPE_CODES[layer.dtype], layer.sliding_window, layer.k_only)


MAX_GROUPS = MAX_LAYERS     # a layer group has at least one layer


def sizing_from_proto(msg: pb.Sizing) -> Sizing:
    if len(msg.group_slots) > MAX_GROUPS:
        raise InvalidArgument(f"sizing.group_slots has {len(msg.group_slots)} entries; a pool has at most "
                              f"{MAX_GROUPS} layer groups")
    return Sizing(msg.max_batch, msg.max_seq_len, msg.memory_budget_bytes, msg.num_slots, msg.max_num_batched_tokens,
                  msg.prefix_headroom_slots, msg.equal_groups, tuple(msg.group_slots))


def sizing_to_proto(s: Sizing) -> pb.Sizing:
    return pb.Sizing(max_batch=s.max_batch, max_seq_len=s.max_seq_len, memory_budget_bytes=s.memory_budget_bytes,
                     num_slots=s.num_slots, max_num_batched_tokens=s.max_num_batched_tokens,
                     prefix_headroom_slots=s.prefix_headroom_slots, equal_groups=s.equal_groups,
                     group_slots=list(s.group_slots))


def index_space_to_proto(space: object) -> pb.IndexSpace:
    return pb.IndexSpace(id=space.id, group=space.group, scale=space.scale, offset=space.offset,
                         upper_bound=space.upper_bound, layers=list(space.layers), base=space.base,
                         index_dtype=cpb.INT32 if space.index_dtype.itemsize == 4 else cpb.INT64)


def plan_to_proto(plan: Plan) -> pb.PlanReply:
    geo = plan.geometry
    return pb.PlanReply(
        num_slots=plan.num_slots, page_size=plan.page_size, max_seq_len=plan.max_seq_len,
        max_pages_per_seq=plan.max_pages_per_seq, bytes_per_layer=plan.bytes_per_layer,
        bytes_per_slot=plan.bytes_per_slot, total_bytes=plan.total_bytes, max_byte_offset=plan.max_byte_offset,
        offsets_exceed_int32=plan.offsets_exceed_int32, offsets_exceed_uint32=plan.offsets_exceed_uint32,
        indices_need_int64=plan.indices_need_int64,
        layers=[pb.LayerPlan(layer=v.layer, group=v.group, index_space=v.index_space, page_bytes=v.page_bytes,
                             bytes=v.page_bytes * geo.groups[v.group].num_slots, scale=v.scale, offset=v.offset,
                             upper_bound=v.upper_bound, base=v.base) for v in geo.layers],
        groups=[pb.GroupPlan(group=g.id, sliding_window=g.sliding_window, layers=list(g.layers),
                             slot_bytes=g.slot_bytes, buffer_bytes=g.buffer_bytes, num_slots=g.num_slots)
                for g in geo.groups],
        index_spaces=[index_space_to_proto(s) for s in geo.index_spaces],
        backends=list(plan.backends), warnings=list(plan.warnings), pool_pages=geo.pool_pages,
        equal_sizing_bytes=plan.equal_sizing_bytes, notes=list(plan.notes))
