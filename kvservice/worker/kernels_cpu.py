"""CPU backend: the SAME kvservice/worker/kernels/*.cu compiled by g++ with the host
emulation header (kv_emu.h), loaded with ctypes. NumPy arrays in and out.

Variants (``KVK_CPU_VARIANT`` or ``build(variant)``):
  ``plain``    -O2, loaded in-process (default);
  ``asan``     AddressSanitizer + UBSan; load only in a process started with
               ``LD_PRELOAD`` of libasan and libubsan (see ``sanitizer_env``);
  ``nocheck``  -DKV_NO_BOUNDS_CHECK (benchmark/negative-control only).
Build outputs: ``build/kernels-cpu/<variant>-<hash of sources+flags>/libkvk.so`` (``KVK_CPU_BUILD_DIR``
moves them, e.g. to time a cold build).

Public API (same as kvservice.worker.kernels_cuda and kvservice.worker.ops_numpy): append_kv,
decode_attention, copy_blocks, validate_page_table, widen, guard_fill, guard_check.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvservice.worker import cancel, guards
from kvservice.worker import kernel_api as api
from kvservice.worker.guards import GuardReport
from kvservice.worker.kernel_api import PageLayout, Policy, ValidationResult

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
ROOT = Path(__file__).resolve().parents[2]  # the repository (build/ lives there)
BUILD_DIR = Path(os.environ.get("KVK_CPU_BUILD_DIR") or ROOT / "build" / "kernels-cpu")  # the env: a cold build
BASE_FLAGS = ["-x", "c++", "-std=c++17", "-fopenmp", "-fPIC", "-shared", "-fno-strict-aliasing",
              "-DKV_HOST_EMU", "-Wall", "-Wno-unknown-pragmas",
              # each variant keeps its own registry/statics when several are loaded
              "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-fno-gnu-unique"]
VARIANT_FLAGS = {
    "plain": ["-O2"],
    "asan": ["-O0", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
             "-fno-sanitize-recover=all"],
    "nocheck": ["-O2", "-DKV_NO_BOUNDS_CHECK"],
    "asan-nocheck": ["-O0", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                     "-fno-sanitize-recover=all", "-DKV_NO_BOUNDS_CHECK"],
}


def sources(kernel_dir: Path = KERNEL_DIR) -> list[Path]:
    return sorted(kernel_dir.glob("*.cu"))


def _source_hash(flags: Sequence[str], kernel_dir: Path = KERNEL_DIR) -> str:
    h = hashlib.sha256(" ".join(flags).encode())
    for p in sorted(kernel_dir.glob("*.cu*")) + sorted(kernel_dir.glob("*.h")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def build(variant: str = "plain", kernel_dir: Path = KERNEL_DIR, only: Sequence[str] | None = None) -> Path:
    """Compile (or reuse) the emulation library for ``variant``; returns its path.
    ``kernel_dir``: another copy of the sources (the planted-bug tests); ``only``: file names of
    the .cu sources to build (default all)."""
    flags = BASE_FLAGS + VARIANT_FLAGS[variant]
    srcs = [p for p in sources(kernel_dir) if only is None or p.name in only]
    key = _source_hash([*flags, *(p.name for p in srcs)], kernel_dir)
    out = BUILD_DIR / f"{variant}-{key}" / "libkvk.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = ["g++", *flags, f"-I{kernel_dir}", *map(str, srcs), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"g++ failed ({' '.join(cmd)}):\n{proc.stderr}")
    os.replace(tmp, out)
    return out


def sanitizer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess that loads the ``asan`` variant."""
    env = dict(os.environ if base is None else base)
    libs = []
    for name in ("libasan.so", "libubsan.so"):
        libs.append(subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True,
                                   text=True, check=True).stdout.strip())
    env["LD_PRELOAD"] = " ".join(libs)
    env["ASAN_OPTIONS"] = "halt_on_error=1:detect_leaks=0:abort_on_error=0:exitcode=86"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1:exitcode=87"
    env["OMP_WAIT_POLICY"] = "passive"
    return env


#: kv_emu_launch_mode's fault codes
FAULTS = {-1: "unknown kernel", -2: "bad launch shape", -3: "short OpenMP team",
          -4: "misaligned cp.async", -5: "shared-memory race", -6: "stopped: deadline passed or cancelled"}
