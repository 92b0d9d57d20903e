"""GPU check of the paged KV kernels, built so one short device window is enough.

    python3 bench/gpu_check.py --out DIR            # on the GPU machine (cupy, torch, numpy)
    python3 bench/gpu_check.py --out DIR --backend emulated [--quick]   # anywhere: CPU emulation

Writes ``DIR/gpu-<date>-<gpu>.jsonl`` (one JSON object per result, appended
and flushed as each finishes) and ``DIR/gpu-<date>-<gpu>.md`` (the report,
re-rendered after every group), plus ``.log`` with each child's output.

1. preflight: two child processes at once compile the checked and the
   ``-DKV_NO_BOUNDS_CHECK`` modules, resolve every kernel and print the
   CuPy / NVRTC / driver versions and each kernel's registers, shared and
   local (spill) bytes and resident blocks per SM. Exit 2 if that fails.
2. every group runs in its own child process (a sticky CUDA error such as an
   illegal address poisons that group only), each check synchronised, with
   a time budget for the whole run, preflight included (default 450 s):
   ``decode-<dtype>`` (bench/decode_cases.py: head_dim x GQA group with
   windows, splits, page sizes, policies, bad pages, empty rows; vs the torch
   float64 reference; one group per cache dtype), ``timing`` (N back-to-back launches between one pair of
   events, checked and unchecked builds interleaved over rounds: median and
   spread, against a device-to-device copy), ``append-copy-guard``,
   ``over-4gib`` (pages past byte 2^32 compared with host-built contents,
   including the pages a wrapped 32-bit offset would have hit).
Exit: 0 every check passed, 1 a check or group failed, 2 cannot run.
Imports only numpy, torch, cupy and ``worker`` / ``bench`` modules (no
protobuf, no gRPC); Python 3.10+.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_DECODE = 0.80  # decode GB/s >= 80 % of device-to-device copy GB/s
TARGET_CHECK_COST = 0.03  # checked vs unchecked decode time <= +3 %
BUDGET_S = 450.0  # the whole run, preflight included
PREFLIGHT_TIMEOUT_S = 240.0
# group -> timeout in seconds (each also capped by what is left of the budget);
# the sweep is one group per dtype, so a fault or a slow machine costs a third of it
GROUP_TIMEOUTS = {"decode-float32": 120.0, "decode-float16": 120.0, "decode-bfloat16": 120.0, "timing": 150.0,
                  "append-copy-guard": 60.0, "over-4gib": 90.0}
EXIT_STICKY = 3  # a child that stopped after a CUDA error left its context unusable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                   help="directory for gpu-<date>-<gpu>.{jsonl,md,log} (default bench/results)")
    p.add_argument("--backend", choices=["cuda", "emulated"], default="cuda")
    p.add_argument("--quick", action="store_true", help="6 sweep cases, small timing shapes, 3 rounds")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; quick or emulated 3)")
    p.add_argument("--launches", type=int, default=None,
                   help="launches per timed batch (default 20; quick or emulated 2)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="wall-clock budget of the groups")
    p.add_argument("--groups", default=",".join(GROUP_TIMEOUTS), help="comma-separated groups to run")
    p.add_argument("--dry-run", action="store_true", help="render --inject (JSON lines) into a report only")
    p.add_argument("--inject", type=Path, default=None, help="JSON-lines results to render with --dry-run")
    p.add_argument("--fault", default=None, help="test hook: the child of this group aborts after its first line")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--jsonl", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--build", choices=["checked", "unchecked"], default="checked", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    small = a.quick or a.backend == "emulated"
    a.rounds = a.rounds or (3 if small else 7)
    a.launches = a.launches or (2 if small else 20)
    unknown = set(a.groups.split(",")) - set(GROUP_TIMEOUTS)
    if unknown:
        p.error(f"unknown groups {sorted(unknown)}; choose from {list(GROUP_TIMEOUTS)}")
    return a


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)  # noqa: UP017  (the UTC alias needs Python 3.11; the device may have 3.10)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


# ==== child side: one group in its own process =========================================
class Ctx:
    """What a group's checks share: backend kind, output file, sizes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.group, self.quick = args, args.child, args.quick
        self.cuda = args.backend == "cuda"
        self._out = open(args.jsonl, "a", encoding="utf-8")  # closed when the process exits
        self.lines = 0

    def emit(self, **line: Any) -> None:
        line = {"group": self.group, "t": round(time.time(), 3), **line}
        self._out.write(json.dumps(line, default=str) + "\n")
        self._out.flush()
        os.fsync(self._out.fileno())
        self.lines += 1
        if self.args.fault == self.group and self.lines == 1:
            os.abort()  # test hook: a child that dies like one hit by a fatal device fault

    def backend(self, unchecked: bool = False) -> Any:
        if self.cuda:
            from worker import kernels_cuda

            return kernels_cuda.backend(unchecked)
        from worker import kernels_cpu

        return kernels_cpu.backend("nocheck" if unchecked else "plain")

    def sync(self) -> None:
        if self.cuda:
            import cupy

            cupy.cuda.runtime.deviceSynchronize()

    def device_ok(self) -> bool:
        try:
            self.sync()
            return True
        except Exception:
            return False

    def check(self, name: str, fn: Callable[[], tuple[bool, str]]) -> bool:
        """Run one check, synchronise, and append its line; stop the group if
        the device context is no longer usable."""
        t0 = time.perf_counter()
        try:
            ok, detail = fn()
            self.sync()
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
            traceback.print_exc()
        self.emit(kind="check", check=name, ok=bool(ok), detail=detail,
                  seconds=round(time.perf_counter() - t0, 3))
        if not ok and self.cuda and not self.device_ok():
            self.emit(kind="abort", detail=f"CUDA context unusable after {name!r}; later checks of this group skipped")
            sys.exit(EXIT_STICKY)
        return bool(ok)


