"""Pool definitions from YAML (or the embedded default) for `kvservice serve`: a strict schema.

    pools:
      - name: llama3-8b
        page_size: 16                # or block_size (vLLM's name)
        layout: per_layer            # or interleaved
        layers:                      # runs of identical layers, in order
          - {count: 32, kv_heads: 8, head_dim: 128, dtype: float16}
        sizing: {max_batch: 64, max_seq_len: 8192}   # or num_slots / memory_budget (40GiB, 80% of device_memory)
        backends: [flashinfer]
        prefix_caching: true         # keep released full pages findable by hash (default false)
        prefix_hash: vllm-sha256-cbor   # page hash mode (default: serve --prefix-hash, else kvservice)
        prefix_hash_seed: "1234"     # vllm-sha256-cbor's NONE_HASH seed (vLLM's PYTHONHASHSEED)
      - name: gemma3-27b
        model_config: models/gemma-3-27b-it/config.json   # layers from the model (model_config.py);
        tp: 4                                              # relative paths: from this file's directory
        dtype: auto                  # or kv_cache_dtype; auto (default): the model's; fp8, fp8_e5m2, ...
        page_size: 16
        sizing: {max_num_seqs: 32, max_model_len: 8192, max_num_batched_tokens: 4096, prefix_headroom_slots: 256}
        model: google/gemma-3-27b-it # the model served (ScorePrefix selects pools by it)

Every key is checked: an unknown or misspelt one is refused with its name, where it is and the line
(``prefix_cachng`` never silently starts a pool without prefix caching), as is a key given twice or a
value of the wrong type. vLLM's names are accepted as aliases: block_size, tensor_parallel_size,
kv_cache_dtype, enable_prefix_caching, max_num_seqs, max_model_len, gpu_memory_utilization.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.hashing import HASH_MODES
from kvservice.core.model_config import DTYPES, load_model_cache
from kvservice.core.units import parse_bytes

DEFAULT_POOLS_YAML = """
pools:
  - name: default
    page_size: 16
    layout: per_layer
    layers:
      - {count: 32, kv_heads: 8, head_dim: 128, dtype: float16}
    sizing: {max_batch: 64, max_seq_len: 4096}
    backends: [native, flashinfer]
