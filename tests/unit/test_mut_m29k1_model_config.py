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


def llama() -> dict:
    return json.loads((FIXTURES / "llama-3-8b.json").read_text())


def test_more_ranks_than_kv_heads_replicate_one_head_and_say_so():
    """Llama 3 8B (8 K/V heads) at tp=16: one replicated head per rank, noted word for word; Nemotron-Nano's 8
    Mamba groups do not split over 16 ranks: each rank keeps all 8 (and 128 / 16 = 8 SSM heads)."""
    m = model_cache(llama(), tp=16)
    assert {la.kv_heads for la in m.spec.layers} == {1}
    assert "num_key_value_heads=8 < tp=16: each rank holds 1 replicated head" in m.notes
    n = model_cache(heldout("nvidia-nemotron-nano-9b-v2"), tp=16)
    conv, ssm = 3 * (8 * 80 + 2 * 8 * 128), 8 * 80 * 128
    assert {(s.conv_elems, s.ssm_elems) for s in n.state_layers} == {(conv, ssm)}
    assert "Mamba groups=8 do not split over tp=16: each rank keeps all of them" in n.notes


def test_kv_cache_quantization_is_read_in_any_case_and_anything_but_fp8_is_refused():
    cfg = llama()
    for algo in ("FP8", "fp8", "Fp8"):
        m = model_cache({**cfg, "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": algo}})
        assert {la.dtype for la in m.spec.layers} == {"float8_e4m3"}
        assert "cache dtype float8_e4m3 (the config's KV-cache quantization)" in m.notes
    with pytest.raises(InvalidArgument) as err:
        model_cache({**cfg, "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "INT8"}})
    assert err.value.message == ("config.json: field 'quantization_config.kv_cache_quant_algo'='INT8' is not FP8; no "
                                 "other KV quantization is planned")
    for scheme in ({"num_bits": 8, "type": "int"}, {"num_bits": 4, "type": "float"}, [8]):
        with pytest.raises(InvalidArgument) as err:
            model_cache({**cfg, "quantization_config": {"quant_method": "compressed-tensors",
                                                        "kv_cache_scheme": scheme}})
        assert err.value.message == (f"config.json: field 'quantization_config.kv_cache_scheme'={scheme!r} is not an "
                                     "8-bit float scheme; no other KV quantization is planned")
    with pytest.raises(InvalidArgument, match="field 'quantization_config' must be an object, got 'fp8'"):
        model_cache({**cfg, "quantization_config": "fp8"})


@pytest.mark.parametrize(("given", "want"), [("BF16", "bfloat16"), ("Float16", "float16"), ("FP8_E5M2", "float8_e5m2"),
                                             ("half", "float16"), ("auto", "bfloat16"), (None, "bfloat16")])
def test_the_callers_cache_dtype_in_any_case(given, want):
    m = model_cache(llama(), dtype=given)
    assert {la.dtype for la in m.spec.layers} == {want}
    assert m.kv_bytes_per_token == 32 * 2 * 8 * 128 * {"bfloat16": 2, "float16": 2, "float8_e5m2": 1}[want]


def test_an_unknown_cache_or_model_dtype_is_refused_with_the_known_names():
    with pytest.raises(InvalidArgument) as err:
        model_cache(llama(), dtype="int3")
    assert err.value.message.startswith("kv cache dtype 'int3' is not a cache dtype; use auto, bf16, bfloat16, ")
    with pytest.raises(InvalidArgument) as err:
        model_cache({**llama(), "torch_dtype": "int8"})
    assert err.value.message == ("config.json: torch_dtype 'int8' is not a cache dtype; give one with --kv-cache-dtype "
                                 "(float16, bfloat16, float32, float8_e4m3, float8_e5m2)")


@pytest.mark.parametrize("dtype", [None, "auto"])
def test_weight_only_quantization_is_noted_unless_the_caller_names_the_dtype(dtype):
    cfg = {**llama(), "quantization_config": {"quant_method": "awq", "bits": 4}}
    note = ("quantization_config (quant_method 'awq') quantizes weights only: the KV cache keeps the model's dtype")
    assert note in model_cache(cfg, dtype=dtype).notes
    assert note not in model_cache(cfg, dtype="float16").notes


def test_a_nested_config_takes_the_dtype_from_the_top_level_under_either_name():
    """Gemma 3 27B states torch_dtype beside text_config; newer configs call it dtype."""
    cfg = json.loads((FIXTURES / "gemma-3-27b-it.json").read_text())
    ref = model_cache(cfg)
    renamed = {k: v for k, v in cfg.items() if k != "torch_dtype"} | {"dtype": cfg["torch_dtype"]}
    m = model_cache(renamed)
    assert m.spec == ref.spec and {la.dtype for la in m.spec.layers} == {"bfloat16"}


def test_mla_layers_keep_the_window_of_a_sliding_layer():
    """Multi-head latent attention pages one K-only head of kv_lora_rank + qk_rope_head_dim = 576 values; with a
    window on every layer (sliding_window alone), every latent layer is a sliding one of that window."""
    cfg = heldout("deepseek-v2-lite")
    full = model_cache(cfg)
    assert {(la.kv_heads, la.head_dim, la.sliding_window, la.k_only) for la in full.spec.layers} == {(1, 576, 0, True)}
    slid = model_cache({**cfg, "sliding_window": 4096})
    assert {(la.kv_heads, la.head_dim, la.sliding_window, la.k_only) for la in slid.spec.layers} == \
        {(1, 576, 4096, True)}


@pytest.mark.parametrize("count", [1, 8, 9, 12])
def test_unknown_fields_are_listed_up_to_eight_then_counted(count):
    names = [f"zz_unknown_{i:02d}" for i in range(count)]
    cfg = llama() | dict.fromkeys(names, 1)
    with pytest.raises(InvalidArgument) as err:
        model_cache(cfg)
    shown = ", ".join(repr(k) for k in names[:8]) + (f" and {count - 8} more" if count > 8 else "")
    assert err.value.message.startswith(f"config.json: unknown field{'s' if count > 1 else ''} {shown}: a field this")
    m = model_cache(cfg, allow_unknown_keys=True)
    assert m.unknown_keys == tuple(names)
    assert f"unknown fields accepted (--allow-unknown-keys), not read: {', '.join(names)}" in m.notes


def test_derived_heads_and_head_dims_are_noted_with_their_formula():
    base = llama()
    assert "head_dim" not in base and base["num_attention_heads"] == 32 and base["hidden_size"] == 4096
    m = model_cache(base)
    assert "head_dim missing: 128 (= hidden_size 4096 / num_attention_heads 32)" in m.notes
    mha = model_cache({k: v for k, v in base.items() if k != "num_key_value_heads"})
    assert "num_key_value_heads missing: 32 (= num_attention_heads, multi-head attention)" in mha.notes
    assert {la.kv_heads for la in mha.spec.layers} == {32}
    with pytest.raises(InvalidArgument) as err:
        model_cache({k: v for k, v in base.items() if k not in ("num_key_value_heads", "num_attention_heads")})
    assert err.value.message == "config.json: neither 'num_key_value_heads' nor 'num_attention_heads' is given"


def test_an_auto_mamba_head_dim_is_expand_x_hidden_over_heads_and_noted():
    """Granite 4 / Bamba's 'auto': mamba_expand x hidden_size / heads (2 x 4480 / 128 = 70 on Nemotron-Nano)."""
    cfg = {**heldout("nvidia-nemotron-nano-9b-v2"), "mamba_head_dim": "auto", "mamba_expand": 2}
    m = model_cache(cfg)
    assert "mamba_head_dim='auto': 70 (mamba_expand x hidden_size / mamba_num_heads)" in m.notes
    conv, ssm = 3 * (128 * 70 + 2 * 8 * 128), 128 * 70 * 128
    assert {(s.conv_elems, s.ssm_elems) for s in m.state_layers} == {(conv, ssm)}


def test_summary_reports_every_figure():
    m = load_model_cache(HELDOUT / "jamba-v0.1.json")
    inner = 8192
    per = (3 * inner + 16 * inner) * BF16
    assert m.summary() == {
        "model_type": "jamba", "tp": 1, "layer_types": list(m.layer_types), "paged_layers": [4, 12, 20, 28],
        "kv_bytes_per_token": 4 * 2 * 8 * 128 * BF16, "state_layers": 28, "state_bytes_per_seq": 28 * per,
        "state": "not paged: managed by the engine", "unknown_keys": [], "notes": list(m.notes)}
    plain = model_cache(llama()).summary()
    assert (plain["state"], plain["state_layers"], plain["state_bytes_per_seq"]) == ("", 0, 0)
    assert plain["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * BF16


def test_input_that_is_not_a_config_is_refused_by_name(tmp_path):
    with pytest.raises(InvalidArgument) as err:
        model_cache([1, 2])
    assert err.value.message == "config.json: expected a JSON object, got list"
    with pytest.raises(InvalidArgument) as err:
        model_cache({**llama(), "text_config": "llama"})
    assert err.value.message == "config.json: field 'text_config' must be an object"
    missing = tmp_path / "nope.json"
    with pytest.raises(InvalidArgument) as err:
        load_model_cache(missing)
    assert err.value.message == f"cannot read model config {missing}: No such file or directory"
    bad = tmp_path / "bad.json"
    bad.write_text("{\"a\": 1,")
    with pytest.raises(InvalidArgument) as err:
        load_model_cache(bad)
    assert err.value.message.startswith(f"{bad}: not valid JSON (Expecting ")


def test_a_model_without_a_paged_layer_names_its_kinds_sorted():
    cfg = {**heldout("nvidia-nemotron-nano-9b-v2"), "hybrid_override_pattern": "M-EM-E", "num_hidden_layers": 6}
    with pytest.raises(InvalidArgument) as err:
        model_cache(cfg)
    assert err.value.message.startswith("config.json: no layer pages K/V (every layer is mamba, mlp, moe); there ")


@pytest.mark.parametrize("dim, ok", [(1, True), (0, False), (-2, False), (True, False), (2.5, False), ("80", False)])
def test_a_mamba2_head_dim_of_one_is_the_smallest_taken_and_anything_else_not_positive_integral_is_refused(dim, ok):
    """Nemotron-Nano with mamba_head_dim set by hand: 1 is a valid (if unusual) head dim, planned by the same
    formula (conv 3 x (128 x 1 + 2 x 8 x 128), SSM 128 x 1 x 128); 0, negatives, booleans, floats and strings are
    refused naming the field."""
    cfg = {**heldout("nvidia-nemotron-nano-9b-v2"), "mamba_head_dim": dim}
    if ok:
        conv, ssm = 3 * (128 * 1 + 2 * 8 * 128), 128 * 1 * 128
        assert {(s.conv_elems, s.ssm_elems) for s in model_cache(cfg).state_layers} == {(conv, ssm)}
    else:
        with pytest.raises(InvalidArgument) as err:
            model_cache(cfg)
        assert err.value.message.endswith(f"field 'mamba_head_dim' must be a positive integer or 'auto', got {dim!r}")
