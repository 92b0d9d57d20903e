"""The config.json planner's state layers, dtypes, defaults and refusals against figures computed by hand from
the published configs (tests/fixtures/model_configs/heldout) and the formulas of kvservice/core/model_config.py's
docstring: every StateLayer field of every layer, not only a total, so that one wrong factor shows."""

import json
import re
from pathlib import Path

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.core.model_config import StateLayer, load_model_cache, model_cache

HELDOUT = Path(__file__).parent.parent / "fixtures" / "model_configs" / "heldout"
FIXTURES = HELDOUT.parent
BF16, F32 = 2, 4


def heldout(name: str) -> dict:
    return json.loads((HELDOUT / f"{name}.json").read_text())


def test_jamba_mamba1_state_layers_are_hand_computed_at_tp_1_and_2_and_tp_3_is_refused():
    """Jamba v0.1: 32 layers, attention iff i % 8 == 4; Mamba 1: d_inner = 2 x 4096, conv (4 - 1) x d_inner,
    SSM d_inner x 16, bf16; each rank keeps d_inner / tp."""
    for tp in (1, 2):
        m = load_model_cache(HELDOUT / "jamba-v0.1.json", tp=tp)
        inner = 2 * 4096 // tp
        conv, ssm = 3 * inner, inner * 16
        want = tuple(StateLayer(i, "mamba", conv, ssm, "bfloat16", (conv + ssm) * BF16)
                     for i in range(32) if i % 8 != 4)
        assert m.state_layers == want
        assert m.paged_layers == (4, 12, 20, 28)
        assert m.state_bytes_per_seq == 28 * (conv + ssm) * BF16
    three_kv = {**heldout("jamba-v0.1"), "num_key_value_heads": 3}     # K/V heads split over 3: the state cannot
    assert model_cache(three_kv).spec.layers[0].kv_heads == 3
    with pytest.raises(InvalidArgument, match=re.escape("Mamba d_inner=8192 cannot be split over tp=3 ranks")):
        model_cache(three_kv, tp=3)


def test_falcon_h1_mamba2_head_dim_from_d_ssm_when_no_head_dim_field_is_given():
    """Falcon-H1 7B without mamba_d_head: head_dim = mamba_d_ssm / mamba_n_heads = 3072 / 24 = 128, the same plan
    as with it. Mamba 2: conv (4 - 1) x (24 x 128 + 2 x 1 x 256), SSM 24 x 128 x 256, every one of 44 layers."""
    cfg = heldout("falcon-h1-7b-instruct")
    conv, ssm = 3 * (24 * 128 + 2 * 256), 24 * 128 * 256
    want = tuple(StateLayer(i, "mamba", conv, ssm, "bfloat16", (conv + ssm) * BF16) for i in range(44))
    assert model_cache(cfg).state_layers == want
    no_dim = {k: v for k, v in cfg.items() if k != "mamba_d_head"}
    assert model_cache(no_dim).state_layers == want
    # tp=2: heads 12 per rank, the one group kept whole on each rank.
    conv2, ssm2 = 3 * (12 * 128 + 2 * 256), 12 * 128 * 256
    m2 = model_cache(no_dim, tp=2)
    assert {(s.conv_elems, s.ssm_elems) for s in m2.state_layers} == {(conv2, ssm2)}
    assert any("Mamba groups=1 do not split over tp=2" in n for n in m2.notes)
    bad = {**no_dim, "mamba_d_ssm": 3001}                      # 3001 // 24 = 125: then 24 x 125 = 3000 != 3001
    with pytest.raises(InvalidArgument, match=re.escape("field 'mamba_d_ssm'=3001 is not mamba_n_heads x "
                                                        "mamba_head_dim = 3000")):
        model_cache(bad)


