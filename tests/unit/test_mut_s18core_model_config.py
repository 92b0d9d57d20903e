"""The config.json planner's whole notes list for state-layer models and for K/V heads replicated over tp,
against strings written by hand from kvservice/core/model_config.py's documented formulas and the published
configs (tests/fixtures/model_configs): the state bytes per sequence are computed here, not read back."""

import json
import re
from pathlib import Path

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.core.model_config import StateLayer, load_model_cache, model_cache

FIXTURES = Path(__file__).parent.parent / "fixtures" / "model_configs"
HELDOUT = FIXTURES / "heldout"
BF16 = 2
DTYPE_NOTE = "cache dtype bfloat16 (the model's torch_dtype)"


def state_note(n: int, which: str, per_layer_elems: int) -> str:
    return (f"{n} {which} layer(s) page no K/V: state {n * per_layer_elems * BF16:,} bytes per sequence (bfloat16), "
            "not paged: managed by the engine")


def jamba_elems(tp: int) -> int:
    inner = 2 * 4096 // tp                               # mamba_expand x hidden_size, split over tp
    return 3 * inner + inner * 16                        # conv (d_conv 4 - 1) x d_inner + SSM d_inner x d_state 16


@pytest.mark.parametrize(("path", "tp", "want"), [
    (HELDOUT / "jamba-v0.1.json", 1, [DTYPE_NOTE, "head_dim missing: 128 (= hidden_size 4096 / num_attention_heads 32)",
                                      state_note(28, "Mamba 1", jamba_elems(1))]),
    (HELDOUT / "jamba-v0.1.json", 2, [DTYPE_NOTE, "head_dim missing: 128 (= hidden_size 4096 / num_attention_heads 32)",
                                      state_note(28, "Mamba 1", jamba_elems(2))]),
    # Mamba 2: conv (4 - 1) x (24 x 128 + 2 x 1 x 256), SSM 24 x 128 x 256, 44 layers
    (HELDOUT / "falcon-h1-7b-instruct.json", 1,
     [DTYPE_NOTE, state_note(44, "Mamba 2", 3 * (24 * 128 + 2 * 256) + 24 * 128 * 256)]),
    # Mamba 2: 128 heads x 80, 8 groups, d_state 128, conv 4; 27 'M' layers in the hybrid pattern
    (HELDOUT / "nvidia-nemotron-nano-9b-v2.json", 1,
     [DTYPE_NOTE, state_note(27, "Mamba 2", 3 * (128 * 80 + 2 * 8 * 128) + 128 * 80 * 128)]),
    # gated DeltaNet: conv (4 - 1) x (2 x 16 x 128 + 32 x 128), recurrent 32 x 128 x 128; 36 of 48 layers
    (HELDOUT / "qwen3-next-80b-a3b-instruct.json", 1,
     [DTYPE_NOTE, state_note(36, "gated DeltaNet", 3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128)]),
    (FIXTURES / "llama-3-8b.json", 16,
     [DTYPE_NOTE, "head_dim missing: 128 (= hidden_size 4096 / num_attention_heads 32)",
      "num_key_value_heads=8 < tp=16: each rank holds 1 replicated head"]),
    (HELDOUT / "deepseek-v2-lite.json", 1,
     [DTYPE_NOTE, "multi-head latent attention: each layer pages one latent of kv_lora_rank 512 + qk_rope_head_dim "
                  "64 = 576 values per token (K only, one head, the same on every rank); num_key_value_heads is not "
                  "cached"]),
    (FIXTURES / "gemma-3-1b-it.json", 4,
     [DTYPE_NOTE, "num_key_value_heads=1 < tp=4: each rank holds 1 replicated head"]),
])
def test_notes_are_the_hand_written_list(path, tp, want):
    assert list(load_model_cache(path, tp=tp).notes) == want


@pytest.mark.parametrize(("kv", "tp"), [(8, 16), (8, 32), (2, 8), (1, 2)])
def test_global_kv_heads_equal_to_kv_heads_replicate_with_one_note(kv, tp):
    """num_global_key_value_heads equal to num_key_value_heads is the same count: every layer (sliding and full)
    holds 1 replicated head per rank, noted once under num_key_value_heads' name, as when the field is absent."""
    base = {**json.loads((FIXTURES / "gemma4-style-synthetic.json").read_text()), "num_key_value_heads": kv}
    with_field = {**base, "num_global_key_value_heads": kv}
    replicated = f"num_key_value_heads={kv} < tp={tp}: each rank holds 1 replicated head"
    for cfg in (base, with_field):
        m = model_cache(cfg, tp=tp)
        assert [n for n in m.notes if "replicated" in n] == [replicated]
        assert {layer.kv_heads for layer in m.spec.layers} == {1}
        assert {layer.head_dim for layer in m.spec.layers} == {256, 512}   # head_dim, global_head_dim
    assert list(model_cache(with_field, tp=tp).notes) == list(model_cache(base, tp=tp).notes)