"""

#: key -> (canonical key, kind) per level; kind: "int", "bool", "str", "size", "list", "map", "float", "ints".
POOL_KEYS = {
    "name": ("name", "str"), "page_size": ("page_size", "int"), "block_size": ("page_size", "int"),
    "layout": ("layout", "str"), "layers": ("layers", "list"), "sizing": ("sizing", "map"),
    "backends": ("backends", "list"), "model_config": ("model_config", "str"), "tp": ("tp", "int"),
    "tensor_parallel_size": ("tp", "int"), "dtype": ("dtype", "str"), "kv_cache_dtype": ("dtype", "str"),
    "prefix_caching": ("prefix_caching", "bool"), "enable_prefix_caching": ("prefix_caching", "bool"),
    "model": ("model", "str"), "allow_unknown_keys": ("allow_unknown_keys", "bool"),
    "prefix_hash": ("prefix_hash", "str"), "prefix_hash_seed": ("prefix_hash_seed", "str"),
}
LAYER_KEYS = {"count": ("count", "int"), "kv_heads": ("kv_heads", "int"), "head_dim": ("head_dim", "int"),
              "dtype": ("dtype", "str"), "sliding_window": ("sliding_window", "int0"), "k_only": ("k_only", "bool")}
SIZING_KEYS = {
    "max_batch": ("max_batch", "int0"), "max_num_seqs": ("max_batch", "int0"),
    "max_seq_len": ("max_seq_len", "int0"), "max_model_len": ("max_seq_len", "int0"),
    "memory_budget_bytes": ("memory_budget", "size"), "memory_budget": ("memory_budget", "size"),
    "device_memory": ("device_memory", "size"), "gpu_memory_utilization": ("gpu_memory_utilization", "float"),
    "num_slots": ("num_slots", "int0"), "max_num_batched_tokens": ("max_num_batched_tokens", "int0"),
    "prefix_headroom_slots": ("prefix_headroom_slots", "int0"), "equal_groups": ("equal_groups", "bool"),
    "group_slots": ("group_slots", "ints"),
}


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str
    spec: CacheSpec
    sizing: Sizing
    backends: tuple[str, ...]
    prefix_caching: bool = False
    model: str = ""
    prefix_hash: str = ""          # "" = the server's --prefix-hash
    prefix_hash_seed: str = ""


class _Map(dict):
    """A YAML mapping that remembers the line of each key (1-based) and of itself."""

    line: int = 0
    lines: dict[Any, int]


class _Loader(yaml.SafeLoader):
    pass


def _mapping(loader: _Loader, node: yaml.MappingNode) -> _Map:
    loader.flatten_mapping(node)
    out = _Map()
    out.line, out.lines = node.start_mark.line + 1, {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in out:
            raise InvalidArgument(f"line {line}: key {key!r} is given twice (first on line {out.lines[key]})")
        out[key] = loader.construct_object(value_node, deep=True)
        out.lines[key] = line
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _line(m: Any, key: Any = None) -> str:
    if not isinstance(m, _Map):
        return ""
    return f" (line {m.lines.get(key, m.line) if key is not None else m.line})"


def _check(m: Any, schema: dict[str, tuple[str, str]], where: str) -> dict[str, Any]:
    """The mapping's values under their canonical keys, type-checked; InvalidArgument naming key, place and line."""
    if not isinstance(m, dict):
        raise InvalidArgument(f"{where}: expected a mapping, got {type(m).__name__}{_line(m)}")
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in m.items():
        if key not in schema:
            close = [k for k in schema if _near(str(key), k)]
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(schema))}"
            raise InvalidArgument(f"{where}: unknown key {key!r}{_line(m, key)}{hint}")
        canon, kind = schema[key]
        if canon in seen:
            raise InvalidArgument(f"{where}: {key!r}{_line(m, key)} and {seen[canon]!r} are the same setting; "
                                  "give one")
        seen[canon] = key
        out[canon] = _typed(value, kind, f"{where}.{key}{_line(m, key)}")
    return out


def _typed(v: Any, kind: str, what: str) -> Any:
    ok = {"int": lambda x: isinstance(x, int) and not isinstance(x, bool) and x > 0,
          "int0": lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0,
          "bool": lambda x: isinstance(x, bool), "str": lambda x: isinstance(x, str) and x != "",
          "list": lambda x: isinstance(x, list), "map": lambda x: isinstance(x, dict),
          "float": lambda x: isinstance(x, int | float) and not isinstance(x, bool),
          "ints": lambda x: isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) and i > 0
                                                        for i in x),
          "size": lambda x: isinstance(x, int | str) and not isinstance(x, bool)}[kind]
    if not ok(v):
        want = {"int": "a positive integer", "int0": "an integer >= 0", "bool": "true or false",
                "str": "a non-empty string", "list": "a list", "map": "a mapping", "float": "a number",
                "ints": "a list of positive integers", "size": "a size (40GiB, 80%, bytes)"}[kind]
        raise InvalidArgument(f"{what}: expected {want}, got {v!r}")
    return v


def _near(a: str, b: str) -> bool:
    """A likely misspelling: same letters but one edit, or one is the other without underscores."""
    a, b = a.lower(), b.lower()
    if a.replace("_", "").replace("-", "") == b.replace("_", ""):
        return True
    if abs(len(a) - len(b)) > 1:
        return False
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1] <= 1


def _sizing(m: Any, where: str) -> Sizing:
    s = _check(m if m is not None else {}, SIZING_KEYS, f"{where}.sizing")
    device = parse_bytes(s.pop("device_memory", 0), f"{where}.sizing.device_memory")
    budget = parse_bytes(s.pop("memory_budget", 0), f"{where}.sizing.memory_budget", device,
                         f"{where}.sizing.device_memory")
    share = s.pop("gpu_memory_utilization", None)
    if share is not None:
        if budget or not device or not 0 < share <= 1:
            raise InvalidArgument(f"{where}.sizing.gpu_memory_utilization: needs device_memory, no memory_budget, "
                                  f"and a value in (0, 1], got {share!r}")
        budget = int(device * share)
    if "group_slots" in s:
        s["group_slots"] = tuple(s["group_slots"])
    return Sizing(memory_budget_bytes=budget, **s)


