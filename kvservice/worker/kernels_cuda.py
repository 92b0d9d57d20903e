"""CUDA backend: kvservice/worker/kernels/*.cu compiled at run time by NVRTC through
``cupy.RawModule``. CuPy arrays in and out; same API as kvservice.worker.kernels_cpu.

The module source is the .cu files with their local includes inlined (so
CuPy's kernel cache keys on the real source text). cupy is imported lazily:
this module imports without it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvservice.worker import guards
from kvservice.worker import kernel_api as api
from kvservice.worker.guards import GuardReport
from kvservice.worker.kernel_api import PageLayout, Policy, ValidationResult

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17",)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def nvrtc_source() -> str:
    """All kernels as one translation unit with local includes inlined once."""
    seen: set[str] = set()

    def inline(path: Path) -> str:
        def repl(m: re.Match) -> str:
            name = m.group(1)
            if name == "kv_emu.h" or name in seen:  # host emulation only / #pragma once
                return f"// (include {name} skipped)"
            seen.add(name)
            return inline(KERNEL_DIR / name)

        return _INCLUDE.sub(repl, path.read_text().replace("#pragma once", ""))

    return "\n".join(inline(p) for p in sorted(KERNEL_DIR.glob("*.cu")))


def nvrtc_options(no_checks: bool = False) -> tuple[str, ...]:
    return NVRTC_OPTIONS + (("-DKV_NO_BOUNDS_CHECK",) if no_checks else ())


class CudaBackend:
    """Launcher over one RawModule (kernel_api.Backend)."""

    def __init__(self, no_checks: bool = False) -> None:
        try:
            import cupy
        except Exception as e:  # ImportError, or CUDA driver errors on import
            raise RuntimeError(f"the cuda kernel backend needs cupy: {e}") from e
        self.xp = cupy
        self.module = cupy.RawModule(code=nvrtc_source(), options=nvrtc_options(no_checks))
        self.sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        self._fns: dict[str, Any] = {}
        self._resident: dict[tuple[str, int], int] = {}

    def function(self, name: str) -> Any:
        """The module's kernel ``name`` (compiles the module on first use)."""
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self.module.get_function(name)
        return fn

    def launch(self, name: str, grid: tuple[int, int, int], block: int, args: list[Any]) -> None:
        self.function(name)(grid, (block, 1, 1), tuple(args))

    def resident_blocks(self, name: str, block: int) -> int:
        """Blocks of ``name`` one SM holds at once (CUDA occupancy API), cached."""
        key = (name, block)
        n = self._resident.get(key)
        if n is None:
            from cupy.cuda import driver

            n = self._resident[key] = max(1, int(driver.occupancyMaxActiveBlocksPerMultiprocessor(
                function_ptr(self.function(name)), block, 0)))
        return n

    def resources(self, name: str) -> dict[str, int]:
        """Registers, static shared / local (spill) bytes and resident blocks of ``name``."""
        from cupy.cuda import driver

        ptr = function_ptr(self.function(name))
        attrs = {"registers": 4, "shared_bytes": 1, "local_bytes": 3, "max_threads": 0}  # CU_FUNC_ATTRIBUTE_*
        out = {k: int(driver.funcGetAttribute(v, ptr)) for k, v in attrs.items()}
        out["blocks_per_sm"] = self.resident_blocks(name, 128)
        return out

    @staticmethod
    def ptr(a: Any) -> int:
        return int(a.data.ptr)

    def to_host(self, a: Any) -> np.ndarray:
        return self.xp.asnumpy(a)


def function_ptr(fn: Any) -> int:
    """CUfunction handle of a ``RawModule.get_function`` result."""
    ptr = getattr(fn, "ptr", None)
    if ptr is None:
        ptr = fn.kernel.ptr
    return int(ptr)


@functools.cache
def backend(no_checks: bool = False) -> CudaBackend:
    return CudaBackend(no_checks)


def append_kv(cache: Any, layout: PageLayout, k: Any, v: Any, slot_mapping: Any,
              *, policy: Policy = Policy.NAN, slot_generations: Any = None, page_gen: Any = None) -> api.KernelCall:
    """See kernel_api.append_kv (CuPy arrays)."""
    return api.append_kv(backend(), cache, layout, k, v, slot_mapping, policy=policy,
                         slot_generations=slot_generations, page_gen=page_gen)


def decode_attention(q: Any, cache: Any, layout: PageLayout, indptr: Any, indices: Any, last_page_len: Any,
                     *, sm_scale: float | None = None, window: int = 0, policy: Policy = Policy.NAN,
                     kv_chunk_pages: int | None = None, max_pages: int | None = None,
                     out: Any = None, lse: Any = None, generations: Any = None,
                     page_gen: Any = None) -> api.AttentionCall:
    """See kernel_api.decode_attention (CuPy arrays)."""
    return api.decode_attention(backend(), q, cache, layout, indptr, indices, last_page_len,
                                sm_scale=sm_scale, window=window, policy=policy,
                                kv_chunk_pages=kv_chunk_pages, max_pages=max_pages, out=out, lse=lse,
                                generations=generations, page_gen=page_gen)


def copy_blocks(caches: Sequence[Any], layout: PageLayout, pairs: Any,
                *, policy: Policy = Policy.NAN, generations: Any = None,
                page_gens: Sequence[Any] | None = None) -> api.KernelCall:
    """See kernel_api.copy_blocks (CuPy arrays)."""
    return api.copy_blocks(backend(), caches, layout, pairs, policy=policy, generations=generations,
                           page_gens=page_gens)


def validate_page_table(indptr: Any, indices: Any, last_page_len: Any, layout: PageLayout, *,
                        generations: Any = None, page_gen: Any = None) -> ValidationResult:
    """See kernel_api.validate_page_table (CuPy arrays)."""
    return api.validate_page_table(backend(), indptr, indices, last_page_len, layout, generations=generations,
                                   page_gen=page_gen)


def widen(x: Any, dtype: str) -> Any:
    """See kernel_api.widen (CuPy arrays)."""
    return api.widen(backend(), x, dtype)


def guard_fill(buf: Any, guard_bytes: int) -> None:
    """See kvservice.worker.guards.guard_fill (CuPy uint8 buffer)."""
    guards.guard_fill(backend(), buf, guard_bytes)


def guard_check(buf: Any, guard_bytes: int) -> GuardReport:
    """See kvservice.worker.guards.guard_check (CuPy uint8 buffer)."""
    return guards.guard_check(backend(), buf, guard_bytes)
