"""The exact source/options kernels_cuda hands to cupy.RawModule compile with
NVRTC (skipped when libnvrtc is not installed, e.g. no nvidia-cuda-nvrtc wheel;
a failure instead under CI, which installs it with the dev extra); the checked
build's sm_90 cubin has no stack and no lower occupancy than main's."""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvservice.worker import kernels_cuda, launch_plan
from tests.ci import missing

ROOT = Path(__file__).resolve().parents[2]
if "sass_budget" not in sys.modules:  # scripts/sass_budget.py (tools, occupancy rules, BASELINE_BLOCKS)
    _spec = importlib.util.spec_from_file_location("sass_budget", ROOT / "scripts" / "sass_budget.py")
    sys.modules["sass_budget"] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
    _spec.loader.exec_module(sys.modules["sass_budget"])
sass_budget = sys.modules["sass_budget"]


def load_nvrtc() -> ctypes.CDLL | None:
    paths: list[str] = []
    try:
        import nvidia  # namespace package of the NVIDIA wheels

        for root in nvidia.__path__:
            paths += glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*"))
    except ImportError:
        pass
    for p in [*sorted(paths), "libnvrtc.so"]:
        try:
            for b in glob.glob(os.path.join(os.path.dirname(p), "libnvrtc-builtins.so*")):
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)  # found by dlopen from libnvrtc
            return ctypes.CDLL(p)
        except OSError:
            continue
    return None


NVRTC = load_nvrtc()


def nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    NVRTC.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def nvrtc_compile(src: str, opts: list[str], cubin: bool = False) -> tuple[int, str, bytes]:
    """(status, log, the cubin when ``cubin`` and the compile succeeded)."""
    lib = NVRTC
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kvk.cu", 0, None, None) == 0
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    binary = b""
    if cubin and rc == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, buf)
        binary = buf.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), binary


def compile_cached(arch: str, no_checks: bool) -> dict:
    """NVRTC on the RawModule source, cached by (source, options, NVRTC version) under build/nvrtc: a
    PTX target (compute_*) gives the log, a cubin target (sm_*) also cuobjdump's resource usage."""
    opts = [*kernels_cuda.nvrtc_options(no_checks), f"--gpu-architecture={arch}"]
    src = kernels_cuda.nvrtc_source()
    key = hashlib.sha256("\0".join([src, *opts, nvrtc_version(), "nvrtc-v1"]).encode()).hexdigest()[:16]
    path = ROOT / "build" / "nvrtc" / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    rc, log, binary = nvrtc_compile(src, opts, cubin=arch.startswith("sm_"))
    got = {"rc": rc, "log": log, "usage": ""}
    if binary:
        cuobjdump = sass_budget.find_tool("cuobjdump")
        if cuobjdump is None:
            missing("cuobjdump", "CUDA toolkit, or the pip wheels deploy/ci-install.sh installs")
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.cubin").write_bytes(binary)
            got["usage"] = subprocess.run([cuobjdump, "-res-usage", str(Path(tmp) / "k.cubin")], capture_output=True,
                                          text=True, check=True).stdout
    if rc == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = path.with_suffix(f".{os.getpid()}.tmp")
        tmp_path.write_text(json.dumps(got))
        os.replace(tmp_path, path)
    return got


@pytest.mark.timeout(3600)  # a cold cubin of every kernel on a loaded 2-core machine; cached by source hash
@pytest.mark.parametrize(("arch", "no_checks"), [("sm_90", False), ("compute_80", True)])
def test_raw_module_source_compiles(arch: str, no_checks: bool) -> None:
    """The checked build to an sm_90 cubin, as cupy.RawModule builds it on the H200: no stack or local
    memory in any kernel, and every decode entry resident at least as many blocks per SM as on main before
    issue 25 (scripts/sass_budget.py BASELINE_BLOCKS; NVRTC's ptxas may allocate otherwise than nvcc's).
    The unchecked build to PTX for sm_80 (front end and NVVM; test_nvcc runs ptxas for sm_80)."""
    if NVRTC is None:
        missing("libnvrtc", "pip package nvidia-cuda-nvrtc, the dev extra")
    got = compile_cached(arch, no_checks)
    assert got["rc"] == 0, got["log"]
    assert "warning" not in got["log"].lower(), got["log"]
    if not arch.startswith("sm_"):
        return
    res = sass_budget.resources(got["usage"])
    assert set(res) == set(launch_plan.kernel_names()), set(res) ^ set(launch_plan.kernel_names())
    spills = {n: r for n, r in res.items() if r.get("stack") or r.get("local")}
    assert not spills, f"NVRTC {nvrtc_version()}: stack or local memory: {spills}"
    low = {n: (sass_budget.blocks_per_sm(r["reg"], r["shared"]), sass_budget.BASELINE_BLOCKS[n])
           for n, r in res.items()
           if n in sass_budget.BASELINE_BLOCKS
           and sass_budget.blocks_per_sm(r["reg"], r["shared"]) < sass_budget.BASELINE_BLOCKS[n]}
    assert not low, f"NVRTC {nvrtc_version()}: blocks/SM (now, main) below main's: {low}"


def test_cuda_backend_without_cupy_fails_clearly() -> None:
    try:
        import cupy  # noqa: F401
    except Exception:
        with pytest.raises(RuntimeError, match="needs cupy"):
            kernels_cuda.CudaBackend()
    else:
        pytest.skip("cupy is installed")
