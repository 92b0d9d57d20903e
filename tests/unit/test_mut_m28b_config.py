"""kvservice/server/config.py against hand-built oracles: whole PoolConfigs and whole error messages.

The expected values are written out by hand from the schema in the module docstring (keys, vLLM aliases,
kinds, "<source>: pools[i].key (line n): ..." messages), never computed by the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.server.config import PoolConfig, load_pools, load_pools_file


def _doc(rng: np.random.Generator) -> tuple[str, list[PoolConfig]]:
    """A two-pool document using every layer-pool key (canonical and vLLM names), and the configs it means."""
    a_runs = [(int(rng.integers(1, 5)), int(rng.integers(1, 9)), int(rng.choice([64, 128, 256]))) for _ in range(3)]
    window = int(rng.integers(1, 4096))
    sizing = {k: int(rng.integers(1, 10_000)) for k in ("max_batch", "max_seq_len", "max_num_batched_tokens",
                                                         "prefix_headroom_slots")}
    seed = str(int(rng.integers(1, 10**9)))
    page = int(rng.choice([8, 16, 32]))
    groups = [int(x) for x in rng.integers(1, 500, 2)]
    text = f"""pools:
  - name: alpha
    page_size: {page}
    layout: interleaved
    layers:
      - {{count: {a_runs[0][0]}, kv_heads: {a_runs[0][1]}, head_dim: {a_runs[0][2]}, dtype: fp16}}
      - {{count: {a_runs[1][0]}, kv_heads: {a_runs[1][1]}, head_dim: {a_runs[1][2]}, dtype: BF16,
          sliding_window: {window}}}
      - {{count: {a_runs[2][0]}, kv_heads: {a_runs[2][1]}, head_dim: {a_runs[2][2]}, sliding_window: 0}}
      - {{kv_heads: 1, head_dim: 576, k_only: true, dtype: fp8}}
    sizing:
      max_num_seqs: {sizing['max_batch']}
      max_model_len: {sizing['max_seq_len']}
      max_num_batched_tokens: {sizing['max_num_batched_tokens']}
      prefix_headroom_slots: {sizing['prefix_headroom_slots']}
      equal_groups: true
      memory_budget_bytes: 3MiB
    backends: [native, flashinfer]
    enable_prefix_caching: true
    model: org/alpha-7b
    prefix_hash: vllm-sha256-cbor
    prefix_hash_seed: "{seed}"
  - name: beta
    block_size: {page * 2}
    layers:
      - {{kv_heads: 2, head_dim: 64, count: 1}}
    sizing: {{max_batch: 0, num_slots: 0, group_slots: [{groups[0]}, {groups[1]}],
              device_memory: 1GiB, gpu_memory_utilization: 0.25}}
