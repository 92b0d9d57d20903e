"""kvservice/core/planner.py plan_groups at its byte and address-width limits, figures worked out by hand.

A K-only float8 layer of page size 1 makes a slot exactly head_dim bytes (contract/geometry.py: page bytes =
kv_tensors x page_size x kv_heads x head_dim x dtype bytes), so a plan's bytes can be any product
num_slots x head_dim: 2^63 - 1 = 7^2 x 73 x 127 x 337 x 92737 x 649657 is reached exactly. A plan may hold at
most 2^63 - 1 bytes, counted three ways (every buffer, the largest layer, and every group sized like the
largest: equal_sizing_bytes), and warns when a byte offset passes 2^31 - 1 or a page index int32.
"""

from __future__ import annotations

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.core.planner import plan_groups

MAX = 2**63 - 1
OFFSETS = "byte offsets reach {} (>= 2^31): kernels must use 64-bit offsets"
INDICES = "page indices exceed int32: tables are emitted as int64"


def _one_byte_slots(head_dim: int, window: int = 0) -> LayerSpec:
    """A layer whose slot (page size 1) takes exactly head_dim bytes."""
    return LayerSpec(1, head_dim, "float8_e4m3", sliding_window=window, k_only=True)


def _refusal(total: int) -> str:
    return (f"this plan needs {total} bytes of cache, more than the 2^63 - 1 any address space holds; check "
            "kv_heads, head_dim and the sizing")


def test_a_plan_of_exactly_2_63_minus_1_bytes_is_accepted_and_one_byte_more_is_not():
    """One group of 92737 x 649657 slots of 7^2 x 73 x 127 x 337 bytes: every one of the three byte counts is
    exactly 2^63 - 1, the limit itself, so the plan is made, with both width warnings; a slot one byte
    bigger is refused naming its total."""
    slots, slot_bytes = 92737 * 649657, 7 * 7 * 73 * 127 * 337
    assert slots * slot_bytes == MAX
    spec = CacheSpec((_one_byte_slots(slot_bytes),), 1)
    p = plan_groups(spec, [slots])
    assert (p.total_bytes, p.bytes_per_layer, p.equal_sizing_bytes, p.saved_bytes) == (MAX, MAX, MAX, 0)
    assert (p.num_slots, p.max_seq_len, p.max_pages_per_seq, p.bytes_per_slot) == (slots, slots, slots, slot_bytes)
    assert p.warnings == (OFFSETS.format(MAX - 1), INDICES)
    assert (p.backends, p.notes) == ((), ())
    with pytest.raises(InvalidArgument) as exc:
        plan_groups(CacheSpec((_one_byte_slots(slot_bytes + 1),), 1), [slots])
    assert exc.value.message == _refusal(slots * (slot_bytes + 1))


def test_equal_sizing_past_2_63_is_refused_even_when_the_buffers_fit():
    """A full group of 2^40 slots of 2^22 bytes (2^62) and a window-1 group of 2 slots of 2^22 bytes: the
    buffers take 2^62 + 2^23 bytes, but equal sizing would give both groups 2^40 slots, 2^63 bytes: refused,
    the message naming the buffers' total. With 2^40 - 1 full slots equal sizing is 2^63 - 2^23: accepted."""
    spec = CacheSpec((_one_byte_slots(2**22), _one_byte_slots(2**22, window=1)), 1)
    with pytest.raises(InvalidArgument) as exc:
        plan_groups(spec, [2**40, 2])
    assert exc.value.message == _refusal(2**62 + 2**23)
    p = plan_groups(spec, [2**40 - 1, 2])
    assert (p.total_bytes, p.equal_sizing_bytes) == ((2**40 - 1) * 2**22 + 2**23, 2**63 - 2**23)
    assert p.saved_bytes == (2**40 - 3) * 2**22
    assert p.bytes_per_layer == (2**40 - 1) * 2**22


def test_width_warnings_start_one_past_int32_max():
    """One-byte slots: 2^31 of them put the last byte offset and the last page index at exactly 2^31 - 1 (no
    warning); one more slot passes both, in that order."""
    spec = CacheSpec((_one_byte_slots(1),), 1)
    at = plan_groups(spec, [2**31], 7, ("native",), "num_slots", ["a note"])
    assert (at.warnings, at.max_seq_len, at.backends, at.notes) == ((), 7, ("native",), ("a note",))
    assert at.max_byte_offset == 2**31 - 1
    past = plan_groups(spec, [2**31 + 1])
    assert past.warnings == (OFFSETS.format(2**31), INDICES)
    assert past.max_seq_len == 2**31 + 1


def test_geometry_warnings_come_first_and_a_sequence_must_fit_with_the_default_how():
    """An interleaved slot padded past 5/4 of its pages keeps the geometry's warning ahead of the planner's; a
    sequence longer than a group names group_slots as the sizing when the caller says nothing."""
    # pages of 4 and 3 bytes, largest first: offsets 0 and round_up(4, 3) = 6, the slot round_up(9, lcm(4, 3)) =
    # 12 bytes > 7 x 5 // 4 = 8: padded. Index spaces of scale 12 / 4 = 3 and 12 / 3 = 4.
    spec = CacheSpec((_one_byte_slots(3), _one_byte_slots(4)), 1, "interleaved")
    p = plan_groups(spec, [2**30])                     # 2^30 slots x 12 bytes; pages up to 4 x 2^30 - 1
    assert p.bytes_per_slot == 12
    assert p.warnings == ("group 0: interleaved slot padded from 7 to 12 bytes to align every page to its own size",
                          OFFSETS.format(12 * 2**30 - 1), INDICES)
    with pytest.raises(InvalidArgument) as exc:
        plan_groups(CacheSpec((_one_byte_slots(1),), 4), [3], 13)
    assert exc.value.message == ("one sequence of max_seq_len 13 tokens needs 4 slots in layer group 0, but the group "
                                 "has 3 (from group_slots); raise the budget or lower max_seq_len")


def test_a_sliding_group_needs_its_window_pages_plus_one_and_max_seq_len_defaults_to_the_pool():
    """Page size 4: a window of 9 tokens straddles at most ceil(9 / 4) + 1 = 4 pages, so its group needs 4 slots
    for a long sequence (3 are refused, naming 4) and only a short sequence's own pages otherwise; max_seq_len 0
    is every slot of the largest group: 5 x 4 = 20 tokens."""
    spec = CacheSpec((_one_byte_slots(2), _one_byte_slots(2, window=9)), 4)
    p = plan_groups(spec, [5, 4])
    assert (p.max_seq_len, p.max_pages_per_seq, p.group_slots) == (20, 5, (5, 4))
    with pytest.raises(InvalidArgument) as exc:
        plan_groups(spec, [5, 3], 0, (), "memory_budget_bytes")
    assert exc.value.message == ("one sequence of max_seq_len 20 tokens needs 4 slots in layer group 1, but the group "
                                 "has 3 (from memory_budget_bytes); raise the budget or lower max_seq_len")
    assert plan_groups(spec, [3, 3], 12).group_slots == (3, 3)      # 12 tokens: 3 pages in either group
    with pytest.raises(InvalidArgument) as exc:
        plan_groups(spec, [3, 2], 12)
    assert exc.value.message == ("one sequence of max_seq_len 12 tokens needs 3 slots in layer group 1, but the group "
                                 "has 2 (from group_slots); raise the budget or lower max_seq_len")
