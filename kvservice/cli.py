"""`kvservice serve`: run the block manager (gRPC + health + reflection, /metrics)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from .config import DEFAULT_POOLS_YAML, load_pools, load_pools_file
from .errors import KVError
from .server import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvservice", description="Paged KV-cache block manager.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the manager")
    s.add_argument("--listen", default="127.0.0.1:50051", help="gRPC address (port 0 picks a free port)")
    s.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (0 picks; -1 off)")
    s.add_argument("--metrics-addr", default="127.0.0.1", help="address /metrics binds to")
    s.add_argument("--pools", help="YAML file of pools to create at start (default: one embedded pool)")
    s.add_argument("--no-pools", action="store_true", help="start empty; create pools over the API")
    s.add_argument("--port-file", help="write the bound gRPC and metrics ports here (tests)")
    s.add_argument("--threads", type=int, default=8, help="gRPC worker threads")
    s.add_argument("--lease-seconds", type=float, default=10.0, help="a worker silent this long is marked dead")
    s.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.no_pools:
            pools = []
        elif args.pools:
            pools = load_pools_file(args.pools)
        else:
            pools = load_pools(DEFAULT_POOLS_YAML, "embedded defaults")
        running = serve(args.listen, None if args.metrics_port < 0 else args.metrics_port, pools,
                        max_workers=args.threads, metrics_addr=args.metrics_addr, lease_seconds=args.lease_seconds)
    except (KVError, OSError) as err:
        print(f"kvservice: {getattr(err, 'message', err)}", file=sys.stderr)
        return 2
    print(f"kvservice: listening on {args.listen.rsplit(':', 1)[0]}:{running.port}, metrics on port "
          f"{running.metrics_port}, pools: {', '.join(running.manager.pool_names()) or 'none'}", flush=True)
    if args.port_file:
        Path(args.port_file).write_text(f"{running.port} {running.metrics_port or 0}\n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    running.stop(grace=2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
