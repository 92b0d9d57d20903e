"""kvservice.worker.kernels_cpu's own logic (not the kernels): build() compiling a tiny probe source of this test
into a temporary build directory (flags and include path observed through what the probe computes, reuse through
the file's identity, failures through g++'s own message), sanitizer_env() against gcc's library paths and the
sanitizers' documented option syntax, and CpuBackend's argument marshalling, faults and cancellation."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # the emulation's 128-thread teams on a small machine

import numpy as np
import pytest

from kvservice.worker import cancel, kernels_cpu
from kvservice.worker.kernels_cpu import CpuBackend, EmulationFault

PROBE = """#include "probe.h"
#ifndef KV_HOST_EMU
#error "built without -DKV_HOST_EMU"
#endif
extern "C" __attribute__((visibility("default"))) int kv_probe(int x) {
#ifdef KV_NO_BOUNDS_CHECK
  return -x;
#else
  return PROBE_K * x + 1;
#endif
}
"""


def _probe_dir(tmp_path: Path, k: int = 3) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "probe.cu").write_text(PROBE)
    (src / "probe.h").write_text(f"#define PROBE_K {k}\n")
    (src / "unused.cuh").write_text("// not included\n")
    return src


def _call(lib: Path, x: int) -> int:
    f = ctypes.CDLL(str(lib)).kv_probe
    f.restype, f.argtypes = ctypes.c_int, [ctypes.c_int]
    return f(x)


def test_build_compiles_with_the_variant_flags_and_reuses_an_identical_build(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels_cpu, "BUILD_DIR", tmp_path / "out")
    src = _probe_dir(tmp_path)
    lib = kernels_cpu.build("plain", kernel_dir=src)
    assert lib.name == "libkvk.so" and lib.parent.parent == tmp_path / "out"
    assert lib.parent.name.startswith("plain-") and len(lib.parent.name) == len("plain-") + 16
    assert _call(lib, 5) == 16                                          # -I<kernel_dir> found probe.h
    assert [p.name for p in lib.parent.iterdir()] == ["libkvk.so"]      # the temporary file was renamed
    ino = lib.stat().st_ino
    assert kernels_cpu.build("plain", kernel_dir=src) == lib and lib.stat().st_ino == ino   # reused, not rebuilt
    nocheck = kernels_cpu.build("nocheck", kernel_dir=src)
    assert nocheck.parent.name.startswith("nocheck-") and _call(nocheck, 5) == -5   # -DKV_NO_BOUNDS_CHECK
    (src / "probe.h").write_text("#define PROBE_K 7\n")                 # a header is part of the sources
    lib7 = kernels_cpu.build("plain", kernel_dir=src)
    assert lib7 != lib and _call(lib7, 5) == 36
    (src / "unused.cuh").write_text("// changed\n")                   # so is every *.cu* file
    lib7b = kernels_cpu.build("plain", kernel_dir=src)
    assert lib7b not in (lib, lib7) and _call(lib7b, 1) == 8


def test_build_only_some_sources_and_a_failing_compile(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels_cpu, "BUILD_DIR", tmp_path / "out")
    src = _probe_dir(tmp_path)
    bad = src / "broken.cu"
    bad.write_text("extern \"C\" int kv_broken( { return 0; }\n")
    lib = kernels_cpu.build("plain", kernel_dir=src, only=["probe.cu"])
    assert _call(lib, 2) == 7
    assert kernels_cpu.sources(src) == [bad, src / "probe.cu"]
    for _ in range(2):                                  # a retry fails the same way
        with pytest.raises(RuntimeError) as ei:
            kernels_cpu.build("plain", kernel_dir=src)
    msg = str(ei.value)
    assert msg.startswith("g++ failed (g++ -x c++ -std=c++17 ") and f"-I{src} " in msg and f"{bad}" in msg
    lines = msg.splitlines()
    assert any(line.startswith(f"{bad}:") and "error" in line for line in lines[1:])   # g++'s text, not bytes
    out_dirs = [d for d in (tmp_path / "out").iterdir() if d != lib.parent]
    assert len(out_dirs) == 1 and list(out_dirs[0].iterdir()) == []     # no library and no temporary left


def test_sanitizer_env_preloads_gccs_runtimes_and_sets_the_documented_options(monkeypatch):
    base = {"PATH": "/usr/bin", "KEEP": "x"}
    env = kernels_cpu.sanitizer_env(base)
    assert base == {"PATH": "/usr/bin", "KEEP": "x"} and env["KEEP"] == "x" and env["PATH"] == "/usr/bin"
    libs = env["LD_PRELOAD"].split(" ")
    assert [os.path.basename(p).split(".so")[0] for p in libs] == ["libasan", "libubsan"]
    assert all(os.path.isabs(p) and os.path.isfile(p) for p in libs)
    opts = {k: dict(kv.split("=") for kv in env[k].split(":")) for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS")}
    assert opts == {"ASAN_OPTIONS": {"halt_on_error": "1", "detect_leaks": "0", "abort_on_error": "0",
                                     "exitcode": "86"},
                    "UBSAN_OPTIONS": {"halt_on_error": "1", "print_stacktrace": "1", "exitcode": "87"}}
    assert env["OMP_WAIT_POLICY"].lower() == "passive"       # OpenMP: values are case-insensitive
    assert all(isinstance(v, str) for v in env.values())
    monkeypatch.setenv("KV_M29W1_MARK", "here")
    assert kernels_cpu.sanitizer_env()["KV_M29W1_MARK"] == "here"         # default base: this process's env


def test_arg_marshalling_each_kind_and_refusals():
    a = np.arange(4, dtype=np.int32)
    p = CpuBackend._arg("p", a, 0, "k")
    assert isinstance(p, ctypes.c_void_p) and p.value == a.ctypes.data
    assert CpuBackend._arg("p", np.uint64(0), 1, "k").value is None
    assert CpuBackend._arg("p", np.uint64(4096), 1, "k").value == 4096
    q = CpuBackend._arg("q", np.int64(-2**40 - 3), 2, "k")
    assert isinstance(q, ctypes.c_longlong) and q.value == -2**40 - 3
    f = CpuBackend._arg("f", np.float32(0.375), 3, "k")
    assert isinstance(f, ctypes.c_float) and f.value == 0.375
    i = CpuBackend._arg("i", np.int32(-7), 4, "k")
    assert isinstance(i, ctypes.c_int) and i.value == -7
    for kind, v, tname in (("q", 5, "int"), ("q", np.int32(5), "int32"), ("p", 5, "int"), ("f", 0.5, "float"),
                           ("i", np.int64(1), "int64"), ("x", np.int64(1), "int64"), ("f", np.float64(1), "float64")):
        with pytest.raises(TypeError) as ei:
            CpuBackend._arg(kind, v, 6, "kv_thing")
        assert str(ei.value) == f"kv_thing arg 6: C kind {kind!r} does not match {tname}"


def test_launch_runs_refuses_and_reports_faults():
    be = kernels_cpu.backend()
    rng = np.random.default_rng(11)
    x = rng.uniform(-2, 2, 40).astype(np.float16)
    out = np.zeros(40, np.float32)
    assert be.signature("kv_widen_f16") == "ppq"
    be.launch("kv_widen_f16", (1, 1, 1), 128, [x, out, np.int64(40)])
    assert np.array_equal(out, x.astype(np.float32))
    with pytest.raises(KeyError, match=r"no kernel named 'kv_nope' in plain build"):
        be.signature("kv_nope")
    with pytest.raises(TypeError, match=r"^kv_widen_f16: C signature has 3 args, got 2$"):
        be.launch("kv_widen_f16", (1, 1, 1), 128, [x, out])
    for grid in ((0, 1, 1), (1, 0, 1)):
        with pytest.raises(EmulationFault) as ei:
            be.launch("kv_widen_f16", grid, 128, [x, out, np.int64(40)])
        assert ei.value.code == -2 and str(ei.value) == "kv_emu_launch(kv_widen_f16) failed with code -2 (bad launch " \
                                                         "shape): "
    assert str(EmulationFault("k", -9, "d")) == "kv_emu_launch(k) failed with code -9 (?): d"
    assert kernels_cpu.FAULTS[kernels_cpu.STOPPED].startswith("stopped")


def test_launch_under_a_call_bound_runs_until_cancelled():
    be = kernels_cpu.backend()
    x = np.arange(1, 33, dtype=np.float16)
    out = np.zeros(32, np.float32)
    with cancel.bounded(None):
        be.launch("kv_widen_f16", (1, 1, 1), 128, [x, out, np.int64(32)])
    assert np.array_equal(out, np.arange(1, 33, dtype=np.float32))
    out[:] = 0
    with cancel.bounded(None) as bound, pytest.raises(cancel.KernelCancelled) as ei:
        bound.cancel()
        be.launch("kv_widen_f16", (1, 1, 1), 128, [x, out, np.int64(32)])
    assert str(ei.value) == ("kv_widen_f16: stopped between blocks, the call's deadline passed or its caller went "
                             "away")
    assert (out == 0).all()
    with cancel.bounded(time.monotonic() - 1.0), pytest.raises(cancel.KernelCancelled):   # a deadline passed
        be.launch("kv_widen_f16", (1, 1, 1), 128, [x, out, np.int64(32)])
    assert (out == 0).all()
    with cancel.bounded(time.monotonic() + 3600.0):                                      # one an hour away
        be.launch("kv_widen_f16", (2, 1, 1), 128, [x, out, np.int64(32)])
    assert np.array_equal(out, np.arange(1, 33, dtype=np.float32))


def test_backend_reads_its_defaults_from_the_environment(monkeypatch):
    make = kernels_cpu.backend.__wrapped__
    for var in ("KVK_EMU_STRICT", "KVK_EMU_BLOCKS", "KVK_CPU_VARIANT"):
        monkeypatch.delenv(var, raising=False)
    b = make()
    assert (b.variant, b.strict, b.blocks_at_once) == ("plain", False, 1)
    monkeypatch.setenv("KVK_EMU_STRICT", "1")
    monkeypatch.setenv("KVK_EMU_BLOCKS", "3")
    b = make()
    assert (b.variant, b.strict, b.blocks_at_once) == ("plain", True, 3)
    monkeypatch.setenv("KVK_EMU_STRICT", "yes")
    b = make(strict=None, blocks_at_once=0)
    assert (b.strict, b.blocks_at_once) == (False, 1)
    b = make("plain", strict=True, blocks_at_once=2)
    assert (b.strict, b.blocks_at_once) == (True, 2)
    assert (CpuBackend.sms, CpuBackend.resident_blocks("kv_decode_f32_g1_d32", 128)) == (4, 2)


CP_PROBE = """#include "kv_emu.h"
extern "C" __global__ void kv_probe_cp(const char* src, long long shift) {
  KV_SHARED(__attribute__((aligned(16))) char, s_buf, [16 * 128]);
  kv_cp_async16(kv_smem(s_buf + 16 * threadIdx.x), src + 16 * threadIdx.x + shift, true);
  kv_cp_async_wait_all();
}
KV_REGISTER(kv_probe_cp)
"""


def test_a_misaligned_cp_async_fault_carries_the_emulations_description(tmp_path, monkeypatch):
    """A probe kernel on the emulation header: 16-byte copies from an aligned source run; one byte off is fault -4
    whose message carries kv_emu_last_fault()'s text."""
    monkeypatch.setattr(kernels_cpu, "BUILD_DIR", tmp_path / "out")
    src = tmp_path / "src"
    src.mkdir()
    (src / "kv_emu.h").write_bytes((kernels_cpu.KERNEL_DIR / "kv_emu.h").read_bytes())
    (src / "probe.cu").write_text(CP_PROBE)
    be = CpuBackend(lib=kernels_cpu.build("plain", kernel_dir=src))
    assert be.signature("kv_probe_cp") == "pq"
    buf = np.zeros(16 * 130, np.uint8)
    aligned = (-buf.ctypes.data) % 16
    be.launch("kv_probe_cp", (1, 1, 1), 128, [buf, np.int64(aligned)])
    with pytest.raises(EmulationFault) as ei:
        be.launch("kv_probe_cp", (1, 1, 1), 128, [buf, np.int64(aligned + 1)])
    assert ei.value.code == -4
    assert str(ei.value).startswith("kv_emu_launch(kv_probe_cp) failed with code -4 (misaligned cp.async): "
                                    "misaligned cp.async (16 bytes need 16-byte aligned addresses): shared 0x")


