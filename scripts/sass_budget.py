"""Static instruction budget of the decode tile loop, read from the SASS nvcc emits for sm_90.

    python3 scripts/sass_budget.py                  # table of every decode entry (markdown)
    python3 scripts/sass_budget.py --check          # exit 1 when an entry is over a limit (below)
    python3 scripts/sass_budget.py --json FILE      # the figures as JSON as well
    python3 scripts/sass_budget.py --real-only      # the real build only (e.g. an older source tree)
    python3 scripts/sass_budget.py --rare           # also what the boundary mask and the rescale cost a tile
    python3 scripts/sass_budget.py --baseline-of REV  # blocks/SM of every entry of the sources at git REV

What it does, with no GPU: compiles kvservice/worker/kernels/decode_attention.cu to a cubin for
sm_90 (nvcc, cached under build/sass/<hash of sources, flags, nvcc version>/), disassembles it
(cuobjdump -sass, or nvdisasm), and per ``kv_decode_*`` entry finds the tile loop(s): the innermost
loops (a backward branch and its target) whose body holds both ``LDGSTS`` (cp.async) and
``BAR.SYNC``; there are two, the one-page loop and the per-copy loop (told apart by the page
divider's IMAD.HI). For each tile loop it builds the control-flow graph of the body and reports

- ``static``: instructions in the body (every path of a tile, counted once);
- ``max``: the longest path from the loop head to its back edge = the most instructions one thread
  can issue for one tile; ``min``: the shortest such path;
- the instruction mix of the body (fp32 math, conversions, shuffles, MUFU, shared loads, copies,
  integer/address, control), and whether it CALLs a subroutine (a slow division, say);

normalised to one 8 KB tile of K + V (the tile of every entry but float32 d512, whose tile is
16 KB). Three builds (VARIANTS): the real one; the steady-state tile (-DKV_SASS_STEADY compiles out
the two rare branches: the boundary masks of a block's first and last tiles, and the lazy rescale)
whose longest path is the budgeted figure (BUDGET); and that tile with a stand-in for a per-page
generation check in the loop (-DKV_SASS_PROBE_PAGE_CHECK: two loads and a compare per page), held to
the same budget. The real build's longest path (the rare tile: both rare branches taken) has its own
limit (RARE_TILE_LIMIT), and ``amortized`` charges the rare tiles a block can take at the GPU timing
shapes (bench/decode_cases.py) against the budget. Registers, shared memory, stack and spill bytes
come from ``cuobjdump -res-usage`` of the real build; any stack or local memory, and fewer resident
blocks per SM than main had before issue 25 (BASELINE_BLOCKS), fail ``--check``.

The performance model: a block-tile of B bytes is processed by 4 warps that each issue N
instructions, i.e. B / (4 N) bytes per warp instruction. An H200 issues at most 132 SMs x 4
schedulers x 1.98 GHz = 1.045e12 warp instructions/s, so at issue efficiency e the tile loop alone
can stream 1.045e12 * e * B / (4 N) bytes/s; that is compared with the 4.3 TB/s device copy
measured on the lent H200 (docs/KERNELS.md). Tools are found on PATH, beside this Python, or in
NVIDIA's wheels (the ``nvcc`` extra: nvidia-cuda-nvcc, nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KDIR = ROOT / "kvservice" / "worker" / "kernels"
SOURCE = KDIR / "decode_attention.cu"
CACHE = ROOT / "build" / "sass"
ARCH = "sm_90"
FLAGS = ["-cubin", f"-arch={ARCH}", "-std=c++17", f"-I{KDIR}"]
PROBE_DEFINE = "-DKV_SASS_PROBE_PAGE_CHECK"

# H200 model constants (docs/KERNELS.md "Performance model")
SMS, SCHEDULERS, CLOCK_HZ = 132, 4, 1.98e9
COPY_BYTES_S = 4.3e12  # device-to-device copy measured on the lent H200 (KINDS.md)
WARPS = 4  # 128 threads per decode block
TILE_UNIT = 8192  # budgets are per thread per 8 KB of K + V

#: Budget: the longest path through the steady-state tile loop, instructions per thread per 8 KB, by
#: heads per block (issue 25: f16_g4_d128 <= 420 from ~649, the 8-heads entries <= 650 from ~1,012).
#: It holds with the --probe-page-check stand-in too (headroom for a per-page generation check), and
#: AMORTIZED (below) holds it at the GPU timing shapes with the rare branches counted.
BUDGET = {1: 420, 4: 420, 8: 650}
#: Limit of the real build's longest path (a tile that takes every rare branch: a boundary mask and a
#: rescale), per 8 KB: the budget plus a quarter. Such a tile is rare (a block's first and last tiles,
#: and a rescale when a score tops the reference max by 2^8), and the ring keeps STAGES - 1 tiles in
#: flight across it, so its cost spreads over the block (AMORTIZED); the limit stops the rare branches
#: from growing unnoticed.
RARE_TILE_LIMIT = {g: b * 5 // 4 for g, b in BUDGET.items()}

#: Resident blocks per SM on sm_90 of every decode entry on main before issue 25's diet (ca455de,
#: `python3 scripts/sass_budget.py --baseline-of ca455de`): --check fails on an entry below it
#: (issue 25: "occupancy no lower").
BASELINE_REV = "ca455de"
BASELINE_BLOCKS = {
    **{f"kv_decode_{t}_g1_d{d}": 6 for t in ("f16", "bf16") for d in (32, 64, 128, 256)},
    **{f"kv_decode_{t}_g1_d512": 5 for t in ("f16", "bf16")},
    **{f"kv_decode_{t}_g4_d{d}": 4 for t in ("f16", "bf16") for d in (32, 64, 128, 256)},
    **{f"kv_decode_{t}_g4_d512": 2 for t in ("f16", "bf16")},
    **{f"kv_decode_{t}_g8_d{d}": 2 for t in ("f16", "bf16") for d in (32, 64, 128, 256)},
    **{f"kv_decode_f32_g1_d{d}": 7 for d in (32, 64, 128)}, "kv_decode_f32_g1_d256": 6, "kv_decode_f32_g1_d512": 5,
    **{f"kv_decode_f32_g4_d{d}": 4 for d in (32, 64, 128, 256)}, "kv_decode_f32_g4_d512": 2,
    **{f"kv_decode_f32_g8_d{d}": 3 for d in (32, 64, 128)}, "kv_decode_f32_g8_d256": 2,
}

CATEGORIES = (
    ("fp32", ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK", "FSET")),
    ("convert", ("HADD2", "F2F", "PRMT", "I2F", "F2I", "F2FP", "HMUL2", "HFMA2")),
    ("shuffle", ("SHFL",)),
    ("mufu", ("MUFU",)),
    ("shared", ("LDS", "STS", "LDSM")),
    ("cp.async", ("LDGSTS", "LDGDEPBAR", "DEPBAR")),
    ("global", ("LDG", "STG", "RED", "ATOM", "ATOMG")),
    ("barrier", ("BAR", "WARPSYNC", "NOP")),
    ("integer", ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "ISETP", "VIADD", "IABS", "IMNMX", "SEL", "MOV",
                 "UMOV", "ULDC", "ULEA", "S2R", "S2UR", "UIADD3", "UIMAD", "USHF", "ULOP3", "R2UR", "PLOP3",
                 "P2R", "R2P", "IADD", "VIMNMX", "UISETP", "USEL", "FLO", "POPC", "BREV", "IMUL")),
    ("control", ("BRA", "BSSY", "BSYNC", "CALL", "RET", "EXIT", "YIELD", "BRX", "JMP")),
)


def find_tool(name: str) -> str | None:
    """``name`` on PATH, beside this Python, or in an NVIDIA wheel (nvidia/cu*/bin/name)."""
    path = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if path:
        return path
    try:
        import nvidia  # namespace package of NVIDIA's wheels
    except ImportError:
        return None
    found = sorted(p for r in nvidia.__path__ for p in glob.glob(os.path.join(r, "cu*", "bin", name)))
    return found[-1] if found else None


def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]


def source_key(defines: tuple[str, ...], nvcc: str, kdir: Path = KDIR) -> str:
    """Hash of what the build reads: decode_attention.cu, the headers, flags and nvcc (another kernel's
    .cu changing does not rebuild it)."""
    h = hashlib.sha256(" ".join([*FLAGS, *defines, _nvcc_version(nvcc), "sass-v2"]).encode())
    for p in sorted(kdir.glob("*")):
        if p.name == SOURCE.name or p.suffix in (".cuh", ".h"):
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def disassemble(defines: tuple[str, ...] = (), kdir: Path = KDIR) -> tuple[str, str]:
    """(SASS text, resource-usage text) of ``kdir``/decode_attention.cu for sm_90, cached by source hash."""
    nvcc = find_tool("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc not found (CUDA toolkit on PATH, or pip install -e '.[nvcc]')")
    d = CACHE / source_key(defines, nvcc, kdir)
    sass, res = d / f"decode{''.join(defines)}.sass", d / f"decode{''.join(defines)}.res"
    if sass.exists() and res.exists():
        return sass.read_text(), res.read_text()
    d.mkdir(parents=True, exist_ok=True)
    cubin = d / f"decode{''.join(defines)}.cubin"
    tmp = cubin.with_suffix(f".{os.getpid()}.tmp")
    flags = [f if f != f"-I{KDIR}" else f"-I{kdir}" for f in FLAGS]
    proc = subprocess.run([nvcc, *flags, *defines, str(kdir / SOURCE.name), "-o", str(tmp)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{proc.stdout}{proc.stderr}")
    os.replace(tmp, cubin)
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if cuobjdump is None:
        raise RuntimeError("cuobjdump not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump: the nvcc extra)")
    if cuobjdump:
        text = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    else:  # pragma: no cover - nvdisasm fallback
        text = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    for path, body in ((sass, text), (res, usage)):
        t = path.with_suffix(f".{os.getpid()}.tmp")
        t.write_text(body)
        os.replace(t, path)
    return text, usage


# ---- SASS parsing --------------------------------------------------------------------------------
_INS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FUNC = re.compile(r"Function : (\w+)")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
_TARGET = re.compile(r"(0x[0-9a-f]+)\s*$")


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Function name -> [(address, instruction text)]."""
    out: dict[str, list[tuple[int, str]]] = {}
    cur: list[tuple[int, str]] | None = None
    for line in sass.splitlines():
        m = _FUNC.search(line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = _INS.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(text: str) -> str:
    """Base opcode: 'IMAD' of '@P0 IMAD.WIDE.U32 R1, ...'."""
    return _PRED.sub("", text).split()[0].split(".")[0]


def is_branch(text: str) -> bool:
    return opcode(text) == "BRA"


def branch_target(text: str) -> int | None:
    m = _TARGET.search(text)
    return int(m.group(1), 16) if (m and is_branch(text)) else None


def unconditional(text: str) -> bool:
    """A branch that always jumps (no guard predicate, no predicate operand) or an EXIT/RET."""
    op = opcode(text)
    if op in ("EXIT", "RET"):
        return not text.startswith("@")
    return op == "BRA" and not text.startswith("@") and re.match(r"^BRA\s+(!?U?P[T0-9]+,)", text) is None


def category(op: str) -> str:
    for name, ops in CATEGORIES:
        if op in ops:
            return name
    return "other"


@dataclass
class Loop:
    head: int  # address of the first instruction
    tail: int  # address of the backward branch
    static: int = 0
    longest: int = 0
    shortest: int = 0
    mix: dict[str, int] = field(default_factory=dict)
    opcodes: dict[str, int] = field(default_factory=dict)
    ldg: int = 0
    calls: int = 0
    inner_loops: int = 0
    kind: str = ""  # "one page" (no division in the loop) or "per copy" (IMAD.HI: the page divider)


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(head, tail) of every backward branch."""
    out = []
    for a, t in ins:
        tgt = branch_target(t)
        if tgt is not None and tgt <= a:
            out.append((tgt, a))
    return out


def analyse(ins: list[tuple[int, str]], head: int, tail: int) -> Loop:
    """Counts and paths of the loop body [head, tail]; the body must be a DAG apart from its back edge."""
    body = [(a, t) for a, t in ins if head <= a <= tail]
    addrs = [a for a, _ in body]
    # basic-block leaders: the head, branch targets inside the body, instructions after a branch
    leaders = {head}
    for i, (_a, t) in enumerate(body):
        tgt = branch_target(t)
        if tgt is not None and head <= tgt <= tail and tgt != head:
            leaders.add(tgt)
        if is_branch(t) and i + 1 < len(body):
            leaders.add(addrs[i + 1])
    starts = sorted(leaders)
    blocks = []
    for k, s in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else tail + 1
        blocks.append([(a, t) for a, t in body if s <= a < end])
    block_of = {blk[0][0]: k for k, blk in enumerate(blocks)}
    succ: list[list[int]] = []
    inner = 0
    for k, blk in enumerate(blocks):
        last = blk[-1][1]
        nxt = []
        tgt = branch_target(last)
        if tgt is not None:
            if tgt in block_of and tgt != head:
                if tgt <= blk[-1][0]:
                    inner += 1  # a backward branch to a block inside the body: an inner loop
                else:
                    nxt.append(block_of[tgt])
        if not unconditional(last) and k + 1 < len(blocks):
            nxt.append(k + 1)
        succ.append(nxt)
    # longest / shortest path from block 0 to the block holding the back edge (addresses ascend: a DAG)
    last_block = len(blocks) - 1
    neg = float("-inf")
    longest = [neg] * len(blocks)
    shortest = [float("inf")] * len(blocks)
    longest[0] = shortest[0] = len(blocks[0])
    for k in range(len(blocks)):
        if longest[k] == neg:
            continue
        for s in succ[k]:
            longest[s] = max(longest[s], longest[k] + len(blocks[s]))
            shortest[s] = min(shortest[s], shortest[k] + len(blocks[s]))
    ops = Counter(opcode(t) for _, t in body)
    mix: Counter[str] = Counter()
    for op, n in ops.items():
        mix[category(op)] += n
    # kv_decode_segment<ONE_PAGE = false> finds each copy's page with KvFastDiv (a multiply-high);
    # the one-page loop divides nothing
    kind = "per copy" if any(_PRED.sub("", t).startswith("IMAD.HI") for _, t in body) else "one page"
    return Loop(head, tail, len(body), int(longest[last_block]), int(shortest[last_block]), dict(mix),
                dict(ops.most_common()), ops.get("LDG", 0), ops.get("CALL", 0), inner, kind)


def tile_loops(ins: list[tuple[int, str]]) -> list[Loop]:
    """The innermost loops whose body holds LDGSTS and BAR.SYNC: the cp.async tile loops."""
    cands = []
    for head, tail in loops(ins):
        ops = Counter(opcode(t) for a, t in ins if head <= a <= tail)
        if ops.get("LDGSTS") and ops.get("BAR"):
            cands.append((head, tail))
    inner = [c for c in cands if not any(o != c and c[0] <= o[0] and o[1] <= c[1] for o in cands)]
    return [analyse(ins, h, t) for h, t in sorted(inner)]


def resources(usage: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in usage.splitlines():
        m = re.search(r"Function (\w+):", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            out[name] = {k.lower(): int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
            name = None
    return out


def blocks_per_sm(registers: int, shared: int, threads: int = 128) -> int:
    """Resident blocks on sm_90 (registers per warp in units of 256; ``shared`` includes the 1 KB
    the system reserves per block, as cuobjdump -res-usage reports it)."""
    wpb = threads // 32
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = (65536 // per_warp) // wpb if registers else 32
    return min(32, 64 // wpb, by_regs, 233472 // max(shared, 1))


def baseline_of(rev: str) -> dict[str, int]:
    """Resident blocks per SM (sm_90) of every decode entry of the kernel sources at git revision ``rev``."""
    import io
    import tarfile
    import tempfile

    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, str(KDIR.relative_to(ROOT))],
                          capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tarfile.open(fileobj=io.BytesIO(blob)).extractall(tmp, **kw)
        _, usage = disassemble((), Path(tmp) / KDIR.relative_to(ROOT))
    return {name: blocks_per_sm(r.get("reg", 0), r.get("shared", 0))
            for name, r in sorted(resources(usage).items()) if _ENTRY.match(name)}


# ---- the report -------------------------------------------------------------------------------------
_ENTRY = re.compile(r"kv_decode_(f32|f16|bf16)_g(\d+)_d(\d+)$")
_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def tile_bytes(entry: str) -> int:
    sys.path.insert(0, str(ROOT))
    from kvservice.worker.launch_plan import decode_geometry

    m = _ENTRY.match(entry)
    return decode_geometry(_DTYPE[m.group(1)], int(m.group(2)), int(m.group(3))).tile_bytes


def model(per_8k: float) -> dict[str, float]:
    """Bytes per warp instruction and the issue-bound bandwidth (fraction of the copy) at 100 / 70 %."""
    bpwi = TILE_UNIT / (WARPS * per_8k)
    peak = SMS * SCHEDULERS * CLOCK_HZ * bpwi
    return {"bytes_per_warp_instr": bpwi, "issue_bound_pct_copy": peak / COPY_BYTES_S,
            "at_70pct_issue_pct_copy": 0.7 * peak / COPY_BYTES_S}


#: the three builds: the real one (registers, occupancy, and the full longest path with the rare
#: branches), the steady-state tile (KV_SASS_STEADY: boundary masks and rescale compiled out: the
#: tile every tile but a block's first and last runs, bar a rescale), and the steady tile with a
#: stand-in per-page generation check in the loop (KV_SASS_PROBE_PAGE_CHECK)
VARIANTS = {"real": (), "steady": ("-DKV_SASS_STEADY",), "probe": ("-DKV_SASS_STEADY", PROBE_DEFINE)}
#: --rare: the real build less one rare branch each (what the mask and the rescale cost per occurrence)
RARE_VARIANTS = {"nomask": ("-DKV_SASS_NO_MASK",), "norescale": ("-DKV_SASS_NO_RESCALE",)}


def loops_of(defines: tuple[str, ...]) -> tuple[dict[str, list[Loop]], dict[str, dict[str, int]]]:
    sass, usage = disassemble(defines)
    return ({name: tile_loops(ins) for name, ins in functions(sass).items() if _ENTRY.match(name)},
            resources(usage))


def per_8k(loops: list[Loop], tb: int) -> float:
    return max((lp.longest for lp in loops), default=float("inf")) * TILE_UNIT / tb


def by_kind(loops: list[dict], tb: int) -> dict[str, float]:
    """Longest path per 8 KB of the one-page loop and of the per-copy loop."""
    return {k: max(lp["longest"] for lp in loops if lp["kind"] == k) * TILE_UNIT / tb
            for k in ("one page", "per copy") if any(lp["kind"] == k for lp in loops)}


def report(variants: tuple[str, ...] = ("real", "steady", "probe")) -> list[dict]:
    every = {**VARIANTS, **RARE_VARIANTS}
    with ThreadPoolExecutor(max_workers=2) as pool:  # two compiles side by side (2 cores)
        got = dict(zip(variants, pool.map(lambda v: loops_of(every[v]), variants), strict=True))
    real_loops, res = got["real"]
    rows = []
    for name in sorted(real_loops):
        m = _ENTRY.match(name)
        tb, r = tile_bytes(name), res.get(name, {})
        row: dict = {"entry": name, "heads": int(m.group(2)), "tile_bytes": tb, "budget": BUDGET[int(m.group(2))],
                     "registers": r.get("reg", 0), "shared": r.get("shared", 0), "stack": r.get("stack", 0),
                     "local": r.get("local", 0), "blocks_per_sm": blocks_per_sm(r.get("reg", 0), r.get("shared", 0))}
        for v in variants:
            loops = got[v][0].get(name, [])
            row[v] = {"per_8k": per_8k(loops, tb), "loops": [asdict(lp) for lp in loops]}
            row[v]["by_kind"] = by_kind(row[v]["loops"], tb)
        row.update(model(row["steady"]["per_8k"] if "steady" in row else row["real"]["per_8k"]))
        rows.append(row)
    return rows


def rescale_slack() -> float:
    """decode_attention.cu's KV_RESCALE_SLACK (log2 domain)."""
    return float(re.search(r"#define KV_RESCALE_SLACK ([0-9.]+)f", SOURCE.read_text()).group(1))


def amortized(rows: list[dict]) -> list[dict]:
    """The tile loop at the GPU timing shapes (bench/decode_cases.py TIMING_SHAPES: float16, full pages of
    TIMING_PAGE_SIZE, q and cache uniform in TIMING_RANGE), rare branches counted, per thread per 8 KB.

    The launch as kernel_api plans it on an H200 (default_splits with SMS x the entry's blocks/SM slots);
    per block, a tile takes a rare branch when it is
    - a boundary tile: rows outside the block's token range are masked on its last tile when the range
      is not a whole number of tiles (at these shapes every range starts on a tile boundary);
    - a rescale tile of some lane group of the warp: every lane group rescales on its first tile (the
      reference max starts at -FLT_MAX), then only when a score tops its reference max by more than
      KV_RESCALE_SLACK; each such move raises the max by more than the slack, and the scores of this
      data lie in [d lo^2, d hi^2] log2(e) / sqrt(d), so a lane group rescales at most
      1 + floor(width / slack) times, a warp at most 1 + (lane groups per warp) floor(width / slack).
    Every rare tile is charged the real build's longest path (both rare branches), the others the steady
    tile: (steady (tiles - rare) + real rare) / tiles over the whole launch."""
    sys.path.insert(0, str(ROOT))
    import math

    import numpy as np

    from bench.decode_cases import TIMING_PAGE_SIZE, TIMING_RANGE, TIMING_SHAPES
    from kvservice.worker import kernel_api as api
    from kvservice.worker import launch_plan

    by = {r["entry"]: r for r in rows}
    ps, slack = TIMING_PAGE_SIZE, rescale_slack()
    lo, hi = (float(np.float16(x)) for x in TIMING_RANGE)
    out = []
    for b, ctx, hq, hkv, d in TIMING_SHAPES:
        entry = api.decode_entry("float16", hq // hkv, d)
        r = by.get(entry)
        if r is None or "steady" not in r:
            continue
        geo = launch_plan.decode_geometry("float16", r["heads"], d)
        blocks = b * hkv * math.ceil(hq // hkv / r["heads"])
        max_pages = ctx // ps
        pps = api.default_splits(blocks, max_pages, SMS * r["blocks_per_sm"])
        splits = [pps] * (max_pages // pps) + ([max_pages % pps] if max_pages % pps else []) if pps else [max_pages]
        width = d * (hi * hi - lo * lo) * math.log2(math.e) / math.sqrt(d)
        per_warp = 1 + (32 // geo.lanes) * int(width // slack)
        tiles = rare = 0
        for pages in splits:
            n = pages * ps
            t = -(-n // geo.tile_tokens)
            tiles += t
            rare += min(t, per_warp + (1 if n % geo.tile_tokens else 0))
        kind = "one page" if ps % geo.tile_tokens == 0 else "per copy"  # the loop these pages run
        steady, real = r["steady"]["by_kind"][kind], r["real"]["by_kind"][kind]
        out.append({"shape": f"B={b} ctx={ctx} hq={hq} hkv={hkv} d={d}", "entry": entry, "loop": kind,
                    "splits": len(splits), "tiles_per_block": tiles / len(splits), "rare_per_block": rare / len(splits),
                    "steady": steady, "real": real, "amortized": (steady * (tiles - rare) + real * rare) / tiles,
                    "budget": r["budget"]})
    return out


def problems(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        for v in ("real", "steady", "probe"):
            if v not in r:
                continue
            if not r[v]["loops"]:
                out.append(f"{r['entry']} ({v}): no tile loop found (LDGSTS + BAR.SYNC in an innermost loop)")
            for lp in r[v]["loops"]:
                if lp["calls"] or lp["inner_loops"]:
                    out.append(f"{r['entry']} ({v}): tile loop at {lp['head']:#x} has {lp['calls']} CALL(s) and "
                               f"{lp['inner_loops']} inner loop(s): its path counts are not per-tile bounds")
            if v != "real" and r[v]["per_8k"] > r["budget"]:
                out.append(f"{r['entry']} ({v}): {r[v]['per_8k']:.0f} instructions per thread per 8 KB tile > "
                           f"budget {r['budget']}")
        if r["real"]["per_8k"] > RARE_TILE_LIMIT[r["heads"]]:
            out.append(f"{r['entry']} (real): a tile with every rare branch costs {r['real']['per_8k']:.0f} per 8 KB "
                       f"> {RARE_TILE_LIMIT[r['heads']]}")
        if r["stack"] or r["local"]:
            out.append(f"{r['entry']}: stack {r['stack']} B, local {r['local']} B (spill)")
        if r["entry"] not in BASELINE_BLOCKS:
            out.append(f"{r['entry']}: no baseline occupancy (add it to BASELINE_BLOCKS)")
        elif r["blocks_per_sm"] < BASELINE_BLOCKS[r["entry"]]:
            out.append(f"{r['entry']}: {r['blocks_per_sm']} blocks/SM < {BASELINE_BLOCKS[r['entry']]} on main "
                       f"({BASELINE_REV}): {r['registers']} registers")
    for a in amortized(rows):
        if a["amortized"] > a["budget"]:
            out.append(f"{a['entry']} at {a['shape']}: {a['amortized']:.0f} per 8 KB with the rare tiles "
                       f"> budget {a['budget']}")
    return out


def _paths(v: dict) -> str:
    """Longest path of the one-page loop / the per-copy loop."""
    return " / ".join(str(max((lp["longest"] for lp in v["loops"] if lp["kind"] == k), default="-"))
                      for k in ("one page", "per copy"))


def markdown(rows: list[dict]) -> str:
    head = ("| entry | tile (B) | steady tile: longest path per loop (one page / per copy) | steady, per 8 KB | "
            "+ page check, per 8 KB | budget | with rare branches, per 8 KB (limit) | FFMA+FMUL+FADD | SHFL | MUFU | "
            f"int/addr | regs | blocks/SM (main {BASELINE_REV}) | B per warp instr | "
            "issue bound, % of copy at 100 % / 70 % issue |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        st = r.get("steady") or r["real"]
        lp = max(st["loops"], key=lambda x: x["longest"]) if st["loops"] else {"opcodes": {}, "mix": {}}
        ops = lp["opcodes"]
        fp = sum(ops.get(k, 0) for k in ("FFMA", "FMUL", "FADD"))
        probe = f"{r['probe']['per_8k']:.0f}" if "probe" in r else "-"
        lines.append(
            f"| {r['entry']} | {r['tile_bytes']} | {_paths(st)} | {st['per_8k']:.0f} | {probe} | {r['budget']} | "
            f"{r['real']['per_8k']:.0f} ({RARE_TILE_LIMIT[r['heads']]}) | {fp} | {ops.get('SHFL', 0)} | "
            f"{ops.get('MUFU', 0)} | {lp['mix'].get('integer', 0)} | {r['registers']} | {r['blocks_per_sm']} "
            f"({BASELINE_BLOCKS.get(r['entry'], '-')}) | {r['bytes_per_warp_instr']:.1f} | "
            f"{100 * r['issue_bound_pct_copy']:.0f} % / {100 * r['at_70pct_issue_pct_copy']:.0f} % |")
    am = amortized(rows)
    if am:
        head = ("| timing shape (float16, page 16) | entry | loop | splits | tiles per block | "
                "rare tiles per block (at most) | steady / rare tile, per 8 KB | amortized, per 8 KB | "
                "B per warp instr | issue bound, % of copy at 100 % / 70 % issue | budget |")
        lines += ["", head, "|" + "---|" * (head.count("|") - 1)]
        for a in am:
            m = model(a["amortized"])
            lines.append(f"| {a['shape']} | {a['entry']} | {a['loop']} | {a['splits']} | {a['tiles_per_block']:.1f} | "
                         f"{a['rare_per_block']:.1f} | {a['steady']:.0f} / {a['real']:.0f} | {a['amortized']:.1f} | "
                         f"{m['bytes_per_warp_instr']:.1f} | {100 * m['issue_bound_pct_copy']:.0f} % / "
                         f"{100 * m['at_70pct_issue_pct_copy']:.0f} % | {a['budget']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when an entry is over budget or spills")
    p.add_argument("--real-only", action="store_true",
                   help="only the real build (longest path with the rare branches; e.g. for an older source)")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON too")
    p.add_argument("--entry", default=None, help="print the opcode mix of this entry's tile loop(s)")
    p.add_argument("--rare", action="store_true",
                   help="also build without each rare branch and print what the mask and the rescale cost a tile")
    p.add_argument("--baseline-of", metavar="REV", default=None,
                   help="print the blocks/SM of every decode entry at git revision REV (BASELINE_BLOCKS) and exit")
    a = p.parse_args(argv)
    if a.baseline_of:
        print(json.dumps(baseline_of(a.baseline_of), indent=1))
        return 0
    variants = ("real",) if a.real_only else ("real", "steady", "probe")
    rows = report(variants + (tuple(RARE_VARIANTS) if a.rare else ()))
    print(markdown(rows), end="")
    if a.rare:
        print("\n| entry | rare tile, per 8 KB | boundary mask costs | rescale costs |\n|---|---|---|---|")
        for r in rows:
            real = r["real"]["per_8k"]
            print(f"| {r['entry']} | {real:.0f} | {real - r['nomask']['per_8k']:.0f} | "
                  f"{real - r['norescale']['per_8k']:.0f} |")
    if a.entry:
        for r in rows:
            if r["entry"] == a.entry:
                for v in ("real", "steady", "probe"):
                    for lp in r.get(v, {}).get("loops", []):
                        print(f"\n{a.entry} [{v}] loop {lp['head']:#x}-{lp['tail']:#x}: longest {lp['longest']}, "
                              f"shortest {lp['shortest']}, static {lp['static']}, mix {lp['mix']}\n  {lp['opcodes']}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rows, indent=1))
    bad = problems(rows)
    for b in bad:
        print(f"OVER BUDGET: {b}", file=sys.stderr)
    return 1 if (a.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
