"""kvservice/core/model_config.py's refusals compared whole (the earlier table, tests/unit/test_model_config.py,
matches a fragment of each, leaving the rest of the message unchecked: what is not supported and why, what to do,
the lists of known dtypes), under the default source and a named one, and the unknown-field refusal's count of
fields past the eight it shows."""

import json
from pathlib import Path

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.core.model_config import model_cache

LLAMA = Path(__file__).parent.parent / "fixtures" / "model_configs" / "llama-3-8b.json"
CACHE_DTYPES = "float16, bfloat16, float32, float8_e4m3, float8_e5m2"

CASES = [
    ({"attention_chunk_size": 8192},
     "field 'attention_chunk_size'=8192 makes 24 of 32 layers chunked local attention (a token attends only its own "
     "chunk), which is not supported: its pages leave at chunk boundaries, which neither a full nor a sliding-window "
     "group models, and planning them as full attention would be a guess"),
    ({"layer_types": ["mlp"] * 16 + ["moe"] * 16},
     "no layer pages K/V (every layer is mlp, moe); there is nothing to plan"),
    ({"rope_sacling": 1},
     "unknown field 'rope_sacling': a field this planner does not know may change which layers cache what, so it "
     "refuses to guess; check what it does, then pass --allow-unknown-keys (pools.yaml: allow_unknown_keys: true) to "
     "plan anyway"),
    ({"torch_dtype": None}, "field 'torch_dtype' is missing; give the cache dtype (--kv-cache-dtype / --dtype)"),
    ({"torch_dtype": "int8"},
     f"torch_dtype 'int8' is not a cache dtype; give one with --kv-cache-dtype ({CACHE_DTYPES})"),
    ({"hidden_size": None},
     "field 'head_dim' is missing and cannot be derived (needs 'hidden_size' and 'num_attention_heads')"),
    ({"num_key_value_heads": None, "num_attention_heads": None},
     "neither 'num_key_value_heads' nor 'num_attention_heads' is given"),
    ({"layer_types": ["full_attention"] * 31 + ["linear_attention"]},
     "linear_attention layers but no field gives their state size (linear_num_value_heads, mamba_n_heads / "
     "mamba_num_heads or mamba_d_state); refusing to guess it"),
    ({"num_kv_shared_layers": 10},
     "field 'num_kv_shared_layers'=10 is not supported: layers that reuse another layer's K/V cache hold none of "
     "their own"),
    ({"attention_k_eq_v": True}, "field 'attention_k_eq_v'=True is not supported: K and V are the same tensor, "
                                 "cached once"),
    ({"use_bidirectional_attention": True},
     "field 'use_bidirectional_attention'=True is not supported: bidirectional attention is an encoder's: no causal "
     "KV cache to page"),
    ({"is_encoder_decoder": True},
     "field 'is_encoder_decoder'=True is not supported: an encoder-decoder model also caches cross-attention K/V of "
     "the encoder's output"),
    ({"sliding_window": 4096, "sliding_window_size": 2048, "layer_types": ["sliding_attention"] * 32},
     "fields 'sliding_window'=4096 and 'sliding_window_size'=2048 disagree"),
]


@pytest.mark.parametrize(("change", "message"), CASES)
def test_each_refusal_is_the_whole_message(change, message):
    cfg = {k: v for k, v in {**json.loads(LLAMA.read_text()), **change}.items() if v is not None}
    for source in ("config.json", "models/x/config.json"):
        with pytest.raises(InvalidArgument) as e:
            if source == "config.json":
                model_cache(cfg)
            else:
                model_cache(cfg, source=source)
        assert e.value.message == f"{source}: {message}"


def test_an_unknown_cache_dtype_lists_every_accepted_name():
    with pytest.raises(InvalidArgument) as e:
        model_cache(json.loads(LLAMA.read_text()), dtype="int4")
    assert e.value.message == ("kv cache dtype 'int4' is not a cache dtype; use auto, bf16, bfloat16, float, float16, "
                               "float32, float8_e4m3, float8_e4m3fn, float8_e5m2, fp16, fp32, fp8, fp8_e4m3, "
                               "fp8_e5m2, half")


@pytest.mark.parametrize("count", [1, 2, 8, 9, 13])
def test_unknown_fields_are_shown_eight_at_most_then_counted(count):
    names = [f"zz_field_{i:02d}" for i in range(count)]
    cfg = {**json.loads(LLAMA.read_text()), **dict.fromkeys(names, 1)}
    with pytest.raises(InvalidArgument) as e:
        model_cache(cfg)
    shown = ", ".join(repr(n) for n in names[:8]) + (f" and {count - 8} more" if count > 8 else "")
    assert e.value.message == (f"config.json: unknown field{'s' if count > 1 else ''} {shown}: a field this planner "
                               "does not know may change which layers cache what, so it refuses to guess; check what "
                               "it does, then pass --allow-unknown-keys (pools.yaml: allow_unknown_keys: true) to plan "
                               "anyway")
    m = model_cache(cfg, allow_unknown_keys=True)
    assert m.unknown_keys == tuple(names)
    assert m.notes[0] == f"unknown fields accepted (--allow-unknown-keys), not read: {', '.join(names)}"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_key_value_heads", 0, "field 'num_key_value_heads' must be a positive integer, got 0"),
    ("sliding_window_pattern", 0, "field 'sliding_window_pattern' must be a positive integer, got 0"),
    ("attention_k_eq_v", True, "field 'attention_k_eq_v'=True is not supported: K and V are the same tensor, "
                               "cached once"),
])
def test_a_refusal_inside_text_config_says_where_it_is(field, value, message):
    """A multimodal config (Gemma 3 27B: the language model under text_config): a refusal of a field read there
    names "<source>: text_config" as where it is."""
    cfg = json.loads((LLAMA.parent / "gemma-3-27b-it.json").read_text())
    cfg["text_config"][field] = value
    for source in ("config.json", "g/config.json"):
        with pytest.raises(InvalidArgument) as e:
            model_cache(cfg) if source == "config.json" else model_cache(cfg, source=source)
        assert e.value.message == f"{source}: text_config: {message}"
