"""kvctl's command line: its flags, their help and defaults, its exit codes (the commands are in kvctl.py)."""

from __future__ import annotations

import argparse
import os

from kvservice.contract.cli import existing_file, existing_path, parser, subparsers

DEFAULT_TARGET = os.environ.get("KVSERVICE_ADDR", "127.0.0.1:50051")
EXIT_OK, EXIT_VIOLATIONS, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_VIOLATIONS: "validate: the table has violations (listed)",
    EXIT_REFUSED: "a usage error, bad input, or a request the manager refused (the message says why)",
    EXIT_UNREACHABLE: "no manager answered within --timeout (UNAVAILABLE or DEADLINE_EXCEEDED, naming the address)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


def geometry_args(p: argparse.ArgumentParser) -> None:
    """Cache and sizing flags; vLLM's names are accepted as aliases (--block-size, --max-model-len, ...)."""
    p.add_argument("--model-config", metavar="PATH", type=existing_path,
                   help="Hugging Face config.json (or its directory): layers, KV heads, head sizes and sliding windows "
                        "from the model; replaces --layers/--kv-heads/--head-dim")
    p.add_argument("--allow-unknown-keys", action="store_true",
                   help="plan a --model-config with fields this planner does not know (listed in the plan) "
                        "instead of refusing it")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks sharing the KV heads (--model-config)")
    p.add_argument("--layers", type=int, help="number of layers (without --model-config)")
    p.add_argument("--kv-heads", type=int, help="KV heads per layer (without --model-config)")
    p.add_argument("--head-dim", type=int, help="elements per head (without --model-config)")
    p.add_argument("--dtype", "--kv-cache-dtype", dest="dtype",
                   help="cache dtype: auto (the model's torch_dtype), float16, bfloat16, float32, fp8 (= fp8_e4m3), "
                        "fp8_e4m3, fp8_e5m2 (default: float16, or auto with --model-config)")
    p.add_argument("--page-size", "--block-size", dest="page_size", type=int, default=16, help="tokens per page")
    p.add_argument("--layout", default="per_layer", choices=["per_layer", "interleaved"],
                   help="per_layer: a buffer per layer; interleaved: a buffer per layer group, layers inside each slot")
    p.add_argument("--sliding-window", type=int, default=0, help="tokens (0 = full attention)")
    p.add_argument("--extra-layer", action="append", default=[], metavar="KV_HEADS:HEAD_DIM[:WINDOW]",
                   help="append a layer of another shape (hybrid models); repeatable")
    p.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int, default=0,
                   help="concurrent sequences")
    p.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", type=int, default=0,
                   help="tokens per sequence")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="tokens one step adds beyond one per sequence (the prompt chunk being prefilled); sizes "
                        "sliding-window groups (0 = min(2048, --max-model-len))")
    p.add_argument("--prefix-headroom", type=int, default=0, metavar="SLOTS",
                   help="extra slots per sliding-window group for prefix-cache pages")
    p.add_argument("--equal-groups", action="store_true",
                   help="give every layer group as many slots as the full-attention group")
    p.add_argument("--memory-budget", default="0", metavar="SIZE",
                   help="bytes for all cache buffers: 40GiB, 512MB, 80%% (of --device-memory) or a byte count")
    p.add_argument("--device-memory", default="0", metavar="SIZE", help="the device's memory, for a --memory-budget "
                   "or --gpu-memory-utilization given as a share")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.0, metavar="FRACTION",
                   help="vLLM's name: cache budget = FRACTION x --device-memory (this plans the KV cache only)")
    p.add_argument("--num-slots", type=int, default=0, help="explicit slot count of every layer group")
    p.add_argument("--backend", action="append", default=[],
                   help="kernel backend the pool feeds (native, flashinfer, flash-attn2, vllm-flash-attn, "
                        "candle-flash-attn, trtllm); repeatable")


def _connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="manager address (env KVSERVICE_ADDR)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="deadline of each call to the manager, seconds, every retry included")
    p.add_argument("--failover-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="keep trying a call that finds no manager (a restart, a failover) for this long, even past "
                        "--timeout (0 = never past --timeout)")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output (events: one JSON object per line)")
    p.add_argument("--tls-ca", type=existing_file, help="CA bundle that signed the manager's certificate (turns TLS "
                   "on)")
    p.add_argument("--tls-cert", type=existing_file, help="client certificate, for a manager with mutual TLS")
    p.add_argument("--tls-key", type=existing_file, help="key of --tls-cert")
    p.add_argument("--tls-server-name", help="name to check the manager's certificate against (default: the host "
                   "of --target)")
    p.add_argument("--token-file", type=existing_file,
                   help="file holding a bearer token (default: env KVSERVICE_TOKEN)")


