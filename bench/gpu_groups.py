"""The groups bench/gpu_check.py runs, each in its own child process
(``gpu_check.py --child GROUP``): preflight, the decode sweep per dtype,
timing, append/copy/guard and the >4 GiB check. Each check is synchronised and
appended as one JSON line when it finishes (``Ctx.check``); after a CUDA error
that leaves the context unusable the child stops with EXIT_STICKY, so only its
own group is lost. Imports numpy at module level; cupy, torch and ``worker``
modules inside the groups.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

EXIT_STICKY = 3  # a child that stopped after a CUDA error left its context unusable


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
            from kvservice.worker import kernels_cuda

            return kernels_cuda.backend(unchecked)
        from kvservice.worker import kernels_cpu

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
    from kvservice.worker import launch_plan

    build = ctx.args.build
    v = versions(ctx.cuda)
    ctx.emit(kind="versions", build=build, **v)
    print(f"[{build}] " + ", ".join(f"{k} {x}" for k, x in v.items()), flush=True)
    t0 = time.perf_counter()
    missing: list[str] = []
    spills: list[str] = []
    try:
        be = ctx.backend(build == "unchecked")
        for name in launch_plan.kernel_names():
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
    ctx.emit(kind="check", check=f"preflight {build}: build and resolve {len(launch_plan.kernel_names())} kernels",
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


def group_sanitize(ctx: Ctx) -> int:
    """A small decode per dtype (split and not, a bad page), run under compute-sanitizer by the parent
    (memcheck / racecheck / synccheck): a few blocks, every ring stage reused, exact record."""
    from bench import decode_cases as dc

    be = ctx.backend()
    picked = [c for c in dc.cases(full=True) if c.head_dim in (64, 128) and c.group in (1, 4, 8)][:6]
    failed = 0
    for case in picked:
        inp = dc.make_inputs(case)
        problems = dc.check_case(case, inp, dc.run_case(be, case, inp))
        failed += bool(problems)
        ctx.emit(kind="check", check=f"sanitized decode {case.name}", ok=not problems,
                 detail="; ".join(problems) or "ok")
    return 1 if failed else 0


def group_append_copy_guard(ctx: Ctx) -> int:
    from bench.decode_cases import rand
    from kvservice.worker import guards, ops_numpy
    from kvservice.worker import kernel_api as api
    from kvservice.worker.kernel_api import PageLayout

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
        guards.guard_fill(be, buf, 4096)
        clean = guards.guard_check(be, buf, 4096)
        buf[(1 << 20) - 7] = 0
        hit = guards.guard_check(be, buf, 4096)
        ok = not clean and (hit.corrupted_bytes, hit.first_offset) == (1, (1 << 20) - 7)
        return ok, f"clean={clean}, corrupted={hit}"

    def widen() -> tuple[bool, str]:
        bits = np.arange(1 << 16, dtype=np.uint16)
        bad = []
        for dtype in ("float16", "bfloat16"):
            x = bits.view(np.float16) if dtype == "float16" else bits
            got = be.to_host(api.widen(be, xp.asarray(x), dtype)).view(np.uint32)
            want = ops_numpy.widen(x, dtype).view(np.uint32)
            if not np.array_equal(got, want):
                bad.append(f"{dtype}: {int((got != want).sum())} of 65536 patterns differ")
        return not bad, "; ".join(bad) or "every float16 and bfloat16 bit pattern widened exactly"
    def stale() -> tuple[bool, str]:
        # pages 2 and 5 written under generation 7; re-allocated (generation 8) and written again: the old
        # table (generation 7) must read stale_page on both pages, and its writes must change nothing.
        pages, sm = np.array([2, 5], np.int64), np.arange(20, dtype=np.int64)
        sm = pages[sm // 16] * 16 + sm % 16
        pg_dev, pg_host = xp.zeros(L.num_pages, np.uint32), np.zeros(L.num_pages, np.uint32)
        recs = []
        for g in (7, 8):
            k = rand(rng, (20, 8, 128), "float16")
            sg = np.full(20, g, np.uint32)
            recs.append(api.append_kv(be, dev, L, xp.asarray(k), xp.asarray(k), xp.asarray(sm),
                                      slot_generations=xp.asarray(sg), page_gen=pg_dev).record)
            recs.append(ops_numpy.append_kv(expect, L, k, k, sm, slot_generations=sg, page_gen=pg_host).record)
        table = [np.array([0, 2], np.int32), pages.astype(np.int32), np.array([4], np.int32)]
        q = rand(rng, (1, 8, 128), "float16")
        old = np.full(2, 7, np.uint32)
        d = api.decode_attention(be, xp.asarray(q), dev, L, *[xp.asarray(a) for a in table],
                                 generations=xp.asarray(old), page_gen=pg_dev)
        want = ops_numpy.decode_attention(q, expect, L, *table, generations=old, page_gen=pg_host).record
        before = be.to_host(dev).copy()
        k = rand(rng, (20, 8, 128), "float16")
        w = api.append_kv(be, dev, L, xp.asarray(k), xp.asarray(k), xp.asarray(sm),
                          slot_generations=xp.asarray(np.full(20, 7, np.uint32)), page_gen=pg_dev).record
        ok = (not any(recs) and d.record == want and want.reason == "stale_page" and want.count == 2
              and bool(np.isnan(be.to_host(d.out)).all()) and (w.count, w.reason) == (20, "stale_page")
              and bool(np.array_equal(be.to_host(dev), before)) and bool(np.array_equal(be.to_host(pg_dev), pg_host)))
        return ok, f"decode {d.record}; stale append {w}"

    ctx.check("append_kv vs NumPy (2 bad tokens)", append)
    ctx.check("copy_blocks vs NumPy (1 bad pair)", copy)
    ctx.check("stale_page: a re-allocated page read and written through the old table", stale)
    ctx.check("guard zones", guard)
    ctx.check("widen: every 16-bit pattern through the attention loads", widen)
    return 0


def group_over_4gib(ctx: Ctx) -> int:
    """A > 4 GiB cache: tokens written to a page past byte 2^32, that page
    copied further up, decode over both; every page involved, and the pages a
    32-bit byte offset would have wrapped to, compared with host-built contents."""
    from bench.decode_cases import rand
    from kvservice.worker import kernel_api as api
    from kvservice.worker import reference
    from kvservice.worker.kernel_api import PageLayout

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
        raw = reference.RawLayer.per_layer(3, ps, kh, d, "float16")
        ref, _ = reference.decode_attention_ref(q, small, raw, t[0], np.arange(3, dtype=np.int32), t[2])
        got = be.to_host(res.out)
        err = reference.row_rel_err(got, ref)
        tol = reference.TOLERANCE["float16"]
        return err <= tol and res.record.count == 0, f"rel err {err:.2e} (limit {tol:g}) vs host-built pages"

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


def recorded(be: Any, call: Callable[[Any], Any]) -> tuple[Callable[[], None], list[tuple], Any]:
    """Run ``call(backend)`` once; return a replay of its launches, the launches and the call's result
    (a replay writes the same outputs)."""
    rec = Recorder(be)
    result = call(rec)
    launches = list(rec.launches)

    def replay() -> None:
        for name, grid, block, args in launches:
            be.launch(name, grid, block, args)

    return replay, launches, result


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
    from bench.decode_cases import TIMING_RANGE

    if xp is np:
        x = rng.uniform(*TIMING_RANGE, n).astype(np.float32)
    else:
        x = xp.random.uniform(*TIMING_RANGE, n, dtype=np.float32)
    return x.astype(dtype)


def decode_shapes(ctx: Ctx) -> list[tuple[int, int, int, int, int]]:
    """(batch, context, q heads, kv heads, head_dim), float16, page TIMING_PAGE_SIZE."""
    from bench.decode_cases import TIMING_SHAPES

    if ctx.quick:
        return [(2, 128, 8, 2, 64)]
    if not ctx.cuda:
        return [(4, 256, 8, 2, 64), (1, 512, 8, 1, 128)]
    return list(TIMING_SHAPES)


READ_ONLY_SRC = r"""
extern "C" __global__ void kv_read_only(const uint4* p, unsigned long long n, unsigned* out) {
  // every 16-byte word read once, four loads in flight per thread; the XOR keeps them live
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned acc = 0;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
    acc ^= a.x ^ b.y ^ c.z ^ d.w ^ a.w ^ b.x ^ c.y ^ d.z;
  }
  for (; i < n; i += stride) acc ^= p[i].x ^ p[i].w;
  if (acc == 0x9e3779b9u) out[0] = acc;
}
"""


def read_only(ctx: Ctx, xp: Any, buf: Any) -> Callable[[], None]:
    """A pass that only reads ``buf`` (uint8, a multiple of 16 bytes): decode's own access kind."""
    if not ctx.cuda:
        words = buf.view(np.uint64)
        return lambda: np.bitwise_xor.reduce(words)
    kern = xp.RawKernel(READ_ONLY_SRC, "kv_read_only")
    sink = xp.zeros(1, dtype=np.uint32)
    n = buf.size // 16
    sms = xp.cuda.Device().attributes["MultiProcessorCount"]
    return lambda: kern((sms * 8,), (256,), (buf, np.uint64(n), sink))


