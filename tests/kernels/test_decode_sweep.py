"""The decode sweep of issue #15 (bench/decode_cases.py: dtype x head_dim x GQA
group, with windows, splits, page sizes, policies, a page past the buffer and
empty rows) on the AddressSanitizer + UBSan build of the kernels, checked
against the float64 torch reference and the NumPy validator's record.

The default run takes six cases that cover every value of every axis; the
full 180-case sweep is marked slow."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import decode_cases as dc
from kvservice.worker import kernels_cpu

DRIVER = Path(__file__).with_name("sweep_driver.py")
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not available")


def run_sweep(tmp_path: Path, full: bool) -> None:
    kernels_cpu.build("asan")  # build outside the sanitized process
    args = [sys.executable, str(DRIVER), "asan", str(tmp_path)] + (["full"] if full else [])
    proc = subprocess.run(args, capture_output=True, text=True, env=kernels_cpu.sanitizer_env(), timeout=3000)
    assert "AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = {d["name"]: d for d in map(json.loads, proc.stdout.strip().splitlines())}
    cases = dc.cases(full)
    assert sorted(lines) == sorted(c.name for c in cases)
    failures = {}
    for case in cases:
        saved = np.load(tmp_path / f"{case.name}.npz")
        got = dc.Result(saved["out"], saved["lse"], tuple(lines[case.name]["record"]), lines[case.name]["error"])
        problems = dc.check_case(case, dc.make_inputs(case), got)
        if problems:
            failures[case.name] = problems
    assert not failures, failures


def test_default_cases_cover_every_axis() -> None:
    cs = dc.cases()
    assert {c.dtype for c in cs} == set(dc.DTYPES)
    assert {c.head_dim for c in cs} == set(dc.HEAD_DIMS)
    assert {c.group for c in cs} == set(dc.GROUPS)
    assert {c.variant for c in cs} == set(dc.VARIANTS)
    full = dc.cases(full=True)
    assert {(c.dtype, c.head_dim, c.group) for c in full} == {
        (d, h, g) for d in dc.DTYPES for h in dc.HEAD_DIMS for g in dc.GROUPS}
    assert len({c.name for c in full}) == len(full)


def test_sweep_under_asan(tmp_path: Path) -> None:
    run_sweep(tmp_path, full=False)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_full_sweep_under_asan(tmp_path: Path) -> None:
    run_sweep(tmp_path, full=True)