# ---- preflight ----------------------------------------------------------------------
def versions(cuda: bool) -> dict[str, str]:
    v = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        import torch

        v["torch"] = torch.__version__
    except Exception as e:
        v["torch"] = f"- ({type(e).__name__})"
    if cuda:
        import cupy

        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(0)
        name = props["name"]
        v.update(cupy=cupy.__version__, nvrtc=".".join(map(str, cupy.cuda.nvrtc.getVersion())),
                 driver=str(rt.driverGetVersion()), runtime=str(rt.runtimeGetVersion()),
                 gpu=name.decode() if isinstance(name, bytes) else str(name),
                 compute_capability=f"{props['major']}.{props['minor']}", sms=str(props["multiProcessorCount"]))
    else:
        gxx = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()
        v.update(gxx=gxx[0] if gxx else "-", gpu="CPU emulation")
    return v


def group_preflight(ctx: Ctx) -> int:
    """Build one module (checked or unchecked), resolve every kernel, report
    versions and resources. Exit 2 when anything is missing."""
    from worker import kernel_api as api

    build = ctx.args.build
    v = versions(ctx.cuda)
    ctx.emit(kind="versions", build=build, **v)
    print(f"[{build}] " + ", ".join(f"{k} {x}" for k, x in v.items()), flush=True)
    t0 = time.perf_counter()
    missing: list[str] = []
    spills: list[str] = []
    try:
        be = ctx.backend(build == "unchecked")
        for name in api.kernel_names():
            try:
                res = be.resources(name) if ctx.cuda else {"signature": be.signature(name)}
            except Exception as e:
                missing.append(f"{name}: {type(e).__name__}: {e}")
                if len(missing) >= 3:  # a module that did not compile fails every name alike
                    break
                continue
            ctx.emit(kind="kernel", build=build, name=name, **res)
            print(f"[{build}] {name}: " + ", ".join(f"{k} {x}" for k, x in res.items()), flush=True)
            if res.get("local_bytes"):
                spills.append(f"{name} {res['local_bytes']} B")
    except Exception as e:
        missing.append(f"{type(e).__name__}: {e}")
        traceback.print_exc()
    ok = not missing
    ctx.emit(kind="check", check=f"preflight {build}: build and resolve {len(api.kernel_names())} kernels",
             ok=ok, detail="; ".join(missing)[:2000] or "every kernel resolved",
             seconds=round(time.perf_counter() - t0, 3))
    if ok and ctx.cuda:  # a spill is a performance bug, not a reason to stop
        ctx.emit(kind="check", check=f"preflight {build}: no local memory (spill) in any kernel", ok=not spills,
                 detail=", ".join(spills) or "none")
    return 0 if ok else 2