def build_parser() -> argparse.ArgumentParser:
    root = parser("kvctl", "Plan, inspect and manage kvservice pools.", EXIT_CODES)
    _connection_args(root)
    sub = subparsers(root, dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("plan", help="capacity plan for a cache (local, no server needed)")
    geometry_args(p)
    p.add_argument("--per-layer", action="store_true", help="also print every layer's view (always with "
                   "--model-config)")
    sub.add_parser("pools", help="list pools")
    p = sub.add_parser("create-pool", help="create a pool on the manager")
    p.add_argument("name", help="the new pool's name")
    geometry_args(p)
    p.add_argument("--prefix-caching", action="store_true", help="keep released full pages findable by hash")
    p.add_argument("--model", default="", help="the model this pool serves (kvctl score --model selects by it)")
    p = sub.add_parser("delete-pool", help="delete a pool (its workers re-plan when a pool of that name comes back)")
    p.add_argument("name", help="the pool to delete")
    p.add_argument("--force", action="store_true", help="delete it even while it has live sequences")
    p = sub.add_parser("seqs", help="list sequences of a pool")
    p.add_argument("pool", help="pool name")
    p.add_argument("--limit", type=int, default=50, help="most sequences listed (0 = all)")
    p = sub.add_parser("stats", help="pool statistics")
    p.add_argument("pool", nargs="?", help="one pool (default: every pool)")
    p = sub.add_parser("workers", help="registered workers and their leases")
    p.add_argument("pool", nargs="?", help="one pool's workers (default: every pool's)")
    p = sub.add_parser("score", help="tokens of a prompt each pool's prefix cache holds now (ScorePrefix)")
    p.add_argument("--tokens", help="comma-separated token ids")
    p.add_argument("--tokens-file", type=existing_file, help="file of token ids (JSON list or whitespace-separated)")
    p.add_argument("--pool", action="append", default=[], help="pool to score (repeatable; default: every pool)")
    p.add_argument("--model", default="", help="with no --pool: only the pools created for this model")
    p.add_argument("--salt", default="", help="the tenant's cache salt")
    p.add_argument("--extra-key", default="", help="extra key (e.g. a LoRA id)")
    p = sub.add_parser("events", help="follow a pool's KV events (WatchEvents), one line per batch as it arrives")
    p.add_argument("pool", help="pool name")
    p.add_argument("--from", dest="from_sequence", type=int, default=0,
                   help="first batch (0 = the current cache as a reset, then live)")
    p.add_argument("--count", type=int, default=0, help="stop after this many batches (0 = follow until Ctrl-C)")
    p = sub.add_parser("validate", help="validate a page table against one layer of a pool")
    p.add_argument("pool", help="pool name")
    p.add_argument("--layer", type=int, required=True, help="the layer whose index space the table is for")
    p.add_argument("--file", type=existing_file, help="JSON file with indptr, indices, last_page_len")
    p.add_argument("--indptr", help="comma-separated row offsets into --indices (B + 1 values, from 0)")
    p.add_argument("--indices", help="comma-separated page indices")
    p.add_argument("--last-page-len", help="comma-separated tokens in each row's last page (B values, 1..page size)")
    p.add_argument("--max-reports", type=int, default=100, help="most violations listed")
    p = sub.add_parser("ping", help="round trips: unary Echo and EchoStream")
    p.add_argument("--count", type=int, default=200, help="round trips of each kind")
    p = sub.add_parser("decode", help="time decode steps: unary Step vs StepStream (adds tokens to the sequences)")
    p.add_argument("pool", help="pool name")
    p.add_argument("--ids", required=True, help="comma-separated sequence ids: live ones, or new ones with --admit")
    p.add_argument("--admit", type=int, default=0, metavar="TOKENS",
                   help="admit --ids first with this many tokens each, and free them at the end (0 = they are live "
                        "already; their tokens stay added)")
    p.add_argument("--steps", type=int, default=50, help="steps per mode (each adds a token to every id)")
    p.add_argument("--mode", action="append", choices=["unary", "stream", "deltas"],
                   help="unary Step, StepStream with full tables, StepStream with incremental tables; repeatable "
                        "(default: all three)")
    for sp in sub.choices.values():   # accept --json after the subcommand too
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="machine-readable output (as before the command)")
    return root
