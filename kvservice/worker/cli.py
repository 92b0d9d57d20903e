"""`kvworker`: the worker process's command line.

`kvworker serve` holds a shard of a pool's KV cache (guarded buffers), registers
with the manager under a lease and serves the Worker gRPC service and /metrics.
`kvworker info` reports what this machine can run: the kernel sources shipped,
whether CuPy and a CUDA device are present (the `cuda` backend) and whether
nvcc and g++ are on PATH (compile checks, the CPU-emulated kernels).
Flags, defaults and exit codes: `kvworker serve --help`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

from kvservice.contract import logs
from kvservice.contract.cli import add_log_args, existing_file, exit_epilog, parser, subparsers

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
EXIT_OK, EXIT_USAGE = 0, 2
EXIT_CODES = {
    EXIT_OK: "serve: stopped cleanly (SIGTERM or SIGINT); info: printed",
    EXIT_USAGE: "a usage or configuration error (the message names the flag), a backend this machine cannot run, "
                "or a manager that refused or did not answer the registration",
}
#: What to do when --backend cuda cannot run here.
CUDA_HINT = ("run with --backend cpu (NumPy kernels, no GPU needed), or install the gpu extra (CuPy: pip install -e "
             "'.[gpu]') on a machine with an NVIDIA GPU")


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
    import signal
    import socket
    import threading

    from kvservice.client.codec import ClientError
    from kvservice.contract.errors import KVError
    from kvservice.worker.server import serve_worker

    logs.configure(args.log_level, args.log_format)
    if args.backend == "cuda" and importlib.util.find_spec("cupy") is None:
        print(f"kvworker: --backend cuda needs CuPy, which is not installed: {CUDA_HINT}", file=sys.stderr)
        return EXIT_USAGE
    begin, end = 0, 0
    if args.layers:
        try:
            b, e = args.layers.split(":")
            begin, end = int(b or 0), int(e or 0)
        except ValueError:
            print(f"kvworker: --layers wants A:B (layers A..B-1), got {args.layers!r}", file=sys.stderr)
            return EXIT_USAGE
    worker_id = args.worker_id or f"{socket.gethostname()}-{args.pool}-{begin}-{end}-r{args.tp_rank}"
    try:
        security = _security(args)
        running = serve_worker(args.manager, args.pool, worker_id, begin, end, args.tp_rank, args.tp_size,
                               args.backend, args.listen, None if args.metrics_port < 0 else args.metrics_port,
                               args.cpu_kernels, args.enable_test_hooks, args.advertise, args.metrics_addr,
                               max_table_rows=args.max_table_rows, max_tables=args.max_tables,
                               table_quota_bytes=args.table_quota_bytes, **security)
    except (ClientError, KVError, OSError, ValueError, ImportError) as err:
        hint = f" ({CUDA_HINT})" if args.backend == "cuda" and isinstance(err, (ImportError, OSError)) else ""
        print(f"kvworker: {getattr(err, 'message', err)}{hint}", file=sys.stderr)
        return EXIT_USAGE
    logs.set_process_fields(pool=args.pool, worker_id=worker_id, epoch=lambda: running.identity["epoch"])
    print(f"kvworker: {worker_id} listening on port {running.port}, metrics on port {running.metrics_port}, "
          f"epoch {running.identity['epoch']}", flush=True)
    if args.port_file:
        Path(args.port_file).write_text(f"{running.port} {running.metrics_port or 0}\n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    running.stop()
    return EXIT_OK


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
    g.add_argument("--tls-cert", type=existing_file,
                   help="PEM certificate of this worker's server (with --tls-key: serve TLS)")
    g.add_argument("--tls-key", type=existing_file, help="PEM key of --tls-cert")
    g.add_argument("--tls-client-ca", type=existing_file,
                   help="require client certificates signed by this CA (mutual TLS)")
    g.add_argument("--tokens-file", type=existing_file,
                   help="YAML of bearer tokens scoped to pools, required on every call")
    g.add_argument("--manager-ca", type=existing_file,
                   help="CA bundle that signed the manager's certificate (TLS to the manager)")
    g.add_argument("--manager-cert", type=existing_file, help="client certificate for a manager with mutual TLS")
    g.add_argument("--manager-key", type=existing_file, help="key of --manager-cert")
    g.add_argument("--manager-token-file", type=existing_file,
                   help="file holding the bearer token for the manager (default: env KVSERVICE_TOKEN)")


def build_parser() -> argparse.ArgumentParser:
    from kvservice.worker.tables import MAX_TABLE_ROWS, MAX_TABLES

    ap = parser("kvworker", "kvservice worker: a shard of a pool's KV cache and the paged kernels over it.",
                EXIT_CODES)
    sub = subparsers(ap, dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="what this machine can run")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    s = sub.add_parser("serve", help="hold a shard of a pool's KV cache and run kernels on request",
                       epilog=exit_epilog(EXIT_CODES))
    s.add_argument("--manager", default="127.0.0.1:50051",
                   help="manager address; several, comma-separated, for replicated managers (docs/HA.md)")
    s.add_argument("--pool", default="default", help="the pool whose cache this worker holds")
    s.add_argument("--layers", help="A:B = layers A..B-1 (default: all)")
    s.add_argument("--tp-rank", type=int, default=0, help="this worker's tensor-parallel rank")
    s.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks of the pool's model")
    s.add_argument("--backend", choices=["cuda", "cpu"], default="cpu",
                   help="cuda: CuPy on an NVIDIA GPU (the gpu extra); cpu: NumPy, no GPU needed")
    s.add_argument("--cpu-kernels", choices=["numpy", "emulated"], default="numpy",
                   help="cpu backend: NumPy kernels, or the .cu sources built with g++ (host emulation)")
    s.add_argument("--listen", default="127.0.0.1:50061", help="gRPC address (port 0 picks a free port)")
    s.add_argument("--advertise", help="address registered with the manager (default: listen host:port)")
    s.add_argument("--metrics-port", type=int, default=9500, help="Prometheus /metrics port (0 picks; -1 off)")
    s.add_argument("--metrics-addr", default="127.0.0.1", help="address /metrics binds to")
    s.add_argument("--worker-id", help="this worker's name with the manager (default: HOST-POOL-BEGIN-END-rRANK)")
    s.add_argument("--port-file", help="write the bound gRPC and metrics ports here (tests)")
    s.add_argument("--enable-test-hooks", action="store_true", help="allow CorruptGuard (tests only)")
    t = s.add_argument_group("persistent tables (UpdateTables; docs/SECURITY.md#worker-tables)")
    t.add_argument("--max-table-rows", type=int, default=MAX_TABLE_ROWS,
                   help="rows one table may hold (at most the pool's slots); with the pool's max_seq_len it sets "
                        "the pool's table size")
    t.add_argument("--max-tables", type=int, default=MAX_TABLES, help="tables per tenant (token)")
    t.add_argument("--table-quota-bytes", type=int, default=0,
                   help="device bytes of one tenant's tables (0: 4 x the most one table of the pool holds)")
    add_log_args(s)
    _security_args(s)
    return ap


def main(argv: list[str] | None = None) -> int:
    """kvworker; returns its exit status (EXIT_CODES)."""
    args = build_parser().parse_args(argv)
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