class ClockSampler:
    """SM clock, memory clock, power, temperature and throttle reasons, sampled every ``period`` s by
    a thread while a shape is timed: NVML (pynvml, the nvidia-ml-py package) when importable, else
    one nvidia-smi query per sample; nothing on the CPU emulation. Only reads the device's state."""

    FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"

    def __init__(self, ctx: Ctx, period: float = 0.1) -> None:
        self.ctx, self.period, self.samples = ctx, period, []
        self.read: Callable[[], dict] | None = None
        if not ctx.cuda:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

            def nvml() -> dict:
                return {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                        "mem_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                        "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                        "temp_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                        "throttle": hex(reasons(h))}

            nvml()
            self.read, self.source = nvml, "NVML"
        except Exception:
            if shutil.which("nvidia-smi"):
                self.read, self.source = self._smi, "nvidia-smi"

    def _smi(self) -> dict:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip().split(", ")
        vals: dict = {}
        for key, v in zip(("sm_mhz", "mem_mhz", "power_w", "temp_c", "throttle"), out, strict=False):
            try:
                vals[key] = v if key == "throttle" else float(v)
            except ValueError:
                pass
        return vals

    def __enter__(self) -> ClockSampler:
        self.samples, self._stop = [], threading.Event()
        if self.read is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except Exception:
                return
            self._stop.wait(self.period)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self.read is not None:
            self._thread.join(timeout=15)

    def emit(self, phase: str) -> None:
        if self.read is None:
            return
        line: dict[str, Any] = {"phase": phase, "samples": len(self.samples), "source": self.source}
        for key in ("sm_mhz", "mem_mhz", "power_w", "temp_c"):
            xs = [float(x[key]) for x in self.samples if isinstance(x.get(key), (int, float))]
            if xs:
                line[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        line["throttle"] = ", ".join(sorted({str(x.get("throttle")) for x in self.samples if x.get("throttle")}))
        self.ctx.emit(kind="clocks", **line)


def long_rows_check(ctx: Ctx, res: Any, q: Any, cache: Any, L: Any, idx: Any, b: int, ppr: int) -> tuple[bool, str]:
    """The output of a timing shape (every row ``ppr`` full pages, per_layer, float16) against a float64
    torch reference of the same rows, on the GPU when there is one. Error per row: max |out - ref| over
    the row divided by max over the row of sum_t p_t |v_t| (the scale float32 accumulation errs
    against; for long rows plain relative error would measure cancellation, not the kernel); lse
    relative to max(|lse|, 1). Both <= reference.TOLERANCE."""
    import torch

    from kvservice.worker import reference

    def t(a: Any) -> Any:
        return torch.from_dlpack(a) if ctx.cuda else torch.from_numpy(np.asarray(a))

    ps, hkv, d = L.page_size, L.kv_heads, L.head_dim
    hq = q.shape[1]
    pages = t(cache).view(-1, 2, ps, hkv, d)
    table = t(idx).long().view(b, ppr)
    out, lse = t(res.out).double(), t(res.lse).double()
    qd = t(q).double().view(b, hkv, hq // hkv, d)
    scale = 1.0 / math_sqrt(d)
    worst, worst_lse = 0.0, 0.0
    for r0 in range(0, b, 8):
        r1 = min(b, r0 + 8)
        sel = pages[table[r0:r1]]  # [rows, ppr, 2, ps, hkv, d]
        k = sel[:, :, 0].reshape(r1 - r0, ppr * ps, hkv, d).double()
        v = sel[:, :, 1].reshape(r1 - r0, ppr * ps, hkv, d).double()
        s = torch.einsum("bhgd,bthd->bhgt", qd[r0:r1], k) * scale
        ref_lse = torch.logsumexp(s, -1)
        p = torch.exp(s - ref_lse[..., None])
        ref = torch.einsum("bhgt,bthd->bhgd", p, v).reshape(r1 - r0, hq, d)
        mag = torch.einsum("bhgt,bthd->bhgd", p, v.abs()).reshape(r1 - r0, hq, d)
        err = (out[r0:r1] - ref).abs().amax(dim=(1, 2)) / mag.amax(dim=(1, 2))
        lerr = (lse[r0:r1] - ref_lse.reshape(r1 - r0, hq)).abs() / ref_lse.reshape(r1 - r0, hq).abs().clamp(min=1.0)
        worst = max(worst, float(err.max()))
        worst_lse = max(worst_lse, float(lerr.max()))
    tol = reference.TOLERANCE["float16"]
    ok = worst <= tol and worst_lse <= tol  # NaN fails both
    return ok, f"{b} rows of {ppr * ps} tokens: max err {worst:.2e}, lse {worst_lse:.2e} (limit {tol:g})"


def math_sqrt(x: float) -> float:
    return float(x) ** 0.5


def group_timing(ctx: Ctx) -> int:
    from kvservice.worker import kernel_api as api
    from kvservice.worker.kernel_api import PageLayout

    checked, unchecked = ctx.backend(), ctx.backend(unchecked=True)
    from bench.decode_cases import TIMING_PAGE_SIZE

    xp, rng = checked.xp, np.random.default_rng(3)
    ps = TIMING_PAGE_SIZE
    clocks = ClockSampler(ctx)
    # device-to-device copy (bytes read + written) and a read-only pass (bytes read): the bandwidths
    # every figure is compared with
    n = (64 << 20) if (ctx.quick or not ctx.cuda) else (1 << 30)
    src, dst = xp.ones(n, dtype=np.uint8), xp.empty(n, dtype=np.uint8)
    if ctx.cuda:
        copy = lambda: xp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, 3, 0)  # noqa: E731
    else:
        copy = lambda: np.copyto(dst, src)  # noqa: E731
    with clocks:
        ts = interleaved(ctx, {"copy": copy, "read": read_only(ctx, xp, src)})
    clocks.emit("copy and read-only")
    copy_gbs = 2 * n / statistics.median(ts["copy"]) / 1e9
    read_gbs = n / statistics.median(ts["read"]) / 1e9
    ctx.emit(kind="perf", kernel="device-to-device copy", shape=f"{n >> 20} MiB", bytes=2 * n, gbs=copy_gbs,
             pct_copy=1.0, pct_read=copy_gbs / read_gbs, **spread(ts["copy"]))
    ctx.emit(kind="perf", kernel="read-only pass", shape=f"{n >> 20} MiB", bytes=n, gbs=read_gbs,
             pct_copy=read_gbs / copy_gbs, pct_read=1.0, **spread(ts["read"]))
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
        replays, grids, results = {}, {}, {}
        page_gen = xp.asarray(rng.integers(1, 2**32 - 1, b * ppr, dtype=np.uint32))
        gens = {"generations": page_gen[idx], "page_gen": page_gen}          # every page fresh: a clean run
        for label, be, kw in (("checked", checked, {}), ("unchecked", unchecked, {}),
                              ("checked+generations", checked, gens)):
            args = (q, cache, L, indptr, idx, lpl)
            replays[label], launches, results[label] = recorded(
                be, lambda rb, args=args, ppr=ppr, kw=kw: api.decode_attention(rb, *args, max_pages=ppr, **kw))
            grids[label] = [f"{name}{list(grid)}" for name, grid, _, _ in launches]
        with clocks:
            ts = interleaved(ctx, replays)
        clocks.emit(shape)
        for label in ("checked", "unchecked", "checked+generations"):
            med = statistics.median(ts[label])
            ctx.emit(kind="perf", kernel=f"decode ({label})", entry=entry, shape=shape, bytes=kv_bytes,
                     gbs=kv_bytes / med / 1e9, pct_copy=kv_bytes / med / 1e9 / copy_gbs,
                     pct_read=kv_bytes / med / 1e9 / read_gbs, launches=grids[label],
                     blocks_per_sm=checked.resident_blocks(entry, api.THREADS), **spread(ts[label]))
        pairs = [c / u - 1 for c, u in zip(ts["checked"], ts["unchecked"], strict=True)]
        ctx.emit(kind="cost", kernel="bounds-check cost", shape=shape,
                 cost=statistics.median(ts["checked"]) / statistics.median(ts["unchecked"]) - 1,
                 round_costs=[round(x, 4) for x in pairs])
        pairs = [g / c - 1 for g, c in zip(ts["checked+generations"], ts["checked"], strict=True)]
        ctx.emit(kind="cost", kernel="generation-check cost", shape=shape,
                 cost=statistics.median(ts["checked+generations"]) / statistics.median(ts["checked"]) - 1,
                 round_costs=[round(x, 4) for x in pairs])
        # the timed outputs (the replays rewrote them) against a float64 reference of the full rows
        ctx.check(f"long rows at the timing shape {shape} (checked build)",
                  lambda res=results["checked"], q=q, cache=cache, L=L, idx=idx, b=b, ppr=ppr:
                  long_rows_check(ctx, res, q, cache, L, idx, b, ppr))
        cache = results = replays = None

    # append_kv and copy_blocks (checked build) on a cache far larger than the L2, with 4 sets of
    # distinct k and v inputs in turn (one set would stay in the L2 between launches)
    hkv, d, b, ppr = 8, 128, (4 if (ctx.quick or not ctx.cuda) else 64), 256
    L = PageLayout.per_layer(b * ppr, ps, hkv, d, "float16")
    cache = random_device(xp, rng, b * ppr * L.page_elems, np.float16)
    nt = 64 if (ctx.quick or not ctx.cuda) else b * 256
    sets = []
    for _ in range(4):
        sm = xp.asarray(rng.permutation(b * ppr * ps)[:nt].astype(np.int64))
        kk = random_device(xp, rng, nt * hkv * d, np.float16).reshape(nt, hkv, d)
        vv = random_device(xp, rng, nt * hkv * d, np.float16).reshape(nt, hkv, d)
        sets.append(recorded(checked, lambda rb, kk=kk, vv=vv, sm=sm: api.append_kv(rb, cache, L, kk, vv, sm))[0])
    turn = [0]

    def append_rotating() -> None:
        sets[turn[0] % 4]()
        turn[0] += 1

    npairs = b * ppr // 8
    perm = rng.permutation(b * ppr)
    pairs = xp.asarray(np.stack([perm[:npairs], perm[npairs:2 * npairs]], 1).astype(np.int64))
    ops = {"append_kv": append_rotating,
           "copy_blocks": recorded(checked, lambda rb: api.copy_blocks(rb, [cache], L, pairs))[0]}
    moved = {"append_kv": 2 * 2 * nt * hkv * d * 2, "copy_blocks": 2 * npairs * L.page_elems * 2}
    cache_mib = b * ppr * L.page_elems * 2 >> 20
    shapes = {"append_kv": f"{nt} tokens x {hkv} x {d} fp16 into {cache_mib} MiB, 4 input sets in turn",
              "copy_blocks": f"{npairs} pages x {L.page_elems * 2 >> 10} KiB"}
    with clocks:
        ts = interleaved(ctx, ops)
    clocks.emit("append_kv and copy_blocks")
    for name in ops:
        med = statistics.median(ts[name])
        ctx.emit(kind="perf", kernel=name, shape=shapes[name], bytes=moved[name], gbs=moved[name] / med / 1e9,
                 pct_copy=moved[name] / med / 1e9 / copy_gbs, **spread(ts[name]))
    return 0


GROUPS: dict[str, Callable[[Ctx], int]] = {
    "preflight": group_preflight,
    "sanitize": group_sanitize,  # the target of the parent's compute-sanitizer runs
    "decode-float32": group_decode_sweep,
    "decode-float16": group_decode_sweep,
    "decode-bfloat16": group_decode_sweep,
    "timing": group_timing,
    "append-copy-guard": group_append_copy_guard,
    "over-4gib": group_over_4gib,
}


# The device's protobuf may be older than the committed stubs: nothing here may
# pull in the service layer (the generated stubs, gRPC, protobuf). The worker's
# kernel API shares the page-table rules of kvservice.pagetable (pure NumPy).
FORBIDDEN_IMPORTS = ("kvservice.v1", "kvservice.manager.api", "kvservice.server.servicer", "grpc", "google.protobuf")


def run_child(args: argparse.Namespace) -> int:
    ctx = Ctx(args)
    if args.hang == args.child:  # test hook: a child stuck with a grandchild (a compiler, say) under it
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        ctx.emit(kind="note", detail=f"hanging; grandchild pid {sleeper.pid}", pid=sleeper.pid)
        time.sleep(600)
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
