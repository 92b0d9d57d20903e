"""Held-out configs (tests/fixtures/model_configs/heldout/, written from the published Hugging Face config.json
of each model, not from the parser): every one is planned exactly or refused naming the field; no linear-attention,
Mamba or chunked layer is ever counted as attention. Expected layer kinds and bytes are computed here by hand from
the models' published architecture, independently of kvservice.core.model_config. Then: the same layer kinds as
transformers' own config classes derive, vLLM's flag names, human sizes, quantized and unknown fields."""

import json
from pathlib import Path

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.sizing import Sizing
from kvservice.core.model_config import load_model_cache, model_cache
from kvservice.core.planner import plan
from kvservice.core.units import parse_bytes
from kvservice.tools import kvctl
from tests.ci import need_module

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
HELDOUT = FIXTURES / "heldout"

# Layer kinds: F full attention, S sliding, L linear attention (gated DeltaNet), M Mamba, - MLP only, H hybrid
# (attention and Mamba side by side). Nemotron-Nano-9B-v2's published pattern, one character per layer:
NEMOTRON = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-".replace("*", "F")


def alternate(n, first="S", second="F"):
    return (first + second) * (n // 2)


# name: (kinds, bytes per token over the paged layers at tp=1, state bytes per sequence, kv heads, head_dim, k_only)
HAND = {
    # 48 layers, every 4th full attention (full_attention_interval 4): 12 x 2 (K, V) x 2 heads x 256 x 2 B.
    # Gated DeltaNet state per layer: conv 3 x (2 x 16 x 128 + 32 x 128) + recurrent 32 x 128 x 128, bf16, x 36.
    "qwen3-next-80b-a3b-instruct": ("LLLF" * 12, 12 * 2 * 2 * 256 * 2,
                                    36 * 2 * (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128), 2, 256, False),
    # attention where i % 8 == 4: layers 4, 12, 20, 28 (4 x 2 x 8 x 128 x 2 B); Mamba 1 state, d_inner 2 x 4096:
    # conv 3 x 8192 + SSM 8192 x 16, bf16, x 28 layers.
    "jamba-v0.1": ("".join("F" if i % 8 == 4 else "M" for i in range(32)), 4 * 2 * 8 * 128 * 2,
                   28 * 2 * (3 * 8192 + 8192 * 16), 8, 128, False),
    # 4 attention layers of 56 (4 x 2 x 8 x 128 x 2 B); 27 Mamba 2 layers of 128 heads x 80, 8 groups, state 128:
    # conv 3 x (10240 + 2 x 8 x 128) + SSM 128 x 80 x 128, bf16.
    "nvidia-nemotron-nano-9b-v2": (NEMOTRON, 4 * 2 * 8 * 128 * 2, 27 * 2 * (3 * (10240 + 2 * 8 * 128) + 128 * 80 * 128),
                                   8, 128, False),
    # every layer attention (2 KV heads x 128) and Mamba 2 (24 heads x 128, 1 group, state 256) side by side.
    "falcon-h1-7b-instruct": ("H" * 44, 44 * 2 * 2 * 128 * 2, 44 * 2 * (3 * (3072 + 2 * 256) + 24 * 128 * 256),
                              2, 128, False),
    # 36 layers alternating sliding (window 128) and full, 8 KV heads x 64, bf16 given (no torch_dtype published).
    "gpt-oss-120b": (alternate(36), 36 * 2 * 8 * 64 * 2, 0, 8, 64, False),
    # 46 layers alternating from a sliding layer 0 (gemma2's rule), 16 KV heads x 128, float32.
    "gemma-2-27b": (alternate(46), 46 * 2 * 16 * 128 * 4, 0, 16, 128, False),
    # nested text_config: 48 layers, every 6th global (gemma3's rule), 8 KV heads x 256, bf16 at the top level.
    "gemma-3-12b-it": ("SSSSSF" * 8, 48 * 2 * 8 * 256 * 2, 0, 8, 256, False),
    # MLA: one latent of 512 + 64 values per token and layer, K only, 61 layers, bf16.
    "deepseek-v3": ("F" * 61, 61 * (512 + 64) * 2, 0, 1, 576, True),
    "deepseek-v2-lite": ("F" * 27, 27 * (512 + 64) * 2, 0, 1, 576, True),
    # sliding_window null: every layer full attention.
    "mixtral-8x7b-v0.1": ("F" * 32, 32 * 2 * 8 * 128 * 2, 0, 8, 128, False),
}
REFUSED = {"llama-4-scout-17b-16e-instruct": "field 'attention_chunk_size'=8192 makes 36 of 48 layers chunked local "
                                             "attention"}
LETTER = {"full_attention": "F", "sliding_attention": "S", "linear_attention": "L", "mamba": "M", "mlp": "-",
          "hybrid": "H", "chunked_attention": "C", "moe": "E"}


def test_the_held_out_set_is_what_this_file_expects():
    assert sorted(p.stem for p in HELDOUT.glob("*.json")) == sorted([*HAND, *REFUSED])


@pytest.mark.parametrize("name", sorted(HAND))
def test_held_out_config_is_planned_exactly(name):
    kinds, per_token, state, kv, hd, k_only = HAND[name]
    m = load_model_cache(HELDOUT / f"{name}.json", dtype="bfloat16" if name.startswith("gpt-oss") else None)
    assert "".join(LETTER[k] for k in m.layer_types) == kinds
    # only attention (and hybrid) layers are paged; no state or MLP layer is counted as attention
    assert m.paged_layers == tuple(i for i, k in enumerate(kinds) if k in "FSH")
    assert len(m.spec.layers) == sum(k in "FSH" for k in kinds)
    assert m.kv_bytes_per_token == per_token
    assert sum(la.page_bytes(16) for la in m.spec.layers) == 16 * per_token
    assert {(la.kv_heads, la.head_dim, la.k_only) for la in m.spec.layers} == {(kv, hd, k_only)}
    assert m.state_bytes_per_seq == state
    assert [s.layer for s in m.state_layers] == [i for i, k in enumerate(kinds) if k in "LMH"]
    if state:
        assert any("not paged: managed by the engine" in n for n in m.notes)
    windows = {la.sliding_window for la, k in zip(m.spec.layers, [k for k in kinds if k in "FSH"], strict=True)
               if k == "S"}
    assert windows <= {128, 1024, 4096}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_held_out_config_is_refused_naming_the_field(name):
    with pytest.raises(InvalidArgument) as err:
        load_model_cache(HELDOUT / f"{name}.json")
    assert REFUSED[name] in err.value.message


def test_what_the_issue_found_wrong_is_right_now():
    """Qwen3-Next was planned at 98,304 B/token over 48 layers (4x), Jamba 8x, Nemotron-Nano 14x."""
    for name, layers, per_token in (("qwen3-next-80b-a3b-instruct", 12, 24_576), ("jamba-v0.1", 4, 16_384),
                                    ("nvidia-nemotron-nano-9b-v2", 4, 16_384)):
        m = load_model_cache(HELDOUT / f"{name}.json")
        assert (len(m.spec.layers), m.kv_bytes_per_token) == (layers, per_token)


def test_tensor_parallel_splits_state_heads_and_replicates_mla_latents():
    q = load_model_cache(HELDOUT / "qwen3-next-80b-a3b-instruct.json", tp=2)
    assert {la.kv_heads for la in q.spec.layers} == {1}
    assert q.state_bytes_per_seq == 36 * 2 * (3 * (2 * 8 * 128 + 16 * 128) + 16 * 128 * 128)
    d = load_model_cache(HELDOUT / "deepseek-v3.json", tp=8)
    assert d.kv_bytes_per_token == 61 * 576 * 2 and any("the same on every rank" in n for n in d.notes)
    n = load_model_cache(HELDOUT / "nvidia-nemotron-nano-9b-v2.json", tp=4)   # 128 heads / 4, 8 groups / 4
    assert n.state_bytes_per_seq == 27 * 2 * (3 * (32 * 80 + 2 * 2 * 128) + 32 * 80 * 128)


def test_quantized_kv_cache_dtypes():
    cfg = json.loads((FIXTURES / "llama-3-8b.json").read_text())
    fp8 = {**cfg, "quantization_config": {"quant_method": "compressed-tensors",
                                          "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}
    m = model_cache(fp8)
    assert {la.dtype for la in m.spec.layers} == {"float8_e4m3"} and m.kv_bytes_per_token == 32 * 2 * 8 * 128
    algo = {**cfg, "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}}
    assert {la.dtype for la in model_cache(algo).spec.layers} == {"float8_e4m3"}
    assert {la.dtype for la in model_cache(cfg, dtype="fp8_e5m2").spec.layers} == {"float8_e5m2"}
    assert {la.dtype for la in model_cache(fp8, dtype="auto").spec.layers} == {"float8_e4m3"}
    assert {la.dtype for la in model_cache(fp8, dtype="bfloat16").spec.layers} == {"bfloat16"}
    weights_only = model_cache({**cfg, "quantization_config": {"quant_method": "awq", "bits": 4}})
    assert {la.dtype for la in weights_only.spec.layers} == {"bfloat16"}
    assert any("quantizes weights only" in n for n in weights_only.notes)


def test_unknown_fields_are_refused_unless_allowed_and_then_reported():
    cfg = {**json.loads((FIXTURES / "llama-3-8b.json").read_text()), "kv_sharing_pattern": "every-2"}
    with pytest.raises(InvalidArgument, match=r"unknown field 'kv_sharing_pattern'.*--allow-unknown-keys"):
        model_cache(cfg)
    m = model_cache(cfg, allow_unknown_keys=True)
    assert m.unknown_keys == ("kv_sharing_pattern",) and any("kv_sharing_pattern" in n for n in m.notes)
    nested = json.loads((HELDOUT / "gemma-3-12b-it.json").read_text())
    nested["text_config"]["sliding_window_layers"] = [0, 1]
    with pytest.raises(InvalidArgument, match=r"unknown field 'text_config.sliding_window_layers'"):
        model_cache(nested)


def test_a_model_with_no_paged_layer_is_refused():
    cfg = json.loads((HELDOUT / "jamba-v0.1.json").read_text())
    cfg["attn_layer_period"], cfg["attn_layer_offset"] = 1, 0
    cfg["hybrid_override_pattern"] = "M" * 32        # disagrees with the period: refused naming both
    with pytest.raises(InvalidArgument, match="'attn_layer_period' disagree"):
        model_cache(cfg)
    del cfg["attn_layer_period"], cfg["attn_layer_offset"]
    with pytest.raises(InvalidArgument, match="no layer pages K/V"):
        model_cache({**cfg, "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_n_groups": 1})


# ---- transformers' own reading of the same configs --------------------------------------------------
def _hf_kinds(cfg):
    from transformers import AutoConfig
    from transformers.configuration_utils import remap_legacy_layer_types

    hf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    text = hf.get_text_config()
    kinds = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    if kinds is None:              # no per-layer types: Mistral-style sliding_window applies to every layer
        kinds = ["sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"] \
            * text.num_hidden_layers
    return remap_legacy_layer_types(list(kinds)), text


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")) + sorted(HELDOUT.glob("*.json")),
                         ids=lambda p: p.stem)
def test_layer_kinds_equal_what_transformers_derives(path):
    need_module("transformers", "pip install -e '.[dev]'")
    from kvservice.core.layer_kinds import layer_kinds

    cfg = json.loads(path.read_text())
    hf, text = _hf_kinds(cfg)
    ours = layer_kinds(cfg.get("text_config", cfg))
    assert ["linear_attention" if k == "mamba" else k for k in ours] == hf
    try:
        m = load_model_cache(path, dtype="bfloat16" if "torch_dtype" not in json.dumps(cfg) else None)
    except InvalidArgument:
        assert "chunked_attention" in hf            # the one refusal of the set: chunked attention
        return
    per_layer = getattr(text, "per_layer_config", None)       # heterogeneous configs (Gemma 4): per layer
    for la, i in zip(m.spec.layers, m.paged_layers, strict=True):
        c = per_layer[i] if per_layer is not None else text
        if la.k_only:
            assert la.head_dim == c.kv_lora_rank + c.qk_rope_head_dim
        else:
            assert la.kv_heads == c.num_key_value_heads
            assert la.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        if la.sliding_window:
            assert la.sliding_window == c.sliding_window


# ---- kvctl: vLLM's names, human sizes, the gemma-3-27b plan --------------------------------------------
def run(capsys, *args):
    code = kvctl.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_kvctl_plan_with_vllm_flags_gemma3_27b_fits_in_10_gb(capsys):
    code, out, err = run(capsys, "--json", "plan", "--block-size", "16", "--max-model-len", "8192", "--max-num-seqs",
                         "8", "--kv-cache-dtype", "auto", "--model-config", str(FIXTURES / "gemma-3-27b-it.json"))
    assert code == 0, err
    doc = json.loads(out)
    # 10 global layers x 8 x 512 pages; 52 sliding layers x (8 x (1024 / 16 + 1) + 2048 / 16) pages; a page of
    # 16 tokens x 2 x 16 heads x 128 x 2 B = 131,072 B
    page = 16 * 2 * 16 * 128 * 2
    want = 10 * 8 * 512 * page + 52 * (8 * 65 + 128) * page
    assert doc["total_bytes"] == want == 9_785_311_232 <= 10 * 10**9
    assert doc["equal_sizing_bytes"] == 62 * 8 * 512 * page and doc["saved_bytes"] == 62 * 8 * 512 * page - want
    assert sorted(g["num_slots"] for g in doc["groups"]) == [648, 4096]
    assert doc["model"]["kv_bytes_per_token"] == 62 * 2 * 16 * 128 * 2


def test_kvctl_vllm_aliases_equal_the_native_flags(capsys):
    cfg = str(HELDOUT / "qwen3-next-80b-a3b-instruct.json")
    _, a, _ = run(capsys, "--json", "plan", "--model-config", cfg, "--block-size", "32", "--max-model-len", "4096",
                  "--max-num-seqs", "4", "--tensor-parallel-size", "2", "--kv-cache-dtype", "fp8_e5m2")
    _, b, _ = run(capsys, "--json", "plan", "--model-config", cfg, "--page-size", "32", "--max-seq-len", "4096",
                  "--max-batch", "4", "--tp", "2", "--dtype", "float8_e5m2")
    assert json.loads(a) == {**json.loads(b), "model": json.loads(a)["model"]}
    doc = json.loads(a)
    assert doc["total_bytes"] == 12 * 4 * 128 * 32 * 2 * 1 * 256 * 1       # 12 layers, 1 head per rank, 1 B
    assert doc["model"]["state_bytes_per_seq"] > 0 and doc["model"]["state"] == "not paged: managed by the engine"


@pytest.mark.parametrize(("text", "device", "want"), [
    ("40GiB", 0, 40 * 2**30), ("512MB", 0, 512 * 10**6), ("1.5TiB", 0, 3 * 2**39), ("1234", 0, 1234),
    (1234, 0, 1234), ("80%", 80 * 2**30, 64 * 2**30), ("12.5 %", 8 * 2**30, 2**30)])
def test_human_sizes(text, device, want):
    assert parse_bytes(text, "--memory-budget", device) == want


@pytest.mark.parametrize(("text", "device", "message"), [
    ("80%", 0, "give --device-memory too"), ("40GB/s", 0, "is not a size"), ("4 parsecs", 0, "unknown unit"),
    ("120%", 2**30, "more than all"), ("9" * 30, 0, "outside 0..2^63-1")])
def test_bad_sizes_name_the_flag(text, device, message):
    with pytest.raises(InvalidArgument) as err:
        parse_bytes(text, "--memory-budget", device)
    assert err.value.message.startswith("--memory-budget") and message in err.value.message


def test_kvctl_memory_budget_in_human_units_and_shares(capsys):
    base = ["--json", "plan", "--layers", "4", "--kv-heads", "8", "--head-dim", "128", "--max-seq-len", "1024"]
    _, a, _ = run(capsys, *base, "--memory-budget", "1GiB")
    _, b, _ = run(capsys, *base, "--memory-budget", "50%", "--device-memory", "2GiB")
    _, c, _ = run(capsys, *base, "--gpu-memory-utilization", "0.5", "--device-memory", "2GiB")
    assert json.loads(a)["num_slots"] == json.loads(b)["num_slots"] == json.loads(c)["num_slots"] \
        == 2**30 // (4 * 2 * 16 * 8 * 128 * 2)


@pytest.mark.parametrize(("args", "message"), [
    (["--max-num-seqs", "8"], "say how big the pool is: --max-num-seqs (--max-batch) with --max-model-len"),
    (["--max-num-seqs", "8"], "--max-num-seqs alone is not enough"),
    (["--memory-budget", "80%"], "--memory-budget: '80%' is a share of the device's memory; give --device-memory"),
    (["--gpu-memory-utilization", "0.9"], "give --device-memory too"),
    (["--gpu-memory-utilization", "1.5", "--device-memory", "8GiB"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--num-slots", "8", "--block-size", "0"], "--block-size/--page-size must be > 0"),
    (["--num-slots", "8", "--kv-cache-dtype", "int4"], "--kv-cache-dtype 'int4' is not a cache dtype"),
])
def test_kvctl_sizing_errors_name_the_flags(capsys, args, message):
    code, _, err = run(capsys, "plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", *args)
    assert code == 2 and message in err, err


def test_kvctl_allow_unknown_keys_is_reported_in_the_plan(capsys, tmp_path):
    cfg = {**json.loads((FIXTURES / "llama-3-8b.json").read_text()), "fancy_new_field": 3}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "plan", "--model-config", str(tmp_path), "--num-slots", "64")
    assert code == 2 and "unknown field 'fancy_new_field'" in err and "--allow-unknown-keys" in err
    code, out, err = run(capsys, "--json", "plan", "--model-config", str(tmp_path), "--num-slots", "64",
                         "--allow-unknown-keys")
    assert code == 0, err
    assert json.loads(out)["model"]["unknown_keys"] == ["fancy_new_field"]


def test_sizing_plan_reports_saved_bytes_and_admission_is_per_group():
    m = load_model_cache(FIXTURES / "gemma-3-27b-it.json")
    equal = plan(m.spec, Sizing(max_batch=8, max_seq_len=8192, equal_groups=True))
    sized = plan(m.spec, Sizing(max_batch=8, max_seq_len=8192, prefix_headroom_slots=100))
    assert equal.group_slots == (4096, 4096) and equal.saved_bytes == 0
    assert sized.group_slots == (648 + 100, 4096) and sized.saved_bytes == equal.total_bytes - sized.total_bytes
    assert any("100 prefix-cache headroom" in n for n in sized.notes)
