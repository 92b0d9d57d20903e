"""Which kind each layer of a Hugging Face config is, from the layer pattern the config states.

The patterns, their precedence and the rules where a config states none are listed in the docstring of
kvservice/core/model_config.py, which reads the rest of the config. Two patterns that disagree are refused,
naming both fields.
"""

from __future__ import annotations

from typing import Any

from kvservice.contract.errors import InvalidArgument

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
LINEAR, MAMBA, HYBRID, MLP, MOE = "linear_attention", "mamba", "hybrid", "mlp", "moe"
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED, HYBRID)        # kinds whose layer pages K/V
STATE_KINDS = (LINEAR, MAMBA, HYBRID)                     # kinds whose layer keeps a per-sequence state
_LEGACY = {"attention": FULL}                             # older spellings of layer_types entries
_PATTERN = {"M": MAMBA, "*": FULL, "-": MLP, "E": MOE}    # hybrid_override_pattern characters
#: model_type -> sliding pattern where the published config.json states none (HF's defaults for the type).
_TYPE_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


def _int(cfg: dict[str, Any], key: str, where: str, required: bool = True, minimum: int = 1) -> int | None:
    v = cfg.get(key)
    if v is None:
        if required:
            raise InvalidArgument(f"{where}: field {key!r} is missing; it is needed to size the KV cache")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InvalidArgument(f"{where}: field {key!r} must be {what}, got {v!r}")
    return v


def _int_list(cfg: dict[str, Any], key: str, where: str) -> list[int]:
    v = cfg[key]
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise InvalidArgument(f"{where}: field {key!r} must be a list of integers, got {v!r}")
    return v


def layer_kinds(cfg: dict[str, Any], where: str = "config.json", notes: list[str] | None = None) -> list[str]:
    """The kind of every layer of a (text) config, from the first layer pattern it states (module docstring).

    InvalidArgument naming the field when a pattern is malformed or two patterns disagree.
    """
    notes = [] if notes is None else notes
    pat = cfg.get("hybrid_override_pattern")
    n = _int(cfg, "num_hidden_layers", where, required=not isinstance(pat, str)) or len(pat)
    model_type = str(cfg.get("model_type") or "")
    found: list[tuple[str, list[str]]] = []          # (field, kinds) of every pattern the config states
    for reader in _PATTERN_READERS:
        found.extend(reader(cfg, n, where, notes))
    if model_type == "falcon_h1":
        found.append(("model_type", [HYBRID] * n))
    if not found:
        return _sliding_kinds(cfg, n, model_type, where, notes)
    key, kinds = found[0]
    for other, theirs in found[1:]:
        if theirs != kinds:
            i = next(j for j, (a, b) in enumerate(zip(kinds, theirs, strict=True)) if a != b)
            raise InvalidArgument(f"{where}: fields {key!r} and {other!r} disagree on layer {i} ({kinds[i]} vs "
                                  f"{theirs[i]}); fix the config so that they agree")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) and SLIDING not in kinds:
        raise InvalidArgument(f"{where}: field 'sliding_window'={cfg['sliding_window']} is set but {key!r} "
                              "names no sliding layer; which layers slide cannot be told")
    return kinds


_Found = list[tuple[str, list[str]]]


def _from_type_lists(cfg: dict[str, Any], n: int, where: str, notes: list[str]) -> _Found:
    """`layer_types` / `layers_block_type`: one kind per layer."""
    found = []
    for key in ("layer_types", "layers_block_type"):
        if cfg.get(key) is None:
            continue
        types = cfg[key]
        if not isinstance(types, list) or len(types) != n:
            raise InvalidArgument(f"{where}: field {key!r} must list one type per layer ({n}), got "
                                  f"{len(types) if isinstance(types, list) else type(types).__name__}")
        kinds = []
        for i, t in enumerate(types):
            k = _LEGACY.get(t, t)
            if k not in (FULL, SLIDING, CHUNKED, LINEAR, MAMBA, HYBRID, MLP, MOE):
                raise InvalidArgument(f"{where}: field {key!r}[{i}] is {t!r}, a layer kind this planner does "
                                      f"not know; known: {FULL}, {SLIDING}, {CHUNKED}, {LINEAR}, {MAMBA}, "
                                      f"attention, {HYBRID}, {MLP}, {MOE}")
            kinds.append(k)
        found.append((key, kinds))
    return found


