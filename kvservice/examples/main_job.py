"""`make run`: the whole system on embedded defaults.

1. A manager (in this process, gRPC on loopback) and one worker process
   (`kvworker serve`, CPU backend by default) that registers with it.
2. The reference scheduler drives a continuous-batching workload (Poisson
   arrivals, capacity pressure, preemption) over one StepStream with incremental
   tables (one request per iteration), validating every table its mirror yields.
3. A tiny transformer generates for 8 prompts in one batch and for each prompt
   alone, its KV cache and attention on the worker; batch and single logits
   must agree (seed 000's validation), and both must match a dense float64
   reference.
4. Seed 000's misconfiguration, handled: a pool planned for one sequence
   refuses the 8-sequence batch; a table pointing past the cache sent straight
   to the worker comes back NaN for that row only, counted on /metrics.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from kvservice.client.client import BlockManagerClient
from kvservice.client.codec import ClientError
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.pagetable import PageTable
from kvservice.contract.sizing import Sizing
from kvservice.examples.scheduler import ReferenceScheduler, Report, Workload
from kvservice.server.app import serve
from kvservice.tools.launch import wait_for_ports

ROOT = Path(__file__).resolve().parents[2]
AGREE_TOL = 1e-4      # float32 batch vs single, max |logit diff|
REF_TOL = 1e-4        # float32 paged vs float64 dense reference, max |logit diff|


class Progress:
    """A one-line progress bar on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, label: str, stream: object = sys.stderr) -> None:
        self.total, self.label, self.stream = total, label, stream
        self.tty = getattr(stream, "isatty", lambda: False)()
        self._last_decile = -1

    def update(self, done: int, extra: str = "") -> None:
        frac = min(done / max(self.total, 1), 1.0)
        bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
        line = f"{self.label} [{bar}] {done}/{self.total} {extra}"
        if self.tty:
            print("\r" + line, end="", file=self.stream, flush=True)  # type: ignore[arg-type]
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            print(line, file=self.stream, flush=True)  # type: ignore[arg-type]

    def __call__(self, report: Report, waiting: int, running: int) -> None:
        self.update(report.served, f"served  step {report.steps}  batch {running}  waiting {waiting}")

    def close(self) -> None:
        if self.tty:
            print(file=self.stream)  # type: ignore[arg-type]


