"""kvservice/core's small contracts pinned whole, against their docstrings and values computed by hand.

- hashing._cbor_ints: "(bytes uint8 [B], page_end int64 [N] offsets)" also for pages without tokens: an empty
  body and int64 page ends (every page ends at 0), for [0, page_size] and [N, 0] arrays alike.
- model_config._state (gated DeltaNet): every StateLayer field at each tensor-parallel split, the whole notes list,
  and the refusal of heads that do not split, naming the field.
- hashing.make_hash_fn: each mode's function and the refusal of an unknown one; backends: page sizes below one
  refused by the backends that take any page size (or any power of two).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvservice.contract.errors import FailedPrecondition, InvalidArgument
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core import hashing
from kvservice.core.backends import check_backends
from kvservice.core.model_config import StateLayer, model_cache
from kvservice.core.planner import plan


@pytest.mark.parametrize("shape", [(0, 4), (0, 1), (3, 0), (1, 0)])
def test_cbor_ints_of_pages_without_tokens_is_empty_with_int64_page_ends(shape):
    body, ends = hashing._cbor_ints(np.zeros(shape, dtype=np.int64))
    assert body.dtype == np.uint8 and body.shape == (0,)
    assert ends.dtype == np.int64 and ends.tolist() == [0] * shape[0]


HELDOUT = Path(__file__).parent.parent / "fixtures" / "model_configs" / "heldout"
QWEN3_NEXT = HELDOUT / "qwen3-next-80b-a3b-instruct.json"


def _split(heads: int, tp: int) -> int:
    """docs: heads split over tp ranks, or one replicated head per rank when there are fewer heads than ranks."""
    return heads // tp if heads >= tp else 1


@pytest.mark.parametrize("tp", [1, 2, 16, 32, 64])
def test_gated_deltanet_state_per_rank_and_its_notes_at_every_split(tp):
    """model_config._state, gated DeltaNet (Qwen3-Next: Hk 16 x dk 128, Hv 32 x dv 128, kernel 4, 36 of 48 layers):
    conv (K - 1) x (2 Hk dk + Hv dv), recurrent Hv x dk x dv with Hk and Hv split over tp, each field with fewer
    heads than ranks noted once under its own name (as num_key_value_heads is), then the state note."""
    cfg = json.loads(QWEN3_NEXT.read_text())
    m = model_cache(cfg, tp=tp)
    hk, hv = _split(16, tp), _split(32, tp)
    conv, ssm = 3 * (2 * hk * 128 + hv * 128), hv * 128 * 128
    assert m.state_layers == tuple(StateLayer(i, "linear_attention", conv, ssm, "bfloat16", (conv + ssm) * 2)
                                   for i in range(48) if i % 4 != 3)
    want = ["cache dtype bfloat16 (the model's torch_dtype)"]
    want += [f"num_key_value_heads=2 < tp={tp}: each rank holds 1 replicated head"] if tp > 2 else []
    want += [f"linear_num_key_heads=16 < tp={tp}: each rank holds 1 replicated head"] if tp > 16 else []
    want += [f"linear_num_value_heads=32 < tp={tp}: each rank holds 1 replicated head"] if tp > 32 else []
    want.append(f"36 gated DeltaNet layer(s) page no K/V: state {36 * (conv + ssm) * 2:,} bytes per sequence "
                "(bfloat16), not paged: managed by the engine")
    assert list(m.notes) == want


@pytest.mark.parametrize("field", ["linear_num_key_heads", "linear_num_value_heads"])
def test_gated_deltanet_heads_that_do_not_split_are_refused_by_name(field):
    """Heads that neither divide nor are divided by tp (6 over 4 ranks, the other field 8 splitting): InvalidArgument
    naming that field, its value and tp."""
    cfg = json.loads(QWEN3_NEXT.read_text())
    cfg |= {"linear_num_key_heads": 8, "linear_num_value_heads": 8, field: 6}
    with pytest.raises(InvalidArgument) as e:
        model_cache(cfg, tp=4)
    assert e.value.message == (f"config.json: {field}=6 cannot be split over tp=4 ranks (neither divides the "
                               "other); choose a tp that divides it or that it divides")


def test_make_hash_fn_gives_each_modes_function_and_names_the_known_modes():
    """hashing.make_hash_fn: the default mode is page_hashes itself; vllm-sha256-cbor a VllmHash over the given
    namespaces and seed (vLLM's default seed unless given); any other mode a ValueError listing the known ones."""
    ns = object()
    assert hashing.make_hash_fn("kvservice", ns) is hashing.page_hashes
    fn = hashing.make_hash_fn("vllm-sha256-cbor", ns, "4242")
    assert type(fn) is hashing.VllmHash and fn.namespaces is ns and fn.seed == "4242"
    assert fn.mode == "vllm-sha256-cbor" and hashing.make_hash_fn("vllm-sha256-cbor", ns).seed == "vllm-none-hash"
    with pytest.raises(ValueError) as e:
        hashing.make_hash_fn("md5", ns)
    assert str(e.value) == "unknown prefix hash mode 'md5'; known: kvservice, vllm-sha256-cbor"


@pytest.mark.parametrize("ps", [0, -16])
def test_backends_that_take_any_page_size_still_refuse_a_page_size_below_one(ps):
    """native and flashinfer take "any page size", TensorRT-LLM a power of two: none of them a page size < 1."""
    for name, display, rule in (("native", "kvservice native kernels", "any page size"),
                                ("flashinfer", "FlashInfer", "any page size"),
                                ("trtllm", "TensorRT-LLM", "page_size a power of two")):
        with pytest.raises(FailedPrecondition) as e:
            check_backends(ps, [name])
        assert e.value.message == f"{display} needs {rule}, got page_size {ps}"
        assert (e.value.reason, e.value.metadata) == ("BACKEND_PAGE_SIZE",
                                                      {"backend": name, "rule": rule, "page_size": str(ps)})


def test_state_layers_keep_the_models_dtype_whatever_the_cache_dtype():
    """model_cache: a state layer's dtype is the model's (the engine keeps it, not the paged cache), whatever cache
    dtype the caller asks for; a config stating no dtype keeps its state in the cache dtype asked for (Jamba v0.1:
    d_inner 8192, conv 3 x 8192, SSM 8192 x 16 per layer, 28 Mamba layers, 4 attention layers)."""
    cfg = json.loads((HELDOUT / "jamba-v0.1.json").read_text())
    conv, ssm = 3 * 8192, 8192 * 16
    for dtype, kv, state, size in (("float32", "float32", "bfloat16", 2), (None, "bfloat16", "bfloat16", 2),
                                   ("auto", "bfloat16", "bfloat16", 2)):
        m = model_cache(cfg, dtype=dtype)
        assert [la.dtype for la in m.spec.layers] == [kv] * 4
        assert [(s.dtype, s.bytes) for s in m.state_layers] == [(state, (conv + ssm) * size)] * 28
    bare = {k: v for k, v in cfg.items() if k not in ("torch_dtype", "dtype")}
    m = model_cache(bare, dtype="float32")
    assert [la.dtype for la in m.spec.layers] == ["float32"] * 4
    assert [(s.dtype, s.bytes) for s in m.state_layers] == [("float32", (conv + ssm) * 4)] * 28
    assert m.notes[-1] == (f"28 Mamba 1 layer(s) page no K/V: state {28 * (conv + ssm) * 4:,} bytes per sequence "
                           "(float32), not paged: managed by the engine")


def test_planner_refusals_name_how_the_count_was_asked_for_whole():
    """plan(): no sizing at all, and a max_batch x ceil(max_seq_len / page_size) count past 2^40 slots, each refused
    with its whole message (the latter naming how the count was made)."""
    tiny = CacheSpec((LayerSpec(1, 32, "float8_e4m3"),), 1, "per_layer")
    for sizing in (Sizing(), Sizing(max_batch=4), Sizing(max_seq_len=64), Sizing(max_num_batched_tokens=8)):
        with pytest.raises(InvalidArgument) as e:
            plan(tiny, sizing)
        assert e.value.message == ("say how big the pool is: num_slots, memory_budget_bytes, or both max_batch and "
                                   "max_seq_len")
    n = (2**20 + 1) * 2**20
    with pytest.raises(InvalidArgument) as e:
        plan(tiny, Sizing(max_batch=2**20 + 1, max_seq_len=2**20))
    assert e.value.message == (f"{n} slots (from max_batch x ceil(max_seq_len / page_size)) is more than the "
                               "1099511627776 a pool may hold")


def test_pages_after_without_the_extended_rows_lengths_by_hand():
    """limits.pages_after with e_old None (lengths unknown): each extended row at max_pages, or, given live_tokens,
    at most (live_tokens + sum(e_k)) // page_size + E pages; fork children at max_pages each; admissions their
    ceil(n / page_size); the widest row max_pages as soon as a row is extended or forked, else the widest
    admission. page_size 16, max_pages 25, a full and a 32-token sliding group: the same figure for both."""
    from kvservice.core.limits import pages_after

    e_k, a_n, none = np.array([5, 30], np.int64), np.array([17, 40], np.int64), np.zeros(0, np.int64)
    assert pages_after(16, 25, (0, 32), None, e_k, a_n, None, 2, None) == ((50 + 5 + 50,) * 2, 25)
    assert pages_after(16, 25, (0, 32), None, e_k, a_n, None, 2, 140) == (((140 + 35) // 16 + 2 + 5 + 50,) * 2, 25)
    assert pages_after(16, 25, (0, 32), None, e_k, a_n, None, 0, 10**6) == ((50 + 5,) * 2, 25)
    assert pages_after(16, 25, (0, 32), None, none, a_n, None, 0, None) == ((5, 5), 3)
    assert pages_after(16, 25, (0, 32), None, none, a_n, None, 1, 0) == ((5 + 25,) * 2, 25)
    assert pages_after(16, 25, (0,), None, none, none, None, 0, None) == ((0,), 0)
    assert pages_after(16, 25, (0,), np.zeros(0, np.int64), none, none, None, 0, None) == ((0,), 0)


def test_exact_sum_is_exact_past_int64():
    from kvservice.core.limits import exact_sum

    assert exact_sum(np.zeros(0, np.int64)) == 0
    assert exact_sum(np.array([1, 2, 3], np.int64)) == 6
    big = np.array([2**62, 2**62, 2**62 - 1], np.int64)
    assert exact_sum(big) == 3 * 2**62 - 1 and type(exact_sum(big)) is int
    assert exact_sum(np.array([2**61, 2**61 - 1], np.int64)) == 2**62 - 1


def test_lru_victim_without_a_cached_page_says_so_whole():
    from kvservice.core.evict import Lru

    pol = Lru(8, {})
    pol.cached([3, 5], 1)                                  # released, then revived: stale queue entries only
    with pytest.raises(AssertionError) as e:
        pol.victim()
    assert str(e.value) == "no cached slot to evict"


def test_a_sliding_hybrids_layers_take_each_kinds_heads_dims_and_window():
    """model_config._attention_layers on a hand-written sliding hybrid: sliding layers page kv / tp heads of head_dim
    (attention_head_dim when head_dim is absent, either when both agree) inside the window; full layers the
    global_head_dim, window 0; sliding_window_size equal to sliding_window and num_global_key_value_heads equal to
    num_key_value_heads are accepted; the only note is the dtype's."""
    from kvservice.contract.geometry import LayerSpec as LS

    cfg = {"model_type": "x", "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
           "sliding_window": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "attention_head_dim": 96,
           "global_head_dim": 256, "torch_dtype": "bfloat16"}
    want = (LS(2, 96, "bfloat16", 512), LS(2, 256, "bfloat16", 0)) * 2
    for extra in ({}, {"head_dim": 96}, {"sliding_window_size": 512}, {"num_global_key_value_heads": 4}):
        m = model_cache({**cfg, **extra}, tp=2)
        assert m.spec.layers == want and m.paged_layers == (0, 1, 2, 3)
        assert m.notes == ("cache dtype bfloat16 (the model's torch_dtype)",)
    no_global = {k: v for k, v in cfg.items() if k != "global_head_dim"}
    assert model_cache(no_global, tp=4).spec.layers == (LS(1, 96, "bfloat16", 512), LS(1, 96, "bfloat16", 0)) * 2


def test_step_reply_bound_by_part_against_the_documented_byte_model():
    """limits.step_reply_bound, each part by hand from the module docstring's byte model: 3 index spaces (group 0:
    an int32 and an int64 space, group 1: an int32 one; 4 generation bytes beside each index), 5 layers; a batch of
    7 rows (4 extended, 2 admitted) gaining 50 tokens, holding 40 and 30 pages per group, 12 wide.
    slot mappings: per space (8 + 4) x 50 + 64 framing; tables: per group its index bytes x (B + 1 + pages), plus
    per space 4 x B of last_page_len and 3 framings; block table: the index bytes x B x widest + a framing per
    space; the rest: 1024 + 397 per space + 10 per layer + 8 x (3B + 1) + 8 per admission + per group
    (16 + 8) x E + 2 x 64 + 11, + 4 x 64."""
    from kvservice.core.limits import ReplyBound, ReplyModel, StepShape, step_reply_bound

    model = ReplyModel(3, (4 + 4 + 8 + 4, 4 + 4), (0, 32), 5, 16, 25)
    shape = StepShape(7, 4, 2, 50, (40, 30), 12)
    mappings = 3 * (12 * 50 + 64)
    tables = 20 * (7 + 1 + 40) + 8 * (7 + 1 + 30) + 3 * (4 * 7 + 3 * 64)
    block = (4 + 8 + 4) * 7 * 12 + 3 * 64
    rest = 1024 + 3 * 397 + 10 * 5 + 8 * (3 * 7 + 1) + 8 * 2 + 2 * ((16 + 8) * 4 + 2 * 64 + 11) + 4 * 64
    assert step_reply_bound(model, shape, True, True) == ReplyBound(mappings, tables, block, rest)
    assert step_reply_bound(model, shape, True, True).total == mappings + tables + block + rest == 8635
    assert step_reply_bound(model, shape, False, False) == ReplyBound(mappings, 0, 0, rest)
    assert step_reply_bound(model, shape, False, True) == ReplyBound(mappings, 0, block, rest)
    assert step_reply_bound(model, shape, True, False) == ReplyBound(mappings, tables, 0, rest)


def test_reply_model_of_a_plan_sums_each_groups_index_and_generation_bytes():
    from kvservice.core.limits import ReplyModel

    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 64, sliding_window=40), LayerSpec(2, 64)), 16, "per_layer")
    p = plan(spec, Sizing(num_slots=64, max_seq_len=200))
    assert ReplyModel.of(p) == ReplyModel(2, (4 + 4, 4 + 4), (0, 40), 3, 16, 13)
    mixed = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 128)), 16, "interleaved")      # two spaces in one group
    q = plan(mixed, Sizing(num_slots=64, max_seq_len=200))
    assert len(q.geometry.index_spaces) == 2
    assert ReplyModel.of(q) == ReplyModel(2, (2 * (4 + 4),), (0,), 2, 16, 13)
