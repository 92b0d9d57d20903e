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

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec, Geometry, group_windows
from kvservice.contract.sizing import DEFAULT_BATCHED_TOKENS, Plan, Sizing
from kvservice.core.backends import check_backends

MAX_SLOTS = 2**40
MAX_BYTES = 2**63 - 1



def sliding_group_slots(window: int, page_size: int, max_batch: int, batched_tokens: int, headroom: int = 0) -> int:
    """Slots a sliding group of `window` tokens needs for max_batch sequences.

    A sequence extended by one token holds at most ceil(window / page_size) + 1 pages of the group
    (the window may straddle a page boundary at each end); the prompt chunk being prefilled adds
    ceil(batched_tokens / page_size) pages over the batch, and headroom keeps cached pages longer.
    """
    return max_batch * (-(-window // page_size) + 1) + -(-batched_tokens // page_size) + headroom


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
