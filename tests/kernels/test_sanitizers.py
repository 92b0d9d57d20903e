"""The same .cu sources built by g++ with AddressSanitizer + UBSan, run in a
subprocess (LD_PRELOAD of libasan/libubsan) on NumPy-allocated caches with
out-of-bounds and off-lattice tables: no sanitizer report, exact records. The
negative control (checks compiled out) must make ASan report the overflow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from spaces import POOLS, check_matrix, layer_caches, matrix
from stale_cases import stale_matrix

from kvservice.worker import kernels_cpu, ops_numpy
from tests.ci import need_tool

DRIVER = Path(__file__).with_name("asan_driver.py")


@pytest.fixture(autouse=True, scope="module")
def _gxx() -> None:
    """g++ builds the sanitizer variants (skip locally without it; fail under CI)."""
    need_tool("g++", "apt package g++; deploy/ci-install.sh installs it")


def run_driver(variant: str, *extra: str) -> subprocess.CompletedProcess:
    kernels_cpu.build(variant)  # build outside the sanitized process
    env = kernels_cpu.sanitizer_env()
    return subprocess.run([sys.executable, str(DRIVER), variant, *extra], capture_output=True, text=True,
                          env=env, timeout=600)


def test_sanitized_build_is_clean_and_records_exact() -> None:
    proc = run_driver("asan")
    assert "AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # row 1 position indptr[1]+1 (= 3: row 0 has 3 pages) holds upper_bound
    assert got["decode-per_layer-0"] == [1, 1, 4, 12, "out_of_bounds"]
    assert got["decode-per_layer-1"] == got["decode-per_layer-0"] == got["validate-per_layer"]
    assert got["decode-interleaved-0"] == [2, 1, 4, 48, "out_of_bounds"]
    assert got["decode-interleaved-1"] == got["decode-interleaved-0"] == got["validate-interleaved"]
    assert got["append-per_layer"] == [2, 1, 1, 48, "out_of_bounds"]
    assert got["append-interleaved"] == [2, 1, 1, 192, "out_of_bounds"]
    assert got["copy-per_layer"] == [1, 0, 1, 12, "out_of_bounds"]
    assert got["copy-interleaved"] == [1, 0, 1, 48, "out_of_bounds"]
    assert got["guard"] == [1, 9000]


def test_cross_space_matrix_under_asan() -> None:
    """Every table of every index space on every layer of every pool kind, under ASan + UBSan
    with each layer on an exact-size buffer: no report, and the records, row status and
    poisoned rows of the in-process NumPy ops."""
    proc = run_driver("asan", "spaces")
    assert "AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(got) == sorted(POOLS)
    for name, spec in POOLS.items():
        check_matrix(got[name], spec)
        assert got[name] == matrix(ops_numpy, spec, layer_caches(ops_numpy, spec)), name


def test_stale_pages_under_asan() -> None:
    """A table whose pages were freed and re-allocated (stale_cases.py) on every kernel, under ASan + UBSan: no
    report, stale_page on exactly A's pages, its row poisoned, nothing written or copied; the NumPy ops agree."""
    proc = run_driver("asan", "stale")
    assert "AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == stale_matrix(ops_numpy)
    for kind in ("per_layer", "interleaved"):
        assert got[f"write-a-{kind}"][0] == got[f"write-b-{kind}"][0] == 0
        for split in (0, 1):
            assert got[f"decode-{kind}-{split}"][:3] + got[f"decode-{kind}-{split}"][4:] == \
                [2, 1, 2, "stale_page", [False, True]]                    # row 1 (A's) only, both its pages
        assert got[f"validate-{kind}"][4:] == ["stale_page", [0, 1 << 5]]
        assert got[f"append-{kind}"][0] == 7 and got[f"append-{kind}"][4:] == ["stale_page", True]
        assert got[f"copy-{kind}"][0] == 1 and got[f"copy-{kind}"][4:] == ["stale_page", True]


def test_negative_control_asan_sees_unchecked_read() -> None:
    proc = run_driver("asan-nocheck", "decode")
    assert proc.returncode != 0
    assert "heap-buffer-overflow" in proc.stderr, proc.stderr[-4000:]
