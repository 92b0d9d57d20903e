"""A cache spec from a Hugging Face ``config.json``: layers, KV heads per rank, head sizes, sliding windows.

Read fields (of ``text_config`` when the model nests one, as multimodal Gemma 3 does):

- ``num_hidden_layers``; ``num_key_value_heads`` (absent: ``num_attention_heads``, plain MHA);
  ``head_dim``, else ``hidden_size / num_attention_heads``;
- full-attention overrides of hybrid models: ``global_head_dim``, ``num_global_key_value_heads``;
- which layers slide, in this order of precedence: ``layer_types`` ("full_attention" /
  "sliding_attention" per layer; gpt-oss, newer Gemma and Qwen configs), ``sliding_window_pattern``
  (every p-th layer global: Gemma 3, Cohere 2), the model type's rule where the published config
  states none (``gemma2``: every other layer from layer 0; ``gemma3``/``gemma3_text``: pattern 6),
  ``use_sliding_window`` with ``max_window_layers`` (Qwen 2/3: layers from max_window_layers on),
  else ``sliding_window`` alone means every layer (Mistral 7B v0.1); ``sliding_window`` gives the window;
- the cache dtype: the caller's, else ``torch_dtype`` (or ``dtype``).

Tensor parallelism divides KV heads over ranks (a rank holds ``kv_heads / tp``; with more ranks
than heads, each rank holds one replicated head). Anything else that changes what a layer caches
(multi-head latent attention, layers sharing another layer's cache, K equal to V, chunked or
linear attention) is refused with an error naming the field, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvservice.contract.errors import InvalidArgument
from kvservice.core.geometry import DTYPE_BYTES, CacheSpec, LayerSpec

FULL, SLIDING = "full_attention", "sliding_attention"
_DTYPES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float32": "float32", "fp32": "float32", "float": "float32", "float8_e4m3": "float8_e4m3",
           "fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3", "float8_e4m3fn": "float8_e4m3"}
#: model_type -> sliding pattern where the published config.json states none (HF's defaults for the type).
_TYPE_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}
#: Fields whose (truthy) presence means the layers cache something this planner does not model.
_UNSUPPORTED = {
    "kv_lora_rank": "multi-head latent attention caches one latent vector per token, not K and V per head",
    "num_kv_shared_layers": "layers that reuse another layer's K/V cache hold none of their own",
    "attention_k_eq_v": "K and V are the same tensor, cached once",
    "attention_chunk_size": "chunked local attention is not a sliding window",
}


@dataclass(frozen=True, slots=True)
class ModelCache:
    """What a config.json says about the KV cache, and how it was read.

    spec: the cache spec (one LayerSpec per layer, per tensor-parallel rank).
    layer_types: "full_attention" or "sliding_attention" per layer.
    notes: each inference made (a default taken, a field ignored), for the person reading the plan.
    """

    spec: CacheSpec
    model_type: str
    layer_types: tuple[str, ...]
    tp: int
    notes: tuple[str, ...] = field(default=())


def _int(cfg: dict[str, Any], key: str, where: str, required: bool = True) -> int | None:
    v = cfg.get(key)
    if v is None:
        if required:
            raise InvalidArgument(f"{where}: field {key!r} is missing; it is needed to size the KV cache")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InvalidArgument(f"{where}: field {key!r} must be a positive integer, got {v!r}")
    return v


def _layer_types(cfg: dict[str, Any], n: int, model_type: str, where: str, notes: list[str]) -> list[str]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n:
            raise InvalidArgument(f"{where}: field 'layer_types' must list one type per layer ({n}), got "
                                  f"{len(types) if isinstance(types, list) else type(types).__name__}")
        for i, t in enumerate(types):
            if t not in (FULL, SLIDING):
                raise InvalidArgument(f"{where}: field 'layer_types'[{i}] is {t!r}; only {FULL!r} and {SLIDING!r} "
                                      "layers are understood (no linear, chunked or state-space layers)")
        return list(types)
    pattern = cfg.get("sliding_window_pattern")
    if pattern is None and window and model_type in _TYPE_PATTERN:
        pattern = _TYPE_PATTERN[model_type]
        notes.append(f"model_type {model_type!r} states no layer pattern: layers {pattern}, {2 * pattern}, ... "
                     "(counting from 1) are global, the others slide (the type's rule)")
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise InvalidArgument(f"{where}: field 'sliding_window_pattern' must be a positive integer, got "
                                  f"{pattern!r}")
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
    if "use_sliding_window" in cfg:
        if not cfg["use_sliding_window"] or not window:
            if window:
                notes.append(f"use_sliding_window is false: sliding_window={window} is not used")
            return [FULL] * n
        first = cfg.get("max_window_layers", 0) or 0
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise InvalidArgument(f"{where}: field 'max_window_layers' must be a non-negative integer, got {first!r}")
        return [SLIDING if i >= first else FULL for i in range(n)]
    if window:
        notes.append(f"sliding_window={window} with no layer pattern: every layer slides")
        return [SLIDING] * n
    return [FULL] * n


def _per_rank(heads: int, tp: int, what: str, where: str, notes: list[str]) -> int:
    if heads % tp == 0:
        return heads // tp
    if tp % heads == 0:
        notes.append(f"{what}={heads} < tp={tp}: each rank holds 1 replicated KV head")
        return 1
    raise InvalidArgument(f"{where}: {what}={heads} cannot be split over tp={tp} ranks (neither divides the "
                          "other); choose a tp that divides it or that it divides")


def model_cache(cfg: dict[str, Any], tp: int = 1, dtype: str | None = None, page_size: int = 16,
                layout: str = "per_layer", source: str = "config.json") -> ModelCache:
    """Read a parsed config.json; InvalidArgument naming the field it cannot interpret."""
    if not isinstance(cfg, dict):
        raise InvalidArgument(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise InvalidArgument(f"tp must be a positive integer, got {tp!r}")
    top = cfg
    where = source
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**{k: v for k, v in top.items() if k in ("torch_dtype", "dtype")}, **cfg["text_config"]}
        where = f"{source}: text_config"
    model_type = str(cfg.get("model_type") or top.get("model_type") or "")
    notes: list[str] = []
    for key, why in _UNSUPPORTED.items():
        if cfg.get(key):
            raise InvalidArgument(f"{where}: field {key!r}={cfg[key]!r} is not supported: {why}")
    n = _int(cfg, "num_hidden_layers", where)
    heads = _int(cfg, "num_attention_heads", where, required=False)
    kv = _int(cfg, "num_key_value_heads", where, required=False)
    if kv is None:
        if heads is None:
            raise InvalidArgument(f"{where}: neither 'num_key_value_heads' nor 'num_attention_heads' is given")
        kv = heads
        notes.append(f"num_key_value_heads missing: {kv} (= num_attention_heads, multi-head attention)")
    head_dim = _int(cfg, "head_dim", where, required=False)
    if head_dim is None:
        hidden = _int(cfg, "hidden_size", where, required=False)
        if hidden is None or heads is None:
            raise InvalidArgument(f"{where}: field 'head_dim' is missing and cannot be derived (needs 'hidden_size' "
                                  "and 'num_attention_heads')")
        if hidden % heads:
            raise InvalidArgument(f"{where}: head_dim is missing and hidden_size={hidden} is not a multiple of "
                                  f"num_attention_heads={heads}")
        head_dim = hidden // heads
        notes.append(f"head_dim missing: {head_dim} (= hidden_size {hidden} / num_attention_heads {heads})")
    global_dim = _int(cfg, "global_head_dim", where, required=False) or head_dim
    global_kv = _int(cfg, "num_global_key_value_heads", where, required=False) or kv
    types = _layer_types(cfg, n, model_type, where, notes)  # type: ignore[arg-type]
    window = 0
    if SLIDING in types:
        window = _int(cfg, "sliding_window", where) or 0
    name = dtype or cfg.get("torch_dtype") or cfg.get("dtype")
    if name is None:
        raise InvalidArgument(f"{where}: field 'torch_dtype' is missing; give the cache dtype (--dtype)")
    cache_dtype = _DTYPES.get(str(name).lower())
    if cache_dtype is None:
        raise InvalidArgument(f"{where if dtype is None else 'dtype'}: {name!r} is not a cache dtype; use one of "
                              f"{', '.join(DTYPE_BYTES)}")
    if dtype is None:
        notes.append(f"cache dtype {cache_dtype} (the model's torch_dtype)")
    kv_rank = _per_rank(kv, tp, "num_key_value_heads", where, notes)
    gkv_rank = kv_rank if global_kv == kv else _per_rank(global_kv, tp, "num_global_key_value_heads", where, notes)
    layers = tuple(LayerSpec(kv_rank, head_dim, cache_dtype, window) if t == SLIDING
                   else LayerSpec(gkv_rank, global_dim, cache_dtype, 0) for t in types)
    return ModelCache(CacheSpec(layers, page_size, layout), model_type, tuple(types), tp, tuple(notes))


def load_model_cache(path: str | Path, tp: int = 1, dtype: str | None = None, page_size: int = 16,
                     layout: str = "per_layer") -> ModelCache:
    """model_cache() of a config.json file (a directory: its config.json)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text()
    except OSError as err:
        raise InvalidArgument(f"cannot read model config {p}: {err.strerror or err}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidArgument(f"{p}: not valid JSON ({err})") from None
    return model_cache(cfg, tp, dtype, page_size, layout, str(p))


__all__ = ["ModelCache", "load_model_cache", "model_cache"]