SAN_PROBE = """#include <climits>
extern "C" __attribute__((visibility("default"))) int kv_probe_heap(int i) {
  volatile int* p = new int[4]{1, 2, 3, 4};
  const int r = p[i];
  delete[] p;
  return r;
}
extern "C" __attribute__((visibility("default"))) int kv_probe_add(int x) {
  volatile int big = INT_MAX;
  return big + x;
}
"""


def test_the_asan_variant_runs_under_sanitizer_env_and_exits_with_the_documented_codes(tmp_path, monkeypatch):
    """The asan build of a probe, loaded by a child process started with sanitizer_env(): a clean call exits 0; a
    heap overflow exits 86 (ASAN_OPTIONS exitcode); a signed overflow exits 87 (UBSAN_OPTIONS exitcode)."""
    import subprocess
    import sys

    monkeypatch.setattr(kernels_cpu, "BUILD_DIR", tmp_path / "out")
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe.cu").write_text(SAN_PROBE)
    lib = kernels_cpu.build("asan", kernel_dir=src)
    assert lib.parent.name.startswith("asan-")
    env = kernels_cpu.sanitizer_env()
    code = "import ctypes, sys; print(getattr(ctypes.CDLL(sys.argv[1]), sys.argv[2])(int(sys.argv[3])))"

    def run(fn: str, arg: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code, str(lib), fn, str(arg)], env=env, capture_output=True,
                              text=True, timeout=120)

    ok = run("kv_probe_heap", 2)
    assert (ok.returncode, ok.stdout) == (0, "3\n"), ok.stderr[-2000:]
    heap = run("kv_probe_heap", 4)
    assert heap.returncode == 86 and "heap-buffer-overflow" in heap.stderr, heap.stderr[-2000:]
    add = run("kv_probe_add", 1)
    assert add.returncode == 87 and "signed integer overflow" in add.stderr, add.stderr[-2000:]
