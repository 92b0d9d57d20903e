"""16-bit cache values to float32, exact to the bit: every bfloat16 pattern (NaN payloads,
infinities, subnormals, -0 included) through the attention kernels' own loads (the .cu,
emulated: kv_widen_bf16 uses KvElem<kv_bf16>::load and ::one) and through the NumPy backend;
every float16 pattern against NumPy's conversion."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.worker import kernels_cpu, ops_numpy

ALL = np.arange(2**16, dtype=np.uint16)


@pytest.mark.parametrize("ops", [kernels_cpu, ops_numpy], ids=["emu", "numpy"])
@pytest.mark.parametrize("tail", [0, 3])
def test_bfloat16_to_float32_is_exact_for_every_pattern(ops, tail: int) -> None:
    """tail 3: n not a multiple of the 8-element vector, so the scalar path runs too."""
    x = np.ascontiguousarray(ALL[: ALL.shape[0] - tail] if tail else ALL)
    got = ops.widen(x, "bfloat16")
    assert got.dtype == np.float32 and got.shape == x.shape
    want = x.astype(np.uint32) << 16        # bf16 is the high half of a float32
    assert np.array_equal(got.view(np.uint32), want)
    # a few values by name
    named = {0x3F80: 1.0, 0xC000: -2.0, 0x7F80: np.inf, 0x0001: 2.0**-133, 0x8000: -0.0}
    for bits, value in named.items():
        assert got[bits] == value and np.signbit(got[bits]) == np.signbit(value)


def test_bfloat16_tail_elements_use_the_scalar_load() -> None:
    x = np.array([0x3F80, 0x7FC1, 0xFF81, 0x0001, 0x8000, 0x4049, 0x1234], dtype=np.uint16)  # 7 < one vector
    got = kernels_cpu.widen(x, "bfloat16")
    assert np.array_equal(got.view(np.uint32), x.astype(np.uint32) << 16)


@pytest.mark.parametrize("ops", [kernels_cpu, ops_numpy], ids=["emu", "numpy"])
def test_float16_to_float32_matches_numpy_for_every_pattern(ops) -> None:
    h = ALL.view(np.float16)
    got = ops.widen(np.ascontiguousarray(h), "float16")
    want = h.astype(np.float32)
    nan = np.isnan(h)
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert np.isnan(got[nan]).all() and np.array_equal(np.signbit(got[nan]), np.signbit(h[nan]))


def test_widen_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        kernels_cpu.widen(np.zeros(8, np.float32), "float32")
    with pytest.raises(TypeError, match="expected dtype uint16"):
        ops_numpy.widen(np.zeros(8, np.float16), "bfloat16")
    with pytest.raises(ValueError, match="16-byte aligned"):
        kernels_cpu.widen(np.zeros(9, np.uint16)[1:], "bfloat16")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_widen_names_the_shape_it_wants(dtype) -> None:
    x = np.ones((2, 4), np.float16 if dtype == "float16" else np.uint16)
    with pytest.raises(ValueError) as e:
        ops_numpy.widen(x, dtype)
    assert str(e.value) == "x: expected shape [n] = (None,), got (2, 4)"