# ---- correctness --------------------------------------------------------------------
def group_decode_sweep(ctx: Ctx) -> int:
    """The cases of bench/decode_cases.py for the group's dtype (decode-<dtype>)."""
    from bench import decode_cases as dc

    be = ctx.backend()
    dtype = ctx.group.removeprefix("decode-")

    def one(case: Any) -> tuple[bool, str]:
        inp = dc.make_inputs(case)
        problems = dc.check_case(case, inp, dc.run_case(be, case, inp))
        return not problems, "; ".join(problems) or "ok"

    for case in dc.cases(full=not ctx.quick):
        if case.dtype == dtype:
            ctx.check(f"decode {case.name}", lambda case=case: one(case))
    return 0


def group_append_copy_guard(ctx: Ctx) -> int:
    from bench.decode_cases import rand
    from worker import kernel_api as api
    from worker import ops_numpy
    from worker.kernel_api import PageLayout

    be, rng = ctx.backend(), np.random.default_rng(1)
    xp = be.xp
    L = PageLayout.per_layer(64, 16, 8, 128, "float16")
    host = rand(rng, (64 * L.page_elems,), "float16")
    dev = xp.asarray(host)
    expect = host.copy()

    def append() -> tuple[bool, str]:
        sm = rng.permutation(64 * 16)[:300].astype(np.int64)
        sm[[5, 17]] = [-1, 64 * 16]
        k, v = rand(rng, (300, 8, 128), "float16"), rand(rng, (300, 8, 128), "float16")
        r1 = api.append_kv(be, dev, L, xp.asarray(k), xp.asarray(v), xp.asarray(sm)).record
        r2 = ops_numpy.append_kv(expect, L, k, v, sm).record
        same = bool(np.array_equal(be.to_host(dev), expect))
        return r1 == r2 and same, f"record {r1}; cache equal to NumPy: {same}"

    def copy() -> tuple[bool, str]:
        pairs = np.array([[1, 2], [3, 64], [10, 11]], dtype=np.int64)
        r1 = api.copy_blocks(be, [dev], L, xp.asarray(pairs)).record
        r2 = ops_numpy.copy_blocks([expect], L, pairs).record
        same = bool(np.array_equal(be.to_host(dev), expect))
        return r1 == r2 and same, f"record {r1}; cache equal to NumPy: {same}"

    def guard() -> tuple[bool, str]:
        buf = xp.zeros(1 << 20, dtype=np.uint8)
        api.guard_fill(be, buf, 4096)
        clean = api.guard_check(be, buf, 4096)
        buf[(1 << 20) - 7] = 0
        hit = api.guard_check(be, buf, 4096)
        ok = not clean and (hit.corrupted_bytes, hit.first_offset) == (1, (1 << 20) - 7)
        return ok, f"clean={clean}, corrupted={hit}"

    ctx.check("append_kv vs NumPy (2 bad tokens)", append)
    ctx.check("copy_blocks vs NumPy (1 bad pair)", copy)
    ctx.check("guard zones", guard)
    return 0


