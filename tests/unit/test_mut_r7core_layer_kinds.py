"""kvservice/core/layer_kinds.py's refusals, each compared whole (the earlier tests check fragments, so the tail of
a message, "fix the config so that they agree", "which layers slide cannot be told", the list of known kinds, went
unchecked): the message names where, the field, the value and what to do, as written here by hand."""

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.core.layer_kinds import layer_kinds

KNOWN = ("full_attention, sliding_attention, chunked_attention, linear_attention, mamba, attention, hybrid, mlp, "
         "moe")
F, L = "full_attention", "linear_attention"

CASES = [
    ({}, "field 'num_hidden_layers' is missing; it is needed to size the KV cache"),
    ({"num_hidden_layers": 0}, "field 'num_hidden_layers' must be a positive integer, got 0"),
    ({"num_hidden_layers": 8, "attn_layer_period": 4, "attn_layer_offset": -1},
     "field 'attn_layer_offset' must be an integer >= 0, got -1"),
    ({"num_hidden_layers": 8, "attn_layer_period": 4, "attn_layer_offset": 4},
     "field 'attn_layer_offset'=4 must be below attn_layer_period=4"),
    ({"num_hidden_layers": 8, "attn_layer_indices": [1, True]},
     "field 'attn_layer_indices' must be a list of integers, got [1, True]"),
    ({"num_hidden_layers": 8, "attn_layer_indices": [0, 8]},
     "field 'attn_layer_indices' names a layer outside 0..7: [0, 8]"),
    ({"num_hidden_layers": 8, "layer_types": [L, L, L, F] * 2, "full_attention_interval": 2},
     "fields 'layer_types' and 'full_attention_interval' disagree on layer 1 (linear_attention vs full_attention); "
     "fix the config so that they agree"),
    ({"num_hidden_layers": 4, "layer_types": [F] * 4, "sliding_window": 4096},
     "field 'sliding_window'=4096 is set but 'layer_types' names no sliding layer; which layers slide cannot be "
     "told"),
    ({"num_hidden_layers": 3, "layer_types": [F] * 2}, "field 'layer_types' must list one type per layer (3), got 2"),
    ({"num_hidden_layers": 3, "layers_block_type": "attention"},
     "field 'layers_block_type' must list one type per layer (3), got str"),
    ({"num_hidden_layers": 3, "layer_types": [F, "cross_attention", F]},
     f"field 'layer_types'[1] is 'cross_attention', a layer kind this planner does not know; known: {KNOWN}"),
    ({"num_hidden_layers": 3, "hybrid_override_pattern": "M*"},
     "field 'hybrid_override_pattern' must be a string of one character per layer (3), got 'M*'"),
    ({"hybrid_override_pattern": "M*X-"},
     "field 'hybrid_override_pattern' has 'X'; known: M (Mamba), * (attention), - (MLP), E (MoE)"),
    ({"num_hidden_layers": 4, "attention_chunk_size": 8, "no_rope_layers": [1, 0, 1]},
     "field 'no_rope_layers' must list one flag per layer (4), got 3"),
    ({"num_hidden_layers": 4, "sliding_window": 64, "sliding_window_pattern": 0},
     "field 'sliding_window_pattern' must be a positive integer, got 0"),
    ({"num_hidden_layers": 4, "sliding_window": 64, "use_sliding_window": True, "max_window_layers": -1},
     "field 'max_window_layers' must be a non-negative integer, got -1"),
]


@pytest.mark.parametrize(("cfg", "message"), CASES)
def test_each_refusal_is_the_whole_documented_message(cfg, message):
    for where in ("config.json", "m/config.json: text_config"):
        with pytest.raises(InvalidArgument) as e:
            layer_kinds(cfg, where)
        assert e.value.message == f"{where}: {message}"
    with pytest.raises(InvalidArgument) as e:
        layer_kinds(cfg)
    assert e.value.message == f"config.json: {message}"


def test_older_spellings_and_every_known_kind_are_read():
    """layer_types entries: every known kind as itself, "attention" as full_attention; layers_block_type alike."""
    kinds = [F, "sliding_attention", "chunked_attention", L, "mamba", "hybrid", "mlp", "moe", "attention"]
    want = [*kinds[:-1], F]
    cfg = {"num_hidden_layers": len(kinds), "sliding_window": 8}
    assert layer_kinds({**cfg, "layer_types": kinds}) == want
    assert layer_kinds({**cfg, "layers_block_type": kinds}) == want
    assert layer_kinds({"num_hidden_layers": 4, "hybrid_override_pattern": "M*-E"}) == ["mamba", F, "mlp", "moe"]


def test_a_chunked_pattern_with_a_sliding_window_but_no_sliding_layer_is_refused_naming_its_field():
    """Llama 4's attention_chunk_size states the pattern (chunked RoPE layers, NoPE layers full); a sliding_window
    beside it names no layer that slides, so the refusal names both fields, 'attention_chunk_size' as written."""
    cfg = {"num_hidden_layers": 4, "attention_chunk_size": 8192, "sliding_window": 4096}
    with pytest.raises(InvalidArgument) as err:
        layer_kinds(cfg)
    assert err.value.message == ("config.json: field 'sliding_window'=4096 is set but 'attention_chunk_size' names "
                                 "no sliding layer; which layers slide cannot be told")