def test_nemotron_mamba2_state_layers_at_tp_1_from_mamba_num_heads():
    """Nemotron-Nano 9B v2: 'M' layers are Mamba 2 with mamba_num_heads 128 x mamba_head_dim 80, ssm_state_size 128,
    n_groups 8, conv_kernel 4."""
    cfg = heldout("nvidia-nemotron-nano-9b-v2")
    pattern = cfg["hybrid_override_pattern"]
    conv, ssm = 3 * (128 * 80 + 2 * 8 * 128), 128 * 80 * 128
    want = tuple(StateLayer(i, "mamba", conv, ssm, "bfloat16", (conv + ssm) * BF16)
                 for i, c in enumerate(pattern) if c == "M")
    m = model_cache(cfg)
    assert m.state_layers == want and len(want) == 27
    assert m.paged_layers == tuple(i for i, c in enumerate(pattern) if c == "*")


def test_qwen3_next_gated_deltanet_state_layers_at_tp_1():
    """Qwen3-Next: every 4th layer full attention, the others gated DeltaNet with Hk 16 x dk 128, Hv 32 x dv 128,
    kernel 4: conv (4 - 1) x (2 x 16 x 128 + 32 x 128), recurrent 32 x 128 x 128."""
    m = model_cache(heldout("qwen3-next-80b-a3b-instruct"))
    conv, ssm = 3 * (2 * 16 * 128 + 32 * 128), 32 * 128 * 128
    want = tuple(StateLayer(i, "linear_attention", conv, ssm, "bfloat16", (conv + ssm) * BF16)
                 for i in range(48) if i % 4 != 3)
    assert m.state_layers == want
    assert any(n.startswith("36 gated DeltaNet layer(s) page no K/V") for n in m.notes), m.notes


@pytest.mark.parametrize("name", ["Float32", "FP32", "float32"])
def test_mamba_ssm_cache_dtype_names_the_state_dtype_in_any_case(name):
    """mamba_ssm_cache_dtype overrides the model's dtype for the state only: 4 bytes per element; K/V stay bf16."""
    cfg = {**heldout("jamba-v0.1"), "mamba_ssm_cache_dtype": name}
    m = model_cache(cfg)
    inner = 8192
    assert {(s.dtype, s.bytes) for s in m.state_layers} == {("float32", (3 * inner + 16 * inner) * F32)}
    assert {la.dtype for la in m.spec.layers} == {"bfloat16"}
    with pytest.raises(InvalidArgument, match=re.escape("field 'mamba_ssm_cache_dtype'='int4' is not a dtype")):
        model_cache({**cfg, "mamba_ssm_cache_dtype": "int4"})


def test_refusals_read_as_documented_word_for_word():
    cfg = json.loads((FIXTURES / "llama-3-8b.json").read_text())
    with pytest.raises(InvalidArgument) as err:
        model_cache({**cfg, "num_global_key_value_heads": 4})
    assert err.value.message == (
        "config.json: field 'num_global_key_value_heads'=4 differs from num_key_value_heads=8 without "
        "attention_k_eq_v; whether the full layers use it cannot be told (transformers applies it only together "
        "with attention_k_eq_v)")
    no_dtype = {k: v for k, v in cfg.items() if k not in ("torch_dtype", "dtype")}
    with pytest.raises(InvalidArgument) as err:
        model_cache(no_dtype)
    assert err.value.message == ("config.json: field 'torch_dtype' is missing; give the cache dtype "
                                 "(--kv-cache-dtype / --dtype)")


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_load_model_cache_defaults_equal_model_cache_defaults(tmp_path, tp):
    """load_model_cache(path) with no options plans exactly what model_cache(parsed) plans: per-layer layout,
    page size 16, the config's dtype; a directory reads its config.json."""
    cfg = json.loads((FIXTURES / "llama-3-8b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model_cache(tmp_path, tp=tp)
    ref = model_cache(cfg, tp=tp, source=str(tmp_path / "config.json"))
    assert m == ref
    assert m.spec.layout == "per_layer" and m.spec.page_size == 16
    assert {la.kv_heads for la in m.spec.layers} == {8 // tp}
    assert m.kv_bytes_per_token == 32 * 2 * (8 // tp) * 128 * BF16