def _pool(entry: Any, where: str, base_dir: Path | None = None) -> PoolConfig:
    e = _check(entry, POOL_KEYS, where)
    if "name" not in e:
        raise InvalidArgument(f"{where}{_line(entry)}: each pool needs a name")
    sizing = _sizing(e.get("sizing"), where)
    mode = e.get("prefix_hash", "")
    if mode and mode not in HASH_MODES:
        raise InvalidArgument(f"{where}: prefix_hash {mode!r}{_line(entry, 'prefix_hash')} is not one of "
                              f"{', '.join(HASH_MODES)}")
    common = dict(prefix_caching=e.get("prefix_caching", False), model=e.get("model", ""), prefix_hash=mode,
                  prefix_hash_seed=e.get("prefix_hash_seed", ""))
    backends = tuple(str(b) for b in e.get("backends", ()))
    if "model_config" in e:
        if "layers" in e:
            raise InvalidArgument(f"{where}: give either layers or model_config, not both")
        path = Path(e["model_config"])
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        try:
            model = load_model_cache(path, e.get("tp", 1), e.get("dtype"), e.get("page_size", 16),
                                     e.get("layout", "per_layer"), e.get("allow_unknown_keys", False))
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}: {exc.message}") from None
        return PoolConfig(str(e["name"]), model.spec, sizing, backends, **common)
    for key in ("tp", "allow_unknown_keys"):
        if key in e:
            raise InvalidArgument(f"{where}: {key!r}{_line(entry, key)} goes with model_config")
    if "layers" not in e:
        raise InvalidArgument(f"{where}{_line(entry)}: pool {e['name']!r} needs layers or model_config")
    layers: list[LayerSpec] = []
    for j, run in enumerate(e["layers"]):
        r = _check(run, LAYER_KEYS, f"{where}.layers[{j}]")
        count = r.pop("count", 1)
        if "dtype" in r:
            r["dtype"] = DTYPES.get(r["dtype"].lower(), r["dtype"])
        missing = [k for k in ("kv_heads", "head_dim") if k not in r]
        if missing:
            raise InvalidArgument(f"{where}.layers[{j}]{_line(run)}: {', '.join(missing)} missing")
        try:
            layers.extend([LayerSpec(**r)] * count)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}.layers[{j}]{_line(run)}: {exc.message}") from None
    if "dtype" in e:
        raise InvalidArgument(f"{where}: 'dtype'{_line(entry, 'dtype')} of a pool goes with model_config; give each "
                              "layer run its dtype")
    return PoolConfig(str(e["name"]), CacheSpec(tuple(layers), e.get("page_size", 16), e.get("layout", "per_layer")),
                      sizing, backends, **common)


def load_pools(text: str, source: str = "<pools>", base_dir: Path | None = None) -> list[PoolConfig]:
    """Parse a pools YAML document; InvalidArgument naming the entry, the key and its line on any mistake."""
    try:
        doc = yaml.load(text, Loader=_Loader) or {}
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{source}: not valid YAML: {exc}") from None
    except InvalidArgument as exc:
        raise InvalidArgument(f"{source}: {exc.message}") from None
    top = _check(doc, {"pools": ("pools", "list")}, source)
    pools = [_pool(e, f"{source}: pools[{i}]", base_dir) for i, e in enumerate(top.get("pools", []))]
    names = [p.name for p in pools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise InvalidArgument(f"{source}: pool name {dup!r} is used twice")
    return pools


def load_pools_file(path: str | Path) -> list[PoolConfig]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise InvalidArgument(f"cannot read pools file {p}: {err.strerror or err}") from None
    return load_pools(text, str(p), p.parent)
