"""The planner's request (Sizing) and its answer (Plan): shared by the manager, the client and the
worker (core/planner.py does the planning)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import INT32_MAX, Geometry

#: Tokens one Step may add over the whole batch when the sizing says none (vLLM's default
#: max_num_batched_tokens for its API server with chunked prefill).
DEFAULT_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class Sizing:
    """How many slots to plan. Precedence: group_slots, num_slots, memory_budget_bytes, max_batch x max_seq_len.

    max_batch: concurrent sequences (0 = unset).
    max_seq_len: tokens per sequence (0 = num_slots * page_size).
    memory_budget_bytes: bytes of all cache buffers together (0 = unset).
    num_slots: explicit slot count of every layer group (0 = unset).
    max_num_batched_tokens: tokens one Step adds over the batch beyond one per sequence, i.e. the
        prompt chunk being prefilled (0 = min(DEFAULT_BATCHED_TOKENS, max_seq_len)); sizes sliding groups.
    prefix_headroom_slots: extra slots of each sliding group, for prefix-cache pages kept past the
        window (0 = none).
    equal_groups: give every layer group as many slots as the full-attention group (the sizing before
        sliding groups were sized to their window).
    group_slots: explicit slot count of each layer group, in group order (() = unset).
    """

    max_batch: int = 0
    max_seq_len: int = 0
    memory_budget_bytes: int = 0
    num_slots: int = 0
    max_num_batched_tokens: int = 0
    prefix_headroom_slots: int = 0
    equal_groups: bool = False
    group_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_seq_len", "memory_budget_bytes", "num_slots", "max_num_batched_tokens",
                     "prefix_headroom_slots"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {getattr(self, name)}")
        object.__setattr__(self, "group_slots", tuple(int(n) for n in self.group_slots))
        if any(n <= 0 for n in self.group_slots):
            raise InvalidArgument(f"group_slots must all be > 0, got {list(self.group_slots)}")


@dataclass(frozen=True, slots=True)
class Plan:
    """A planned pool: geometry plus the figures a person checks before allocating."""

    geometry: Geometry
    max_seq_len: int
    backends: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())     # how each group was sized, for the person reading the plan

    @property
    def num_slots(self) -> int:
        """Slots of the largest layer group (every group's own: group_slots)."""
        return self.geometry.num_slots

    @property
    def group_slots(self) -> tuple[int, ...]:
        return self.geometry.group_slots

    @property
    def page_size(self) -> int:
        return self.geometry.spec.page_size

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def bytes_per_layer(self) -> int:
        """The largest per-layer byte count (the layer's group's num_slots * page_bytes)."""
        g = self.geometry
        return max(v.page_bytes * g.groups[v.group].num_slots for v in g.layers)

    @property
    def bytes_per_slot(self) -> int:
        return self.geometry.bytes_per_slot

    @property
    def total_bytes(self) -> int:
        """Bytes of every cache buffer (each group's num_slots * slot_bytes)."""
        return self.geometry.total_bytes

    @property
    def equal_sizing_bytes(self) -> int:
        """What the buffers would take if every group had num_slots slots (the largest group's count)."""
        return self.num_slots * self.bytes_per_slot

    @property
    def saved_bytes(self) -> int:
        """Bytes saved by sizing each group to what it needs, against equal sizing."""
        return self.equal_sizing_bytes - self.total_bytes

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
            "group_slots": list(self.group_slots),
            "equal_sizing_bytes": self.equal_sizing_bytes,
            "saved_bytes": self.saved_bytes,
            "max_byte_offset": self.max_byte_offset,
            "offsets_exceed_int32": self.offsets_exceed_int32,
            "offsets_exceed_uint32": self.offsets_exceed_uint32,
            "indices_need_int64": self.indices_need_int64,
            "pool_pages": g.pool_pages,
            "backends": list(self.backends),
            "groups": [{"group": gr.id, "sliding_window": gr.sliding_window, "layers": list(gr.layers),
                        "num_slots": gr.num_slots, "slot_bytes": gr.slot_bytes, "bytes": gr.bytes,
                        "buffer_bytes": gr.buffer_bytes} for gr in g.groups],
            "index_spaces": [{"id": s.id, "group": s.group, "scale": s.scale, "offset": s.offset,
                              "base": s.base, "upper_bound": s.upper_bound, "layers": list(s.layers),
                              "index_dtype": s.index_dtype.name} for s in g.index_spaces],
            "warnings": list(self.warnings),
            "notes": list(self.notes),
        }
