"""`kvservice serve`: run the block manager (gRPC + health + reflection, /metrics); `kvservice check-state DIR`;
`kvservice export-state` / `import-state`. Flags, defaults and exit codes: `kvservice serve --help`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sqlite3
import sys
import threading
from pathlib import Path

from kvservice.contract import logs
from kvservice.contract.auth import ServerTLS, TokenTable
from kvservice.contract.cli import add_log_args, existing_file, exit_epilog, parser, subparsers
from kvservice.contract.errors import InvalidArgument, KVError, StateError
from kvservice.contract.transport import MAX_MESSAGE_BYTES
from kvservice.core.hashing import HASH_MODES
from kvservice.core.units import parse_bytes
from kvservice.events.zmq import DEFAULT_FORMAT, FORMATS, zmq_configs
from kvservice.events.zmq_guard import DEFAULT_REPLAY_BURST, DEFAULT_REPLAY_RATE, CurveKeys, ReplayLimiter
from kvservice.manager.event_log import DEFAULT_RING_BATCHES, DEFAULT_RING_BYTES, EventsConfig
from kvservice.manager.read_budget import DEFAULT_READ_BURST, DEFAULT_READ_SHARE, ReadBudget
from kvservice.server.app import default_budget_limits, serve
from kvservice.server.budget import BudgetLimits
from kvservice.server.config import DEFAULT_POOLS_YAML, load_pools, load_pools_file
from kvservice.server.limits import Limits
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.nats.leader import LeaseConfig
from kvservice.state.sqlite.unusable import NO_SPACE, unusable_state

log = logging.getLogger("kvservice")
_LIMITS = Limits()
EXIT_OK, EXIT_BROKEN, EXIT_USAGE = 0, 1, 2
EXIT_FAILED = 3   # the journal failed (fail-stop): restart the manager, it recovers from its state dir
EXIT_CODES = {
    EXIT_OK: "serve: stopped cleanly (SIGTERM or SIGINT); check-state: the state is sound",
    EXIT_BROKEN: "check-state: the state breaks the pools' invariants (listed)",
    EXIT_USAGE: "a usage or configuration error (the message names the flag or the file), an unreachable NATS, or "
                "a state that is not usable (NOT USABLE: what to do)",
    EXIT_FAILED: "serve: the journal failed and the manager stopped on purpose (fail-stop): restart it",
}

#: sys.setswitchinterval of `kvservice serve`, ms (docs/SECURITY.md#fairness).
DEFAULT_GIL_SWITCH_MS = 1.0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="run the manager", epilog=exit_epilog(EXIT_CODES))
    s.add_argument("--listen", default="127.0.0.1:50051", help="gRPC address (port 0 picks a free port)")
    s.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port (0 picks; -1 off)")
    s.add_argument("--metrics-addr", default="127.0.0.1", help="address /metrics binds to")
    s.add_argument("--pools", type=existing_file, metavar="FILE",
                   help="YAML file of pools to create at start if missing (format: kvservice/server/config.py; "
                        "default: one embedded pool)")
    s.add_argument("--no-pools", action="store_true", help="start empty; create pools over the API")
    s.add_argument("--port-file", help="write the bound gRPC and metrics ports here (tests)")
    s.add_argument("--threads", type=int, default=8, help="gRPC worker threads")
    s.add_argument("--gil-switch-ms", type=float, default=DEFAULT_GIL_SWITCH_MS, metavar="MS",
                   help="longest a Python thread keeps the interpreter while another waits (sys.setswitchinterval; "
                        "Python's own 5 ms lets one tenant's CPU-heavy read delay another's Step by 5 ms per "
                        "hand-over: docs/SECURITY.md#fairness)")
    s.add_argument("--max-streams", type=int, default=64,
                   help="StepStream/EchoStream calls open at once (each holds a thread of its own)")
    s.add_argument("--lease-seconds", type=float, default=10.0, help="a worker silent this long is marked dead")
    add_log_args(s)
    d = s.add_argument_group("state (docs/DURABILITY.md)")
    d.add_argument("--state-dir", default=os.environ.get("KVSERVICE_STATE_DIR"),
                   help="durable state: SQLite journal + snapshots in this dir (env KVSERVICE_STATE_DIR)")
    d.add_argument("--state", type=_state_arg, help="'memory': throwaway state, no warning (the default without "
                   "--state-dir); nats://HOST:PORT[,HOST:PORT...]: replicated state on NATS JetStream, with a "
                   "standby manager taking over (docs/HA.md)")
    d.add_argument("--sync", choices=["full", "normal"], default="full",
                   help="full: fsync every commit (survives power loss); normal: survives a process crash only")
    d.add_argument("--compact-every", type=int, default=10_000, help="journal entries between snapshots")
    d.add_argument("--idempotency-window", type=int, default=100_000, help="request ids remembered")
    d.add_argument("--idempotency-seconds", type=float, default=600.0, help="... for at most this long")
    r = s.add_argument_group("replication, with --state nats://... (docs/HA.md)")
    r.add_argument("--nats-name", default=os.environ.get("KVSERVICE_NATS_NAME", "kvservice"),
                   help="deployment name: stream KVS_<name>, buckets KVS_<name>_snapshots / _leader")
    r.add_argument("--nats-replicas", type=int, default=1, help="JetStream replicas (3 in production, 1 for dev)")
    r.add_argument("--leader-ttl", type=float, default=LeaseConfig().ttl_seconds,
                   help="leader lease, seconds: a standby takes over this long after the leader stops renewing")
    r.add_argument("--leader-renew", type=float, default=LeaseConfig().renew_seconds,
                   help="lease renewal period, seconds (at most a third of --leader-ttl)")
    r.add_argument("--leader-lapse", type=float, default=LeaseConfig().lapse_seconds,
                   help="how long a leader whose renewals fail keeps trying (serving nothing) before it gives up "
                   "the lease; covers a NATS election")
    r.add_argument("--advertise", help="gRPC address written into the leader key for clients (default: listen "
                   "host:port)")
    r.add_argument("--node-id", help="this manager's name in the leader key (default: HOSTNAME-pid)")
    lim = s.add_argument_group("limits")
    lim.add_argument("--max-step-sequences", type=int, default=_LIMITS.max_step_sequences,
                     help="ids in one Step (0 = no cap)")
    lim.add_argument("--max-step-tokens", type=int, default=_LIMITS.max_step_tokens,
                     help="new tokens in one Step (0 = no cap)")
    lim.add_argument("--max-pool-slots", type=int, default=_LIMITS.max_pool_slots,
                     help="slots x layer groups of one pool (0 = no cap)")
    lim.add_argument("--max-pools", type=int, default=_LIMITS.max_pools, help="pools (0 = no cap)")
    lim.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES, help="gRPC message limit")
    lim.add_argument("--rpc-memory-budget", type=_size, default=0, metavar="SIZE",
                     help="memory that requests in flight, Step replies and open stream sessions may hold together, "
                          "e.g. 2304MiB (0 = derived from the cgroup memory limit; docs/SECURITY.md#memory-budget)")
    lim.add_argument("--tenant-rpc-memory-budget", type=_size, default=0, metavar="SIZE",
                     help="... and those of one token (0 = half of --rpc-memory-budget with --tokens-file, else all)")
    ev = s.add_argument_group("KV events (docs/operations.md#kv-events)")
    ev.add_argument("--kv-events-zmq", action="append", default=[], metavar="[POOL=][bind:|connect:]ENDPOINT",
                    help="publish a pool's KV events in vLLM's ZeroMQ format on this PUB endpoint, e.g. "
                         "tcp://127.0.0.1:5557; bound if it holds '*' or '::' or is ipc://, else connected to a "
                         "collector that binds (vLLM's rule; bind: or connect: forces one); a bind must be on "
                         "loopback unless --kv-events-allow-remote; no POOL = --kv-events-pool; repeatable, one per "
                         "pool")
    ev.add_argument("--kv-events-format", default=DEFAULT_FORMAT, choices=FORMATS,
                    help="vLLM wire version of the ZeroMQ events: vllm-0.33 (events as tagged maps, with layer "
                         "groups and extra keys) or vllm-0.11 (events as tagged arrays)")
    ev.add_argument("--prefix-hash", default="", choices=("", *HASH_MODES),
                    help="page hash of configured pools with prefix caching that name none: kvservice (default) or "
                         "vllm-sha256-cbor (vLLM's block hashes, for routers that compute them from token ids)")
    ev.add_argument("--kv-events-replay", action="append", default=[], metavar="[POOL=]ENDPOINT",
                    help="ROUTER endpoint answering replay requests for missed batches, e.g. tcp://127.0.0.1:5558 "
                         "(loopback unless --kv-events-allow-remote)")
    ev.add_argument("--kv-events-allow-remote", action="store_true",
                    help="let ZeroMQ sockets bind non-loopback addresses (tcp://*:5557, an interface's address): "
                         "whoever reaches them reads the pools' cache contents; pair with --kv-events-curve-*")
    ev.add_argument("--kv-events-curve-secret", type=existing_file, metavar="FILE",
                    help="CURVE secret certificate (NAME.key_secret of zmq.auth.create_certificates) of the bound "
                         "PUB and replay sockets; with --kv-events-curve-clients")
    ev.add_argument("--kv-events-curve-clients", metavar="DIR",
                    help="directory of the client public keys (*.key) admitted by CURVE; any other client is refused")
    ev.add_argument("--kv-events-no-token-ids", action="store_true",
                    help="publish hashes without token ids on ZeroMQ (BlockStored.token_ids empty): no prompt tokens "
                         "leave the manager")
    ev.add_argument("--kv-events-replay-rate", type=float, default=DEFAULT_REPLAY_RATE,
                    help="replay requests per second one peer may send on average (more are refused, not served)")
    ev.add_argument("--kv-events-replay-burst", type=int, default=DEFAULT_REPLAY_BURST,
                    help="... and at once")
    ev.add_argument("--kv-events-pool", default="default", help="pool of an --kv-events-zmq without POOL=")
    ev.add_argument("--kv-events-topic", default="", help="first frame of each ZeroMQ message ('{pool}' = its name)")
    ev.add_argument("--kv-events-medium", default="GPU", help="'medium' of the vLLM events")
    ev.add_argument("--kv-events-buffer", type=int, default=DEFAULT_RING_BATCHES,
                    help="batches each pool retains for late, resuming and replaying subscribers")
    ev.add_argument("--kv-events-buffer-bytes", type=int, default=DEFAULT_RING_BYTES,
                    help="... and at most this many bytes of hashes and token ids per pool")
    ev.add_argument("--kv-events-max-watchers", type=int, default=4,
                    help="concurrent WatchEvents streams (each holds a gRPC thread: keep below --threads)")
    ev.add_argument("--kv-events-max-watchers-per-tenant", type=int, default=0, metavar="N",
                    help="... of one tenant (token name), so that one tenant never takes them all; 0 (default) = "
                         "half of --kv-events-max-watchers, at least 1")
    sec = s.add_argument_group("security (docs/SECURITY.md)")
    sec.add_argument("--tls-cert", type=existing_file, help="PEM server certificate (chain); with --tls-key serves "
                     "TLS")
    sec.add_argument("--tls-key", type=existing_file, help="PEM private key of --tls-cert")
    sec.add_argument("--tls-client-ca", type=existing_file,
                     help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    sec.add_argument("--tokens-file", type=existing_file,
                     help="YAML of bearer tokens scoped to pools; every call then needs one")
    sec.add_argument("--tenant-read-share", type=float, default=DEFAULT_READ_SHARE, metavar="CORES",
                     help="CPU one tenant's heavy reads (KV event resets and catch-up, ScorePrefix) may use on "
                          "average, as a fraction of one core (0 = no limit); past it streams wait and ScorePrefix "
                          "is refused RATE_LIMITED")
    sec.add_argument("--tenant-read-burst", type=float, default=DEFAULT_READ_BURST, metavar="SECONDS",
                     help="... and CPU seconds of such reads at once")


def events_config(args: argparse.Namespace) -> EventsConfig:
    """--kv-events-* flags -> EventsConfig (InvalidArgument for inconsistent ones)."""
    if args.kv_events_buffer < 1 or args.kv_events_buffer_bytes < 0 or args.kv_events_max_watchers < 0:
        raise InvalidArgument("--kv-events-buffer must be >= 1, --kv-events-buffer-bytes and "
                              "--kv-events-max-watchers >= 0")
    if not 0 <= args.kv_events_max_watchers_per_tenant <= max(1, args.kv_events_max_watchers):
        raise InvalidArgument(f"--kv-events-max-watchers-per-tenant {args.kv_events_max_watchers_per_tenant} must be "
                              f"between 0 (half of --kv-events-max-watchers) and --kv-events-max-watchers "
                              f"({args.kv_events_max_watchers}); below it, one tenant never takes every stream")
    if args.kv_events_max_watchers >= args.threads:
        raise InvalidArgument(f"--kv-events-max-watchers {args.kv_events_max_watchers} would let event streams take "
                              f"every one of the {args.threads} gRPC threads; lower it or raise --threads")
    curve = None
    if args.kv_events_curve_secret or args.kv_events_curve_clients:
        curve = CurveKeys.load(args.kv_events_curve_secret or "", args.kv_events_curve_clients or "")
    ReplayLimiter(args.kv_events_replay_rate, args.kv_events_replay_burst)       # InvalidArgument if out of range
    ReadBudget(args.tenant_read_share, args.tenant_read_burst)
    return EventsConfig(ring_batches=args.kv_events_buffer, ring_bytes=args.kv_events_buffer_bytes,
                        max_watchers=args.kv_events_max_watchers,
                        max_watchers_per_tenant=args.kv_events_max_watchers_per_tenant,
                        zmq=zmq_configs(args.kv_events_zmq, args.kv_events_replay, args.kv_events_pool,
                                        args.kv_events_topic, args.kv_events_medium, args.kv_events_format,
                                        allow_remote=args.kv_events_allow_remote, curve=curve,
                                        token_ids=not args.kv_events_no_token_ids,
                                        replay_rate=args.kv_events_replay_rate,
                                        replay_burst=args.kv_events_replay_burst),
                        read_share=args.tenant_read_share, read_burst=args.tenant_read_burst)
def _state_arg(value: str) -> str:
    if value == "memory" or value.startswith("nats://"):
        return value
    raise argparse.ArgumentTypeError(f"expected 'memory' or nats://HOST:PORT[,HOST:PORT...], got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    parser_ = parser("kvservice", "Paged KV-cache block manager.", EXIT_CODES)
    sub = subparsers(parser_, dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)
    c = sub.add_parser("check-state", help="recover a state dir (or nats://...) read-only, check all of it, say "
                       "what is wrong", epilog=exit_epilog(EXIT_CODES))
    c.add_argument("state_dir", help="a --state-dir, or the nats://HOST:PORT,... of a replicated manager")
    c.add_argument("--repair", action="store_true",
                   help="accept the state dir as it is on disk (rewrite its MANIFEST) when every content check "
                        "passes; for a damaged or lost MANIFEST or write-ahead log you chose to give up on")
    c.add_argument("--nats-name", default=os.environ.get("KVSERVICE_NATS_NAME", "kvservice"),
                   help="deployment name of a nats://... state (env KVSERVICE_NATS_NAME)")
    add_log_args(c, "WARNING")
    for name, what in (("export-state", "write the replicated state (nats://...) into a new SQLite state dir"),
                       ("import-state", "write a SQLite state dir as the snapshot of a new replicated deployment")):
        x = sub.add_parser(name, help=what, epilog=exit_epilog(EXIT_CODES))
        x.add_argument("source", help="nats://HOST:PORT,... (export) or a state dir (import)")
        x.add_argument("target", help="a new state dir (export) or nats://HOST:PORT,... (import)")
        x.add_argument("--nats-name", default=os.environ.get("KVSERVICE_NATS_NAME", "kvservice"),
                       help="deployment name: stream KVS_<name> (env KVSERVICE_NATS_NAME)")
        x.add_argument("--nats-replicas", type=int, default=1, help="import: replicas of the new stream")
        x.add_argument("--epoch", type=int, default=1, help="import: leader epoch to continue from (docs/HA.md)")
        add_log_args(x, "WARNING")
    return parser_


def main(argv: list[str] | None = None) -> int:
    """kvservice; returns its exit status (EXIT_CODES)."""
    parser_ = build_parser()
    args = parser_.parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    if args.command == "check-state":
        return check_state(args.state_dir, args.repair, args.nats_name)
    if args.command in ("export-state", "import-state"):
        return move_state(args)
    return run_serve(parser_, args)


def _size(text: str) -> int:
    try:
        return parse_bytes(text, "a memory budget")
    except InvalidArgument as err:
        raise argparse.ArgumentTypeError(err.message) from None


def _budget(args: argparse.Namespace, limits: Limits, tenants: bool) -> BudgetLimits:
    """--rpc-memory-budget and --tenant-rpc-memory-budget, each derived where 0 (server.app.default_budget_limits)."""
    total = args.rpc_memory_budget or default_budget_limits(limits, tenants).total_bytes
    tenant = args.tenant_rpc_memory_budget or (total // 2 if tenants else total)
    budget = BudgetLimits(total, min(tenant, total))
    log.info("memory budget: %d MiB, %d MiB per tenant", budget.total_bytes >> 20, budget.tenant_bytes >> 20)
    return budget


def run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    _check_serve_flags(parser, args)
    journal = None
    try:
        pools = _startup_pools(args)
        tls = ServerTLS.from_files(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        tokens = TokenTable.from_file(args.tokens_file) if args.tokens_file else None
        limits = Limits(args.max_step_sequences, args.max_step_tokens, args.max_pool_slots, args.max_pools)
        events = events_config(args)
        sys.setswitchinterval(args.gil_switch_ms / 1000)      # a heavy read hands the interpreter over sooner
        if args.state and args.state != "memory":
            return _serve_replicated(args, pools, tls, tokens, limits, events)
        if args.state_dir:
            journal = _open_state_dir(args)
        elif args.state != "memory":
            log.warning("state is in memory only and is lost when this process ends; pass --state-dir DIR for "
                        "durable state (or --state memory to silence this)")
        running = serve(args.listen, None if args.metrics_port < 0 else args.metrics_port, pools,
                        max_workers=args.threads, metrics_addr=args.metrics_addr, lease_seconds=args.lease_seconds,
                        journal=journal, tls=tls, tokens=tokens, limits=limits,
                        max_message_bytes=args.max_message_bytes, events=events, max_streams=args.max_streams,
                        budget=_budget(args, limits, tokens is not None))
    except (KVError, OSError, sqlite3.Error) as err:
        if journal is not None:
            with contextlib.suppress(KVError, OSError, sqlite3.Error):   # a full or read-only volume: exit anyway
                journal.close(snapshot=False)
        if args.state_dir and (isinstance(err, sqlite3.Error) or getattr(err, "errno", 0) in NO_SPACE):
            err = unusable_state(err, args.state_dir) or err        # startup pools written to a full volume
        if isinstance(err, StateError):
            print(f"kvservice: NOT USABLE ({err.reason}): {err.message}", file=sys.stderr)
        else:
            print(f"kvservice: {getattr(err, 'message', err)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"kvservice: listening on {args.listen.rsplit(':', 1)[0]}:{running.port}, metrics on port "
          f"{running.metrics_port}, pools: {', '.join(running.manager.pool_names()) or 'none'}, state: "
          f"{args.state_dir or 'memory'}", flush=True)
    _serve_until_stopped(running, args.port_file, 0.2)
    running.stop(grace=0.5 if running.failed.is_set() else 2.0)
    if running.failed.is_set():
        print(f"kvservice: stopped: {running.journal.failed if running.journal else 'journal failed'}",
              file=sys.stderr)
        return EXIT_FAILED
    return 0


def _check_serve_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that exclude or need each other, and ranges argparse does not check (exits 2 naming the flag)."""
    if args.state and args.state_dir:
        parser.error(f"--state {args.state.split(',')[0]} and --state-dir exclude each other")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    if not 0 < args.gil_switch_ms <= 100:
        parser.error(f"--gil-switch-ms must be in (0, 100], got {args.gil_switch_ms}")