def start_worker(target: str, pool: str, backend: str, tmp: Path, worker_id: str) -> tuple[subprocess.Popen, str, str]:
    """A `kvworker serve` process; returns (process, grpc address, metrics url)."""
    port_file = tmp / f"{worker_id}.ports"
    log = open(tmp / f"{worker_id}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvservice.worker.cli", "serve", "--manager", target, "--pool", pool,
                             "--backend", backend, "--listen", "127.0.0.1:0", "--metrics-port", "0",
                             "--port-file", str(port_file), "--worker-id", worker_id, "--log-level", "WARNING"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        port, metrics = wait_for_ports(proc, port_file, 120, tmp / f"{worker_id}.log", f"worker {worker_id}")
    except RuntimeError:
        proc.kill()
        raise
    return proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics"


def run_workload(client: BlockManagerClient, args: argparse.Namespace) -> Report:
    spec = CacheSpec.uniform(num_layers=32, kv_heads=8, head_dim=128, dtype="float16", page_size=16)
    info = client.create_pool("demo", spec, Sizing(num_slots=args.num_slots, max_seq_len=2048),
                              ("native", "flashinfer", "vllm-flash-attn"))
    print(f"[1/4] continuous batching: pool 'demo' {info.plan.num_slots:,} slots of {info.plan.page_size} tokens "
          f"({info.plan.total_bytes / 2**30:.2f} GiB planned over {len(info.plan.layers)} layers), "
          f"{args.requests} requests", flush=True)
    progress = Progress(args.requests, "      ")
    scheduler = ReferenceScheduler(client, "demo", max_batch=args.max_batch, optimistic=True, transport=args.transport)
    try:
        report = scheduler.run(Workload(num_requests=args.requests, arrival_rate=args.rate, seed=args.seed), progress)
    finally:
        scheduler.close()
    progress.close()
    return report


def run_model(client: BlockManagerClient, worker_addr: str, args: argparse.Namespace) -> dict[str, float]:
    from kvservice.client.worker_client import WorkerClient
    from kvservice.examples.generate import Cluster, generate
    from kvservice.examples.tiny_model import TinyConfig, TinyModel

    cfg = TinyConfig(seed=args.seed)
    model = TinyModel(cfg)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab, int(n)).tolist() for n in rng.integers(5, 60, 8)]
    print(f"[2/4] tiny transformer ({cfg.num_layers} layers, {cfg.q_heads} q / {cfg.kv_heads} kv heads, head_dim "
          f"{cfg.head_dim}, page_size 16): 8 prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.new_tokens} new tokens each, batched and one by one", flush=True)
    with WorkerClient(worker_addr, "worker-0") as w:
        cluster = Cluster.of(client, "tiny", [(range(cfg.num_layers), w)])
        progress = Progress(len(prompts) + 1, "      ")
        stream = client.step_stream("tiny", deltas=args.transport == "deltas") if args.transport != "unary" else None
        try:
            batch = generate(client, "tiny", cluster, model, prompts, args.new_tokens, 1000, stream=stream)
            progress.update(1, "batch done")
            singles = []
            for i, p in enumerate(prompts):
                singles.append(generate(client, "tiny", cluster, model, [p], args.new_tokens, 2000 + i, stream=stream))
                progress.update(i + 2, f"single {i + 1}/8")
        finally:
            if stream is not None:
                stream.close()
        progress.close()
    single_logits = np.concatenate([s.logits for s in singles])
    ref_diff = 0.0
    for i, p in enumerate(prompts):
        ref = model.reference_logits(p + batch.tokens[i, :-1].tolist())[len(p) - 1:]
        ref_diff = max(ref_diff, float(np.abs(ref - batch.logits[i]).max()))
    return {"batch_vs_single": float(np.abs(batch.logits - single_logits).max()),
            "tokens_equal": float((batch.tokens == np.concatenate([s.tokens for s in singles])).all()),
            "vs_reference": ref_diff}


def run_seed000(client: BlockManagerClient, worker_addr: str, metrics_url: str) -> dict[str, object]:
    from kvservice.client.worker_client import WorkerClient

    print("[3/4] seed 000, handled", flush=True)
    out: dict[str, object] = {}
    spec = CacheSpec.uniform(32, 8, 128, "float16", 16)
    info = client.create_pool("one-seq", spec, Sizing(max_batch=1, max_seq_len=2048))
    try:
        client.step("one-seq", admit=np.arange(8), admit_tokens=2048)
        out["refused"] = "NOT REFUSED"
    except ClientError as err:
        out["refused"] = f"{err.code.name}: {err.message}"
        out["refused_ok"] = err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and \
            client.stats("one-seq")["one-seq"].num_sequences == 0
    print(f"      pool planned for one sequence ({info.plan.num_slots} slots), 8 x 2048 tokens -> {out['refused']}")
    # A hand-made table: 4 rows, row 2's last page is one past the worker's cache.
    num_slots = client.get_pool("tiny").plan.num_slots
    rng = np.random.default_rng(7)
    q = rng.standard_normal((4, 4, 32)).astype(np.float32)
    good = rng.choice(num_slots, 8, replace=False).astype(np.int32)
    table = PageTable(np.array([0, 2, 4, 6, 8], dtype=np.int32), good.copy(), np.array([16, 3, 9, 1], np.int32))
    bad = PageTable(table.indptr, good.copy(), table.last_page_len)
    bad.indices[5] = num_slots
    with WorkerClient(worker_addr, "worker-0") as w:
        clean = w.decode_attention(0, q, table)
        hit = w.decode_attention(0, q, bad)
    rows_nan = [bool(np.isnan(hit.out[r]).all()) for r in range(4)]
    others_equal = all(np.array_equal(hit.out[r], clean.out[r]) for r in (0, 1, 3))
    v = hit.violation
    print(f"      table with row 2 pointing at page {num_slots} (cache has {num_slots}): rows NaN = {rows_nan}, "
          f"other rows bit-identical to the clean call = {others_equal}")
    print(f"      violation record: {v.count} violation(s), row {v.row}, position {v.position}, value {v.value}, "
          f"reason {v.reason}")
    metrics = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    lines = [ln for ln in metrics.splitlines() if ln.startswith("kvworker_bounds_violations_total{")]
    print(f"      {metrics_url}: {len(lines)} kvworker_bounds_violations_total series (kernel x layer x reason):")
    for ln in lines:
        if not ln.endswith(" 0.0"):
            print(f"        {ln}")
    print(f"        ... and {sum(ln.endswith(' 0.0') for ln in lines)} more, all 0.0")
    out["nan_ok"] = rows_nan == [False, False, True, False] and others_equal and \
        (v.count, v.row, v.position, v.value, v.reason) == (1, 2, 5, num_slots, "out_of_bounds")
    injected = 'kvworker_bounds_violations_total{kernel="decode_attention",layer="0",reason="out_of_bounds"}'
    values = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}
    out["metric_ok"] = values.get(injected) == 1.0 and all(v == 0.0 for k, v in values.items() if k != injected)
    return out


