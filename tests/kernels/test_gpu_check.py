"""bench/gpu_check.py without a GPU: arguments, the report renderer, a clean
exit 2 without cupy, the whole run end to end on the CPU emulation (quick
sizes), and a child that dies taking only its own group down."""

from __future__ import annotations

import ast
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

INJECT = [
    {"kind": "versions", "group": "preflight", "build": "checked", "gpu": "NVIDIA H200", "cupy": "13.6.0"},
    {"kind": "check", "group": "decode-float16", "check": "decode float16-d128-g4", "ok": True, "detail": "ok"},
    {"kind": "perf", "group": "timing", "kernel": "device-to-device copy", "shape": "1024 MiB", "bytes": 2 << 30,
     "gbs": 4000.0, "pct_copy": 1.0, "median_s": 5.4e-4, "min_s": 5.3e-4, "max_s": 5.6e-4},
    {"kind": "perf", "group": "timing", "kernel": "decode (checked)", "shape": "B=64", "bytes": 1 << 30,
     "gbs": 2600.0, "pct_copy": 0.65, "median_s": 4e-4, "min_s": 3.9e-4, "max_s": 4.2e-4, "blocks_per_sm": 4},
    {"kind": "cost", "group": "timing", "kernel": "bounds-check cost", "shape": "B=64", "cost": 0.02,
     "round_costs": [0.01, 0.03]},
    {"kind": "group", "group": "over-4gib", "status": "timed out", "ok": False, "detail": "timed out after 90 s"},
]


def run_script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT))


def lines_of(out: Path) -> list[dict]:
    (jsonl,) = out.glob("gpu-*-cpu-emulation.jsonl")
    return [json.loads(x) for x in jsonl.read_text().splitlines()]


def test_parse_args_defaults() -> None:
    a = gpu_check.parse_args([])
    assert a.backend == "cuda" and a.out == ROOT / "bench" / "results" and (a.rounds, a.launches) == (7, 20)
    e = gpu_check.parse_args(["--backend", "emulated", "--out", "x"])
    assert e.out == Path("x") and (e.rounds, e.launches) == (3, 2)


def test_render_injected_results() -> None:
    text = gpu_check.render(INJECT, {"date": "2030-01-02 03:04 UTC", "gpu": "NVIDIA H200", "backend": "cuda",
                                     "status": "FAILURES"})
    assert "2030-01-02 03:04 UTC" in text and "NVIDIA H200" in text and "cupy 13.6.0" in text
    assert "| decode >= 80% of copy bandwidth | B=64 | 65.0% | MISSED |" in text
    assert "| bounds-check cost <= 2% | B=64 | +2.0% (rounds [0.01, 0.03]) | MET |" in text
    assert "| over-4gib | timed out | timed out after 90 s |" in text
    assert "| decode (checked) | B=64 | 0.400 (0.390 - 0.420) | 2600.0 | 65.0 % | 4 |" in text


def test_dry_run_writes_report(tmp_path: Path) -> None:
    inj = tmp_path / "r.jsonl"
    inj.write_text("\n".join(json.dumps(x) for x in INJECT))
    assert gpu_check.main(["--dry-run", "--inject", str(inj), "--out", str(tmp_path / "o")]) == 0
    assert "MISSED" in (tmp_path / "o" / "gpu-dry-run.md").read_text()


def test_without_cupy_fails_cleanly(tmp_path: Path) -> None:
    code = ("import sys, runpy; sys.modules['cupy'] = None; "
            f"sys.argv = ['gpu_check.py', '--out', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cupy is not importable" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())


def test_emulated_end_to_end(tmp_path: Path) -> None:
    proc = run_script("--backend", "emulated", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()  # noqa: UP017
    report = (tmp_path / f"gpu-{today}-cpu-emulation.md").read_text()
    lines = lines_of(tmp_path)
    checks = [x for x in lines if x["kind"] == "check"]
    assert checks and all(c["ok"] for c in checks)
    assert {x["group"] for x in lines} == {"preflight", *gpu_check.GROUP_TIMEOUTS}
    kernels = {(x["build"], x["name"]) for x in lines if x["kind"] == "kernel"}
    from kvservice.worker import kernel_api

    assert kernels == {(b, n) for b in ("checked", "unchecked") for n in kernel_api.kernel_names()}
    assert {x["kernel"] for x in lines if x["kind"] == "perf"} == {
        "device-to-device copy", "decode (checked)", "decode (unchecked)", "decode (checked+generations)", "append_kv",
        "copy_blocks"}
    assert "FAIL" not in report and "all checks passed" in report and "| bounds-check cost <= 2% |" in report
    assert "| generation-check cost <= 2% |" in report
    assert any(c["check"].startswith("stale_page") and c["ok"] for c in checks)


def test_dead_child_takes_only_its_group(tmp_path: Path) -> None:
    proc = run_script("--backend", "emulated", "--quick", "--out", str(tmp_path), "--groups",
                      "decode-float16,over-4gib", "--fault", "decode-float16")
    assert proc.returncode == 1
    lines = lines_of(tmp_path)
    dead = [x for x in lines if x["kind"] == "group"]
    assert [(x["group"], x["ok"]) for x in dead] == [("decode-float16", False)] and "exit" in dead[0]["status"]
    # the line written before the abort survived, and the next group ran in a fresh process
    first = next(x for x in lines if x["group"] == "decode-float16" and x["kind"] == "check")
    assert first["check"].startswith("decode float16-") and first["ok"]
    later = [x for x in lines if x["group"] == "over-4gib" and x["kind"] == "check"]
    assert len(later) == 2 and all(x["ok"] for x in later)


def test_runs_on_python_310() -> None:
    """The device may have Python 3.10: no 3.11+ syntax or datetime.UTC in what gpu_check imports."""
    files = [SCRIPT, ROOT / "bench" / "gpu_groups.py", ROOT / "bench" / "decode_cases.py"] + [
        ROOT / "kvservice" / "worker" / f"{m}.py"
        for m in ("kernel_api", "kernels_cuda", "kernels_cpu", "reference", "ops_numpy")]
    for f in files:
        src = f.read_text()
        ast.parse(src, filename=str(f), feature_version=(3, 10))
        assert "dt.UTC" not in src and "datetime.UTC" not in src and "tomllib" not in src, f


def test_every_group_has_a_runner() -> None:
    from bench import gpu_groups

    assert set(gpu_groups.GROUPS) == {"preflight", *gpu_check.GROUP_TIMEOUTS}