def _from_override_pattern(cfg: dict[str, Any], n: int, where: str, notes: list[str]) -> _Found:
    """`hybrid_override_pattern` (Nemotron-H): one character per layer."""
    pat = cfg.get("hybrid_override_pattern")
    if pat is None:
        return []
    if not isinstance(pat, str) or len(pat) != n:
        raise InvalidArgument(f"{where}: field 'hybrid_override_pattern' must be a string of one character per "
                              f"layer ({n}), got {pat!r}")
    bad = [c for c in pat if c not in _PATTERN]
    if bad:
        raise InvalidArgument(f"{where}: field 'hybrid_override_pattern' has {bad[0]!r}; known: M (Mamba), "
                              "* (attention), - (MLP), E (MoE)")
    return [("hybrid_override_pattern", [_PATTERN[c] for c in pat])]


def _from_periods(cfg: dict[str, Any], n: int, where: str, notes: list[str]) -> _Found:
    """`full_attention_interval` (Qwen3-Next), `attn_layer_period/offset` (Jamba), `attn_layer_indices`."""
    found = []
    if cfg.get("full_attention_interval") is not None:
        k = _int(cfg, "full_attention_interval", where)
        found.append(("full_attention_interval", [FULL if (i + 1) % k == 0 else LINEAR for i in range(n)]))
    if cfg.get("attn_layer_period") is not None or cfg.get("attn_layer_offset") is not None:
        period = _int(cfg, "attn_layer_period", where)
        offset = _int(cfg, "attn_layer_offset", where, minimum=0)
        if offset >= period:
            raise InvalidArgument(f"{where}: field 'attn_layer_offset'={offset} must be below "
                                  f"attn_layer_period={period}")
        found.append(("attn_layer_period", [FULL if i % period == offset else MAMBA for i in range(n)]))
    if cfg.get("attn_layer_indices") is not None:
        idx = _int_list(cfg, "attn_layer_indices", where)
        if any(not 0 <= i < n for i in idx):
            raise InvalidArgument(f"{where}: field 'attn_layer_indices' names a layer outside 0..{n - 1}: {idx}")
        found.append(("attn_layer_indices", [FULL if i in idx else MAMBA for i in range(n)]))
    return found


def _from_chunking(cfg: dict[str, Any], n: int, where: str, notes: list[str]) -> _Found:
    """`attention_chunk_size` with `no_rope_layers` (Llama 4): chunked layers, NoPE layers full."""
    if not cfg.get("attention_chunk_size"):
        return []
    chunk = _int(cfg, "attention_chunk_size", where)
    rope = cfg.get("no_rope_layers") or []
    if rope:
        rope = _int_list(cfg, "no_rope_layers", where)
        if len(rope) != n:
            raise InvalidArgument(f"{where}: field 'no_rope_layers' must list one flag per layer ({n}), got "
                                  f"{len(rope)}")
    else:        # transformers' rule: every no_rope_layer_interval-th layer has no RoPE (and full attention)
        interval = _int(cfg, "no_rope_layer_interval", where, required=False) or 4
        rope = [int((i + 1) % interval != 0) for i in range(n)]
        notes.append(f"no_rope_layers not given: every {interval}th layer is NoPE (full attention), the others "
                     f"chunked (transformers' rule)")
    notes.append(f"attention_chunk_size={chunk}")
    return [("attention_chunk_size", [CHUNKED if r else FULL for r in rope])]


#: The layer patterns a config can state, in order of precedence (the first found is the answer; the rest
#: must agree with it).
_PATTERN_READERS = (_from_type_lists, _from_override_pattern, _from_periods, _from_chunking)


def _sliding_kinds(cfg: dict[str, Any], n: int, model_type: str, where: str, notes: list[str]) -> list[str]:
    """Layer kinds of an attention-only model from its sliding-window fields."""
    window = cfg.get("sliding_window")
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
