"""Pool definitions from YAML (or the embedded default) for `kvservice serve`.

    pools:
      - name: llama3-8b
        page_size: 16
        layout: per_layer            # or interleaved
        layers:                      # runs of identical layers, in order
          - {count: 32, kv_heads: 8, head_dim: 128, dtype: float16}
        sizing: {max_batch: 64, max_seq_len: 8192}   # or num_slots / memory_budget_bytes
        backends: [flashinfer]
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import InvalidArgument
from .geometry import CacheSpec, LayerSpec
from .planner import Sizing

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


def _pool(entry: dict[str, Any], where: str) -> PoolConfig:
    if not isinstance(entry, dict) or "name" not in entry:
        raise InvalidArgument(f"{where}: each pool needs at least a name, page_size and layers")
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
                          Sizing(**sizing), tuple(entry.get("backends") or ()))
    except TypeError as exc:
        raise InvalidArgument(f"{where}: {exc}") from None


def load_pools(text: str, source: str = "<pools>") -> list[PoolConfig]:
    """Parse a pools YAML document; InvalidArgument naming the entry on any mistake."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("pools", []), list):
        raise InvalidArgument(f"{source}: expected a mapping with a 'pools' list")
    return [_pool(e, f"{source}: pools[{i}]") for i, e in enumerate(doc.get("pools", []))]


def load_pools_file(path: str | Path) -> list[PoolConfig]:
    p = Path(path)
    return load_pools(p.read_text(), str(p))
