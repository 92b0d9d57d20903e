"""Kernel backend constraints on the page size (seed 003), checked when a pool is planned."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvservice.contract.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True, slots=True)
class BackendRule:
    """A page-size rule one kernel backend imposes (and, for our own kernels, a per-layer rule)."""

    name: str                        # canonical id used in configs, e.g. "flash-attn2"
    display: str                     # how people call it, used in messages
    rule: str                        # the rule in words, e.g. "page_size % 256 == 0"
    accepts: Callable[[int], bool]   # page_size -> ok
    layer_rule: str = ""             # per-layer rule in words; "" = none
    accepts_layer: Callable[[int, str], bool] | None = None   # (head_dim, dtype) -> ok


NATIVE_HEAD_DIMS = (32, 64, 128, 256, 512)
NATIVE_DTYPES = ("float16", "bfloat16", "float32")


BACKENDS: dict[str, BackendRule] = {r.name: r for r in (
    BackendRule("native", "kvservice native kernels", "any page size", lambda ps: ps > 0,
                "head_dim in 32/64/128/256/512 and a float16, bfloat16 or float32 cache",
                lambda hd, dt: hd in NATIVE_HEAD_DIMS and dt in NATIVE_DTYPES),
    BackendRule("flashinfer", "FlashInfer", "any page size", lambda ps: ps > 0),
    BackendRule("flash-attn2", "flash-attn 2", "page_size % 256 == 0", lambda ps: ps % 256 == 0),
    BackendRule("vllm-flash-attn", "vLLM's flash-attn fork", "page_size % 16 == 0", lambda ps: ps % 16 == 0),
    BackendRule("candle-flash-attn", "candle flash-attn", "page_size % 32 == 0", lambda ps: ps % 32 == 0),
    BackendRule("trtllm", "TensorRT-LLM", "page_size a power of two", lambda ps: ps > 0 and ps & (ps - 1) == 0),
)}

_ALIASES = {
    "flash-attn-2": "flash-attn2", "flash_attn2": "flash-attn2", "fa2": "flash-attn2",
    "vllm": "vllm-flash-attn", "vllm_flash_attn": "vllm-flash-attn",
    "candle": "candle-flash-attn", "tensorrt-llm": "trtllm", "tensorrt_llm": "trtllm",
}


def resolve_backend(name: str) -> BackendRule:
    """The rule of a backend by name or alias; InvalidArgument listing known names otherwise."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in BACKENDS:
        raise InvalidArgument(f"unknown kernel backend {name!r}; known: {', '.join(BACKENDS)}",
                              backend=name)
    return BACKENDS[key]


def check_backends(page_size: int, backends: Iterable[str],
                   layers: Iterable[tuple[int, str]] = ()) -> list[str]:
    """Canonical names of backends, after checking page_size (and each layer's (head_dim, dtype))
    against each one's rules.

    Raises FailedPrecondition naming the first backend whose rule fails.
    """
    names = []
    layers = list(layers)
    for name in backends:
        rule = resolve_backend(name)
        if not rule.accepts(page_size):
            raise FailedPrecondition(
                f"{rule.display} needs {rule.rule}, got page_size {page_size}",
                reason="BACKEND_PAGE_SIZE", backend=rule.name, rule=rule.rule, page_size=page_size)
        for i, (head_dim, dtype) in enumerate(layers):
            if rule.accepts_layer is not None and not rule.accepts_layer(head_dim, dtype):
                raise FailedPrecondition(
                    f"{rule.display} need {rule.layer_rule}; layer {i} has head_dim {head_dim}, dtype {dtype}",
                    reason="BACKEND_LAYER", backend=rule.name, rule=rule.layer_rule, layer=i)
        names.append(rule.name)
    return names
