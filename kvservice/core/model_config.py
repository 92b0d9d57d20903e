"""A cache spec from a Hugging Face ``config.json``: which layers page K/V, their heads, head sizes and windows,
and what the layers without paged KV keep per sequence. Never guessed: every field is understood, known not
to matter (`model_keys`), or the config is refused naming it.

The language model's fields are read from ``text_config`` when the model nests one (multimodal Gemma 3,
Llama 4); the dtype may stand at the top level.

**Layer kinds** (transformers' names), from the first of these a config states:

- ``layer_types`` (or ``layers_block_type``): one of full_attention, sliding_attention, chunked_attention,
  linear_attention (Qwen3-Next's gated DeltaNet; Mamba in transformers' newer names), mamba / attention
  (older names of Granite 4 and Jamba), mlp, moe (blocks with no mixer: nothing cached), hybrid (Falcon-H1:
  attention and Mamba side by side in every layer);
- ``hybrid_override_pattern`` (Nemotron-H): ``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE per layer;
- ``full_attention_interval`` k (Qwen3-Next): layers k-1, 2k-1, ... full attention, the others linear;
- ``attn_layer_period`` p / ``attn_layer_offset`` o (Jamba): layer i is attention iff i % p == o, else Mamba;
- ``attn_layer_indices`` (Bamba): those layers attention, the others Mamba;
- model type ``falcon_h1``: every layer hybrid;
- ``attention_chunk_size`` with ``no_rope_layers`` (Llama 4): layers with RoPE use chunked attention;
- otherwise the sliding rules: ``sliding_window_pattern`` (every p-th layer global), the model type's rule
  where the published config states none (gemma2: every other layer; gemma3: pattern 6),
  ``use_sliding_window`` with ``max_window_layers`` (Qwen 2/3), else ``sliding_window`` alone means every
  layer (Mistral 7B v0.1). Two of these that disagree are refused, naming both.

**What a layer caches.** Attention layers page K and V: ``num_key_value_heads`` heads (absent:
``num_attention_heads``) of ``head_dim`` (else ``attention_head_dim``, else hidden_size / heads), with
``global_head_dim`` / ``num_global_key_value_heads`` for full layers of a sliding hybrid. Multi-head latent
attention (``kv_lora_rank``: DeepSeek-V2/V3, Kimi-K2) pages one latent vector per token: a K-only layer of
one head of ``kv_lora_rank + qk_rope_head_dim`` values, the same on every tensor-parallel rank. Chunked
attention is refused (`attention_chunk_size`): its pages leave at chunk boundaries, which no layer group
here models. Linear-attention and Mamba layers page nothing: each keeps a fixed state per sequence
(`StateLayer`), reported, never counted as attention (the engine manages it; docs/ARCHITECTURE.md says why).

**Cache dtype**: the caller's (``auto`` = the model's), else a KV-cache quantization the config states
(``quantization_config.kv_cache_scheme`` or ``kv_cache_quant_algo``: FP8), else ``torch_dtype`` / ``dtype``.
Weight-only quantization leaves the cache in the model's dtype.

**Tensor parallelism** divides K/V heads over ranks (with more ranks than heads each holds one replicated
head) and state-layer heads likewise; MLA latents are replicated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import DTYPE_BYTES, CacheSpec, LayerSpec
from kvservice.core.layer_kinds import (
    ATTENTION_KINDS,
    CHUNKED,
    HYBRID,
    LINEAR,
    MAMBA,
    SLIDING,
    STATE_KINDS,
    _int,
    layer_kinds,
)
from kvservice.core.model_keys import IRRELEVANT, REFUSED, TOP_LEVEL_IRRELEVANT, UNDERSTOOD

#: Cache dtypes by the names configs and vLLM's --kv-cache-dtype use.
DTYPES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float32": "float32", "fp32": "float32", "float": "float32", "float8_e4m3": "float8_e4m3",
          "fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3", "float8_e4m3fn": "float8_e4m3",
          "float8_e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True, slots=True)
class StateLayer:
    """A layer that pages no K/V but keeps a fixed-size state per sequence (per tensor-parallel rank).

    kind: "linear_attention" (gated DeltaNet) or "mamba" (Mamba 1 or 2); layer: its index in the model.
    conv_elems, ssm_elems: elements of the convolution state and of the recurrent (SSM) state.
    bytes: (conv_elems + ssm_elems) * bytes of the state dtype.
    """

    layer: int
    kind: str
    conv_elems: int
    ssm_elems: int
    dtype: str
    bytes: int


@dataclass(frozen=True, slots=True)
class ModelCache:
    """What a config.json says about the KV cache, and how it was read.

    spec: the cache spec of the layers that page K/V (one LayerSpec each, per tensor-parallel rank).
    layer_types: the kind of every layer of the model (module docstring), paged or not.
    paged_layers: the model layer of each spec layer (spec layer i is model layer paged_layers[i]).
    state_layers: the layers that keep a per-sequence state instead (Mamba, linear attention).
    unknown_keys: fields neither understood nor known to be irrelevant, accepted by allow_unknown_keys.
    notes: each inference made (a default taken, a field ignored), for the person reading the plan.
    """

    spec: CacheSpec
    model_type: str
    layer_types: tuple[str, ...]
    tp: int
    notes: tuple[str, ...] = field(default=())
    paged_layers: tuple[int, ...] = field(default=())
    state_layers: tuple[StateLayer, ...] = field(default=())
    unknown_keys: tuple[str, ...] = field(default=())

    @property
    def state_bytes_per_seq(self) -> int:
        """Bytes of every state layer's state for one sequence (per rank): what the engine keeps, not paged."""
        return sum(s.bytes for s in self.state_layers)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in the paged layers (per rank), before any window releases pages."""
        return sum(la.page_bytes(1) for la in self.spec.layers)

    def summary(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "tp": self.tp, "layer_types": list(self.layer_types),
                "paged_layers": list(self.paged_layers), "kv_bytes_per_token": self.kv_bytes_per_token,
                "state_layers": len(self.state_layers), "state_bytes_per_seq": self.state_bytes_per_seq,
                "state": "not paged: managed by the engine" if self.state_layers else "",
                "unknown_keys": list(self.unknown_keys), "notes": list(self.notes)}


# ---- reading fields ------------------------------------------------------------------------------
def _check_keys(cfg: dict[str, Any], allowed: frozenset[str], where: str, prefix: str) -> list[str]:
    """Unknown fields (with their path) of one level of the config."""
    return [f"{prefix}{k}" for k in cfg if k not in UNDERSTOOD and k not in allowed]


# ---- state layers ----------------------------------------------------------------------------------
def _per_rank(heads: int, tp: int, what: str, where: str, notes: list[str]) -> int:
    if heads % tp == 0:
        return heads // tp
    if tp % heads == 0:
        notes.append(f"{what}={heads} < tp={tp}: each rank holds 1 replicated head")
        return 1
    raise InvalidArgument(f"{where}: {what}={heads} cannot be split over tp={tp} ranks (neither divides the "
                          "other); choose a tp that divides it or that it divides")


def _state(cfg: dict[str, Any], kind: str, tp: int, where: str, notes: list[str]) -> tuple[int, int, str]:
    """(conv_elems, ssm_elems, which) of one state layer per rank.

    gated DeltaNet (linear_num_*): conv (K - 1) x (2 Hk dk + Hv dv), recurrent Hv x dk x dv;
    Mamba 2 (heads x head dim x d_state): conv (d_conv - 1) x (heads x head_dim + 2 groups x d_state),
    SSM heads x head_dim x d_state; Mamba 1 (Jamba): d_inner = mamba_expand x hidden_size,
    conv (d_conv - 1) x d_inner, SSM d_inner x d_state.
    """
    if kind == LINEAR and "linear_num_value_heads" in cfg:
        hk = _per_rank(_int(cfg, "linear_num_key_heads", where), tp, "linear_num_key_heads", where, notes)
        hv = _per_rank(_int(cfg, "linear_num_value_heads", where), tp, "linear_num_value_heads", where, notes)
        dk, dv = _int(cfg, "linear_key_head_dim", where), _int(cfg, "linear_value_head_dim", where)
        k = _int(cfg, "linear_conv_kernel_dim", where)
        return (k - 1) * (2 * hk * dk + hv * dv), hv * dk * dv, "gated DeltaNet"
    heads_key = next((k for k in ("mamba_n_heads", "mamba_num_heads") if k in cfg), None)
    if heads_key is not None:                                     # Mamba 2
        heads = _int(cfg, heads_key, where)
        dim_key = "mamba_d_head" if "mamba_d_head" in cfg else "mamba_head_dim"
        head_dim = cfg.get(dim_key)
        if head_dim == "auto":           # transformers' rule for Granite 4 / Bamba
            head_dim = _int(cfg, "mamba_expand", where) * _int(cfg, "hidden_size", where) // heads
            notes.append(f"{dim_key}='auto': {head_dim} (mamba_expand x hidden_size / {heads_key})")
        elif head_dim is None:
            head_dim = _int(cfg, "mamba_d_ssm", where) // heads
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise InvalidArgument(f"{where}: field {dim_key!r} must be a positive integer or 'auto', got {head_dim!r}")
        if "mamba_d_ssm" in cfg and _int(cfg, "mamba_d_ssm", where) != heads * head_dim:
            raise InvalidArgument(f"{where}: field 'mamba_d_ssm'={cfg['mamba_d_ssm']} is not {heads_key} x "
                                  f"{dim_key} = {heads * head_dim}")
        d_state = _int(cfg, "mamba_d_state" if "mamba_d_state" in cfg else "ssm_state_size", where)
        groups = _int(cfg, "mamba_n_groups" if "mamba_n_groups" in cfg else "n_groups", where, required=False) or 1
        d_conv = _int(cfg, "mamba_d_conv" if "mamba_d_conv" in cfg else "conv_kernel", where)
        h = _per_rank(heads, tp, heads_key, where, notes)
        g = groups // tp if groups % tp == 0 else groups
        if groups % tp:
            notes.append(f"Mamba groups={groups} do not split over tp={tp}: each rank keeps all of them")
        return (d_conv - 1) * (h * head_dim + 2 * g * d_state), h * head_dim * d_state, "Mamba 2"
    if "mamba_d_state" in cfg:                                    # Mamba 1 (Jamba)
        inner = _int(cfg, "mamba_expand", where) * _int(cfg, "hidden_size", where)
        if inner % tp:
            raise InvalidArgument(f"{where}: Mamba d_inner={inner} cannot be split over tp={tp} ranks")
        inner //= tp
        return (_int(cfg, "mamba_d_conv", where) - 1) * inner, inner * _int(cfg, "mamba_d_state", where), "Mamba 1"
    raise InvalidArgument(f"{where}: {kind} layers but no field gives their state size (linear_num_value_heads, "
                          "mamba_n_heads / mamba_num_heads or mamba_d_state); refusing to guess it")


# ---- the reader --------------------------------------------------------------------------------------
def _cache_dtype(cfg: dict[str, Any], top: dict[str, Any], dtype: str | None, where: str,
                 notes: list[str]) -> tuple[str, str]:
    """(cache dtype, model dtype) from the caller's choice, the config's KV quantization or its dtype."""
    model = cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype") or top.get("dtype")
    model_dtype = DTYPES.get(str(model).lower(), "") if model is not None else ""
    quant = cfg.get("quantization_config") or top.get("quantization_config")
    kv_quant = None
    if quant is not None:
        if not isinstance(quant, dict):
            raise InvalidArgument(f"{where}: field 'quantization_config' must be an object, got {quant!r}")
        scheme = quant.get("kv_cache_scheme")
        algo = quant.get("kv_cache_quant_algo")
        if scheme:
            if not (isinstance(scheme, dict) and scheme.get("num_bits") == 8 and scheme.get("type") == "float"):
                raise InvalidArgument(f"{where}: field 'quantization_config.kv_cache_scheme'={scheme!r} is not an "
                                      "8-bit float scheme; no other KV quantization is planned")
            kv_quant = "float8_e4m3"
        elif algo:
            if str(algo).upper() != "FP8":
                raise InvalidArgument(f"{where}: field 'quantization_config.kv_cache_quant_algo'={algo!r} is not "
                                      "FP8; no other KV quantization is planned")
            kv_quant = "float8_e4m3"
        elif dtype in (None, "auto"):
            notes.append(f"quantization_config (quant_method {quant.get('quant_method')!r}) quantizes weights only: "
                         "the KV cache keeps the model's dtype")
    if dtype not in (None, "auto"):
        cache = DTYPES.get(str(dtype).lower())
        if cache is None:
            raise InvalidArgument(f"kv cache dtype {dtype!r} is not a cache dtype; use auto, "
                                  f"{', '.join(sorted(DTYPES))}")
        return cache, model_dtype
    if kv_quant is not None:
        notes.append(f"cache dtype {kv_quant} (the config's KV-cache quantization)")
        return kv_quant, model_dtype
    if model is None:
        raise InvalidArgument(f"{where}: field 'torch_dtype' is missing; give the cache dtype (--kv-cache-dtype / "
                              "--dtype)")
    if not model_dtype or model_dtype not in DTYPE_BYTES:
        raise InvalidArgument(f"{where}: torch_dtype {model!r} is not a cache dtype; give one with --kv-cache-dtype "
                              f"({', '.join(DTYPE_BYTES)})")
    notes.append(f"cache dtype {model_dtype} (the model's torch_dtype)")
    return model_dtype, model_dtype


def model_cache(cfg: dict[str, Any], tp: int = 1, dtype: str | None = None, page_size: int = 16,
                layout: str = "per_layer", source: str = "config.json",
                allow_unknown_keys: bool = False) -> ModelCache:
    """Read a parsed config.json; InvalidArgument naming the field it cannot interpret.

    dtype: the cache dtype (None or "auto": the config's); allow_unknown_keys: plan a config with fields
    this reader does not know (each is listed in the result's unknown_keys and notes) instead of refusing it.
    """
    if not isinstance(cfg, dict):
        raise InvalidArgument(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise InvalidArgument(f"tp must be a positive integer, got {tp!r}")
    notes: list[str] = []
    top, cfg, where, unknown = _text_config(cfg, source, allow_unknown_keys, notes)
    model_type = str(cfg.get("model_type") or top.get("model_type") or "")
    for key, why in REFUSED.items():
        if cfg.get(key):
            raise InvalidArgument(f"{where}: field {key!r}={cfg[key]!r} is not supported: {why}")
    kinds = layer_kinds(cfg, where, notes)
    if CHUNKED in kinds:
        chunked = [i for i, k in enumerate(kinds) if k == CHUNKED]
        raise InvalidArgument(
            f"{where}: field 'attention_chunk_size'={cfg['attention_chunk_size']} makes {len(chunked)} of "
            f"{len(kinds)} layers chunked local attention (a token attends only its own chunk), which is not "
            "supported: its pages leave at chunk boundaries, which neither a full nor a sliding-window group "
            "models, and planning them as full attention would be a guess")
    cache_dtype, model_dtype = _cache_dtype(cfg, top, dtype, where, notes)
    paged = [i for i, k in enumerate(kinds) if k in ATTENTION_KINDS]
    layers: list[LayerSpec] = []
    if paged:
        layers = _attention_layers(cfg, [kinds[i] for i in paged], tp, cache_dtype, where, notes)
    states = _state_layers(cfg, kinds, tp, model_dtype or cache_dtype, where, notes)
    if not layers:
        raise InvalidArgument(f"{where}: no layer pages K/V (every layer is {', '.join(sorted(set(kinds)))}); there "
                              "is nothing to plan")
    if cfg.get("num_nextn_predict_layers"):
        notes.append(f"num_nextn_predict_layers={cfg['num_nextn_predict_layers']}: the multi-token-prediction "
                     "layer's cache (speculative decoding only) is not planned")
    return ModelCache(CacheSpec(tuple(layers), page_size, layout), model_type, tuple(kinds), tp, tuple(notes),
                      tuple(paged), tuple(states), tuple(unknown))


def _text_config(cfg: dict[str, Any], source: str, allow_unknown_keys: bool,
                 notes: list[str]) -> tuple[dict[str, Any], dict[str, Any], str, list[str]]:
    """(top-level config, the config that describes the layers (text_config when there is one), where it is,
    the unknown keys); unknown keys refused unless allowed (then noted)."""
    top, where = cfg, source
    unknown: list[str] = []
    if cfg.get("text_config") is not None:
        if not isinstance(cfg["text_config"], dict):
            raise InvalidArgument(f"{source}: field 'text_config' must be an object")
        unknown += _check_keys(top, TOP_LEVEL_IRRELEVANT, source, "")
        cfg = cfg["text_config"]
        where = f"{source}: text_config"
        unknown += _check_keys(cfg, IRRELEVANT, where, "text_config.")
    else:
        unknown += _check_keys(cfg, IRRELEVANT, where, "")
    if unknown:
        if not allow_unknown_keys:
            shown = ", ".join(repr(k) for k in unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8
                                                                 else "")
            raise InvalidArgument(
                f"{source}: unknown field{'s' if len(unknown) > 1 else ''} {shown}: a field this planner does not "
                "know may change which layers cache what, so it refuses to guess; check what it does, then pass "
                "--allow-unknown-keys (pools.yaml: allow_unknown_keys: true) to plan anyway")
        notes.append(f"unknown fields accepted (--allow-unknown-keys), not read: {', '.join(unknown)}")
    return top, cfg, where, unknown


def _state_layers(cfg: dict[str, Any], kinds: list[str], tp: int, state_dtype: str, where: str,
                  notes: list[str]) -> list[StateLayer]:
    """The layers that keep a recurrent state instead of paged K/V (Mamba, gated DeltaNet), with their bytes
    per sequence; state_dtype: the model's dtype unless mamba_ssm_cache_dtype names another."""
    if cfg.get("mamba_ssm_cache_dtype") not in (None, "auto"):
        state_dtype = DTYPES.get(str(cfg["mamba_ssm_cache_dtype"]).lower(), "")
        if not state_dtype:
            raise InvalidArgument(f"{where}: field 'mamba_ssm_cache_dtype'={cfg['mamba_ssm_cache_dtype']!r} is not "
                                  "a dtype")
    states: list[StateLayer] = []
    which = ""
    per_kind: dict[str, tuple[int, int, str]] = {}      # each kind's state read (and its notes made) once
    for i, k in enumerate(kinds):
        if k in STATE_KINDS:
            kind = MAMBA if k == HYBRID else k
            if kind not in per_kind:
                per_kind[kind] = _state(cfg, kind, tp, where, notes)
            conv, ssm, which = per_kind[kind]
            states.append(StateLayer(i, LINEAR if which == "gated DeltaNet" else MAMBA, conv, ssm, state_dtype,
                                     (conv + ssm) * DTYPE_BYTES.get(state_dtype, 2)))
    if states:
        notes.append(f"{len(states)} {which} layer(s) page no K/V: state {sum(s.bytes for s in states):,} bytes per "
                     f"sequence ({state_dtype}), not paged: managed by the engine")
    return states


def _attention_layers(cfg: dict[str, Any], kinds: list[str], tp: int, dtype: str, where: str,
                      notes: list[str]) -> list[LayerSpec]:
    """One LayerSpec per paged layer of the given kinds (full, sliding or hybrid)."""
    window = _int(cfg, "sliding_window", where) if SLIDING in kinds else 0
    if SLIDING in kinds and cfg.get("sliding_window_size") not in (None, window):
        raise InvalidArgument(f"{where}: fields 'sliding_window'={window} and 'sliding_window_size'="
                              f"{cfg['sliding_window_size']} disagree")
    if cfg.get("kv_lora_rank"):                                   # multi-head latent attention
        rank = _int(cfg, "kv_lora_rank", where)
        rope = _int(cfg, "qk_rope_head_dim", where)
        notes.append(f"multi-head latent attention: each layer pages one latent of kv_lora_rank {rank} + "
                     f"qk_rope_head_dim {rope} = {rank + rope} values per token (K only, one head, the same on "
                     f"every rank); num_key_value_heads is not cached")
        return [LayerSpec(1, rank + rope, dtype, window if k == SLIDING else 0, k_only=True) for k in kinds]
    heads = _int(cfg, "num_attention_heads", where, required=False)
    kv = _int(cfg, "num_key_value_heads", where, required=False)
    if kv is None:
        if heads is None:
            raise InvalidArgument(f"{where}: neither 'num_key_value_heads' nor 'num_attention_heads' is given")
        kv = heads
        notes.append(f"num_key_value_heads missing: {kv} (= num_attention_heads, multi-head attention)")
    head_dim = _int(cfg, "head_dim", where, required=False)
    alt = _int(cfg, "attention_head_dim", where, required=False)
    if head_dim is not None and alt is not None and alt != head_dim:
        raise InvalidArgument(f"{where}: fields 'head_dim'={head_dim} and 'attention_head_dim'={alt} disagree")
    head_dim = head_dim or alt
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
    if global_kv != kv:       # transformers (Gemma 4) applies it only with attention_k_eq_v, which is refused
        raise InvalidArgument(f"{where}: field 'num_global_key_value_heads'={global_kv} differs from "
                              f"num_key_value_heads={kv} without attention_k_eq_v; whether the full layers use it "
                              "cannot be told (transformers applies it only together with attention_k_eq_v)")
    kv_rank = _per_rank(kv, tp, "num_key_value_heads", where, notes)
    gkv_rank = kv_rank if global_kv == kv else _per_rank(global_kv, tp, "num_global_key_value_heads", where, notes)
    return [LayerSpec(kv_rank, head_dim, dtype, window) if k == SLIDING else LayerSpec(gkv_rank, global_dim, dtype, 0)
            for k in kinds]


def load_model_cache(path: str | Path, tp: int = 1, dtype: str | None = None, page_size: int = 16,
                     layout: str = "per_layer", allow_unknown_keys: bool = False) -> ModelCache:
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
    return model_cache(cfg, tp, dtype, page_size, layout, str(p), allow_unknown_keys)


__all__ = ["ModelCache", "StateLayer", "layer_kinds", "load_model_cache", "model_cache"]