@pytest.mark.parametrize(("kv", "tp"), [(8, 3), (6, 4), (12, 8), (3, 2)])
def test_heads_that_neither_divide_nor_are_divided_by_tp_are_refused_with_the_whole_message(kv, tp):
    cfg = {**json.loads((FIXTURES / "llama-3-8b.json").read_text()), "num_key_value_heads": kv}
    want = (f"config.json: num_key_value_heads={kv} cannot be split over tp={tp} ranks (neither divides the other); "
            "choose a tp that divides it or that it divides")
    with pytest.raises(InvalidArgument, match=f"^{re.escape(want)}$"):
        model_cache(cfg, tp=tp)


@pytest.mark.parametrize("tp", [True, False, 0, -2, 1.0, "2"])
def test_tp_that_is_not_a_positive_int_is_refused_by_value(tp):
    cfg = json.loads((FIXTURES / "llama-3-8b.json").read_text())
    with pytest.raises(InvalidArgument, match=f"^{re.escape(f'tp must be a positive integer, got {tp!r}')}$"):
        model_cache(cfg, tp=tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_mamba2_without_a_groups_field_has_one_group(tp):
    """Falcon-H1 7B with mamba_n_groups removed: one group (transformers' default), so conv (4 - 1) x
    (24/tp x 128 + 2 x 1 x 256), SSM 24/tp x 128 x 256; at tp=2 the one group is kept whole on each rank."""
    cfg = {k: v for k, v in json.loads((HELDOUT / "falcon-h1-7b-instruct.json").read_text()).items()
           if k != "mamba_n_groups"}
    h = 24 // tp
    conv, ssm = 3 * (h * 128 + 2 * 256), h * 128 * 256
    m = model_cache(cfg, tp=tp)
    assert m.state_layers == tuple(StateLayer(i, "mamba", conv, ssm, "bfloat16", (conv + ssm) * BF16)
                                   for i in range(44))


@pytest.mark.parametrize("size", [0, 4095, 4097, 2048, False])
def test_a_sliding_window_size_other_than_the_window_is_refused(size):
    cfg = json.loads((FIXTURES / "gemma-2-9b.json").read_text())
    assert cfg["sliding_window"] == cfg["sliding_window_size"] == 4096
    assert {layer.sliding_window for layer in model_cache(cfg).spec.layers} == {0, 4096}
    assert {layer.sliding_window for layer in model_cache({**cfg, "sliding_window_size": None}).spec.layers} == \
        {0, 4096}
    with pytest.raises(InvalidArgument, match=re.escape(f"config.json: fields 'sliding_window'=4096 and "
                                                        f"'sliding_window_size'={size} disagree")):
        model_cache({**cfg, "sliding_window_size": size})


GEMMA3_PATTERN = ("model_type 'gemma3_text' states no layer pattern: layers 6, 12, ... (counting from 1) are global, "
                  "the others slide (the type's rule)")


def nested() -> dict:
    """Gemma 3 27B: the layers in text_config, torch_dtype (bfloat16) at the top level only."""
    return json.loads((FIXTURES / "gemma-3-27b-it.json").read_text())


@pytest.mark.parametrize(("name", "want"), [("BFloat16", "bfloat16"), ("FLOAT16", "float16"), ("Float32", "float32"),
                                            ("FP8_E5M2", "float8_e5m2")])
def test_the_models_dtype_is_read_in_any_case(name, want):
    cfg = {**nested(), "torch_dtype": name}
    m = model_cache(cfg)
    assert {layer.dtype for layer in m.spec.layers} == {want}
    assert list(m.notes) == [GEMMA3_PATTERN, f"cache dtype {want} (the model's torch_dtype)"]


def test_text_configs_own_dtype_field_comes_before_the_top_levels():
    """The config that describes the layers is read first: its `dtype` (transformers' newer name) over the top
    level's torch_dtype; without it, the top level's."""
    cfg = nested()
    cfg["text_config"] = {**cfg["text_config"], "dtype": "float16"}
    m = model_cache(cfg)
    assert {layer.dtype for layer in m.spec.layers} == {"float16"}
    assert list(m.notes) == [GEMMA3_PATTERN, "cache dtype float16 (the model's torch_dtype)"]
    top_only = {k: v for k, v in nested().items() if k != "torch_dtype"}
    top_only["dtype"] = "float32"
    assert {layer.dtype for layer in model_cache(top_only).spec.layers} == {"float32"}


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_a_kv_cache_scheme_at_either_level_quantizes_the_cache(where):
    """An 8-bit float kv_cache_scheme plans float8_e4m3 K/V whether the quantization_config sits at the top level
    (as multimodal checkpoints write it) or in text_config."""
    cfg = nested()
    quant = {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    if where == "top":
        cfg["quantization_config"] = quant
    else:
        cfg["text_config"] = {**cfg["text_config"], "quantization_config": quant}
    m = model_cache(cfg)
    assert {layer.dtype for layer in m.spec.layers} == {"float8_e4m3"}
    assert list(m.notes) == [GEMMA3_PATTERN, "cache dtype float8_e4m3 (the config's KV-cache quantization)"]
