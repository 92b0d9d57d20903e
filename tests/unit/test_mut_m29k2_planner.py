"""kvservice/core/planner.py and backends.py against plans worked out by hand from the module docstrings.

Slot bytes of a per_layer group: the sum over its layers of 2 (K and V) x kv_heads x head_dim x dtype bytes x
page_size. A full group gets max_batch x ceil(max_seq_len / page_size) slots; a sliding group of window w
at most max_batch x (ceil(w / page_size) + 1) + ceil(batched / page_size) + headroom, where batched is
max_num_batched_tokens or min(2048, max_seq_len). A budget plan is the largest n with
sum over groups of min(n, cap_g) x slot_bytes_g <= budget (searched here by a plain linear scan).
Backend rules: docs/DESIGN.md's table (seed 003), re-stated as plain predicates.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvservice.contract.errors import FailedPrecondition, InvalidArgument
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.backends import check_backends
from kvservice.core.planner import plan

PS = 16
W = 1000
# group 0 (full): layers 0 and 2; group 1 (window 1000): layers 1 and 3
SPEC = CacheSpec((LayerSpec(2, 64, "float16"), LayerSpec(1, 128, "float16", W), LayerSpec(4, 64, "bfloat16"),
                  LayerSpec(1, 64, "float16", W)), PS, "per_layer")
SLOT_BYTES = [2 * (2 * 64 + 4 * 64) * 2 * PS, 2 * (128 + 64) * 2 * PS]          # [24576, 12288]


def _cap(max_batch: int, batched: int, headroom: int = 0) -> int:
    return max_batch * (math.ceil(W / PS) + 1) + math.ceil(batched / PS) + headroom


def _note(c: int, max_batch: int, batched: int, headroom: int = 0) -> str:
    return (f"group 1 (sliding window {W}): {c} slots = {max_batch} sequences x (ceil({W} / {PS}) + 1) + "
            f"ceil({batched} batched tokens / {PS})" + (f" + {headroom} prefix-cache headroom" if headroom else ""))


@pytest.mark.parametrize("max_batch, max_seq_len, batched, headroom", [
    (8, 4096, 0, 0),          # batched: min(2048, 4096) = 2048
    (8, 1600, 0, 0),          # batched: min(2048, 1600) = 1600
    (3, 9000, 512, 0),
    (5, 20000, 0, 77),
])
def test_max_batch_plans_against_hand_computed_counts_and_notes(max_batch, max_seq_len, batched, headroom):
    p = plan(SPEC, Sizing(max_batch=max_batch, max_seq_len=max_seq_len, max_num_batched_tokens=batched,
                          prefix_headroom_slots=headroom))
    eff = batched or min(2048, max_seq_len)
    full = max_batch * math.ceil(max_seq_len / PS)
    cap = _cap(max_batch, eff, headroom)
    assert [g.num_slots for g in p.geometry.groups] == [full, min(full, cap)]
    assert [g.slot_bytes for g in p.geometry.groups] == SLOT_BYTES
    assert p.max_seq_len == max_seq_len
    assert p.notes == ((_note(cap, max_batch, eff, headroom),) if cap < full else ())
    # equal_groups: every group as many slots as the full one, no notes
    eq = plan(SPEC, Sizing(max_batch=max_batch, max_seq_len=max_seq_len, equal_groups=True))
    assert [g.num_slots for g in eq.geometry.groups] == [full, full] and eq.notes == ()


def _fit(budget: int, caps: list[int | None]) -> int:
    def cost(n: int) -> int:
        return sum(min(n, c) * b if c is not None else n * b for c, b in zip(caps, SLOT_BYTES, strict=True))

    n = 0
    while cost(n + 1) <= budget:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(4))
def test_budget_plans_are_the_largest_that_fit(seed):
    rng = np.random.default_rng(seed)
    max_batch = int(rng.integers(1, 4))
    budget = int(rng.integers(8 * 2**20, 40 * 2**20))
    eff = min(2048, 3000)
    cap = _cap(max_batch, eff)
    n = _fit(budget, [None, cap])
    p = plan(SPEC, Sizing(memory_budget_bytes=budget, max_batch=max_batch, max_seq_len=3000))
    assert [g.num_slots for g in p.geometry.groups] == [n, min(n, cap)]
    assert sum(g.num_slots * b for g, b in zip(p.geometry.groups, SLOT_BYTES, strict=True)) <= budget
    assert p.notes == ((_note(cap, max_batch, eff),) if n >= cap else ())
    # no max_batch: no cap, every group n
    m = _fit(budget, [None, None])
    q = plan(SPEC, Sizing(memory_budget_bytes=budget, max_seq_len=16))
    assert [g.num_slots for g in q.geometry.groups] == [m, m]


def test_budget_below_one_slot_of_every_group_is_refused_with_the_figures():
    one = sum(SLOT_BYTES)
    assert [g.num_slots for g in plan(SPEC, Sizing(memory_budget_bytes=one, max_seq_len=16)).geometry.groups] == [1, 1]
    with pytest.raises(InvalidArgument) as exc:
        plan(SPEC, Sizing(memory_budget_bytes=one - 1))
    assert exc.value.message == (f"memory budget of {one - 1} bytes holds no slot: one slot of every group takes "
                                 f"{one} bytes")


def test_slot_count_limit_is_2_to_the_40_inclusive():
    tiny = CacheSpec((LayerSpec(1, 32, "float8_e4m3"),), 1, "per_layer")
    p = plan(tiny, Sizing(num_slots=2**40))
    assert p.num_slots == 2**40 and p.max_seq_len == 2**40
    with pytest.raises(InvalidArgument) as exc:
        plan(tiny, Sizing(num_slots=2**40 + 1))
    assert exc.value.message == "1099511627777 slots (from num_slots) is more than the 1099511627776 a pool may hold"
    with pytest.raises(InvalidArgument) as exc:
        plan(tiny, Sizing(group_slots=(2**40 + 5,)))
    assert "1099511627781 slots (from group_slots)" in exc.value.message


def test_group_slots_must_match_the_groups():
    assert [g.num_slots for g in plan(SPEC, Sizing(group_slots=(300, 140), max_seq_len=PS * 10)).geometry.groups] \
        == [300, 140]
    with pytest.raises(InvalidArgument) as exc:
        plan(SPEC, Sizing(group_slots=(300,)))
    assert exc.value.message == ("group_slots has 1 entries; this cache has 2 layer groups (windows [0, 1000], "
                                 "0 = full attention)")


#: name -> (display, rule, accepts) from the backend table (docs/DESIGN.md, seed 003)
RULES = {
    "native": ("kvservice native kernels", "any page size", lambda ps: True),
    "flashinfer": ("FlashInfer", "any page size", lambda ps: True),
    "flash-attn2": ("flash-attn 2", "page_size % 256 == 0", lambda ps: ps % 256 == 0),
    "vllm-flash-attn": ("vLLM's flash-attn fork", "page_size % 16 == 0", lambda ps: ps % 16 == 0),
    "candle-flash-attn": ("candle flash-attn", "page_size % 32 == 0", lambda ps: ps % 32 == 0),
    "trtllm": ("TensorRT-LLM", "page_size a power of two", lambda ps: ps in {2**k for k in range(12)}),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_backend_accepts_exactly_its_page_sizes_and_refuses_with_reason_and_metadata(name):
    display, rule, accepts = RULES[name]
    for ps in range(1, 1100):
        if accepts(ps):
            assert check_backends(ps, [name]) == [name]
            continue
        with pytest.raises(FailedPrecondition) as exc:
            check_backends(ps, ["native", name])
        e = exc.value
        assert e.message == f"{display} needs {rule}, got page_size {ps}"
        assert e.reason == "BACKEND_PAGE_SIZE"
        assert e.metadata == {"backend": name, "rule": rule, "page_size": str(ps)}


def test_aliases_and_the_native_layer_rule():
    aliases = {"flash-attn-2": "flash-attn2", "flash_attn2": "flash-attn2", "fa2": "flash-attn2",
               "vllm": "vllm-flash-attn", "vllm_flash_attn": "vllm-flash-attn", "candle": "candle-flash-attn",
               "tensorrt-llm": "trtllm", "tensorrt_llm": "trtllm"}
    for alias, name in aliases.items():
        assert check_backends(512, [alias, f" {alias.upper()} "]) == [name, name]
    assert check_backends(512, [*RULES]) == [*RULES]
    ok = [(hd, dt) for hd in (32, 64, 128, 256, 512) for dt in ("float16", "bfloat16", "float32")]
    assert check_backends(16, ["native"], ok) == ["native"]
    assert check_backends(16, ["flashinfer"], [(96, "float8_e4m3")]) == ["flashinfer"]     # no layer rule
    for i, bad in ((2, (96, "float16")), (1, (128, "float8_e4m3"))):
        layers = [*ok[:i], bad, *ok]
        with pytest.raises(FailedPrecondition) as exc:
            check_backends(16, ["native"], layers)
        e = exc.value
        assert e.message == ("kvservice native kernels need head_dim in 32/64/128/256/512 and a float16, bfloat16 "
                             f"or float32 cache; layer {i} has head_dim {bad[0]}, dtype {bad[1]}")
        assert e.reason == "BACKEND_LAYER"
        assert e.metadata == {"backend": "native", "rule": "head_dim in 32/64/128/256/512 and a float16, bfloat16 "
                              "or float32 cache", "layer": str(i)}
    with pytest.raises(InvalidArgument) as exc:
        check_backends(16, ["cudnn"])
    assert exc.value.message == ("unknown kernel backend 'cudnn'; known: native, flashinfer, flash-attn2, "
                                 "vllm-flash-attn, candle-flash-attn, trtllm")


def test_a_plan_over_2_63_bytes_is_refused_with_its_size():
    big = CacheSpec((LayerSpec(1024, 512, "float32"),), 16, "per_layer")   # a slot: 2 x 1024 x 512 x 4 x 16 = 2^26 B
    assert plan(big, Sizing(num_slots=2**37 - 1)).total_bytes == (2**37 - 1) * 2**26      # just under 2^63
    with pytest.raises(InvalidArgument) as exc:
        plan(big, Sizing(num_slots=2**37))
    assert exc.value.message == (f"this plan needs {2**63} bytes of cache, more than the 2^63 - 1 any address space "
                                 "holds; check kv_heads, head_dim and the sizing")


def test_one_sequence_must_fit_each_group():
    # full group: ceil(4096 / 16) = 256 pages; window group: ceil(1000 / 16) + 1 = 64 pages at most
    assert [g.num_slots for g in plan(SPEC, Sizing(group_slots=(256, 64), max_seq_len=4096)).geometry.groups] == \
        [256, 64]
    for slots, g, need, has in (((256, 63), 1, 64, 63), ((255, 64), 0, 256, 255)):
        with pytest.raises(InvalidArgument) as exc:
            plan(SPEC, Sizing(group_slots=slots, max_seq_len=4096))
        assert exc.value.message == (f"one sequence of max_seq_len 4096 tokens needs {need} slots in layer group {g}, "
                                     f"but the group has {has} (from group_slots); raise the budget or lower "
                                     "max_seq_len")
    # a sequence shorter than the window needs only its own pages there
    assert [g.num_slots for g in plan(SPEC, Sizing(group_slots=(20, 20), max_seq_len=320)).geometry.groups] == \
        [20, 20]


def test_budget_plans_when_the_capped_window_group_has_the_bigger_slots():
    # full group: 2 x 1 x 64 x 2 x 16 = 4096 B a slot; window group (256): 2 x 8 x 128 x 2 x 16 = 65536 B
    spec = CacheSpec((LayerSpec(1, 64, "float16"), LayerSpec(8, 128, "float16", 256)), 16, "per_layer")
    cap = 2 * (256 // 16 + 1) + 256 // 16                  # max_batch 2, batched min(2048, 256) = 256: 50
    for budget in (cap * 65536 + 1000 * 4096, cap * 65536 + 1000 * 4096 - 1, 40 * (4096 + 65536) + 5):
        n = 0
        while (n + 1) * 4096 + min(n + 1, cap) * 65536 <= budget:
            n += 1
        p = plan(spec, Sizing(memory_budget_bytes=budget, max_batch=2, max_seq_len=256))
        assert [g.num_slots for g in p.geometry.groups] == [n, min(n, cap)]
    assert n == 40 and [g.num_slots for g in p.geometry.groups] == [40, 40]
