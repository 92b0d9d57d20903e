"""Capacity planning: how many slots, how many bytes, and which address widths a pool needs.

Seed 000 sized a cache for one sequence and indexed eight. Here the slot count
comes from ``max_batch * ceil(max_seq_len / page_size)`` (or a byte budget, or
an explicit count), and the plan says whether any byte offset passes 2^31 or
2^32 (seed 002) and whether page indices need int64.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvservice.contract.errors import InvalidArgument
from kvservice.core.backends import check_backends
from kvservice.core.geometry import INT32_MAX, CacheSpec, Geometry

MAX_SLOTS = 2**40
MAX_BYTES = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Sizing:
    """How many slots to plan. Precedence: num_slots, memory_budget_bytes, max_batch x max_seq_len.

    max_batch: concurrent sequences (0 = unset).
    max_seq_len: tokens per sequence (0 = num_slots * page_size).
    memory_budget_bytes: bytes of all cache buffers together (0 = unset).
    num_slots: explicit slot count per layer group (0 = unset).
    """

    max_batch: int = 0
    max_seq_len: int = 0
    memory_budget_bytes: int = 0
    num_slots: int = 0

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_seq_len", "memory_budget_bytes", "num_slots"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Plan:
    """A planned pool: geometry plus the figures a person checks before allocating."""

    geometry: Geometry
    max_seq_len: int
    backends: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())

    @property
    def num_slots(self) -> int:
        return self.geometry.num_slots

    @property
    def page_size(self) -> int:
        return self.geometry.spec.page_size

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def bytes_per_layer(self) -> int:
        """The largest per-layer byte count (num_slots * page_bytes)."""
        return max(v.page_bytes for v in self.geometry.layers) * self.num_slots

    @property
    def bytes_per_slot(self) -> int:
        return self.geometry.bytes_per_slot

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    @property
    def max_byte_offset(self) -> int:
        return self.geometry.max_byte_offset

    @property
    def offsets_exceed_int32(self) -> bool:
        return self.max_byte_offset > INT32_MAX

    @property
    def offsets_exceed_uint32(self) -> bool:
        return self.max_byte_offset > 2**32 - 1

    @property
    def indices_need_int64(self) -> bool:
        return any(s.upper_bound - 1 > INT32_MAX for s in self.geometry.index_spaces)

    def summary(self) -> dict:
        """Plain-data view (what `kvctl plan --json` prints)."""
        g = self.geometry
        return {
            "num_slots": self.num_slots,
            "page_size": self.page_size,
            "layout": g.spec.layout,
            "num_layers": len(g.layers),
            "max_seq_len": self.max_seq_len,
            "max_pages_per_seq": self.max_pages_per_seq,
            "bytes_per_layer": self.bytes_per_layer,
            "bytes_per_slot": self.bytes_per_slot,
            "total_bytes": self.total_bytes,
            "max_byte_offset": self.max_byte_offset,
            "offsets_exceed_int32": self.offsets_exceed_int32,
            "offsets_exceed_uint32": self.offsets_exceed_uint32,
            "indices_need_int64": self.indices_need_int64,
            "pool_pages": g.pool_pages,
            "backends": list(self.backends),
            "groups": [{"group": gr.id, "sliding_window": gr.sliding_window, "layers": list(gr.layers),
                        "slot_bytes": gr.slot_bytes, "buffer_bytes": gr.buffer_bytes} for gr in g.groups],
            "index_spaces": [{"id": s.id, "group": s.group, "scale": s.scale, "offset": s.offset,
                              "base": s.base, "upper_bound": s.upper_bound, "layers": list(s.layers),
                              "index_dtype": s.index_dtype.name} for s in g.index_spaces],
            "warnings": list(self.warnings),
        }


def plan(spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] | list[str] = ()) -> Plan:
    """Plan a pool for spec; checks every named backend's page-size rule first."""
    checked = tuple(check_backends(spec.page_size, backends, ((la.head_dim, la.dtype) for la in spec.layers)))
    ps = spec.page_size
    if sizing.num_slots:
        num_slots = sizing.num_slots
        how = "num_slots"
    elif sizing.memory_budget_bytes:
        per_slot = Geometry(spec, 1).bytes_per_slot
        num_slots = sizing.memory_budget_bytes // per_slot
        how = "memory_budget_bytes"
        if num_slots == 0:
            raise InvalidArgument(
                f"memory budget of {sizing.memory_budget_bytes} bytes holds no slot: one slot takes "
                f"{per_slot} bytes")
    elif sizing.max_batch and sizing.max_seq_len:
        num_slots = sizing.max_batch * -(-sizing.max_seq_len // ps)
        how = "max_batch x ceil(max_seq_len / page_size)"
    else:
        raise InvalidArgument(
            "say how big the pool is: num_slots, memory_budget_bytes, or both max_batch and max_seq_len")
    if num_slots > MAX_SLOTS:
        raise InvalidArgument(f"{num_slots} slots (from {how}) is more than the {MAX_SLOTS} a pool may hold")
    geometry = Geometry(spec, num_slots)
    max_seq_len = sizing.max_seq_len or num_slots * ps
    warnings = list(geometry.warnings)
    pages_per_seq = -(-max_seq_len // ps)
    if pages_per_seq > num_slots:
        raise InvalidArgument(
            f"one sequence of max_seq_len {max_seq_len} tokens needs {pages_per_seq} slots, but the pool "
            f"has {num_slots} (from {how}); raise the budget or lower max_seq_len")
    plan_ = Plan(geometry, max_seq_len, checked, ())
    if plan_.total_bytes > MAX_BYTES or max(v.page_bytes for v in geometry.layers) * num_slots > MAX_BYTES:
        raise InvalidArgument(f"this plan needs {plan_.total_bytes} bytes of cache, more than the 2^63 - 1 any "
                              "address space holds; check kv_heads, head_dim and the sizing")
    if plan_.offsets_exceed_int32:
        warnings.append(
            f"byte offsets reach {plan_.max_byte_offset} (>= 2^31): kernels must use 64-bit offsets")
    if plan_.indices_need_int64:
        warnings.append("page indices exceed int32: tables are emitted as int64")
    return Plan(geometry, max_seq_len, checked, tuple(warnings))