"""
    layers = ((LayerSpec(a_runs[0][1], a_runs[0][2], "float16"),) * a_runs[0][0]
              + (LayerSpec(a_runs[1][1], a_runs[1][2], "bfloat16", window),) * a_runs[1][0]
              + (LayerSpec(a_runs[2][1], a_runs[2][2]),) * a_runs[2][0]
              + (LayerSpec(1, 576, "float8_e4m3", k_only=True),))
    alpha = PoolConfig("alpha", CacheSpec(layers, page, "interleaved"),
                       Sizing(memory_budget_bytes=3 * 2**20, equal_groups=True, **sizing),
                       ("native", "flashinfer"), prefix_caching=True, model="org/alpha-7b",
                       prefix_hash="vllm-sha256-cbor", prefix_hash_seed=seed)
    beta = PoolConfig("beta", CacheSpec((LayerSpec(2, 64),), page * 2, "per_layer"),
                      Sizing(memory_budget_bytes=2**30 // 4, group_slots=tuple(groups)), ())
    return text, [alpha, beta]


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_a_document_with_every_key_parses_to_the_hand_built_pools(seed: int) -> None:
    text, want = _doc(np.random.default_rng(seed))
    got = load_pools(text, "pools.yaml")
    assert got == want
    assert [type(p.model) for p in got] == [str, str]       # absent model: "" (the dataclass default), not None


def test_an_empty_document_or_pool_list_means_no_pools() -> None:
    assert load_pools("") == []
    assert load_pools("pools: []\n") == []
    assert load_pools("{}\n") == []


def _llama_dir(tmp_path: Path, kv_heads: int, layers: int, **extra: object) -> Path:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
           "num_attention_heads": 32, "num_key_value_heads": kv_heads, "hidden_size": 4096,
           "torch_dtype": "bfloat16", **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(("tp_key", "tp"), [("tp", 2), ("tensor_parallel_size", 4), (None, 1)])
def test_a_model_config_pool_splits_kv_heads_by_tp_and_takes_dtype_page_size_layout(tmp_path: Path, tp_key, tp) -> None:
    rng = np.random.default_rng(tp)
    n_layers, kv_heads = int(rng.integers(2, 9)), 8
    d = _llama_dir(tmp_path, kv_heads, n_layers)
    tp_line = f"    {tp_key}: {tp}\n" if tp_key else ""
    text = ("pools:\n  - name: m\n    model_config: config.json\n" + tp_line
            + "    kv_cache_dtype: fp8\n    layout: interleaved\n    block_size: 32\n    sizing: {num_slots: 7}\n"
            + "    model: meta/llama\n")
    (pc,) = load_pools(text, "p.yaml", d)
    # hand-computed: 8 KV heads over tp ranks, head_dim 4096 / 32 = 128, fp8 = float8_e4m3
    want = CacheSpec((LayerSpec(kv_heads // tp, 128, "float8_e4m3"),) * n_layers, 32, "interleaved")
    assert pc == PoolConfig("m", want, Sizing(num_slots=7), (), model="meta/llama")
    (auto,) = load_pools("pools: [{name: m, model_config: " + str(d) + ", sizing: {num_slots: 7}}]")
    assert auto.spec == CacheSpec((LayerSpec(kv_heads, 128, "bfloat16"),) * n_layers, 16, "per_layer")


def test_allow_unknown_keys_reaches_the_model_planner(tmp_path: Path) -> None:
    d = _llama_dir(tmp_path, 8, 2, kv_zz_mode="x")
    text = "pools:\n  - name: m\n    model_config: config.json\n    sizing: {num_slots: 7}\n"
    with pytest.raises(InvalidArgument) as err:
        load_pools(text, "p.yaml", d)
    assert err.value.message.startswith(f"p.yaml: pools[0]: {d / 'config.json'}: unknown field 'kv_zz_mode'")
    (pc,) = load_pools(text + "    allow_unknown_keys: true\n", "p.yaml", d)
    assert pc.spec.layers == (LayerSpec(8, 128, "bfloat16"),) * 2


def test_a_pools_file_resolves_model_config_from_its_own_directory(tmp_path: Path) -> None:
    d = _llama_dir(tmp_path, 4, 3)
    f = d / "pools.yaml"
    f.write_text("pools:\n  - name: m\n    model_config: config.json\n    sizing: {num_slots: 7}\n")
    (pc,) = load_pools_file(f)
    assert pc.spec.layers == (LayerSpec(4, 128, "bfloat16"),) * 3
    with pytest.raises(InvalidArgument) as err:
        load_pools_file(d / "absent.yaml")
    assert err.value.message == f"cannot read pools file {d / 'absent.yaml'}: No such file or directory"


BASE = """pools:
  - name: chat
    page_size: 16
    layers:
      - {count: 2, kv_heads: 8, head_dim: 128, dtype: bfloat16}
    sizing: {max_batch: 8, max_seq_len: 1024}