STOPPED = -6


class EmulationFault(RuntimeError):
    """A launch that the device would have faulted on (misaligned cp.async), or that the strict
    emulation found racing on shared memory. ``code``: kv_emu_launch_mode's return code."""

    def __init__(self, name: str, code: int, detail: str) -> None:
        super().__init__(f"kv_emu_launch({name}) failed with code {code} ({FAULTS.get(code, '?')}): {detail}")
        self.code = code


class CpuBackend:
    """ctypes launcher over one emulation library (kernel_api.Backend).

    ``strict``: cp.async copies land at issue and a shadow of the ring reports any read before a
    copy's wait, a read of another thread's copy with no barrier after its wait, and a copy over
    a piece another thread read since the last barrier (EmulationFault code -5). ``blocks_at_once``:
    blocks of one launch run concurrently (in reverse order) instead of one after another.
    ``lib``: a library built elsewhere (``build(kernel_dir=...)``). Misaligned cp.async is a fault
    (code -4) in every mode.
    """

    xp = np
    sms = 4  # pretend SM count for the split heuristics

    @staticmethod
    def resident_blocks(name: str, block: int) -> int:
        """Pretend residency (2 blocks per SM) for the split heuristics."""
        return 2

    def __init__(self, variant: str = "plain", *, strict: bool = False, blocks_at_once: int = 1,
                 lib: Path | None = None) -> None:
        self.variant, self.strict, self.blocks_at_once = variant, strict, max(1, int(blocks_at_once))
        self.lib = ctypes.CDLL(str(lib or build(variant)))
        self.lib.kv_emu_launch_mode.restype = ctypes.c_int
        self.lib.kv_emu_launch_mode.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                                ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                                ctypes.c_int]
        self.lib.kv_emu_launch_until.restype = ctypes.c_int
        self.lib.kv_emu_launch_until.argtypes = [*self.lib.kv_emu_launch_mode.argtypes, ctypes.c_longlong,
                                                 ctypes.POINTER(ctypes.c_int)]
        self.lib.kv_emu_signature.restype = ctypes.c_char_p
        self.lib.kv_emu_signature.argtypes = [ctypes.c_char_p]
        self.lib.kv_emu_last_fault.restype = ctypes.c_char_p

    def signature(self, name: str) -> str:
        sig = self.lib.kv_emu_signature(name.encode())
        if sig is None:
            raise KeyError(f"no kernel named {name!r} in {self.variant} build")
        return sig.decode()

    @staticmethod
    def _arg(kind: str, v: Any, i: int, name: str) -> Any:
        if kind == "p":
            if isinstance(v, np.ndarray):
                return ctypes.c_void_p(v.ctypes.data)
            if isinstance(v, np.uint64):
                return ctypes.c_void_p(int(v) or None)
        elif kind == "q" and isinstance(v, np.int64):
            return ctypes.c_longlong(int(v))
        elif kind == "f" and isinstance(v, np.float32):
            return ctypes.c_float(float(v))
        elif kind == "i" and isinstance(v, np.int32):
            return ctypes.c_int(int(v))
        raise TypeError(f"{name} arg {i}: C kind {kind!r} does not match {type(v).__name__}")

    def launch(self, name: str, grid: tuple[int, int, int], block: int, args: list[Any]) -> None:
        sig = self.signature(name)
        if len(sig) != len(args):
            raise TypeError(f"{name}: C signature has {len(sig)} args, got {len(args)}")
        cvals = [self._arg(k, v, i, name) for i, (k, v) in enumerate(zip(sig, args, strict=True))]
        argv = (ctypes.c_void_p * len(cvals))(*[ctypes.cast(ctypes.pointer(c), ctypes.c_void_p) for c in cvals])
        bound = cancel.current()         # the RPC's deadline and cancellation (kvservice/worker/cancel.py)
        if bound is None:
            rc = self.lib.kv_emu_launch_mode(name.encode(), *grid, block, argv, int(self.strict), self.blocks_at_once)
        else:
            rc = self.lib.kv_emu_launch_until(name.encode(), *grid, block, argv, int(self.strict),
                                              self.blocks_at_once, bound.deadline_ns, ctypes.byref(bound.flag))
        if rc == STOPPED:
            raise cancel.KernelCancelled(f"{name}: stopped between blocks, the call's deadline passed or its caller "
                                         "went away")
        if rc != 0:
            detail = (self.lib.kv_emu_last_fault() or b"").decode(errors="replace") if rc in (-4, -5) else ""
            raise EmulationFault(name, rc, detail)

    @staticmethod
    def ptr(a: Any) -> int:
        return int(a.ctypes.data)

    @staticmethod
    def to_host(a: Any) -> np.ndarray:
        return np.asarray(a)


