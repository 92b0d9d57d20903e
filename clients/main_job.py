"""`make run`: the manager on embedded defaults, driven by the reference scheduler.

Starts a manager in this process (gRPC on loopback, a pool sized so the
workload meets capacity pressure), runs a synthetic continuous-batching
workload through one Step RPC per iteration, validates every table the manager
emits, and prints a summary.
"""

from __future__ import annotations

import argparse
import sys

from kvservice.geometry import CacheSpec
from kvservice.planner import Sizing
from kvservice.server import serve

from .client import BlockManagerClient
from .scheduler import ReferenceScheduler, Report, Workload


class Progress:
    """A one-line progress bar on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, stream: object = sys.stderr) -> None:
        self.total = total
        self.stream = stream
        self.tty = getattr(stream, "isatty", lambda: False)()
        self._last_decile = -1

    def __call__(self, report: Report, waiting: int, running: int) -> None:
        frac = report.served / self.total
        bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
        line = (f"[{bar}] {report.served}/{self.total} served  step {report.steps}  batch {running}  "
                f"waiting {waiting}  slots used {report.peak_slots_used} peak")
        if self.tty:
            print("\r" + line, end="", file=self.stream, flush=True)  # type: ignore[arg-type]
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            print(line, file=self.stream, flush=True)  # type: ignore[arg-type]

    def close(self) -> None:
        if self.tty:
            print(file=self.stream)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.main_job", description=__doc__)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per step")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--num-slots", type=int, default=768, help="slots of the demo pool (capacity pressure)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", help="use a running manager instead of an embedded one")
    args = ap.parse_args(argv)

    running = None
    target = args.target
    if target is None:
        running = serve("127.0.0.1:0", metrics_port=None)
        target = f"127.0.0.1:{running.port}"
    try:
        with BlockManagerClient(target) as client:
            client.wait_ready()
            spec = CacheSpec.uniform(num_layers=32, kv_heads=8, head_dim=128, dtype="float16", page_size=16)
            info = client.create_pool("demo", spec, Sizing(num_slots=args.num_slots, max_seq_len=2048),
                                      ("native", "flashinfer", "vllm-flash-attn"))
            print(f"manager at {target}; pool 'demo': {info.plan.num_slots:,} slots of {info.plan.page_size} "
                  f"tokens, {info.plan.total_bytes / 2**30:.2f} GiB of cache planned over {len(info.plan.layers)} "
                  f"layers", flush=True)
            workload = Workload(num_requests=args.requests, arrival_rate=args.rate, seed=args.seed)
            progress = Progress(args.requests)
            scheduler = ReferenceScheduler(client, "demo", max_batch=args.max_batch, optimistic=True)
            report = scheduler.run(workload, progress)
            progress.close()
            stats = client.stats("demo")["demo"]
    finally:
        if running is not None:
            running.stop()
    print("\nsummary")
    rows = [("sequences served", f"{report.served}"), ("steps", f"{report.steps}"),
            ("tokens generated", f"{report.tokens_generated}"),
            ("peak slots used", f"{report.peak_slots_used} of {args.num_slots} (manager: {stats.peak_used_slots})"),
            ("peak batch", f"{report.peak_batch}"), ("refused admissions", f"{report.refused_admissions}"),
            ("preemptions", f"{report.preemptions}"),
            ("tables validated", f"{report.tables_validated} ({report.table_violations} violations)"),
            ("step latency p50", f"{report.percentile_ms(50):.3f} ms"),
            ("step latency p99", f"{report.percentile_ms(99):.3f} ms"), ("wall time", f"{report.wall_s:.1f} s")]
    for k, v in rows:
        print(f"  {k:<20} {v}")
    ok = report.served == args.requests and report.table_violations == 0 and stats.num_sequences == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
