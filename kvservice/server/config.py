"""Pool definitions from YAML (or the embedded default) for `kvservice serve`.

    pools:
      - name: llama3-8b
        page_size: 16
        layout: per_layer            # or interleaved
        layers:                      # runs of identical layers, in order
          - {count: 32, kv_heads: 8, head_dim: 128, dtype: float16}
        sizing: {max_batch: 64, max_seq_len: 8192}   # or num_slots / memory_budget_bytes
        backends: [flashinfer]
        prefix_caching: true         # optional: cache full prompt pages (default false)
        prefix_hash: vllm-sha256-cbor   # optional: page hash mode (default: serve --prefix-hash, else kvservice)
        prefix_hash_seed: "1234"     # optional: vllm-sha256-cbor's NONE_HASH seed (vLLM's PYTHONHASHSEED)
      - name: gemma3-27b
        model_config: models/gemma-3-27b-it/config.json   # layers from the model (model_config.py);
        tp: 4                                              # relative paths: from this file's directory
        dtype: bfloat16                                    # optional: default the model's torch_dtype
        page_size: 16
        sizing: {max_batch: 32, max_seq_len: 8192}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvservice.contract.errors import InvalidArgument
from kvservice.core.geometry import CacheSpec, LayerSpec
from kvservice.core.model_config import load_model_cache
from kvservice.core.planner import Sizing

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


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str
    spec: CacheSpec
    sizing: Sizing
    backends: tuple[str, ...]
    prefix_caching: bool = False
    prefix_hash: str = ""          # "" = the server's --prefix-hash
    prefix_hash_seed: str = ""


def _cache_opts(entry: dict[str, Any], where: str) -> dict[str, Any]:
    from kvservice.core.hashing import HASH_MODES
    mode = str(entry.get("prefix_hash", ""))
    if mode and mode not in HASH_MODES:
        raise InvalidArgument(f"{where}: prefix_hash {mode!r} is not one of {', '.join(HASH_MODES)}")
    return {"prefix_caching": bool(entry.get("prefix_caching", False)), "prefix_hash": mode,
            "prefix_hash_seed": str(entry.get("prefix_hash_seed", ""))}


def _pool(entry: dict[str, Any], where: str, base_dir: Path | None = None) -> PoolConfig:
    if not isinstance(entry, dict) or "name" not in entry:
        raise InvalidArgument(f"{where}: each pool needs at least a name, page_size and layers")
    if "model_config" in entry:
        return _model_pool(entry, where, base_dir)
    layers: list[LayerSpec] = []
    for j, run in enumerate(entry.get("layers") or []):
        run = dict(run)
        count = int(run.pop("count", 1))
        try:
            layers.extend([LayerSpec(**run)] * count)
        except TypeError as exc:
            raise InvalidArgument(f"{where}.layers[{j}]: {exc}") from None
    sizing = entry.get("sizing") or {}
    try:
        return PoolConfig(str(entry["name"]),
                          CacheSpec(tuple(layers), int(entry.get("page_size", 16)),
                                    entry.get("layout", "per_layer")),
                          Sizing(**sizing), tuple(entry.get("backends") or ()), **_cache_opts(entry, where))
    except TypeError as exc:
        raise InvalidArgument(f"{where}: {exc}") from None


def _model_pool(entry: dict[str, Any], where: str, base_dir: Path | None) -> PoolConfig:
    """A pool whose layers come from a Hugging Face config.json (model_config, tp, dtype)."""
    if "layers" in entry:
        raise InvalidArgument(f"{where}: give either layers or model_config, not both")
    path = Path(str(entry["model_config"]))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        model = load_model_cache(path, int(entry.get("tp", 1)), entry.get("dtype"), int(entry.get("page_size", 16)),
                                 entry.get("layout", "per_layer"))
        return PoolConfig(str(entry["name"]), model.spec, Sizing(**(entry.get("sizing") or {})),
                          tuple(entry.get("backends") or ()), **_cache_opts(entry, where))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc.message}") from None


def load_pools(text: str, source: str = "<pools>", base_dir: Path | None = None) -> list[PoolConfig]:
    """Parse a pools YAML document; InvalidArgument naming the entry on any mistake."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("pools", []), list):
        raise InvalidArgument(f"{source}: expected a mapping with a 'pools' list")
    return [_pool(e, f"{source}: pools[{i}]", base_dir) for i, e in enumerate(doc.get("pools", []))]


def load_pools_file(path: str | Path) -> list[PoolConfig]:
    p = Path(path)
    return load_pools(p.read_text(), str(p), p.parent)
