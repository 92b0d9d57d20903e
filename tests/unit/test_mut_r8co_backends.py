"""kvservice/core/backends.py: every backend's page-size rule at its edges, the native kernels' per-layer rule over
every head_dim and dtype, name resolution (aliases, case, whitespace) and the exact refusals with their metadata.

Oracle: the rules as the module documents them in words (each BackendRule's ``rule`` text), recomputed here in
plain Python: "any page size" is ps >= 1, "page_size % N == 0" is divisibility by N, "a power of two" is one bit
set; the native kernels take head_dim 32/64/128/256/512 with a float16, bfloat16 or float32 cache.
"""

from __future__ import annotations

import pytest

from kvservice.contract.errors import FailedPrecondition, InvalidArgument
from kvservice.core.backends import BACKENDS, check_backends, resolve_backend

#: name -> (display, rule text, the rule recomputed)
RULES = {
    "native": ("kvservice native kernels", "any page size", lambda ps: ps >= 1),
    "flashinfer": ("FlashInfer", "any page size", lambda ps: ps >= 1),
    "flash-attn2": ("flash-attn 2", "page_size % 256 == 0", lambda ps: ps % 256 == 0),
    "vllm-flash-attn": ("vLLM's flash-attn fork", "page_size % 16 == 0", lambda ps: ps % 16 == 0),
    "candle-flash-attn": ("candle flash-attn", "page_size % 32 == 0", lambda ps: ps % 32 == 0),
    "trtllm": ("TensorRT-LLM", "page_size a power of two", lambda ps: ps >= 1 and bin(ps).count("1") == 1),
}
PAGE_SIZES = (-256, -16, -1, 0, 1, 2, 3, 4, 6, 8, 12, 15, 16, 17, 24, 31, 32, 33, 48, 64, 96, 128, 255, 256,
              257, 384, 512, 768, 1024, 4096)
NATIVE_LAYER_RULE = "head_dim in 32/64/128/256/512 and a float16, bfloat16 or float32 cache"


def test_the_backends_are_exactly_the_documented_six():
    assert list(BACKENDS) == list(RULES)
    for name, (display, rule, _) in RULES.items():
        r = BACKENDS[name]
        assert (r.name, r.display, r.rule) == (name, display, rule)
    assert BACKENDS["native"].layer_rule == NATIVE_LAYER_RULE
    assert all(BACKENDS[n].layer_rule == "" and BACKENDS[n].accepts_layer is None for n in RULES if n != "native")


@pytest.mark.parametrize("name", list(RULES))
def test_each_rule_accepts_and_refuses_page_sizes_as_its_words_say(name):
    display, rule, ok = RULES[name]
    for ps in PAGE_SIZES:
        if ok(ps):
            assert check_backends(ps, [name]) == [name], ps
            continue
        with pytest.raises(FailedPrecondition) as e:
            check_backends(ps, [name])
        assert e.value.message == f"{display} needs {rule}, got page_size {ps}"
        assert e.value.reason == "BACKEND_PAGE_SIZE"
        assert e.value.metadata == {"backend": name, "rule": rule, "page_size": str(ps)}


def test_the_native_layer_rule_over_every_head_dim_and_dtype():
    dtypes = ("float16", "bfloat16", "float32", "float8_e4m3", "float8_e5m2")
    for hd in (16, 31, 32, 33, 64, 80, 96, 128, 192, 256, 320, 512, 576, 1024):
        for dt in dtypes:
            good = hd in (32, 64, 128, 256, 512) and dt in ("float16", "bfloat16", "float32")
            layers = [(128, "float16"), (64, "bfloat16"), (hd, dt)]
            assert check_backends(16, ["flashinfer", "trtllm"], layers) == ["flashinfer", "trtllm"]
            if good:
                assert check_backends(16, ["native"], layers) == ["native"]
                continue
            with pytest.raises(FailedPrecondition) as e:
                check_backends(16, ["flashinfer", "native"], layers)
            assert e.value.message == (f"kvservice native kernels need {NATIVE_LAYER_RULE}; layer 2 has head_dim "
                                       f"{hd}, dtype {dt}")
            assert e.value.reason == "BACKEND_LAYER"
            assert e.value.metadata == {"backend": "native", "rule": NATIVE_LAYER_RULE, "layer": "2"}


def test_layers_may_be_any_iterable_and_every_backend_is_checked_in_order():
    layers = iter([(64, "float16"), (128, "float32")])       # a one-shot iterator, read for every backend
    assert check_backends(256, ["Native", " FA2 ", "vllm", "candle", "tensorrt-llm", "flashinfer"], layers) == \
        ["native", "flash-attn2", "vllm-flash-attn", "candle-flash-attn", "trtllm", "flashinfer"]
    # the first failing backend in the given order is named, the page size checked before the layers
    with pytest.raises(FailedPrecondition) as e:
        check_backends(128, ["native", "trtllm", "fa2", "candle"], [(96, "float16")])
    assert e.value.reason == "BACKEND_LAYER"
    with pytest.raises(FailedPrecondition) as e:
        check_backends(128, ["trtllm", "fa2", "native"], [(96, "float16")])
    assert e.value.metadata["backend"] == "flash-attn2"
    assert check_backends(64, []) == []
    with pytest.raises(FailedPrecondition) as e:              # a layer seen by the first backend is seen by all
        check_backends(16, ["flashinfer", "native"], iter([(128, "float16"), (96, "float16")]))
    assert e.value.metadata["layer"] == "1"


@pytest.mark.parametrize(("alias", "name"), [
    ("flash-attn-2", "flash-attn2"), ("flash_attn2", "flash-attn2"), ("fa2", "flash-attn2"),
    ("vllm", "vllm-flash-attn"), ("vllm_flash_attn", "vllm-flash-attn"), ("candle", "candle-flash-attn"),
    ("tensorrt-llm", "trtllm"), ("tensorrt_llm", "trtllm"), ("  FLASHINFER\t", "flashinfer"), ("Native", "native"),
    ("TensorRT_LLM ", "trtllm")])
def test_aliases_case_and_whitespace_resolve_to_the_canonical_rule(alias, name):
    assert resolve_backend(alias) is BACKENDS[name]


@pytest.mark.parametrize("bad", ["cudnn", "flash-attn3", "", " fa 2", "flash attn2"])
def test_an_unknown_backend_is_refused_listing_the_known_names(bad):
    with pytest.raises(InvalidArgument) as e:
        resolve_backend(bad)
    assert e.value.message == (f"unknown kernel backend {bad!r}; known: native, flashinfer, flash-attn2, "
                               "vllm-flash-attn, candle-flash-attn, trtllm")
    assert e.value.reason == "INVALID_ARGUMENT" and e.value.metadata == {"backend": bad}
    with pytest.raises(InvalidArgument):
        check_backends(16, ["native", bad])
