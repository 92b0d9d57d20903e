"""The exact source/options kernels_cuda hands to cupy.RawModule compile with
NVRTC (skipped when libnvrtc is not installed, e.g. no nvidia-cuda-nvrtc wheel;
a failure instead under CI, which installs it with the dev extra)."""

from __future__ import annotations

import ctypes
import glob
import os

import pytest

from kvservice.worker import kernels_cuda
from tests.ci import missing


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


def nvrtc_compile(src: str, opts: list[str]) -> tuple[int, str]:
    lib = NVRTC
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kvk.cu", 0, None, None) == 0
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


@pytest.mark.parametrize(("arch", "no_checks"), [("compute_90", False), ("compute_80", True)])
def test_raw_module_source_compiles(arch: str, no_checks: bool) -> None:
    """To PTX (front end and NVVM, ~4x faster than a cubin): ptxas runs on every
    entry for sm_80 and sm_90 in test_nvcc. Each build is compiled for one arch."""
    if NVRTC is None:
        missing("libnvrtc", "pip package nvidia-cuda-nvrtc, the dev extra")
    opts = [*kernels_cuda.nvrtc_options(no_checks), f"--gpu-architecture={arch}"]
    rc, log = nvrtc_compile(kernels_cuda.nvrtc_source(), opts)
    assert rc == 0, log
    assert "warning" not in log.lower(), log


def test_cuda_backend_without_cupy_fails_clearly() -> None:
    try:
        import cupy  # noqa: F401
    except Exception:
        with pytest.raises(RuntimeError, match="needs cupy"):
            kernels_cuda.CudaBackend()
    else:
        pytest.skip("cupy is installed")
