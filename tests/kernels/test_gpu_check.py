"""bench/gpu_check.py on a machine without a GPU: argument parsing, report
writing (dry run with injected results), a clean failure without cupy, and
the whole script end to end on the CPU emulation at toy sizes."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

INJECT = {
    "gpu": "NVIDIA H200", "date": "2030-01-02 03:04 UTC",
    "checks": [{"check": "decode float16", "ok": True, "detail": "rel err 1e-4"}],
    "perf": [
        {"kernel": "device-to-device copy", "shape": "1 GiB", "ms": 0.5, "gbs": 4000.0, "pct_copy": 1.0},
        {"kernel": "decode (checked)", "shape": "B=64", "ms": 0.4, "gbs": 2600.0, "pct_copy": 0.65},
        {"kernel": "bounds-check cost", "shape": "-", "ms": None, "gbs": None, "cost": 0.02},
    ],
}


def test_parse_args_defaults() -> None:
    a = gpu_check.parse_args([])
    assert a.backend == "cuda" and not a.dry_run
    assert a.out.name == f"gpu-{dt.date.today().isoformat()}.md"
    assert gpu_check.parse_args(["--out", "x.md", "--dry-run"]).out == Path("x.md")


def test_dry_run_renders_injected_results(tmp_path: Path) -> None:
    inj = tmp_path / "r.json"
    inj.write_text(json.dumps(INJECT))
    out = tmp_path / "sub" / "gpu.md"
    assert gpu_check.main(["--dry-run", "--inject", str(inj), "--out", str(out)]) == 0
    text = out.read_text()
    assert "2030-01-02 03:04 UTC" in text and "NVIDIA H200" in text
    assert "| decode >= 70% of copy bandwidth | 65.0% | MISSED |" in text
    assert "| bounds-check cost <= 3% | +2.0% | MET |" in text


def test_without_cupy_fails_cleanly(tmp_path: Path) -> None:
    code = ("import sys, runpy; sys.modules['cupy'] = None; "
            f"sys.argv = ['gpu_check.py', '--out', {str(tmp_path / 'r.md')!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cupy is not importable" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r.md").exists()


def test_cpu_backend_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "cpu.md"
    assert gpu_check.main(["--backend", "cpu", "--quick", "--iters", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "FAIL" not in text and "| decode (unchecked) |" in text and "CPU emulation" in text
