"""Every kernel compiles with nvcc for sm_80 and sm_90 without warnings
(-Werror all-warnings), with no spill and no stack frame, and with at least the
resident blocks per SM that docs/KERNELS.md documents (computed from the ptxas
registers and shared memory of each entry). The fresh table is written to
build/nvcc-resources.md (paste it into the docs when an entry improves)."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvservice.worker import launch_plan
from tests.ci import find_nvcc, missing

ROOT = Path(__file__).resolve().parents[2]
KDIR = ROOT / "kvservice" / "worker" / "kernels"
OUT = ROOT / "build" / "nvcc"
ARCHS = ("sm_80", "sm_90")
FLAGS = ["-std=c++17", "-Werror", "all-warnings", "-Xptxas", "-v", "-c"]
NVCC = find_nvcc()


@pytest.fixture(autouse=True, scope="module")
def _need_nvcc() -> None:
    """nvcc (on PATH or from the nvidia-cuda-nvcc wheel); skip locally without it, fail under CI."""
    if NVCC is None:
        missing("nvcc", "CUDA toolkit on PATH, or deploy/ci-install.sh installs the nvidia-cuda-nvcc wheels")


def parse_ptxas(text: str) -> list[dict]:
    """One row per (entry function, arch): registers, smem, stack, spill stores/loads."""
    rows, cur = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(\w+)'", line)
        if m:
            cur = {"function": m.group(1), "arch": m.group(2), "smem": 0}
            rows.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            cur["smem"] = int(m.group(1))
    return rows


# Per-SM limits: registers, warps, blocks, shared memory (bytes) and the
# shared memory the system reserves per block.
SM_LIMITS = {"sm_80": (65536, 64, 32, 167936, 1024), "sm_90": (65536, 64, 32, 233472, 1024)}


def blocks_per_sm(arch: str, registers: int, smem: int, threads: int = 128) -> int:
    """Resident blocks of ``threads`` threads, as the CUDA occupancy calculator
    counts them (registers allocated per warp in units of 256)."""
    regs, warps, blocks, shm, reserved = SM_LIMITS[arch]
    wpb = -(-threads // 32)
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = (regs // per_warp) // wpb if registers else blocks
    by_smem = shm // (smem + reserved)
    return min(blocks, warps // wpb, by_regs, by_smem)


def documented_blocks() -> dict[tuple[str, str], int]:
    """(function, arch) -> blocks per SM from the resource table of docs/KERNELS.md."""
    out = {}
    for line in (ROOT / "docs" / "KERNELS.md").read_text().splitlines():
        m = re.match(r"\| (kv_\w+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|", line)
        if m:
            out[(m.group(1), "sm_80")] = int(m.group(6))
            out[(m.group(1), "sm_90")] = int(m.group(7))
    return out


@functools.cache
def nvcc_version() -> str:
    return subprocess.run([str(NVCC), "--version"], capture_output=True, text=True).stdout


def compile_one(src: Path, arch: str, defines: tuple[str, ...] = ()) -> tuple[int, str, list[dict]]:
    flags = [f"-arch={arch}", *FLAGS, *defines]
    h = hashlib.sha256((" ".join(flags) + nvcc_version() + " rows-v3").encode())  # bump when parse_ptxas changes
    for p in sorted(KDIR.glob("*")):  # the source and every header: once per version of what it reads
        if p == src or p.suffix in (".cuh", ".h"):
            h.update(p.name.encode() + p.read_bytes())
    key = OUT / h.hexdigest()[:16] / f"{src.stem}-{arch}{''.join(defines)}.json"
    if key.exists():
        d = json.loads(key.read_text())
        return d["rc"], d["log"], d["rows"]
    key.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(NVCC), *flags, str(src), "-o", str(key.with_suffix(".o"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    log = proc.stdout + proc.stderr
    rows = parse_ptxas(log)
    if proc.returncode == 0:
        key.write_text(json.dumps({"rc": 0, "log": log, "rows": rows}))
    return proc.returncode, log, rows


def table(rows: list[dict]) -> str:
    by = {(r["function"], r["arch"]): r for r in rows}
    lines = ["| function | regs sm_80 | regs sm_90 | smem (B) | spill (B) | blocks/SM sm_80 | blocks/SM sm_90 |",
             "|---|---|---|---|---|---|---|"]
    for f in sorted({r["function"] for r in rows}):
        a, b = by[(f, "sm_80")], by[(f, "sm_90")]
        spill = max(a["spill_stores"] + a["spill_loads"], b["spill_stores"] + b["spill_loads"])
        lines.append(f"| {f} | {a['registers']} | {b['registers']} | {b['smem']} | {spill} | "
                     f"{blocks_per_sm('sm_80', a['registers'], a['smem'])} | "
                     f"{blocks_per_sm('sm_90', b['registers'], b['smem'])} |")
    return "\n".join(lines)


def test_occupancy_model() -> None:
    assert blocks_per_sm("sm_90", 128, 24840) == 4
    assert blocks_per_sm("sm_90", 133, 24840) == 3  # 136 per thread: 15 warps by registers
    assert blocks_per_sm("sm_90", 217, 33288) == 2
    assert blocks_per_sm("sm_80", 24, 0) == 16  # warps limit (64 / 4)
    assert blocks_per_sm("sm_80", 64, 80000) == 2  # shared memory limit


@pytest.mark.timeout(3600)  # every .cu for two archs: minutes on a loaded 2-core machine
def test_nvcc_all_kernels_sm80_sm90() -> None:
    jobs = [(src, arch, ()) for src in sorted(KDIR.glob("*.cu")) for arch in ARCHS]
    jobs.append((KDIR / "decode_attention.cu", "sm_90", ("-DKV_NO_BOUNDS_CHECK",)))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: (j, compile_one(*j)), jobs))
    rows: list[dict] = []
    for (src, arch, defines), (rc, log, r) in results:
        assert rc == 0, f"nvcc {arch} {src.name} {defines} failed:\n{log}"
        assert "warning" not in log.lower(), log
        spills = [x for x in r if x["spill_stores"] or x["spill_loads"] or x["stack"]]
        assert not spills, f"spill or stack frame ({arch} {defines}): {spills}"
        if not defines:
            rows += r
    names = {r["function"] for r in rows}
    assert names == set(launch_plan.kernel_names()), names ^ set(launch_plan.kernel_names())
    report = table(rows)
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "nvcc-resources.md").write_text(report + "\n")
    print("\n" + report)
    for r in rows:  # the Python geometry model agrees with what the compiler laid out
        m = re.fullmatch(r"kv_decode_(\w+)_g(\d+)_d(\d+)", r["function"])
        if m:
            dtype = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[m.group(1)]
            assert r["smem"] == launch_plan.decode_geometry(dtype, int(m.group(2)), int(m.group(3))).smem_bytes, r
    doc = documented_blocks()
    assert {f for f, _ in doc} == names, "docs/KERNELS.md resource table must list every kernel"
    drops = [(r["function"], r["arch"], blocks_per_sm(r["arch"], r["registers"], r["smem"]),
              doc[(r["function"], r["arch"])]) for r in rows
             if blocks_per_sm(r["arch"], r["registers"], r["smem"]) < doc[(r["function"], r["arch"])]]
    assert not drops, f"occupancy below docs/KERNELS.md (function, arch, now, documented): {drops}"
