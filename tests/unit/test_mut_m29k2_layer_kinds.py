"""kvservice/core/layer_kinds.py against the rules written in kvservice/core/model_config.py's docstring.

Each rule is re-stated here in plain Python from its wording ("layers k-1, 2k-1, ... full attention", "layer i
is attention iff i % p == o", ...), as sets of layer indices, and checked on random layer counts and
parameters; notes and error messages are checked for the fields and values they must name.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.core.layer_kinds import layer_kinds

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
LINEAR, MAMBA, HYBRID, MLP, MOE = "linear_attention", "mamba", "hybrid", "mlp", "moe"


def _kinds(n: int, chosen: set[int], yes: str, no: str) -> list[str]:
    return [yes if i in chosen else no for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_every_pattern_gives_the_documented_layers(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 60))
    k = int(rng.integers(1, 7))
    # full_attention_interval k: layers k-1, 2k-1, ... full, the others linear
    assert layer_kinds({"num_hidden_layers": n, "full_attention_interval": k}) == \
        _kinds(n, set(range(k - 1, n, k)), FULL, LINEAR)
    # attn_layer_period p / attn_layer_offset o: attention iff i % p == o
    p = int(rng.integers(2, 9))
    o = int(rng.integers(0, p))
    assert layer_kinds({"num_hidden_layers": n, "attn_layer_period": p, "attn_layer_offset": o}) == \
        _kinds(n, set(range(o, n, p)), FULL, MAMBA)
    # attn_layer_indices: those layers attention
    idx = sorted({int(x) for x in rng.integers(0, n, 4)})
    assert layer_kinds({"num_hidden_layers": n, "attn_layer_indices": idx}) == _kinds(n, set(idx), FULL, MAMBA)
    # hybrid_override_pattern: M Mamba, * attention, - MLP, E MoE (no num_hidden_layers needed)
    chars = "".join(rng.choice(list("M*-E"), n))
    assert layer_kinds({"hybrid_override_pattern": chars}) == \
        [{"M": MAMBA, "*": FULL, "-": MLP, "E": MOE}[c] for c in chars]
    # layer_types, with the legacy spelling "attention"
    types = [str(t) for t in rng.choice([FULL, SLIDING, "attention", MAMBA, LINEAR, MLP], n)]
    want = [FULL if t == "attention" else t for t in types]
    window = {"sliding_window": 4096} if SLIDING in types else {}
    assert layer_kinds({"num_hidden_layers": n, "layer_types": types, **window}) == want
    assert layer_kinds({"num_hidden_layers": n, "layers_block_type": types, **window}) == want
    # falcon_h1: every layer hybrid
    assert layer_kinds({"num_hidden_layers": n, "model_type": "falcon_h1"}) == [HYBRID] * n


@pytest.mark.parametrize("seed", range(6))
def test_chunked_attention_layers_follow_no_rope_layers_or_the_interval_rule(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(5, 50))
    chunk = int(rng.integers(1, 9000))
    rope = [int(x) for x in rng.integers(0, 2, n)]
    notes: list[str] = []
    got = layer_kinds({"num_hidden_layers": n, "attention_chunk_size": chunk, "no_rope_layers": rope}, notes=notes)
    assert got == [CHUNKED if r else FULL for r in rope]
    assert notes == [f"attention_chunk_size={chunk}"]
    # no no_rope_layers: every interval-th layer (counting from 1) has no RoPE and is full; default 4
    for interval, cfg_extra in ((4, {}), (int(rng.integers(2, 7)), None)):
        extra = {"no_rope_layer_interval": interval} if cfg_extra is None else cfg_extra
        notes = []
        got = layer_kinds({"num_hidden_layers": n, "attention_chunk_size": chunk, **extra}, notes=notes)
        assert got == _kinds(n, set(range(interval - 1, n, interval)), FULL, CHUNKED)
        assert notes == [f"no_rope_layers not given: every {interval}th layer is NoPE (full attention), the others "
                         "chunked (transformers' rule)", f"attention_chunk_size={chunk}"]


@pytest.mark.parametrize("seed", range(6))
def test_sliding_rules_and_their_notes_reach_the_callers_list(seed):
    rng = np.random.default_rng(200 + seed)
    n = int(rng.integers(5, 60))
    w = int(rng.integers(1, 10_000))
    p = int(rng.integers(1, 8))
    notes: list[str] = []
    assert layer_kinds({"num_hidden_layers": n, "sliding_window": w, "sliding_window_pattern": p}, notes=notes) == \
        _kinds(n, set(range(p - 1, n, p)), FULL, SLIDING)
    assert notes == []
    for model_type, pattern in (("gemma2", 2), ("gemma3", 6), ("gemma3_text", 6)):
        notes = []
        got = layer_kinds({"num_hidden_layers": n, "sliding_window": w, "model_type": model_type}, notes=notes)
        assert got == _kinds(n, set(range(pattern - 1, n, pattern)), FULL, SLIDING)
        assert notes == [f"model_type {model_type!r} states no layer pattern: layers {pattern}, {2 * pattern}, ... "
                         "(counting from 1) are global, the others slide (the type's rule)"]
    # Qwen 2/3: use_sliding_window with max_window_layers m: layers from m on slide, the first m are full
    m = int(rng.integers(1, n))
    notes = []
    got = layer_kinds({"num_hidden_layers": n, "sliding_window": w, "use_sliding_window": True,
                       "max_window_layers": m}, notes=notes)
    assert got == [FULL] * m + [SLIDING] * (n - m) and notes == []
    assert layer_kinds({"num_hidden_layers": n, "sliding_window": w, "use_sliding_window": True}) == [SLIDING] * n
    notes = []
    got = layer_kinds({"num_hidden_layers": n, "sliding_window": w, "use_sliding_window": False,
                       "max_window_layers": m}, notes=notes)
    assert got == [FULL] * n
    assert notes == [f"use_sliding_window is false: sliding_window={w} is not used"]
    notes = []
    assert layer_kinds({"num_hidden_layers": n, "sliding_window": w}, notes=notes) == [SLIDING] * n
    assert notes == [f"sliding_window={w} with no layer pattern: every layer slides"]
    assert layer_kinds({"num_hidden_layers": n}) == [FULL] * n
    for model_type in ("gemma2", "gemma3", "gemma3_text"):       # the type's rule needs a window to slide
        notes = []
        assert layer_kinds({"num_hidden_layers": n, "model_type": model_type}, notes=notes) == [FULL] * n
        assert notes == []
    assert layer_kinds({"num_hidden_layers": n, "sliding_window": None}) == [FULL] * n


def _refused(cfg, *parts):
    with pytest.raises(InvalidArgument) as exc:
        layer_kinds(cfg, where="cfg.json")
    msg = exc.value.message
    assert isinstance(msg, str) and msg.startswith("cfg.json: "), msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


def test_malformed_fields_are_refused_naming_field_and_value():
    _refused({}, "field 'num_hidden_layers' is missing")
    for bad in (0, -3, True, "12", 2.0):
        _refused({"num_hidden_layers": bad}, "field 'num_hidden_layers' must be a positive integer", repr(bad))
        _refused({"num_hidden_layers": 8, "full_attention_interval": bad}, "'full_attention_interval'", repr(bad))
    _refused({"num_hidden_layers": 8, "attn_layer_offset": 1}, "field 'attn_layer_period' is missing")
    _refused({"num_hidden_layers": 8, "attn_layer_period": 4}, "field 'attn_layer_offset' is missing")
    _refused({"num_hidden_layers": 8, "attn_layer_period": 4, "attn_layer_offset": -1},
             "field 'attn_layer_offset' must be an integer >= 0, got -1")
    _refused({"num_hidden_layers": 8, "attn_layer_period": 4, "attn_layer_offset": 4},
             "'attn_layer_offset'=4 must be below attn_layer_period=4")
    for bad in ([1, True], [1, "2"], [1.0], "1,2", 3):
        _refused({"num_hidden_layers": 8, "attn_layer_indices": bad},
                 "field 'attn_layer_indices' must be a list of integers", repr(bad))
    _refused({"num_hidden_layers": 8, "attn_layer_indices": [0, 8]}, "outside 0..7")
    _refused({"num_hidden_layers": 4, "attention_chunk_size": 8, "no_rope_layers": [1, 0, True, 1]},
             "field 'no_rope_layers' must be a list of integers")
    _refused({"num_hidden_layers": 4, "attention_chunk_size": 8, "no_rope_layers": [1, 0, 1]},
             "one flag per layer (4), got 3")
    _refused({"num_hidden_layers": 4, "attention_chunk_size": 8, "no_rope_layer_interval": 0},
             "field 'no_rope_layer_interval' must be a positive integer, got 0")
    for bad in (-1, True, "2", 1.5):
        _refused({"num_hidden_layers": 4, "sliding_window": 64, "use_sliding_window": True,
                  "max_window_layers": bad}, f"field 'max_window_layers' must be a non-negative integer, got {bad!r}")
    for bad in (0, -2, True, "3"):
        _refused({"num_hidden_layers": 4, "sliding_window": 64, "sliding_window_pattern": bad},
                 f"field 'sliding_window_pattern' must be a positive integer, got {bad!r}")
    _refused({"num_hidden_layers": 3, "layer_types": [FULL, "cross_attention", FULL]},
             "field 'layer_types'[1] is 'cross_attention'")
    _refused({"num_hidden_layers": 3, "layer_types": [FULL] * 2}, "one type per layer (3), got 2")
    _refused({"hybrid_override_pattern": "M*X"}, "has 'X'")


def test_disagreeing_patterns_and_an_unplaced_window_are_refused_naming_both():
    n = 8
    _refused({"num_hidden_layers": n, "layer_types": [LINEAR, LINEAR, LINEAR, FULL] * 2,
              "full_attention_interval": 2},
             "fields 'layer_types' and 'full_attention_interval' disagree on layer 1 (linear_attention vs "
             "full_attention)")
    # agreeing patterns are accepted
    assert layer_kinds({"num_hidden_layers": n, "layer_types": [LINEAR, FULL] * 4, "full_attention_interval": 2}) \
        == [LINEAR, FULL] * 4
    w = 3 * 1024 + 7
    _refused({"num_hidden_layers": n, "layer_types": [FULL] * n, "sliding_window": w},
             f"field 'sliding_window'={w} is set but 'layer_types' names no sliding layer")
    # use_sliding_window false: the window is not used, so no refusal
    assert layer_kinds({"num_hidden_layers": n, "layer_types": [FULL] * n, "sliding_window": w,
                        "use_sliding_window": False}) == [FULL] * n