@functools.cache
def backend(variant: str | None = None, strict: bool | None = None, blocks_at_once: int | None = None) -> CpuBackend:
    """The backend of a build variant (``KVK_CPU_VARIANT``, default plain); ``strict`` and
    ``blocks_at_once`` default to ``KVK_EMU_STRICT`` (1 = on) and ``KVK_EMU_BLOCKS`` (1)."""
    if strict is None:
        strict = os.environ.get("KVK_EMU_STRICT", "0") == "1"
    if blocks_at_once is None:
        blocks_at_once = int(os.environ.get("KVK_EMU_BLOCKS", "1"))
    return CpuBackend(variant or os.environ.get("KVK_CPU_VARIANT", "plain"), strict=strict,
                      blocks_at_once=blocks_at_once)


def append_kv(cache: np.ndarray, layout: PageLayout, k: np.ndarray, v: np.ndarray,
              slot_mapping: np.ndarray, *, policy: Policy = Policy.NAN, slot_generations: np.ndarray | None = None,
              page_gen: np.ndarray | None = None) -> api.KernelCall:
    """See kernel_api.append_kv."""
    return api.append_kv(backend(), cache, layout, k, v, slot_mapping, policy=policy,
                         slot_generations=slot_generations, page_gen=page_gen)


def decode_attention(q: np.ndarray, cache: np.ndarray, layout: PageLayout, indptr: np.ndarray,
                     indices: np.ndarray, last_page_len: np.ndarray, *, sm_scale: float | None = None,
                     window: int = 0, policy: Policy = Policy.NAN, kv_chunk_pages: int | None = None,
                     max_pages: int | None = None, out: np.ndarray | None = None,
                     lse: np.ndarray | None = None, generations: np.ndarray | None = None,
                     page_gen: np.ndarray | None = None) -> api.AttentionCall:
    """See kernel_api.decode_attention."""
    return api.decode_attention(backend(), q, cache, layout, indptr, indices, last_page_len,
                                sm_scale=sm_scale, window=window, policy=policy,
                                kv_chunk_pages=kv_chunk_pages, max_pages=max_pages, out=out, lse=lse,
                                generations=generations, page_gen=page_gen)


def copy_blocks(caches: Sequence[np.ndarray], layout: PageLayout, pairs: np.ndarray,
                *, policy: Policy = Policy.NAN, generations: np.ndarray | None = None,
                page_gens: Sequence[np.ndarray] | None = None) -> api.KernelCall:
    """See kernel_api.copy_blocks."""
    return api.copy_blocks(backend(), caches, layout, pairs, policy=policy, generations=generations,
                           page_gens=page_gens)


def validate_page_table(indptr: np.ndarray, indices: np.ndarray, last_page_len: np.ndarray,
                        layout: PageLayout, *, generations: np.ndarray | None = None,
                        page_gen: np.ndarray | None = None) -> ValidationResult:
    """See kernel_api.validate_page_table."""
    return api.validate_page_table(backend(), indptr, indices, last_page_len, layout, generations=generations,
                                   page_gen=page_gen)


def widen(x: np.ndarray, dtype: str) -> np.ndarray:
    """See kernel_api.widen."""
    return api.widen(backend(), x, dtype)


def guard_fill(buf: np.ndarray, guard_bytes: int) -> None:
    """See kvservice.worker.guards.guard_fill."""
    guards.guard_fill(backend(), buf, guard_bytes)


def guard_check(buf: np.ndarray, guard_bytes: int) -> GuardReport:
    """See kvservice.worker.guards.guard_check."""
    return guards.guard_check(backend(), buf, guard_bytes)