"""
P = "pools.yaml: pools[0]"


def _with(line: str) -> str:
    return BASE + line + "\n"


ERRORS = [
    # _check: same setting twice, unknown keys, not a mapping
    (_with("    block_size: 32"), f"{P}: 'block_size' (line 7) and 'page_size' are the same setting; give one"),
    (_with("    enable_prefix_caching: true\n    prefix_caching: false"),
     f"{P}: 'prefix_caching' (line 8) and 'enable_prefix_caching' are the same setting; give one"),
    (BASE.replace("dtype: bfloat16", "dtype: bfloat16, colour: red"),
     f"{P}.layers[0]: unknown key 'colour' (line 5); known keys: count, dtype, head_dim, k_only, kv_heads, "
     "sliding_window"),
    (_with("    colour: red"),
     f"{P}: unknown key 'colour' (line 7); known keys: allow_unknown_keys, backends, block_size, dtype, "
     "enable_prefix_caching, kv_cache_dtype, layers, layout, model, model_config, name, page_size, prefix_caching, "
     "prefix_hash, prefix_hash_seed, sizing, tensor_parallel_size, tp"),
    (_with("    pagesize: 32"), f"{P}: unknown key 'pagesize' (line 7); did you mean 'page_size'?"),
    ("pools: [3]\n", f"{P}: expected a mapping, got int"),
    ("- 1\n", "pools.yaml: expected a mapping, got list"),
    (BASE.replace("      - {count", "      - 5\n      - {count"), f"{P}.layers[0]: expected a mapping, got int"),
    # _typed: one case per kind, with the wording of each
    (BASE.replace("page_size: 16", "page_size: 0"), f"{P}.page_size (line 3): expected a positive integer, got 0"),
    (BASE.replace("page_size: 16", "page_size: true"),
     f"{P}.page_size (line 3): expected a positive integer, got True"),
    (BASE.replace("head_dim: 128", "head_dim: 12.5"),
     f"{P}.layers[0].head_dim (line 5): expected a positive integer, got 12.5"),
    (BASE.replace("max_batch: 8", "max_batch: -1"),
     f"{P}.sizing.max_batch (line 6): expected an integer >= 0, got -1"),
    (BASE.replace("max_batch: 8", "max_batch: false"),
     f"{P}.sizing.max_batch (line 6): expected an integer >= 0, got False"),
    (_with("    prefix_caching: 1"), f"{P}.prefix_caching (line 7): expected true or false, got 1"),
    (BASE.replace("name: chat", "name: 5"), f"{P}.name (line 2): expected a non-empty string, got 5"),
    (_with("    backends: flashinfer"), f"{P}.backends (line 7): expected a list, got 'flashinfer'"),
    (BASE.replace("sizing: {max_batch: 8, max_seq_len: 1024}", "sizing: [8]"),
     f"{P}.sizing (line 6): expected a mapping, got [8]"),
    (BASE.replace("max_seq_len: 1024", "device_memory: 1GiB, gpu_memory_utilization: half"),
     f"{P}.sizing.gpu_memory_utilization (line 6): expected a number, got 'half'"),
    (BASE.replace("max_seq_len: 1024", "group_slots: [4, 0]"),
     f"{P}.sizing.group_slots (line 6): expected a list of positive integers, got [4, 0]"),
    (BASE.replace("max_seq_len: 1024", "group_slots: [4, true]"),
     f"{P}.sizing.group_slots (line 6): expected a list of positive integers, got [4, True]"),
    (BASE.replace("max_seq_len: 1024", "memory_budget: [1]"),
     f"{P}.sizing.memory_budget (line 6): expected a size (40GiB, 80%, bytes), got [1]"),
    (BASE.replace("max_seq_len: 1024", "memory_budget: true"),
     f"{P}.sizing.memory_budget (line 6): expected a size (40GiB, 80%, bytes), got True"),
    ("pools: {name: a}\n", "pools.yaml.pools (line 1): expected a list, got {'name': 'a'}"),
    # _sizing: gpu_memory_utilization needs device_memory, no budget, a share in (0, 1]
    (BASE.replace("max_seq_len: 1024", "gpu_memory_utilization: 0.5"),
     f"{P}.sizing.gpu_memory_utilization: needs device_memory, no memory_budget, and a value in (0, 1], got 0.5"),
    (BASE.replace("max_seq_len: 1024", "device_memory: 1GiB, gpu_memory_utilization: 1.5"),
     f"{P}.sizing.gpu_memory_utilization: needs device_memory, no memory_budget, and a value in (0, 1], got 1.5"),
    (BASE.replace("max_seq_len: 1024", "device_memory: 1GiB, gpu_memory_utilization: 0"),
     f"{P}.sizing.gpu_memory_utilization: needs device_memory, no memory_budget, and a value in (0, 1], got 0"),
    (BASE.replace("max_seq_len: 1024", "device_memory: 1GiB, memory_budget: 1MiB, gpu_memory_utilization: 0.5"),
     f"{P}.sizing.gpu_memory_utilization: needs device_memory, no memory_budget, and a value in (0, 1], got 0.5"),
    (BASE.replace("max_seq_len: 1024", "memory_budget: 50%"),
     f"{P}.sizing.memory_budget: '50%' is a share of the device's memory; give {P}.sizing.device_memory too"),
    # _pool
    ("pools:\n  - page_size: 16\n", f"{P} (line 2): each pool needs a name"),
    (_with("    prefix_hash: md5"), f"{P}: prefix_hash 'md5' (line 7) is not one of kvservice, vllm-sha256-cbor"),
    (_with("    model_config: m/config.json"), f"{P}: give either layers or model_config, not both"),
    ("pools:\n  - name: chat\n    sizing: {num_slots: 4}\n", f"{P} (line 2): pool 'chat' needs layers or model_config"),
    (BASE.replace("kv_heads: 8, ", ""), f"{P}.layers[0] (line 5): kv_heads missing"),
    (BASE.replace("kv_heads: 8, head_dim: 128, ", ""), f"{P}.layers[0] (line 5): kv_heads, head_dim missing"),
    (BASE.replace("dtype: bfloat16", "dtype: int4"),
     f"{P}.layers[0] (line 5): unknown cache dtype 'int4'; use one of float16, bfloat16, float32, float8_e4m3, "
     "float8_e5m2"),
    (_with("    tp: 2"), f"{P}: 'tp' (line 7) goes with model_config"),
    (_with("    dtype: float16"),
     f"{P}: 'dtype' (line 7) of a pool goes with model_config; give each layer run its dtype"),
    # load_pools
    (BASE + BASE.replace("pools:\n", ""), "pools.yaml: pool name 'chat' is used twice"),
    (_with("    page_size: 32"), "pools.yaml: line 7: key 'page_size' is given twice (first on line 3)"),
]


@pytest.mark.parametrize(("text", "message"), ERRORS)
def test_each_mistake_is_refused_with_its_whole_message(text: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        load_pools(text, "pools.yaml")
    assert err.value.message == message


def test_a_missing_model_config_and_bad_yaml_name_the_source(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument) as err:
        load_pools("pools:\n  - name: m\n    model_config: nope.json\n", "p.yaml", tmp_path)
    assert err.value.message == f"p.yaml: pools[0]: cannot read model config {tmp_path / 'nope.json'}: " \
                                "No such file or directory"
    with pytest.raises(InvalidArgument) as err:          # no base directory: a relative path is the process's
        load_pools("pools:\n  - name: m\n    model_config: absent-m28b/config.json\n", "p.yaml")
    assert err.value.message == "p.yaml: pools[0]: cannot read model config absent-m28b/config.json: " \
                                "No such file or directory"
    with pytest.raises(InvalidArgument) as err:
        load_pools("pools: [", "p.yaml")
    assert err.value.message.startswith("p.yaml: not valid YAML: ")


def test_zero_is_accepted_where_the_schema_says_an_integer_at_least_zero() -> None:
    text = BASE.replace("sizing: {max_batch: 8, max_seq_len: 1024}",
                        "sizing: {max_batch: 0, max_seq_len: 0, num_slots: 9, max_num_batched_tokens: 0, "
                        "prefix_headroom_slots: 0}").replace("dtype: bfloat16", "sliding_window: 0")
    (pc,) = load_pools(text)
    assert pc.sizing == Sizing(num_slots=9)
    assert pc.spec.layers == (LayerSpec(8, 128, "float16", 0),) * 2


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance, the textbook recursion with memo (a model, independent of _near's table)."""
    from functools import cache

    @cache
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


def test_a_near_miss_is_one_edit_or_the_same_name_without_separators() -> None:
    """The module's rule for "did you mean": case aside, one insertion, deletion or substitution, or the same
    letters once underscores (and a typed hyphen) are dropped."""
    from kvservice.server.config import _near

    rng = np.random.default_rng(61)
    alphabet = "ab_-C"
    for _ in range(3000):
        a = "".join(rng.choice(list(alphabet), int(rng.integers(0, 6))))
        b = "".join(rng.choice(list("ab_c"), int(rng.integers(0, 6))))
        al, bl = a.lower(), b.lower()
        want = al.replace("_", "").replace("-", "") == bl.replace("_", "") or (
            abs(len(al) - len(bl)) <= 1 and _edit_distance(al, bl) <= 1)
        assert _near(a, b) is want, (a, b)
    assert _near("prefix_cachng", "prefix_caching") and _near("Max-Batch", "max_batch")
    assert not _near("colour", "count") and not _near("pagesize_x", "page_size")
