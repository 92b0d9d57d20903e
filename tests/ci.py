"""Skips CI must not take. A test that needs a tool CI installs (deploy/ci-install.sh and the
dev extra: kubectl, promtool, prometheus, openssl, nats-server, nvcc, libnvrtc, g++, grpcio-tools,
kubernetes-validate) skips on a developer's machine that lacks it, saying how to install it,
but FAILS when the environment variable CI is set (CI runs with CI=true): a missing tool there
is a broken CI setup, not a reason to report green."""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import sys

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(what: str, how: str) -> None:
    """Skip (locally) or fail (under CI) because ``what`` is not installed; ``how`` installs it."""
    message = f"{what} is not installed ({how})"
    if IN_CI:
        pytest.fail(f"{message}; CI=true and CI installs it, so this is a CI setup error", pytrace=False)
    pytest.skip(message)


def need_tool(tool: str, how: str) -> str:
    """Path of executable ``tool`` on PATH, else skip / fail (see module docstring)."""
    path = shutil.which(tool)
    if path is None:
        missing(tool, how)
    return path


def need_module(name: str, how: str) -> None:
    """Python module ``name`` importable, else skip / fail."""
    if importlib.util.find_spec(name) is None:
        missing(f"Python module {name}", how)


def find_nvcc() -> str | None:
    """nvcc on PATH, else beside this Python (a toolkit linked by deploy/ci-install.sh), else the
    one of the PyPI wheel nvidia-cuda-nvcc (the `nvcc` extra, which ci-install.sh installs)."""
    path = shutil.which("nvcc") or shutil.which("nvcc", path=os.path.dirname(sys.executable))
    if path:
        return path
    try:
        import nvidia  # namespace package of NVIDIA's wheels
    except ImportError:
        return None
    found = sorted(p for root in nvidia.__path__ for p in glob.glob(os.path.join(root, "cu*", "bin", "nvcc")))
    return found[-1] if found else None