#: The KV-cache fields of Gemma 3 1B's config.json (26 layers, 5 sliding (window 512) : 1 global).
GEMMA3_1B = {"model_type": "gemma3_text", "num_hidden_layers": 26, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 1152, "sliding_window": 512,
             "sliding_window_pattern": 6, "torch_dtype": "bfloat16"}


def run_hybrid_prefix(client: BlockManagerClient, seed: int) -> dict[str, object]:
    """Prefix caching on a hybrid model: a Gemma-3-style pool (planned from its config.json fields) where
    32 chats share a 1,536-token system prompt; every layer group must serve a hit."""
    from kvservice.core.model_config import model_cache
    mc = model_cache(GEMMA3_1B, page_size=16, source="gemma-3-1b config.json")
    client.create_pool("gemma", mc.spec, Sizing(max_batch=64, max_seq_len=4096), prefix_caching=True)
    info = client.get_pool("gemma")
    groups = ", ".join(f"group {g.group}: {len(g.layers)} layers, "
                       + (f"window {g.sliding_window}" if g.sliding_window else "full attention")
                       for g in info.plan.groups)
    print(f"[4/4] prefix caching on a hybrid model: {mc.model_type}, {groups}", flush=True)
    rng = np.random.default_rng(seed)
    system = rng.integers(1, 50_000, 1536)
    cached, computed = [], 0
    for i in range(32):
        prompt = np.concatenate((system, rng.integers(1, 50_000, int(rng.integers(20, 200)))))
        r = client.step("gemma", admit=[i + 1], admit_tokens=[len(prompt)], admit_token_ids=prompt)
        cached.append(int(r.cached_tokens[0]))
        computed += len(prompt) - int(r.cached_tokens[0])
    stats = client.stats("gemma")["gemma"]
    seqs = client.sequences("gemma").sequences
    held = {s.seq_id: list(s.num_slots_per_group) for s in seqs[:2]}
    print(f"      32 prompts sharing 1,536 tokens: prompt tokens served from the cache {sum(cached):,} "
          f"(first admission {cached[0]}, then {min(cached[1:])}-{max(cached[1:])} each), computed {computed:,}; "
          f"slots held per group: the first sequence {held[1]}, the second (a hit) {held[2]}", flush=True)
    client.step("gemma", free=[s.seq_id for s in seqs])
    return {"cached": cached, "hits": stats.prefix_cache_hits,
            "ok": cached[0] == 0 and min(cached[1:]) >= 1536 and stats.num_sequences == 32}


