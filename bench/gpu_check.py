"""GPU check for the paged KV kernels: build via cupy, correctness vs the torch
float64 reference (including a cache buffer over 4 GiB), and timings as GB/s
against a device-to-device copy measured in the same run, plus the cost of
the bounds checks (checked build vs -DKV_NO_BOUNDS_CHECK build).

    python bench/gpu_check.py --out bench/results/gpu-<date>.md

``--dry-run`` writes a report without touching a GPU (``--inject FILE.json``
supplies results); ``--backend cpu --quick`` runs every check on the CPU
emulation at toy sizes (timings meaningless) to test this script itself.
Exit: 0 correctness passed, 1 a correctness check failed, 2 cannot run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker import kernel_api as api  # noqa: E402
from worker.kernel_api import PageLayout  # noqa: E402

TARGET_DECODE = 0.70  # decode GB/s >= 70 % of copy GB/s
TARGET_CHECK_COST = 0.03  # checked vs unchecked decode time <= +3 %


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="markdown report path (default bench/results/gpu-DATE.md)")
    p.add_argument("--backend", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dry-run", action="store_true", help="write the report only, run nothing")
    p.add_argument("--inject", type=Path, default=None, help="JSON results to render (with --dry-run)")
    p.add_argument("--quick", action="store_true", help="toy sizes (for --backend cpu)")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    if a.out is None:
        a.out = ROOT / "bench" / "results" / f"gpu-{dt.date.today().isoformat()}.md"
    return a


class Ops:
    """kernel_api functions bound to one backend."""

    def __init__(self, be: Any) -> None:
        self.be, self.xp = be, be.xp
        for name in ("append_kv", "decode_attention", "copy_blocks", "validate_page_table",
                     "guard_fill", "guard_check"):
            setattr(self, name, functools.partial(getattr(api, name), be))


def make_backends(kind: str) -> tuple[Ops, Ops, str]:
    """(checked, unchecked, device name). Raises SystemExit(2) with a message."""
    if kind == "cpu":
        from worker import kernels_cpu

        return Ops(kernels_cpu.backend("plain")), Ops(kernels_cpu.backend("nocheck")), "CPU emulation (g++)"
    try:
        import cupy
    except Exception as e:
        raise SystemExit(f"gpu_check: cupy is not importable ({e}); run this on a GPU machine with cupy, "
                         "or use --dry-run / --backend cpu") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise SystemExit(f"gpu_check: no usable CUDA device ({e})") from None
    if n == 0:
        raise SystemExit("gpu_check: no CUDA device found")
    from worker import kernels_cuda

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return Ops(kernels_cuda.backend(False)), Ops(kernels_cuda.backend(True)), name


# ---- data helpers --------------------------------------------------------------------
def rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    x = rng.uniform(0.1, 1.0, shape).astype(np.float32) * rng.choice([-1.0, 1.0], shape).astype(np.float32)
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(api.DTYPES[dtype])


def table(rng: np.random.Generator, layout: PageLayout, slots: int, lens: list[int]) -> tuple[np.ndarray, ...]:
    pages = [-(-n // layout.page_size) for n in lens]
    idx = np.asarray(layout.page_index(rng.permutation(slots)[: sum(pages)]), dtype=np.int32)
    indptr = np.concatenate(([0], np.cumsum(pages))).astype(np.int32)
    lpl = np.array([n - layout.page_size * (p - 1) for n, p in zip(lens, pages, strict=True)], dtype=np.int32)
    return indptr, idx, lpl


def rel_err(a: np.ndarray, ref: np.ndarray, floor: float = 1e-30) -> float:
    """Largest per-row relative error against the float64 oracle (worker.reference.row_rel_err)."""
    from worker import reference

    return reference.row_rel_err(a, ref, floor)


# ---- correctness -------------------------------------------------------------------
def check_decode(ops: Ops, quick: bool) -> list[dict]:
    from worker import reference

    rng = np.random.default_rng(0)
    out = []
    hq, hkv, lens = (8, 2, [37, 150, 1, 64]) if quick else (32, 8, [1000, 1, 4096, 333, 17, 2048])
    dims = (64,) if quick else (64, 128, 256)
    for dtype in ("float16", "bfloat16", "float32"):
        for d in dims:
            for kind in ("per_layer", "interleaved"):
                ps = 16
                slots = sum(-(-n // ps) for n in lens) + 3
                pe = 2 * ps * hkv * d
                if kind == "per_layer":
                    L = PageLayout.per_layer(slots, ps, hkv, d, dtype)
                    raw = reference.RawLayer.per_layer(slots, ps, hkv, d, dtype)
                    host = rand(rng, (slots * pe,), dtype)
                else:
                    pb = pe * api.ITEMSIZE[dtype]
                    L = PageLayout.interleaved(slots, 4 * pb, 2 * pb, ps, hkv, d, dtype)
                    raw = reference.RawLayer.interleaved(slots, 4 * pb, 2 * pb, ps, hkv, d, dtype)
                    host = rand(rng, (slots * 4 * pe,), dtype)
                t = table(rng, L, slots, lens)
                q = rand(rng, (len(lens), hq, d), dtype)
                ref_o, ref_lse = reference.decode_attention_ref(q, host, raw, *t)
                tol = reference.TOLERANCE[dtype]
                for split in (0, 3):
                    xs = [ops.xp.asarray(a) for a in (q, host, *t)]
                    res = ops.decode_attention(xs[0], xs[1], L, *xs[2:], kv_chunk_pages=split)
                    err = rel_err(ops.be.to_host(res.out), ref_o)
                    err_lse = rel_err(ops.be.to_host(res.lse), ref_lse, 1.0)
                    ok = err <= tol and err_lse <= tol and res.record.count == 0
                    out.append({"check": f"decode {dtype} d{d} {kind} split={split}", "ok": ok,
                                "detail": f"rel err out {err:.2e}, lse {err_lse:.2e} (tol {tol:g}, per row)"})
                # one row one page past the buffer: NaN row + exact record, others unaffected
                bad = t[1].copy()
                bad[t[0][1]] = L.upper_bound
                xs = [ops.xp.asarray(a) for a in (q, host, t[0], bad, t[2])]
                res = ops.decode_attention(*xs[:2], L, *xs[2:], kv_chunk_pages=3)
                o = ops.be.to_host(res.out)
                r = res.record
                ok = (r.count, r.row, r.position, r.reason) == (1, 1, int(t[0][1]), "out_of_bounds") and \
                    bool(np.isnan(o[1]).all()) and rel_err(np.delete(o, 1, 0), np.delete(ref_o, 1, 0)) <= tol
                out.append({"check": f"decode {dtype} d{d} {kind} page past end", "ok": ok, "detail": str(r)})
    return out


def check_append_copy_guard(ops: Ops) -> list[dict]:
    from worker import ops_numpy

    rng = np.random.default_rng(1)
    res = []
    L = PageLayout.per_layer(64, 16, 8, 128, "float16")
    host = rand(rng, (64 * L.page_elems,), "float16")
    sm = (rng.permutation(64 * 16)[:300]).astype(np.int64)
    sm[[5, 17]] = [-1, 64 * 16]
    k, v = rand(rng, (300, 8, 128), "float16"), rand(rng, (300, 8, 128), "float16")
    dev = ops.xp.asarray(host)
    r1 = ops.append_kv(dev, L, ops.xp.asarray(k), ops.xp.asarray(v), ops.xp.asarray(sm)).record
    exp = host.copy()
    r2 = ops_numpy.append_kv(exp, L, k, v, sm).record
    res.append({"check": "append vs numpy", "ok": r1 == r2 and np.array_equal(ops.be.to_host(dev), exp),
                "detail": str(r1)})
    pairs = np.array([[1, 2], [3, 64], [10, 11]], dtype=np.int64)
    r1 = ops.copy_blocks([dev], L, ops.xp.asarray(pairs)).record
    r2 = ops_numpy.copy_blocks([exp], L, pairs).record
    res.append({"check": "copy_blocks vs numpy", "ok": r1 == r2 and np.array_equal(ops.be.to_host(dev), exp),
                "detail": str(r1)})
    buf = ops.xp.zeros(1 << 20, dtype=np.uint8)
    ops.guard_fill(buf, 4096)
    clean = ops.guard_check(buf, 4096)
    buf[(1 << 20) - 7] = 0
    hit = ops.guard_check(buf, 4096)
    ok = not clean and (hit.corrupted_bytes, hit.first_offset) == (1, (1 << 20) - 7)
    res.append({"check": "guard zones", "ok": ok, "detail": f"clean={clean}, corrupted={hit}"})
    return res


def check_over_4gib(ops: Ops) -> list[dict]:
    """Cache buffer of > 4 GiB: write and read a page whose byte offset is past 2^32."""
    from worker import reference

    rng = np.random.default_rng(2)
    L = PageLayout.per_layer(2**16 + 8, 16, 8, 128, "float16")  # 64 KiB pages, 4 GiB + 512 KiB
    cache = ops.xp.zeros(L.upper_bound * L.page_elems, dtype=np.float16)
    high = 2**16 + 1
    k, v = rand(rng, (20, 8, 128), "float16"), rand(rng, (20, 8, 128), "float16")
    sm = np.concatenate([3 * 16 + np.arange(16), high * 16 + np.arange(4)]).astype(np.int64)
    r = ops.append_kv(cache, L, ops.xp.asarray(k), ops.xp.asarray(v), ops.xp.asarray(sm)).record
    ops.copy_blocks([cache], L, ops.xp.asarray(np.array([[high, high + 2]], dtype=np.int64)))
    pe = L.page_elems
    small = np.concatenate([ops.be.to_host(cache[p * pe:(p + 1) * pe]) for p in (3, high, high + 2)])
    wrapped = ops.be.to_host(cache[: 3 * pe])
    q = rand(rng, (1, 32, 128), "float16")
    t = (np.array([0, 3], np.int32), np.array([3, high, high + 2], np.int32), np.array([4], np.int32))
    res = ops.decode_attention(ops.xp.asarray(q), cache, L, *[ops.xp.asarray(a) for a in t])
    raw = reference.RawLayer.per_layer(3, 16, 8, 128, "float16")
    ref_o, _ = reference.decode_attention_ref(q, small, raw, t[0], np.arange(3, dtype=np.int32), t[2])
    err = rel_err(ops.be.to_host(res.out), ref_o)
    ok = r.count == 0 and not wrapped.any() and err <= reference.TOLERANCE["float16"]
    del cache
    return [{"check": "cache > 4 GiB: page past 2^32 bytes", "ok": ok,
             "detail": f"rel err {err:.2e}, low pages untouched={not wrapped.any()}"}]


# ---- timing --------------------------------------------------------------------------
def timer(ops: Ops, fn: Callable[[], Any], iters: int) -> float:
    """Median seconds per call."""
    for _ in range(3):
        fn()
    ts = []
    if ops.xp is np:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    else:
        cp = ops.xp
        for _ in range(iters):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return float(np.median(ts))


def measure(ops: Ops, raw: Ops, quick: bool, iters: int) -> list[dict]:
    xp, rng = ops.xp, np.random.default_rng(3)
    B, ctx, hq, hkv, d, ps = (4, 256, 8, 2, 64, 16) if quick else (64, 4096, 32, 8, 128, 16)
    rows: list[dict] = []
    # device-to-device copy
    n = (8 << 20) if quick else (1 << 30)
    src, dst = xp.ones(n, dtype=np.uint8), xp.empty(n, dtype=np.uint8)
    if xp is np:
        t = timer(ops, lambda: np.copyto(dst, src), iters)
    else:
        t = timer(ops, lambda: xp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, 3, 0), iters)
    copy_gbs = 2 * n / t / 1e9
    rows.append({"kernel": "device-to-device copy", "shape": f"{n >> 20} MiB", "ms": t * 1e3, "gbs": copy_gbs})
    src = dst = None  # free before the cache is allocated
    # decode
    ppr = ctx // ps
    L = PageLayout.per_layer(B * ppr, ps, hkv, d, "float16")
    cache = xp.asarray(rand(rng, (B * ppr * L.page_elems,), "float16"))
    idx = xp.asarray(rng.permutation(B * ppr).astype(np.int32))
    indptr = xp.asarray((np.arange(B + 1) * ppr).astype(np.int32))
    lpl = xp.asarray(np.full(B, ps, dtype=np.int32))
    q = xp.asarray(rand(rng, (B, hq, d), "float16"))
    kv_bytes = B * ctx * hkv * d * 2 * 2
    times = {}
    for label, o in (("checked", ops), ("unchecked", raw)):
        times[label] = timer(o, lambda o=o: o.decode_attention(q, cache, L, indptr, idx, lpl, max_pages=ppr), iters)
        rows.append({"kernel": f"decode ({label})", "shape": f"B={B} ctx={ctx} hq={hq} hkv={hkv} d={d} fp16",
                     "ms": times[label] * 1e3, "gbs": kv_bytes / times[label] / 1e9})
    # append: B * 256 tokens
    nt = 64 if quick else B * 256
    sm = xp.asarray(rng.permutation(B * ppr * ps)[:nt].astype(np.int64))
    kk = xp.asarray(rand(rng, (nt, hkv, d), "float16"))
    t = timer(ops, lambda: ops.append_kv(cache, L, kk, kk, sm), iters)
    rows.append({"kernel": "append_kv", "shape": f"{nt} tokens", "ms": t * 1e3,
                 "gbs": 2 * 2 * nt * hkv * d * 2 / t / 1e9})
    # copy_blocks: a quarter of the pages
    npairs = B * ppr // 8
    perm = rng.permutation(B * ppr)
    pairs = xp.asarray(np.stack([perm[:npairs], perm[npairs:2 * npairs]], 1).astype(np.int64))
    t = timer(ops, lambda: ops.copy_blocks([cache], L, pairs), iters)
    rows.append({"kernel": "copy_blocks", "shape": f"{npairs} pages x {L.page_elems * 2 >> 10} KiB",
                 "ms": t * 1e3, "gbs": 2 * npairs * L.page_elems * 2 / t / 1e9})
    for r in rows:
        r["pct_copy"] = r["gbs"] / copy_gbs
    rows.append({"kernel": "bounds-check cost", "shape": "checked / unchecked decode - 1",
                 "ms": None, "gbs": None, "cost": times["checked"] / times["unchecked"] - 1})
    return rows


# ---- report --------------------------------------------------------------------------
def render(results: dict) -> str:
    lines = [f"# GPU kernel check — {results['date']}", "", f"- GPU: {results['gpu']}",
             f"- backend: {results['backend']}", f"- versions: {results.get('versions', '-')}", ""]
    if results.get("note"):
        lines += [f"> {results['note']}", ""]
    checks = results.get("checks", [])
    lines += ["## Correctness (vs torch float64 reference)", "", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c['check']} | {'PASS' if c['ok'] else 'FAIL'} | {c['detail']} |" for c in checks]
    if not checks:
        lines.append("| (not run) | - | - |")
    perf = results.get("perf", [])
    lines += ["", "## Performance", "", "| kernel | shape | time (ms) | GB/s | % of copy |", "|---|---|---|---|---|"]
    cost = None
    for r in perf:
        if "cost" in r:
            cost = r["cost"]
            continue
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['ms']:.3f} | {r['gbs']:.1f} | {100 * r['pct_copy']:.1f} % |")
    if not perf:
        lines.append("| (not run) | - | - | - | - |")
    dec = next((r for r in perf if r["kernel"] == "decode (checked)"), None)
    lines += ["", "## Targets", "", "| target | measured | result |", "|---|---|---|"]
    if dec is not None:
        ok = dec["pct_copy"] >= TARGET_DECODE
        lines.append(f"| decode >= {TARGET_DECODE:.0%} of copy bandwidth | {dec['pct_copy']:.1%} | "
                     f"{'MET' if ok else 'MISSED'} |")
    if cost is not None:
        ok = cost <= TARGET_CHECK_COST
        lines.append(f"| bounds-check cost <= {TARGET_CHECK_COST:.0%} | {cost:+.1%} | {'MET' if ok else 'MISSED'} |")
    if dec is None and cost is None:
        lines.append("| (not measured) | - | - |")
    return "\n".join(lines) + "\n"


def versions() -> str:
    out = [f"numpy {np.__version__}"]
    for mod in ("cupy", "torch"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            out.append(f"{mod} -")
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if args.dry_run:
        results = json.loads(args.inject.read_text()) if args.inject else {}
        results.setdefault("gpu", "(dry run: no GPU used)")
        results.setdefault("backend", args.backend)
        results.setdefault("date", now)
        results.setdefault("note", "dry run: nothing was executed")
    else:
        try:
            ops, raw, gpu = make_backends(args.backend)
        except SystemExit as e:
            print(e, file=sys.stderr)
            return 2
        results = {"gpu": gpu, "backend": args.backend, "date": now, "versions": versions(), "checks": []}
        steps: list[Callable[[], list[dict]]] = [lambda: check_decode(ops, args.quick),
                                                 lambda: check_append_copy_guard(ops)]
        if not args.quick:
            steps.append(lambda: check_over_4gib(ops))
        else:
            results["note"] = "quick mode: toy sizes, no > 4 GiB check; timings are not meaningful"
        for step in steps:
            try:
                results["checks"] += step()
            except Exception as e:
                results["checks"].append({"check": getattr(step, "__name__", "step"), "ok": False,
                                          "detail": f"{type(e).__name__}: {e}"})
                traceback.print_exc()
        try:
            results["perf"] = measure(ops, raw, args.quick, args.iters)
        except Exception as e:
            results["checks"].append({"check": "timing", "ok": False, "detail": f"{type(e).__name__}: {e}"})
            traceback.print_exc()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = render(results)
    args.out.write_text(text)
    print(text)
    print(f"report written to {args.out}")
    return 0 if all(c["ok"] for c in results.get("checks", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