def _open_state_dir(args: argparse.Namespace) -> Journal:
    """The state dir's journal, recovered; a dir, database or volume that cannot be written is a StateError that
    says why and what to do (kvservice/state/sqlite/unusable.py), never a traceback."""
    try:
        return Journal.open(args.state_dir, args.lease_seconds, _journal_config(args))
    except (OSError, sqlite3.Error) as err:
        raise unusable_state(err, args.state_dir) or err from None


def _startup_pools(args: argparse.Namespace) -> list:
    """The pools `serve` starts with: none, a --pools file, or the embedded defaults; --prefix-hash fills gaps."""
    if args.no_pools:
        return []
    if args.pools:
        try:
            pools = load_pools_file(args.pools)
        except KVError as err:
            raise InvalidArgument(f"--pools {err.message}") from None
    else:
        pools = load_pools(DEFAULT_POOLS_YAML, "embedded defaults")
    if args.prefix_hash:                     # the default hash mode of configured pools that name none
        pools = [dataclasses.replace(p, prefix_hash=p.prefix_hash or args.prefix_hash) for p in pools]
    return pools


def _serve_until_stopped(running: object, port_file: str | None, poll_seconds: float) -> None:
    """Write the port file (if asked), then wait for SIGTERM/SIGINT or a failed server."""
    if port_file:
        Path(port_file).write_text(f"{running.port} {running.metrics_port or 0}\n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(poll_seconds) and not running.failed.is_set():
        pass


def _journal_config(args: argparse.Namespace) -> JournalConfig:
    return JournalConfig(sync=args.sync, compact_every=args.compact_every, id_window=args.idempotency_window,
                         id_window_seconds=args.idempotency_seconds)


def _serve_replicated(args: argparse.Namespace, pools: list, tls: ServerTLS | None, tokens: TokenTable | None,
                      limits: Limits, events: EventsConfig) -> int:
    """`serve --state nats://...`: a standby that follows the journal and takes over as leader (docs/HA.md)."""
    from kvservice.server.ha import serve_ha, stop_ha
    from kvservice.state.nats.journal import parse_state_url
    from kvservice.state.nats.leader import LeaseConfig
    config = parse_state_url(args.state, name=args.nats_name, replicas=args.nats_replicas)
    if config.replicas == 1:
        log.warning("--nats-replicas 1: the journal has a single copy on one NATS server; production uses 3 "
                    "(docs/HA.md)")
    lease = LeaseConfig(ttl_seconds=args.leader_ttl, renew_seconds=args.leader_renew,
                        poll_seconds=min(LeaseConfig().poll_seconds, args.leader_ttl / 4),
                        margin_seconds=min(LeaseConfig().margin_seconds, args.leader_ttl / 8),
                        lapse_seconds=args.leader_lapse)
    running, ha = serve_ha(config, lease, args.listen, pools, node=args.node_id, advertise=args.advertise or "",
                           journal_config=_journal_config(args), lease_seconds=args.lease_seconds,
                           metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                           max_workers=args.threads, metrics_addr=args.metrics_addr, tls=tls, tokens=tokens,
                           limits=limits, max_message_bytes=args.max_message_bytes, events=events,
                           max_streams=args.max_streams, budget=_budget(args, limits, tokens is not None))
    logs.set_process_fields(node=ha.lease.node, epoch=lambda: ha.store.epoch)   # epoch: while it leads
    print(f"kvservice: listening on {args.listen.rsplit(':', 1)[0]}:{running.port}, metrics on port "
          f"{running.metrics_port}, state: {config.url} (stream {config.stream}), standby until it holds the "
          f"lease", flush=True)
    _serve_until_stopped(running, args.port_file, 0.05)
    failed = running.failed.is_set()
    stop_ha(running, ha, grace=0.5 if failed else 2.0)
    if failed:
        print(f"kvservice: stopped: {ha.failed or (running.journal.failed if running.journal else '?')}",
              file=sys.stderr)
        return EXIT_FAILED
    return 0


def move_state(args: argparse.Namespace) -> int:
    """export-state (NATS -> a new state dir: a backup) and import-state (a state dir -> a new NATS deployment)."""
    from kvservice.server.ha import export_state, import_state
    from kvservice.state.nats.journal import parse_state_url
    try:
        if args.command == "export-state":
            j = export_state(parse_state_url(args.source, name=args.nats_name), args.target)
            print(f"exported {args.source} (stream KVS_{args.nats_name}) at journal position {j.seq} into "
                  f"{args.target}")
        else:
            config = parse_state_url(args.target, name=args.nats_name, replicas=args.nats_replicas)
            seq, epoch = import_state(args.source, config, args.epoch)
            print(f"imported {args.source} at journal position {seq} into {config.url} (stream {config.stream}); "
                  f"managers continue from epoch {epoch}")
    except KVError as err:
        print(f"kvservice: {err.message}", file=sys.stderr)
        return 2
    return 0


def check_state(state_dir: str, repair: bool = False, nats_name: str = "kvservice") -> int:
    """Recover state_dir without writing it (unless repair) and report; exit 0 sound, 1 invariants broken, 2 unusable.

    Every check recovery makes is made (see kvservice/state/sqlite/store.py; for nats://... the stream and
    snapshot checks of kvservice/state/nats/journal.py): a problem is printed with what to do, exactly as
    `kvservice serve` would refuse to start with it.
    """
    from kvservice.core.invariants import assert_invariants
    replicated = state_dir.startswith("nats://")
    try:
        if replicated:
            if repair:
                raise InvalidArgument("--repair works on a state dir; a replicated journal has no MANIFEST to "
                                      "rewrite (restore it with kvservice import-state, docs/operations.md)")
            from kvservice.server.ha import open_journal
            from kvservice.state.nats.journal import parse_state_url
            journal = open_journal(parse_state_url(state_dir, name=nats_name), readonly=True)
        else:
            journal = Journal.open(state_dir, repair=repair) if repair else Journal.open(state_dir, readonly=True)
    except KVError as err:
        problems = getattr(err, "problems", [err.message])
        print(f"kvservice: NOT USABLE ({err.reason}): {err.message}", file=sys.stderr)
        for p in problems[1:]:
            print(f"  also: {p}", file=sys.stderr)
        return 1 if err.reason == "STATE_INVARIANTS" else 2
    bad = 0
    try:
        store = journal.store
        m = getattr(store, "manifest", None) or {}
        if replicated:
            witness = f"stream {store.config.stream} read to its end, leader epoch {store.max_epoch}"  # type: ignore
        else:
            mark = store.mark.found if store.mark is not None else None
            witness = (f"MANIFEST: {'running' if m.get('running') else 'stopped cleanly'}, at least "
                       f"{m.get('last_seq', '?')} acknowledged; ACKED: "
                       f"{mark.seq if mark is not None else 'none'}")
        print(f"{state_dir}: journal position {journal.seq}, snapshot at {journal.snapshot_seq}, incarnation "
              f"{journal.incarnation}, {len(journal.window.ids)} request ids remembered; {witness}; lineage "
              f"{journal.lineage:016x}")
        for note in getattr(store, "notes", []):
            print(f"note: {note}")
        for name in journal.manager.pool_names():
            with journal.manager.locked(name) as pool:
                try:
                    assert_invariants(pool)
                    verdict = "ok"
                except AssertionError as err:
                    bad += 1
                    verdict = f"BROKEN: {err}"
                print(f"pool {name}: {pool.num_sequences} sequences, {pool.num_free_slots} of "
                      f"{pool.plan.num_slots} slots free, {pool.steps} steps; invariants {verdict}")
        for w in journal.manager.workers.workers():
            print(f"worker {w.worker_id}: pool {w.pool}, epoch {w.epoch}, {'alive' if w.alive else 'dead'}")
    finally:
        journal.close(snapshot=repair)
    if repair:
        print(f"repaired: the MANIFEST now records position {journal.seq}; the state dir can be served")
    print("state ok" if not bad else f"state BROKEN: {bad} pool(s) break invariants")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