def _transport(transport: str, report: Report) -> str:
    if transport == "unary":
        return "unary Step"
    mean = report.reply_bytes / max(report.steps, 1)
    what = f"{report.delta_replies} of {report.steps} replies incremental" if transport == "deltas" else "full tables"
    return f"StepStream, {what}, {mean:,.0f} bytes per reply"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvservice.examples.main_job", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per step")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--num-slots", type=int, default=768, help="slots of the demo pool (capacity pressure)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu", help="worker backend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transport", choices=["deltas", "stream", "unary"], default="deltas",
                    help="how the scheduler steps: StepStream with incremental tables (default), StepStream with "
                         "full tables, or unary Step")
    args = ap.parse_args(argv)

    running = serve("127.0.0.1:0", metrics_port=0)
    target = f"127.0.0.1:{running.port}"
    worker = None
    try:
        with BlockManagerClient(target) as client, tempfile.TemporaryDirectory() as tmp:
            client.wait_ready()
            tiny = CacheSpec.uniform(num_layers=3, kv_heads=2, head_dim=32, dtype="float32", page_size=16)
            client.create_pool("tiny", tiny, Sizing(num_slots=256, max_seq_len=512), ("native",))
            worker, worker_addr, metrics_url = start_worker(target, "tiny", args.backend, Path(tmp), "worker-0")
            (w,) = client.workers("tiny")
            print(f"manager at {target} (metrics http://127.0.0.1:{running.metrics_port}/metrics); worker "
                  f"{w.worker_id} ({w.backend}, {w.device_name}) epoch {w.epoch} at {w.address}, metrics "
                  f"{metrics_url}", flush=True)
            report = run_workload(client, args)
            stats = client.stats("demo")["demo"]
            model = run_model(client, worker_addr, args)
            seed000 = run_seed000(client, worker_addr, metrics_url)
            hybrid = run_hybrid_prefix(client, args.seed)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(10)
        running.stop()
    checks = {
        "workload served, tables valid, no slot leaked": report.served == args.requests
        and report.table_violations == 0 and stats.num_sequences == 0,
        f"batch == single (max |logit diff| {model['batch_vs_single']:.2e} < {AGREE_TOL:g})":
            model["batch_vs_single"] < AGREE_TOL and model["tokens_equal"] == 1.0,
        f"paged == dense float64 reference (max |logit diff| {model['vs_reference']:.2e} < {REF_TOL:g})":
            model["vs_reference"] < REF_TOL,
        "one-sequence pool refuses the 8-sequence batch, unchanged": bool(seed000.get("refused_ok")),
        "row past the cache is NaN, other rows exact, violation recorded": bool(seed000["nan_ok"]),
        "kvworker_bounds_violations_total == 1 for it, nothing else counted": bool(seed000["metric_ok"]),
        "hybrid (Gemma-3-style) pool serves shared prompt prefixes from every layer group's cache": bool(hybrid["ok"]),
    }
    print("\nsummary")
    rows = [("sequences served", f"{report.served}"), ("steps", f"{report.steps}"),
            ("tokens generated", f"{report.tokens_generated}"),
            ("peak slots used", f"{report.peak_slots_used} of {args.num_slots} (manager: {stats.peak_used_slots})"),
            ("refused admissions", f"{report.refused_admissions}"), ("preemptions", f"{report.preemptions}"),
            ("tables validated", f"{report.tables_validated} ({report.table_violations} violations)"),
            ("step transport", _transport(args.transport, report)),
            ("step latency p50", f"{report.percentile_ms(50):.3f} ms"),
            ("step latency p99", f"{report.percentile_ms(99):.3f} ms"),
            ("batch vs single", f"max |logit diff| {model['batch_vs_single']:.3e}"),
            ("vs float64 ref", f"max |logit diff| {model['vs_reference']:.3e}"),
            ("hybrid prefix hits", f"{sum(hybrid['cached']):,} prompt tokens from the cache (Gemma-3-style pool)")]
    for k, v in rows:
        print(f"  {k:<20} {v}")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
