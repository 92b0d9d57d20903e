"""`kvworker`: the worker process's command line.

`kvworker serve` holds a shard of a pool's KV cache (guarded buffers), registers
with the manager under a lease and serves the Worker gRPC service and /metrics.
`kvworker info` reports what this machine can run: the kernel sources shipped,
whether CuPy and a CUDA device are present (the `cuda` backend) and whether
nvcc and g++ are on PATH (compile checks, the CPU-emulated kernels).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"


def probe() -> dict[str, object]:
    """What this machine offers the worker."""
    info: dict[str, object] = {
        "kernel_sources": sorted(p.name for p in KERNEL_DIR.glob("*.cu")),
        "nvcc": shutil.which("nvcc"),
        "gxx": shutil.which("g++"),
        "cupy": importlib.util.find_spec("cupy") is not None,
        "cuda_devices": [],
    }
    if info["cupy"]:
        try:
            import cupy

            n = cupy.cuda.runtime.getDeviceCount()
            info["cuda_devices"] = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(n)]
        except Exception as exc:  # CuPy installed but no driver/device
            info["cuda_error"] = str(exc)
    info["backends"] = ["cpu"] + (["cuda"] if info["cuda_devices"] else [])
    return info


def serve(args: argparse.Namespace) -> int:
    import logging
    import signal
    import socket
    import threading

    from kvservice.client.codec import ClientError
    from kvservice.contract.errors import KVError
    from kvservice.worker.server import serve_worker

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    begin, end = 0, 0
    if args.layers:
        try:
            b, e = args.layers.split(":")
            begin, end = int(b or 0), int(e or 0)
        except ValueError:
            print(f"kvworker: --layers wants A:B (layers A..B-1), got {args.layers!r}", file=sys.stderr)
            return 2
    worker_id = args.worker_id or f"{socket.gethostname()}-{args.pool}-{begin}-{end}-r{args.tp_rank}"
    try:
        security = _security(args)
        running = serve_worker(args.manager, args.pool, worker_id, begin, end, args.tp_rank, args.tp_size,
                               args.backend, args.listen, None if args.metrics_port < 0 else args.metrics_port,
                               args.cpu_kernels, args.enable_test_hooks, args.advertise, args.metrics_addr,
                               max_table_rows=args.max_table_rows, max_tables=args.max_tables,
                               table_quota_bytes=args.table_quota_bytes, **security)
    except (ClientError, KVError, OSError, ValueError, ImportError) as err:
        print(f"kvworker: {getattr(err, 'message', err)}", file=sys.stderr)
        return 2
    print(f"kvworker: {worker_id} listening on port {running.port}, metrics on port {running.metrics_port}, "
          f"epoch {running.identity['epoch']}", flush=True)
    if args.port_file:
        Path(args.port_file).write_text(f"{running.port} {running.metrics_port or 0}\n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    running.stop()
    return 0


def _security(args: argparse.Namespace) -> dict[str, object]:
    """TLS and token options of serve_worker from the flags (files are read here; tokens never printed)."""
    import os

    from kvservice.client.client import TLSOptions
    from kvservice.contract.auth import ServerTLS, TokenTable

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    token = Path(args.manager_token_file).read_text().strip() if args.manager_token_file else \
        os.environ.get("KVSERVICE_TOKEN") or None
    return {
        "manager_tls": TLSOptions.from_files(args.manager_ca, args.manager_cert, args.manager_key)
        if args.manager_ca or args.manager_cert else None,
        "manager_token": token,
        "tls": ServerTLS.from_files(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None,
        "tokens": TokenTable.from_file(args.tokens_file) if args.tokens_file else None,
    }


def _security_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("security (docs/SECURITY.md)")
    g.add_argument("--tls-cert", help="PEM certificate of this worker's server (with --tls-key: serve TLS)")
    g.add_argument("--tls-key", help="PEM key of --tls-cert")
    g.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")
    g.add_argument("--tokens-file", help="YAML of bearer tokens scoped to pools, required on every call")
    g.add_argument("--manager-ca", help="CA bundle that signed the manager's certificate (TLS to the manager)")
    g.add_argument("--manager-cert", help="client certificate for a manager with mutual TLS")
    g.add_argument("--manager-key", help="key of --manager-cert")
    g.add_argument("--manager-token-file", help="file holding the bearer token for the manager "
                   "(default: env KVSERVICE_TOKEN)")


def main(argv: list[str] | None = None) -> int:
    from kvservice.worker.tables import MAX_TABLE_ROWS, MAX_TABLES

    ap = argparse.ArgumentParser(prog="kvworker", description="kvservice worker")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="what this machine can run")
    p.add_argument("--json", action="store_true")
    s = sub.add_parser("serve", help="hold a shard of a pool's KV cache and run kernels on request")
    s.add_argument("--manager", default="127.0.0.1:50051", help="manager address")
    s.add_argument("--pool", default="default")
    s.add_argument("--layers", help="A:B = layers A..B-1 (default: all)")
    s.add_argument("--tp-rank", type=int, default=0)
    s.add_argument("--tp-size", type=int, default=1)
    s.add_argument("--backend", choices=["cuda", "cpu"], default="cpu")
    s.add_argument("--cpu-kernels", choices=["numpy", "emulated"], default="numpy",
                   help="cpu backend: NumPy kernels, or the .cu sources built with g++ (host emulation)")
    s.add_argument("--listen", default="127.0.0.1:50061")
    s.add_argument("--advertise", help="address registered with the manager (default: listen host:port)")
    s.add_argument("--metrics-port", type=int, default=9500, help="0 picks a port, -1 disables")
    s.add_argument("--metrics-addr", default="127.0.0.1")
    s.add_argument("--worker-id")
    s.add_argument("--port-file", help="write the bound gRPC and metrics ports here (tests)")
    s.add_argument("--enable-test-hooks", action="store_true", help="allow CorruptGuard (tests only)")
    t = s.add_argument_group("persistent tables (UpdateTables; docs/SECURITY.md#worker-tables)")
    t.add_argument("--max-table-rows", type=int, default=MAX_TABLE_ROWS,
                   help="rows one table may hold (at most the pool's slots); with the pool's max_seq_len it sets "
                        "the pool's table size")
    t.add_argument("--max-tables", type=int, default=MAX_TABLES, help="tables per tenant (token)")
    t.add_argument("--table-quota-bytes", type=int, default=0,
                   help="device bytes of one tenant's tables (0: 4 x the most one table of the pool holds)")
    s.add_argument("--log-level", default="INFO")
    _security_args(s)
    args = ap.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    info = probe()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:<15} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
