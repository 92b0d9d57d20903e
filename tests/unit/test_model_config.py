"""Plans from Hugging Face config.json: every fixture family's layers, slots, bytes per layer and per-layer
scale/offset through `kvctl plan --model-config`, tensor parallelism, pools YAML, and errors naming the field."""

import itertools
import json
from pathlib import Path

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.core.model_config import load_model_cache, model_cache
from kvservice.server.config import load_pools, load_pools_file
from kvservice.tools import kvctl

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
HELDOUT = FIXTURES / "heldout"
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def every(n, period):
    """Layer kinds: 'F' (full) where (i + 1) % period == 0, else 'S' (sliding): Gemma 3's rule."""
    return "".join("F" if (i + 1) % period == 0 else "S" for i in range(n))


# Facts about each model (from the published model cards / configs), written independently of the parser:
# layer kinds (F full, S sliding), window, (kv heads, head dim) of sliding and of full layers, dtype.
MODELS = {
    "llama-3-8b": ("F" * 32, 0, None, (8, 128), "bfloat16"),
    "qwen2-7b": ("F" * 28, 0, None, (4, 128), "bfloat16"),
    "qwen3-0.6b": ("F" * 28, 0, None, (8, 128), "bfloat16"),
    "mistral-7b-v0.1": ("S" * 32, 4096, (8, 128), None, "bfloat16"),
    "gemma-2-9b": ("SF" * 21, 4096, (8, 256), (8, 256), "float32"),
    "gemma-3-1b-it": (every(26, 6), 512, (1, 256), (1, 256), "bfloat16"),
    "gemma-3-27b-it": (every(62, 6), 1024, (16, 128), (16, 128), "bfloat16"),
    "gpt-oss-20b": ("SF" * 12, 128, (8, 64), (8, 64), "bfloat16"),
    "gemma4-style-synthetic": (("S" * 5 + "F") * 5, 1024, (8, 256), (8, 512), "bfloat16"),
}
SLOTS = 4 * (2048 // 16)                     # --max-batch 4 --max-seq-len 2048 --page-size 16


def group_slots(window):
    """Slots of a group at --max-batch 4 --max-seq-len 2048 --page-size 16 (the default 2048 batched tokens):
    a full group 4 x 128; a sliding group 4 x (ceil(w / 16) + 1) + 2048 / 16, never more than a full one."""
    return SLOTS if not window else min(SLOTS, 4 * (-(-window // 16) + 1) + 2048 // 16)


def run_kvctl(capsys, *args):
    code = kvctl.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def plan_json(capsys, name, *extra):
    args = ["--json", "plan", "--model-config", str(FIXTURES / f"{name}.json"), "--max-batch", "4",
            "--max-seq-len", "2048", *extra]
    if name == "gpt-oss-20b":
        args += ["--dtype", "bfloat16"]
    code, out, err = run_kvctl(capsys, *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
def test_kvctl_plan_from_each_model_family(capsys, name, layout):
    kinds, window, sliding, full, dtype = MODELS[name]
    doc = plan_json(capsys, name, "--layout", layout)
    assert doc["num_slots"] == (SLOTS if "F" in kinds else group_slots(window)) and doc["num_layers"] == len(kinds)
    assert "".join("S" if t == "sliding_attention" else "F" for t in doc["model"]["layer_types"]) == kinds
    groups: dict[int, list[int]] = {}
    for row in doc["layers"]:
        i = row["layer"]
        kv, hd = sliding if kinds[i] == "S" else full
        assert (row["kv_heads"], row["head_dim"]) == (kv, hd), row
        assert row["sliding_window"] == (window if kinds[i] == "S" else 0)
        page_bytes = 2 * 16 * kv * hd * BYTES[dtype]
        slots = group_slots(window if kinds[i] == "S" else 0)
        assert row["page_bytes"] == page_bytes and row["bytes"] == slots * page_bytes
        groups.setdefault(row["group"], []).append(i)
    # one group per attention kind present
    assert len(groups) == len(set(kinds))
    for members in groups.values():
        assert len({kinds[i] for i in members}) == 1
    for row in doc["layers"]:
        members = groups[row["group"]]
        slots = group_slots(row["sliding_window"])
        if layout == "per_layer":
            assert (row["scale"], row["offset"], row["upper_bound"] - row["base"]) == (1, 0, slots)
        else:   # every layer of a group has the same page size here: slot = the group's pages side by side
            scale, offset = len(members), members.index(row["layer"])
            assert (row["scale"], row["offset"], row["upper_bound"] - row["base"]) == (scale, offset, slots * scale), \
                row
    # what the plan saves against giving every group the full group's count
    assert doc["total_bytes"] == sum(r["bytes"] for r in doc["layers"]) or layout == "interleaved"
    assert doc["saved_bytes"] == doc["equal_sizing_bytes"] - doc["total_bytes"] >= 0
    # Disjoint index spaces: each space's range starts where the previous one ends.
    spaces = sorted({(r["index_space"], r["base"], r["upper_bound"]) for r in doc["layers"]})
    assert spaces[0][1] == 0 and all(b[1] == a[2] for a, b in itertools.pairwise(spaces))
    assert doc["bytes_per_slot"] == sum(r["page_bytes"] for r in doc["layers"])


def test_human_output_names_the_model_and_every_layer_view(capsys):
    code, out, _ = run_kvctl(capsys, "plan", "--model-config", str(FIXTURES / "gemma-2-9b.json"), "--max-batch",
                             "4", "--max-seq-len", "2048")
    assert code == 0
    assert "gemma2, 42 layers (21 sliding_attention, 21 full_attention), 42 paged, tp=1, cache dtype float32" in out
    assert "saved_bytes" in out and "layer group" in out
    assert "layers 2, 4, ... (counting from 1) are global" in out          # the inference is stated
    assert "bytes per layer" in out and "scale" in out and "offset" in out
    # per_layer: the 21 sliding and 21 full layers alternate, so the table has 42 runs of one layer
    table = out.split("upper bound\n")[-1].splitlines()[1:]
    assert len([r for r in table if r.strip()]) == 42
    assert table[0].split()[:3] == ["0", "0", "4,096"] and table[1].split()[:3] == ["1", "1", "full"]


@pytest.mark.parametrize(("tp", "kv", "note"), [(1, 8, None), (4, 2, None), (8, 1, None),
                                                (16, 1, "each rank holds 1 replicated KV head")])
def test_tensor_parallel_splits_kv_heads(tp, kv, note):
    m = load_model_cache(FIXTURES / "llama-3-8b.json", tp=tp)
    assert {la.kv_heads for la in m.spec.layers} == {kv}
    assert (note is None) == all("replicated" not in n for n in m.notes)


def test_tensor_parallel_of_a_hybrid_splits_each_kind():
    m = load_model_cache(FIXTURES / "gemma4-style-synthetic.json", tp=4)
    assert {(la.kv_heads, la.head_dim) for la in m.spec.layers} == {(2, 256), (2, 512)}
    cfg = json.loads((FIXTURES / "gemma4-style-synthetic.json").read_text())
    with pytest.raises(InvalidArgument, match="'num_global_key_value_heads'=2 differs from num_key_value_heads=8"):
        model_cache({**cfg, "num_global_key_value_heads": 2})


def test_pools_yaml_takes_a_model_config(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((FIXTURES / "qwen3-0.6b.json").read_text())
    f = tmp_path / "pools.yaml"
    f.write_text("pools:\n  - name: q\n    model_config: m\n    tp: 2\n    dtype: float16\n    page_size: 32\n"
                 "    sizing: {max_batch: 2, max_seq_len: 1024}\n")
    (pc,) = load_pools_file(f)
    assert pc.name == "q" and len(pc.spec.layers) == 28 and pc.spec.page_size == 32
    assert {(la.kv_heads, la.head_dim, la.dtype) for la in pc.spec.layers} == {(4, 128, "float16")}
    with pytest.raises(InvalidArgument, match=r"pools\[0\]: give either layers or model_config"):
        load_pools("pools:\n  - {name: q, model_config: x.json, layers: [{count: 1, kv_heads: 1, head_dim: 8}]}\n")
    with pytest.raises(InvalidArgument, match=r"pools\[0\]: cannot read model config"):
        load_pools("pools:\n  - {name: q, model_config: /nonexistent/config.json}\n")


def base():
    return json.loads((FIXTURES / "llama-3-8b.json").read_text())


@pytest.mark.parametrize(("change", "message"), [
    ({"num_hidden_layers": None}, "field 'num_hidden_layers' is missing"),
    ({"num_hidden_layers": "32"}, "field 'num_hidden_layers' must be a positive integer"),
    ({"num_key_value_heads": 0}, "field 'num_key_value_heads' must be a positive integer"),
    ({"hidden_size": 4100}, "hidden_size=4100 is not a multiple of num_attention_heads=32"),
    ({"hidden_size": None}, "field 'head_dim' is missing and cannot be derived"),
    ({"torch_dtype": None}, "field 'torch_dtype' is missing; give the cache dtype (--kv-cache-dtype"),
    ({"torch_dtype": "int8"}, "torch_dtype 'int8' is not a cache dtype"),
    ({"kv_lora_rank": 512}, "field 'qk_rope_head_dim' is missing"),
    ({"num_kv_shared_layers": 10}, "field 'num_kv_shared_layers'=10 is not supported"),
    ({"attention_k_eq_v": True}, "field 'attention_k_eq_v'=True is not supported"),
    ({"attention_chunk_size": 8192}, "field 'attention_chunk_size'=8192 makes 24 of 32 layers chunked local"),
    ({"layer_types": ["full_attention"] * 31 + ["lightning_attention"]},
     "field 'layer_types'[31] is 'lightning_attention', a layer kind this planner does not know"),
    ({"layer_types": ["full_attention"] * 31 + ["linear_attention"]},
     "linear_attention layers but no field gives their state size"),
    ({"num_hidden_layers": 4, "hybrid_override_pattern": "M*-X"}, "field 'hybrid_override_pattern' has 'X'"),
    ({"num_hidden_layers": 4, "hybrid_override_pattern": "M*-"}, "one character per layer (4)"),
    ({"attn_layer_period": 8}, "field 'attn_layer_offset' is missing"),
    ({"attn_layer_period": 4, "attn_layer_offset": 4}, "'attn_layer_offset'=4 must be below attn_layer_period=4"),
    ({"full_attention_interval": 4, "layer_types": ["full_attention"] * 32},
     "fields 'layer_types' and 'full_attention_interval' disagree on layer 0"),
    ({"full_attention_interval": 4, "sliding_window": 4096}, "'sliding_window'=4096 is set but"),
    ({"mamba_d_state": 16, "attn_layer_period": 8, "attn_layer_offset": 4}, "field 'mamba_expand' is missing"),
    ({"mamba_d_state": 16, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_n_heads": 0},
     "field 'mamba_n_heads' must be a positive integer, got 0"),
    ({"sliding_window": 4096, "sliding_window_size": 2048}, "'sliding_window'=4096 and 'sliding_window_size'=2048"),
    ({"head_dim": 128, "attention_head_dim": 64}, "'head_dim'=128 and 'attention_head_dim'=64 disagree"),
    ({"use_bidirectional_attention": True}, "bidirectional attention is an encoder's"),
    ({"rope_sacling": {"factor": 2}}, "unknown field 'rope_sacling'"),
    ({"cross_attention_layers": [3, 8], "kv_channels": 128}, "unknown fields 'cross_attention_layers', 'kv_channels'"),
    ({"quantization_config": {"kv_cache_scheme": {"num_bits": 4, "type": "int"}}},
     "'quantization_config.kv_cache_scheme'={'num_bits': 4, 'type': 'int'} is not an 8-bit float"),
    ({"layer_types": ["full_attention"] * 3}, "must list one type per layer (32), got 3"),
    ({"layer_types": ["sliding_attention"] * 32}, "field 'sliding_window' is missing"),
    ({"sliding_window_pattern": 0, "sliding_window": 10}, "'sliding_window_pattern' must be a positive integer"),
    ({"global_head_dim": 0}, "field 'global_head_dim' must be a positive integer, got 0"),
])
def test_config_errors_name_the_field(change, message):
    cfg = {**base(), **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(InvalidArgument) as err:
        model_cache(cfg, source="cfg.json")
    assert message in err.value.message and err.value.message.startswith("cfg.json")


def test_tp_that_does_not_divide_is_refused():
    with pytest.raises(InvalidArgument, match="num_key_value_heads=8 cannot be split over tp=3"):
        model_cache(base(), tp=3)
    with pytest.raises(InvalidArgument, match="tp must be a positive integer"):
        model_cache(base(), tp=0)


def test_kvctl_reports_config_errors_and_mixed_flags(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    code, _, err = run_kvctl(capsys, "plan", "--model-config", str(tmp_path), "--num-slots", "8")
    assert code == 2 and "not valid JSON" in err
    code, _, err = run_kvctl(capsys, "plan", "--model-config", str(FIXTURES / "gpt-oss-20b.json"), "--num-slots", "8")
    assert code == 2 and "field 'torch_dtype' is missing" in err
    code, _, err = run_kvctl(capsys, "plan", "--model-config", str(HELDOUT / "llama-4-scout-17b-16e-instruct.json"),
                             "--num-slots", "8")
    assert code == 2 and "field 'attention_chunk_size'=8192" in err
    code, _, err = run_kvctl(capsys, "plan", "--model-config", str(FIXTURES / "llama-3-8b.json"), "--layers", "2",
                             "--num-slots", "8")
    assert code == 2 and "drop --layers" in err
    code, _, err = run_kvctl(capsys, "plan", "--num-slots", "8")
    assert code == 2 and "give --model-config PATH, or all of --layers" in err


@pytest.mark.parametrize("n", [1, 3])
def test_a_multi_token_prediction_layer_is_named_as_not_planned(n):
    """DeepSeek-V3's config.json (num_nextn_predict_layers=1): the MTP layer's cache serves speculative decoding
    only and is left out; the note says so, with the field's value, and the plan keeps the model's own layers."""
    m = model_cache({**base(), "num_nextn_predict_layers": n})
    assert f"num_nextn_predict_layers={n}: the multi-token-prediction layer's cache (speculative decoding only) " \
           "is not planned" in m.notes
    assert len(m.spec.layers) == base()["num_hidden_layers"]
    assert not any("nextn" in note for note in model_cache(base()).notes)


def test_attn_layer_indices_count_from_layer_0_and_an_index_past_the_last_is_refused():
    """Jamba's config with its attention layers listed by index (attn_layer_indices) in place of period/offset:
    the first layer (index 0) may be one of them, and an index past the last layer (31) is refused naming the
    valid range."""
    jamba = json.loads((HELDOUT / "jamba-v0.1.json").read_text())
    cfg = {k: v for k, v in jamba.items() if k not in ("attn_layer_period", "attn_layer_offset")}
    mc = model_cache({**cfg, "attn_layer_indices": [0, 5, 17]}, source="cfg.json")
    assert mc.paged_layers == (0, 5, 17) and len(mc.state_layers) == 29
    assert [i for i, t in enumerate(mc.layer_types) if t == "full_attention"] == [0, 5, 17]
    for idx in ([3, 32], [-1, 4]):
        with pytest.raises(InvalidArgument) as err:
            model_cache({**cfg, "attn_layer_indices": idx}, source="cfg.json")
        assert err.value.message == (f"cfg.json: field 'attn_layer_indices' names a layer outside 0..31: {idx}")
