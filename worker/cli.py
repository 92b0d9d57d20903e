"""`kvworker`: the worker process's command line.

`kvworker info` reports what this machine can run: the kernel sources shipped,
whether CuPy and a CUDA device are present (the `cuda` backend) and whether
nvcc and g++ are on PATH (compile checks, the CPU-emulated kernels). The
serving process (`kvworker serve`) joins with the worker service.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"


def probe() -> dict[str, object]:
    """What this machine offers the worker."""
    info: dict[str, object] = {
        "kernel_sources": sorted(p.name for p in KERNEL_DIR.glob("*.cu")),
        "nvcc": shutil.which("nvcc"),
        "gxx": shutil.which("g++"),
        "cupy": importlib.util.find_spec("cupy") is not None,
        "cuda_devices": [],
    }
    if info["cupy"]:
        try:
            import cupy

            n = cupy.cuda.runtime.getDeviceCount()
            info["cuda_devices"] = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(n)]
        except Exception as exc:  # CuPy installed but no driver/device
            info["cuda_error"] = str(exc)
    info["backends"] = ["cpu"] + (["cuda"] if info["cuda_devices"] else [])
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvworker", description="kvservice worker")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="what this machine can run")
    p.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    info = probe()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:<15} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