def group_over_4gib(ctx: Ctx) -> int:
    """A > 4 GiB cache: tokens written to a page past byte 2^32, that page
    copied further up, decode over both; every page involved, and the pages a
    32-bit byte offset would have wrapped to, compared with host-built contents."""
    from bench.decode_cases import rand
    from worker import kernel_api as api
    from worker import reference
    from worker.kernel_api import PageLayout

    be, rng = ctx.backend(), np.random.default_rng(2)
    xp = be.xp
    ps, kh, d = 16, 8, 128
    L = PageLayout.per_layer(2**16 + 8, ps, kh, d, "float16")  # 64 KiB pages: 4 GiB + 512 KiB
    pe = L.page_elems
    high = 2**16 + 1  # byte offset (2^16 + 1) * 2^16 = 2^32 + 2^16
    wrap = {high: (high * pe * 2 % 2**32) // (pe * 2), high + 2: ((high + 2) * pe * 2 % 2**32) // (pe * 2)}
    assert wrap == {high: 1, high + 2: 3}
    n = 20
    k, v = rand(rng, (n, kh, d), "float16"), rand(rng, (n, kh, d), "float16")
    sm = np.concatenate([3 * ps + np.arange(ps), high * ps + np.arange(n - ps)]).astype(np.int64)
    # host-built expectation of every page that matters, independent of the device
    want = {p: np.zeros((2, ps, kh, d), dtype=np.float16) for p in (0, 1, 2, 3, high, high + 2)}
    for i, s in enumerate(sm):
        p, t = divmod(int(s), ps)
        want[p][0, t], want[p][1, t] = k[i], v[i]
    want[high + 2] = want[high].copy()
    state: dict[str, Any] = {}

    def write_and_copy() -> tuple[bool, str]:
        cache = state["cache"] = xp.zeros(L.upper_bound * pe, dtype=np.float16)
        r1 = api.append_kv(be, cache, L, xp.asarray(k), xp.asarray(v), xp.asarray(sm)).record
        r2 = api.copy_blocks(be, [cache], L, xp.asarray(np.array([[high, high + 2]], dtype=np.int64))).record
        bad = [p for p, w in want.items()
               if not np.array_equal(be.to_host(cache[p * pe:(p + 1) * pe]).reshape(w.shape), w)]
        targets = sorted(set(wrap.values()))
        return r1.count == 0 and r2.count == 0 and not bad, \
            f"pages differing from the host-built contents: {bad or 'none'} (wrapped targets {targets})"

    def decode() -> tuple[bool, str]:
        cache = state["cache"]
        q = rand(rng, (1, 32, d), "float16")
        t = (np.array([0, 3], np.int32), np.array([3, high, high + 2], np.int32), np.array([n - ps], np.int32))
        res = api.decode_attention(be, xp.asarray(q), cache, L, *[xp.asarray(a) for a in t], kv_chunk_pages=1)
        small = np.concatenate([want[p].reshape(-1) for p in (3, high, high + 2)])
        Ls = PageLayout.per_layer(3, ps, kh, d, "float16")
        ref, _ = reference.decode_attention_ref(q, small, Ls, t[0], np.arange(3, dtype=np.int32), t[2])
        got = be.to_host(res.out)
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        return err <= 1e-2 and res.record.count == 0, f"rel err {err:.2e} vs host-built pages"

    if ctx.check("cache > 4 GiB: append + copy past byte 2^32, wrapped pages untouched", write_and_copy):
        ctx.check("cache > 4 GiB: decode over pages past byte 2^32", decode)
    state.clear()
    return 0


# ---- timing -------------------------------------------------------------------------
class Recorder:
    """Backend that launches and remembers each launch, so a public call's
    kernels can be replayed back to back (no argument checks, no record copy)."""

    def __init__(self, be: Any) -> None:
        self.be, self.launches = be, []

    def launch(self, name: str, grid: tuple[int, int, int], block: int, args: list[Any]) -> None:
        self.launches.append((name, grid, block, args))
        self.be.launch(name, grid, block, args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.be, name)


def recorded(be: Any, call: Callable[[Any], Any]) -> tuple[Callable[[], None], list[tuple]]:
    """Run ``call(backend)`` once; return a replay of its launches and the launches."""
    rec = Recorder(be)
    call(rec)
    launches = list(rec.launches)

    def replay() -> None:
        for name, grid, block, args in launches:
            be.launch(name, grid, block, args)

    return replay, launches


def time_batch(ctx: Ctx, fn: Callable[[], None], n: int) -> float:
    """Seconds per call of ``fn`` over ``n`` back-to-back calls between one pair of events."""
    if ctx.cuda:
        import cupy

        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        return cupy.cuda.get_elapsed_time(a, b) / 1e3 / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def interleaved(ctx: Ctx, fns: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
    """Per-call seconds of each fn over ``rounds`` rounds, the order alternating each round."""
    names = list(fns)
    for name in names:  # warm-up (module load, caches)
        time_batch(ctx, fns[name], 1)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(ctx.args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(time_batch(ctx, fns[name], ctx.args.launches))
    return out


def spread(ts: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}


def random_device(xp: Any, rng: np.random.Generator, n: int, dtype: Any) -> Any:
    """Random non-zero values, generated on the device when it is one."""
    if xp is np:
        x = rng.uniform(0.1, 1.0, n).astype(np.float32)
    else:
        x = xp.random.uniform(0.1, 1.0, n, dtype=np.float32)
    return x.astype(dtype)


def decode_shapes(ctx: Ctx) -> list[tuple[int, int, int, int, int]]:
    """(batch, context, q heads, kv heads, head_dim), float16, page 16."""
    if ctx.quick:
        return [(2, 128, 8, 2, 64)]
    if not ctx.cuda:
        return [(4, 256, 8, 2, 64), (1, 512, 8, 1, 128)]
    return [(64, 4096, 32, 8, 128), (64, 4096, 64, 8, 128), (4, 16384, 32, 8, 128), (64, 4096, 32, 8, 64)]


def group_timing(ctx: Ctx) -> int:
    from worker import kernel_api as api
    from worker.kernel_api import PageLayout

    checked, unchecked = ctx.backend(), ctx.backend(unchecked=True)
    xp, rng = checked.xp, np.random.default_rng(3)
    ps = 16
    # device-to-device copy: the bandwidth every figure is compared with
    n = (64 << 20) if (ctx.quick or not ctx.cuda) else (1 << 30)
    src, dst = xp.ones(n, dtype=np.uint8), xp.empty(n, dtype=np.uint8)
    if ctx.cuda:
        copy = lambda: xp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, 3, 0)  # noqa: E731
    else:
        copy = lambda: np.copyto(dst, src)  # noqa: E731
    ts = interleaved(ctx, {"copy": copy})["copy"]
    copy_gbs = 2 * n / statistics.median(ts) / 1e9
    ctx.emit(kind="perf", kernel="device-to-device copy", shape=f"{n >> 20} MiB", bytes=2 * n, gbs=copy_gbs,
             pct_copy=1.0, **spread(ts))
    src = dst = None

    for b, ctx_len, hq, hkv, d in decode_shapes(ctx):
        ppr = ctx_len // ps
        L = PageLayout.per_layer(b * ppr, ps, hkv, d, "float16")
        cache = random_device(xp, rng, b * ppr * L.page_elems, np.float16)
        idx = xp.asarray(rng.permutation(b * ppr).astype(np.int32))
        indptr = xp.asarray((np.arange(b + 1) * ppr).astype(np.int32))
        lpl = xp.asarray(np.full(b, ps, dtype=np.int32))
        q = random_device(xp, rng, b * hq * d, np.float16).reshape(b, hq, d)
        kv_bytes = b * ctx_len * hkv * d * 2 * 2
        shape = f"B={b} ctx={ctx_len} hq={hq} hkv={hkv} d={d} fp16 page {ps}"
        entry = api.decode_entry("float16", hq // hkv, d)
        replays, grids = {}, {}
        for label, be in (("checked", checked), ("unchecked", unchecked)):
            args = (q, cache, L, indptr, idx, lpl)
            replays[label], launches = recorded(
                be, lambda rb, args=args, ppr=ppr: api.decode_attention(rb, *args, max_pages=ppr))
            grids[label] = [f"{name}{list(grid)}" for name, grid, _, _ in launches]
        ts = interleaved(ctx, replays)
        for label in ("checked", "unchecked"):
            med = statistics.median(ts[label])
            ctx.emit(kind="perf", kernel=f"decode ({label})", entry=entry, shape=shape, bytes=kv_bytes,
                     gbs=kv_bytes / med / 1e9, pct_copy=kv_bytes / med / 1e9 / copy_gbs, launches=grids[label],
                     blocks_per_sm=checked.resident_blocks(entry, api.THREADS), **spread(ts[label]))
        pairs = [c / u - 1 for c, u in zip(ts["checked"], ts["unchecked"], strict=True)]
        ctx.emit(kind="cost", kernel="bounds-check cost", shape=shape,
                 cost=statistics.median(ts["checked"]) / statistics.median(ts["unchecked"]) - 1,
                 round_costs=[round(x, 4) for x in pairs])
        cache = None

    # append_kv and copy_blocks (checked build)
    hkv, d, b, ppr = 8, 128, (4 if (ctx.quick or not ctx.cuda) else 64), 256
    L = PageLayout.per_layer(b * ppr, ps, hkv, d, "float16")
    cache = random_device(xp, rng, b * ppr * L.page_elems, np.float16)
    nt = 64 if (ctx.quick or not ctx.cuda) else b * 256
    sm = xp.asarray(rng.permutation(b * ppr * ps)[:nt].astype(np.int64))
    kk = random_device(xp, rng, nt * hkv * d, np.float16).reshape(nt, hkv, d)
    npairs = b * ppr // 8
    perm = rng.permutation(b * ppr)
    pairs = xp.asarray(np.stack([perm[:npairs], perm[npairs:2 * npairs]], 1).astype(np.int64))
    ops = {"append_kv": recorded(checked, lambda rb: api.append_kv(rb, cache, L, kk, kk, sm))[0],
           "copy_blocks": recorded(checked, lambda rb: api.copy_blocks(rb, [cache], L, pairs))[0]}
    moved = {"append_kv": 2 * 2 * nt * hkv * d * 2, "copy_blocks": 2 * npairs * L.page_elems * 2}
    shapes = {"append_kv": f"{nt} tokens x {hkv} x {d} fp16",
              "copy_blocks": f"{npairs} pages x {L.page_elems * 2 >> 10} KiB"}
    ts = interleaved(ctx, ops)
    for name in ops:
        med = statistics.median(ts[name])
        ctx.emit(kind="perf", kernel=name, shape=shapes[name], bytes=moved[name], gbs=moved[name] / med / 1e9,
                 pct_copy=moved[name] / med / 1e9 / copy_gbs, **spread(ts[name]))
    return 0


GROUPS: dict[str, Callable[[Ctx], int]] = {
    "preflight": group_preflight,
    "decode-float32": group_decode_sweep,
    "decode-float16": group_decode_sweep,
    "decode-bfloat16": group_decode_sweep,
    "timing": group_timing,
    "append-copy-guard": group_append_copy_guard,
    "over-4gib": group_over_4gib,
}


# The device's protobuf may be older than the committed stubs: nothing here may
# pull in the service layer.
FORBIDDEN_IMPORTS = ("kvservice", "grpc", "google.protobuf")


def run_child(args: argparse.Namespace) -> int:
    ctx = Ctx(args)
    try:
        rc = GROUPS[args.child](ctx)
    except Exception as e:
        ctx.emit(kind="check", check=f"{args.child}: group", ok=False, detail=f"{type(e).__name__}: {e}")
        traceback.print_exc()
        rc = 1
    found = [m for m in FORBIDDEN_IMPORTS if m in sys.modules]
    if found:
        ctx.emit(kind="check", check=f"{args.child}: imports", ok=False, detail=f"imported {found}")
        rc = rc or 1
    return rc


# ==== parent side ======================================================================
def read_lines(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"kind": "check", "group": "?", "check": "unreadable line", "ok": False,
                            "detail": line[:200]})
    return out


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.3f}" if x < 10 else f"{x:.1f} s"


def render(lines: list[dict], header: dict) -> str:
    out = [f"# GPU kernel check — {header.get('date', '-')}", "",
           f"- GPU: {header.get('gpu', '-')}", f"- backend: {header.get('backend', '-')}",
           f"- run: {header.get('status', '-')}"]
    for v in (ln for ln in lines if ln.get("kind") == "versions"):
        keys = ", ".join(f"{k} {v[k]}" for k in v if k not in ("kind", "group", "t", "build"))
        out.append(f"- versions ({v.get('build')}): {keys}")
    if header.get("note"):
        out += ["", f"> {header['note']}"]
    checks = [ln for ln in lines if ln.get("kind") == "check"]
    failed = [c for c in checks if not c.get("ok")]
    out += ["", "## Correctness", "",
            f"{len(checks) - len(failed)} of {len(checks)} checks passed."]
    if failed:
        out += ["", "Failed:", ""] + [f"- **{c.get('group')}** {c.get('check')}: {c.get('detail')}" for c in failed]
    aborts = [ln for ln in lines if ln.get("kind") in ("abort", "group")]
    if aborts:
        out += ["", "| group | status | detail |", "|---|---|---|"]
        out += [f"| {a.get('group')} | {a.get('status', 'aborted')} | {a.get('detail', '')} |" for a in aborts]
    out += ["", "| group | check | result | detail | s |", "|---|---|---|---|---|"]
    out += [f"| {c.get('group')} | {c.get('check')} | {'PASS' if c.get('ok') else 'FAIL'} | {c.get('detail')} | "
            f"{c.get('seconds', '-')} |" for c in checks]
    perf = [ln for ln in lines if ln.get("kind") == "perf"]
    costs = [ln for ln in lines if ln.get("kind") == "cost"]
    out += ["", "## Performance", "", "Per launch: median of the rounds (min - max); each round times N back-to-back "
            "launches between one pair of events; checked and unchecked builds alternate round by round.", "",
            "| kernel | shape | ms per launch (min - max) | GB/s | % of copy | blocks/SM |",
            "|---|---|---|---|---|---|"]
    for r in perf:
        ms = f"{fmt_s(r['median_s'])} ({fmt_s(r['min_s'])} - {fmt_s(r['max_s'])})"
        out.append(f"| {r['kernel']} | {r['shape']} | {ms} | {r['gbs']:.1f} | {100 * r['pct_copy']:.1f} % | "
                   f"{r.get('blocks_per_sm', '-')} |")
    if not perf:
        out.append("| (not measured) | - | - | - | - | - |")
    out += ["", "## Targets", "", "| target | shape | measured | result |", "|---|---|---|---|"]
    for r in perf:
        if r["kernel"] == "decode (checked)":
            ok = r["pct_copy"] >= TARGET_DECODE
            out.append(f"| decode >= {TARGET_DECODE:.0%} of copy bandwidth | {r['shape']} | {r['pct_copy']:.1%} | "
                       f"{'MET' if ok else 'MISSED'} |")
    for c in costs:
        ok = c["cost"] <= TARGET_CHECK_COST
        out.append(f"| bounds-check cost <= {TARGET_CHECK_COST:.0%} | {c['shape']} | {c['cost']:+.1%} "
                   f"(rounds {c.get('round_costs')}) | {'MET' if ok else 'MISSED'} |")
    if not perf and not costs:
        out.append("| (not measured) | - | - | - |")
    kernels = [ln for ln in lines if ln.get("kind") == "kernel" and ln.get("build") == "checked"]
    if kernels and "registers" in kernels[0]:
        out += ["", "## Kernel resources (checked build, from the driver)", "",
                "| kernel | registers | shared (B) | local/spill (B) | blocks/SM |", "|---|---|---|---|---|"]
        out += [f"| {k['name']} | {k['registers']} | {k['shared_bytes']} | {k['local_bytes']} | {k['blocks_per_sm']} |"
                for k in kernels]
    return "\n".join(out) + "\n"


class Run:
    """Parent: starts children, keeps the JSON lines, the log and the report."""

    def __init__(self, args: argparse.Namespace, gpu: str) -> None:
        self.args = args
        now = utc_now()
        stem = f"gpu-{now.date().isoformat()}-{slug(gpu)}"
        args.out.mkdir(parents=True, exist_ok=True)
        self.jsonl, self.md, self.log = (args.out / f"{stem}.{ext}" for ext in ("jsonl", "md", "log"))
        self.jsonl.write_text("")
        self.log.write_text("")
        self.header = {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "gpu": gpu, "backend": args.backend,
                       "status": "running"}
        if args.quick:
            self.header["note"] = "quick mode: 6 sweep cases, small timing shapes; timings are not meaningful"
        elif args.backend == "emulated":
            self.header["note"] = "CPU emulation: correctness is real, timings are not GPU figures"
        self.env = dict(os.environ)
        self.env.setdefault("CUPY_CACHE_DIR", tempfile.mkdtemp(prefix="kvk-cupy-"))  # shared by the children
        self.env["PYTHONUNBUFFERED"] = "1"

    def cmd(self, group: str, build: str = "checked") -> list[str]:
        a = self.args
        c = [sys.executable, str(Path(__file__).resolve()), "--child", group, "--jsonl", str(self.jsonl),
             "--backend", a.backend, "--build", build, "--rounds", str(a.rounds), "--launches", str(a.launches)]
        return c + (["--quick"] if a.quick else []) + (["--fault", a.fault] if a.fault else [])

    def note(self, **line: Any) -> None:
        with open(self.jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": round(time.time(), 3), **line}) + "\n")

    def start(self, group: str, build: str = "checked") -> subprocess.Popen:
        return subprocess.Popen(self.cmd(group, build), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=self.env, cwd=str(ROOT))

    def finish(self, name: str, proc: subprocess.Popen, timeout: float, t0: float, echo: bool = False) -> int:
        try:
            text, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
            rc = -9
        secs = time.perf_counter() - t0
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(f"==== {name}: exit {rc}, {secs:.1f} s\n{text}\n")
        if echo:
            print(text, end="", flush=True)
        status = "ok" if rc == 0 else ("timed out" if rc == -9 else f"exit {rc}")
        if rc != 0:
            tail = " | ".join(text.strip().splitlines()[-3:])[-400:]
            self.note(kind="group", group=name, status=status, ok=False, detail=f"{status} after {secs:.1f} s: {tail}")
            self.note(kind="check", group=name, check=f"{name}: child process", ok=False, detail=f"{status}: {tail}")
        print(f"gpu_check: {name}: {status} ({secs:.1f} s)", flush=True)
        return rc

    def report(self, status: str) -> None:
        self.header["status"] = status
        self.md.write_text(render(read_lines(self.jsonl), self.header), encoding="utf-8")


def gpu_name(backend: str) -> str:
    """Device name for the file names, without creating a CUDA context here."""
    if backend == "emulated":
        return "cpu-emulation"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out.splitlines()[0] if out else "gpu"
    except Exception:
        return "gpu"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    if args.dry_run:
        lines = [json.loads(x) for x in args.inject.read_text().splitlines() if x.strip()] if args.inject else []
        header = {"date": utc_now().strftime("%Y-%m-%d %H:%M UTC"), "gpu": "(dry run: nothing executed)",
                  "backend": args.backend, "status": "dry run"}
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "gpu-dry-run.md"
        path.write_text(render(lines, header), encoding="utf-8")
        print(f"report written to {path}")
        return 0
    if args.backend == "cuda":
        try:
            import cupy  # noqa: F401  (importing creates no CUDA context)
        except Exception as e:
            print(f"gpu_check: cupy is not importable ({type(e).__name__}: {e}); run this on a GPU machine "
                  "with cupy, or use --backend emulated", file=sys.stderr)
            return 2
    start = time.perf_counter()
    run = Run(args, gpu_name(args.backend))
    print(f"gpu_check: writing {run.jsonl} and {run.md}", flush=True)
    # 1. preflight: both builds at once
    t0 = time.perf_counter()
    procs = {b: run.start("preflight", b) for b in ("checked", "unchecked")}
    limit = min(PREFLIGHT_TIMEOUT_S, args.budget_s)
    rcs = {b: run.finish(f"preflight ({b})", p, max(1.0, limit - (time.perf_counter() - t0)), t0, echo=True)
           for b, p in procs.items()}
    if any(rcs.values()):
        run.report("preflight failed")
        tail = run.log.read_text().strip().splitlines()[-5:]
        print("gpu_check: preflight failed (see " + str(run.log) + "):\n  " + "\n  ".join(tail), file=sys.stderr)
        return 2
    run.report("running")
    # 2. the groups, each in its own process, within the budget
    deadline = start + args.budget_s
    for group in args.groups.split(","):
        left = deadline - time.perf_counter()
        if left < 15:
            run.note(kind="group", group=group, status="skipped", ok=False,
                     detail=f"time budget ({args.budget_s:.0f} s) spent")
            run.note(kind="check", group=group, check=f"{group}: skipped", ok=False, detail="time budget spent")
            continue
        t0 = time.perf_counter()
        run.finish(group, run.start(group), min(GROUP_TIMEOUTS[group], left), t0)
        run.report("running")
    lines = read_lines(run.jsonl)
    ok = all(ln.get("ok", True) for ln in lines if ln.get("kind") == "check")
    run.report(f"{'all checks passed' if ok else 'FAILURES'} in {time.perf_counter() - start:.0f} s")
    print(run.md.read_text())
    print(f"gpu_check: report {run.md}, results {run.jsonl} ({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
