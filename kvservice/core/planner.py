"""Capacity planning: how many slots, how many bytes, and which address widths a pool needs.

Seed 000 sized a cache for one sequence and indexed eight. Here the slot count
comes from ``max_batch * ceil(max_seq_len / page_size)`` (or a byte budget, or
an explicit count), and the plan says whether any byte offset passes 2^31 or
2^32 (seed 002) and whether page indices need int64.

Each layer group is sized to what it needs: a sliding-window group never holds
more than its window's pages per sequence plus the chunk being prefilled, so it
gets ``max_batch * (ceil(window / page_size) + 1) + ceil(max_num_batched_tokens /
page_size)`` slots (plus any prefix-cache headroom), never more than a full
group; the plan reports the bytes saved against giving every group the same
count. Admission stays exact per group: a Step that any group cannot serve is
refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvservice.contract.errors import InvalidArgument
from kvservice.core.backends import check_backends
from kvservice.core.geometry import INT32_MAX, CacheSpec, Geometry, group_windows

MAX_SLOTS = 2**40
MAX_BYTES = 2**63 - 1


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


def sliding_group_slots(window: int, page_size: int, max_batch: int, batched_tokens: int, headroom: int = 0) -> int:
    """Slots a sliding group of `window` tokens needs for max_batch sequences.

    A sequence extended by one token holds at most ceil(window / page_size) + 1 pages of the group
    (the window may straddle a page boundary at each end); the prompt chunk being prefilled adds
    ceil(batched_tokens / page_size) pages over the batch, and headroom keeps cached pages longer.
    """
    return max_batch * (-(-window // page_size) + 1) + -(-batched_tokens // page_size) + headroom


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


def plan(spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...] | list[str] = ()) -> Plan:
    """Plan a pool for spec; checks every named backend's page-size rule first.

    Each layer group gets the slots it needs: a full-attention group max_batch * ceil(max_seq_len /
    page_size); a sliding group of window w at most that, and no more than
    `sliding_group_slots(w, ...)` (its window's pages per sequence plus the chunk being prefilled and
    the prefix-cache headroom). Sizing.equal_groups, num_slots and group_slots size groups explicitly.
    """
    checked = tuple(check_backends(spec.page_size, backends, ((la.head_dim, la.dtype) for la in spec.layers)))
    ps = spec.page_size
    windows = group_windows(spec)
    unit = Geometry(spec, 1)
    slot_bytes = [g.slot_bytes for g in unit.groups]
    batched = sizing.max_num_batched_tokens or min(DEFAULT_BATCHED_TOKENS, sizing.max_seq_len or DEFAULT_BATCHED_TOKENS)
    notes: list[str] = []

    def caps() -> list[int | None]:
        """Per group: the most slots its window needs for max_batch sequences (None: no cap)."""
        if sizing.equal_groups or not sizing.max_batch:
            return [None] * len(windows)
        return [sliding_group_slots(w, ps, sizing.max_batch, batched, sizing.prefix_headroom_slots) if w else None
                for w in windows]

    if sizing.group_slots:
        counts = list(sizing.group_slots)
        if len(counts) != len(windows):
            raise InvalidArgument(f"group_slots has {len(counts)} entries; this cache has {len(windows)} layer groups "
                                  f"(windows {windows}, 0 = full attention)")
        how = "group_slots"
    elif sizing.num_slots:
        counts = [sizing.num_slots] * len(windows)
        how = "num_slots"
    elif sizing.memory_budget_bytes:
        counts = _fit_budget(sizing.memory_budget_bytes, slot_bytes, caps())
        how = "memory_budget_bytes"
    elif sizing.max_batch and sizing.max_seq_len:
        n = sizing.max_batch * -(-sizing.max_seq_len // ps)
        counts = [n if c is None else min(n, c) for c in caps()]
        how = "max_batch x ceil(max_seq_len / page_size)"
    else:
        raise InvalidArgument(
            "say how big the pool is: num_slots, memory_budget_bytes, or both max_batch and max_seq_len")
    if max(counts) > MAX_SLOTS:
        raise InvalidArgument(f"{max(counts)} slots (from {how}) is more than the {MAX_SLOTS} a pool may hold")
    if how in ("memory_budget_bytes", "max_batch x ceil(max_seq_len / page_size)"):
        for g, (w, c, cap) in enumerate(zip(windows, counts, caps(), strict=True)):
            if w and cap is not None and c == cap:
                notes.append(f"group {g} (sliding window {w}): {c} slots = {sizing.max_batch} sequences x "
                             f"(ceil({w} / {ps}) + 1) + ceil({batched} batched tokens / {ps})"
                             + (f" + {sizing.prefix_headroom_slots} prefix-cache headroom"
                                if sizing.prefix_headroom_slots else ""))
    return plan_groups(spec, counts, sizing.max_seq_len, checked, how, notes)


def _fit_budget(budget: int, slot_bytes: list[int], caps: list[int | None]) -> list[int]:
    """The most slots n of the full groups such that sum over groups of min(n, cap_g) * slot_bytes_g <= budget."""
    def cost(n: int) -> int:
        return sum(min(n, c) * b if c is not None else n * b for c, b in zip(caps, slot_bytes, strict=True))

    if cost(1) > budget:
        raise InvalidArgument(f"memory budget of {budget} bytes holds no slot: one slot of every group takes "
                              f"{cost(1)} bytes")
    lo, hi = 1, min(MAX_SLOTS, budget // min(slot_bytes)) + 1
    while hi - lo > 1:                               # cost is monotone in n: the largest n that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid)
    return [lo if c is None else min(lo, c) for c in caps]


def plan_groups(spec: CacheSpec, group_slots: list[int] | tuple[int, ...], max_seq_len: int = 0,
                backends: tuple[str, ...] = (), how: str = "group_slots", notes: list[str] | None = None) -> Plan:
    """A plan with these slot counts per layer group (backends already checked); the checks every plan passes."""
    ps = spec.page_size
    geometry = Geometry(spec, group_slots)
    num_slots = geometry.num_slots
    max_seq_len = max_seq_len or num_slots * ps
    warnings = list(geometry.warnings)
    pages_per_seq = -(-max_seq_len // ps)
    for g in geometry.groups:
        need = pages_per_seq
        if g.sliding_window:   # prefilled a token at a time, one sequence needs no more than its window
            need = min(pages_per_seq, -(-g.sliding_window // ps) + 1)
        if need > g.num_slots:
            raise InvalidArgument(
                f"one sequence of max_seq_len {max_seq_len} tokens needs {need} slots in layer group {g.id}, but "
                f"the group has {g.num_slots} (from {how}); raise the budget or lower max_seq_len")
    plan_ = Plan(geometry, max_seq_len, tuple(backends), (), tuple(notes or ()))
    if plan_.total_bytes > MAX_BYTES or plan_.bytes_per_layer > MAX_BYTES or plan_.equal_sizing_bytes > MAX_BYTES:
        raise InvalidArgument(f"this plan needs {plan_.total_bytes} bytes of cache, more than the 2^63 - 1 any "
                              "address space holds; check kv_heads, head_dim and the sizing")
    if plan_.offsets_exceed_int32:
        warnings.append(
            f"byte offsets reach {plan_.max_byte_offset} (>= 2^31): kernels must use 64-bit offsets")
    if plan_.indices_need_int64:
        warnings.append("page indices exceed int32: tables are emitted as int64")
    return Plan(geometry, max_seq_len, tuple(backends), tuple(warnings), tuple(notes or ()))
