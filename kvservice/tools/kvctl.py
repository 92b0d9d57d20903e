"""`kvctl`: plan a cache, inspect and manage pools, validate page tables, time unary vs streaming steps.

Human tables by default, `--json` for machines (``events``: one JSON object per line, each line
flushed as its batch arrives). Flags, defaults and exit codes: kvservice/tools/kvctl_parser.py
(``kvctl --help``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import threading
from typing import Any

import numpy as np

from kvservice.client.client import BlockManagerClient, TLSOptions
from kvservice.client.codec import ClientError
from kvservice.client.deadline import RETRY_CODES
from kvservice.contract.errors import KVError
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.pagetable import PageTable
from kvservice.contract.sizing import Plan, Sizing
from kvservice.core.model_config import DTYPES, ModelCache, load_model_cache
from kvservice.core.planner import plan
from kvservice.core.units import parse_bytes
from kvservice.tools.kvctl_parser import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_VIOLATIONS,
    build_parser,
)


def _table(rows: list[list[Any]], headers: list[str]) -> str:
    cells = [headers] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for i in ids:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)


def _model(a: argparse.Namespace) -> ModelCache | None:
    if not a.model_config:
        if a.allow_unknown_keys:
            raise KVError("--allow-unknown-keys goes with --model-config")
        return None
    if a.layers or a.kv_heads or a.head_dim or a.extra_layer or a.sliding_window:
        raise KVError("--model-config takes the layers from the model; drop --layers/--kv-heads/--head-dim/"
                      "--sliding-window/--extra-layer")
    return load_model_cache(a.model_config, a.tp, a.dtype, a.page_size, a.layout, a.allow_unknown_keys)


def _sizing(a: argparse.Namespace) -> Sizing:
    """The Sizing the flags say; KVError naming the flags when they say too little or contradict each other."""
    for flag, v in (("--max-num-seqs/--max-batch", a.max_batch), ("--max-model-len/--max-seq-len", a.max_seq_len),
                    ("--num-slots", a.num_slots), ("--max-num-batched-tokens", a.max_num_batched_tokens),
                    ("--prefix-headroom", a.prefix_headroom), ("--block-size/--page-size", a.page_size)):
        if v < 0 or (flag.startswith("--block-size") and v == 0):
            raise KVError(f"{flag} must be {'> 0' if flag.startswith('--block-size') else '>= 0'}, got {v}")
    device = parse_bytes(a.device_memory, "--device-memory")
    budget = parse_bytes(a.memory_budget, "--memory-budget", device)
    if a.gpu_memory_utilization:
        if not 0 < a.gpu_memory_utilization <= 1:
            raise KVError(f"--gpu-memory-utilization must be in (0, 1], got {a.gpu_memory_utilization}")
        if budget:
            raise KVError("give --memory-budget or --gpu-memory-utilization, not both")
        if not device:
            raise KVError("--gpu-memory-utilization is a share of the device's memory: give --device-memory too")
        budget = int(device * a.gpu_memory_utilization)
    if not (a.num_slots or budget or (a.max_batch and a.max_seq_len)):
        have = [f for f, v in (("--max-num-seqs", a.max_batch), ("--max-model-len", a.max_seq_len)) if v]
        raise KVError("say how big the pool is: --max-num-seqs (--max-batch) with --max-model-len (--max-seq-len), "
                      "--memory-budget SIZE (or --gpu-memory-utilization with --device-memory), or --num-slots"
                      + (f"; {have[0]} alone is not enough" if have else ""))
    return Sizing(a.max_batch, a.max_seq_len, budget, a.num_slots, a.max_num_batched_tokens, a.prefix_headroom,
                  a.equal_groups)


def _spec_and_sizing(a: argparse.Namespace, model: ModelCache | None = None) -> tuple[CacheSpec, Sizing]:
    if model is not None:
        return model.spec, _sizing(a)
    if not (a.layers and a.kv_heads and a.head_dim):
        raise KVError("give --model-config PATH, or all of --layers, --kv-heads and --head-dim")
    sizing = _sizing(a)
    dtype = DTYPES.get(str(a.dtype or "float16").lower())
    if dtype is None:
        raise KVError(f"--kv-cache-dtype {a.dtype!r} is not a cache dtype; use float16, bfloat16, float32, fp8, "
                      "fp8_e4m3 or fp8_e5m2 (auto needs --model-config)")
    layers = [LayerSpec(a.kv_heads, a.head_dim, dtype, a.sliding_window)] * a.layers
    for extra in a.extra_layer:
        parts = [int(x) for x in extra.split(":")]
        if len(parts) not in (2, 3):
            raise KVError(f"--extra-layer wants KV_HEADS:HEAD_DIM[:WINDOW], got {extra!r}")
        layers.append(LayerSpec(parts[0], parts[1], dtype, parts[2] if len(parts) == 3 else 0))
    return CacheSpec(tuple(layers), a.page_size, a.layout), sizing


def layer_rows(p: Plan) -> list[dict[str, Any]]:
    """One row per layer: its group, window, shape and how it addresses pages (scale, offset, base, upper bound)."""
    spec = p.geometry.spec
    groups = p.geometry.groups
    return [{"layer": v.layer, "group": v.group, "sliding_window": spec.layers[v.layer].sliding_window,
             "kv_heads": spec.layers[v.layer].kv_heads, "head_dim": spec.layers[v.layer].head_dim,
             "k_only": spec.layers[v.layer].k_only, "page_bytes": v.page_bytes,
             "bytes": v.page_bytes * groups[v.group].num_slots, "index_space": v.index_space,
             "scale": v.scale, "offset": v.offset, "base": v.base, "upper_bound": v.upper_bound}
            for v in p.geometry.layers]


def _print_layers(rows: list[dict[str, Any]]) -> None:
    """Per-layer table; consecutive layers that differ only in their number are one row."""
    keys = ["group", "sliding_window", "kv_heads", "head_dim", "page_bytes", "bytes", "index_space", "scale",
            "offset", "base", "upper_bound"]
    runs: list[tuple[list[int], dict[str, Any]]] = []
    for r in rows:
        if runs and all(runs[-1][1][k] == r[k] for k in keys):
            runs[-1][0].append(r["layer"])
        else:
            runs.append(([r["layer"]], r))
    print(_table([[_ranges(ids), r["group"], r["sliding_window"] or "full", r["kv_heads"], r["head_dim"],
                   r["page_bytes"], r["bytes"], r["index_space"], r["scale"], r["offset"], r["base"],
                   r["upper_bound"]] for ids, r in runs],
                 ["layers", "group", "window", "kv heads", "head dim", "page bytes", "bytes per layer", "space",
                  "scale", "offset", "base", "upper bound"]))


def _print_plan(summary: dict[str, Any]) -> None:
    keys = ["num_slots", "page_size", "layout", "num_layers", "max_seq_len", "max_pages_per_seq", "bytes_per_layer",
            "bytes_per_slot", "total_bytes", "equal_sizing_bytes", "saved_bytes", "max_byte_offset",
            "offsets_exceed_int32", "offsets_exceed_uint32", "indices_need_int64", "pool_pages"]
    print(_table([[k, summary[k]] for k in keys], ["plan", "value"]))
    print()
    print(_table([[g["group"], g["sliding_window"] or "full", len(g["layers"]), g["num_slots"], g["slot_bytes"],
                   g["bytes"]] for g in summary["groups"]],
                 ["layer group", "window", "layers", "slots", "slot bytes", "bytes"]))
    for n in summary.get("notes", []):
        print(f"  {n}")
    print()
    print(_table([[s["id"], s["group"], s["scale"], s["offset"], s.get("base", 0), s["upper_bound"], s["index_dtype"],
                   _ranges(s["layers"])] for s in summary["index_spaces"]],
                 ["index space", "group", "scale", "offset", "base", "upper bound", "dtype", "layers"]))
    if summary["backends"]:
        print(f"\nbackends satisfied: {', '.join(summary['backends'])}")
    for w in summary["warnings"]:
        print(f"warning: {w}")


def _plan_from_reply(reply: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict
    return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def cmd_plan(a: argparse.Namespace) -> int:
    model = _model(a)
    spec, sizing = _spec_and_sizing(a, model)
    p: Plan = plan(spec, sizing, tuple(a.backend))
    summary = p.summary()
    rows = layer_rows(p)
    if model is not None:
        summary["model"] = {"config": a.model_config, **model.summary(),
                            "state_layer_list": [{"layer": st.layer, "kind": st.kind, "bytes": st.bytes,
                                                  "conv_elems": st.conv_elems, "ssm_elems": st.ssm_elems,
                                                  "dtype": st.dtype} for st in model.state_layers]}
    if a.json:
        print(json.dumps({**summary, "layers": rows}, indent=2))
        return 0
    if model is not None:
        kinds = {k: model.layer_types.count(k) for k in dict.fromkeys(model.layer_types)}
        print(f"model {a.model_config}: {model.model_type or 'unknown type'}, {len(model.layer_types)} layers "
              f"({', '.join(f'{n} {k}' for k, n in kinds.items())}), {len(spec.layers)} paged, tp={model.tp}, "
              f"cache dtype {spec.layers[0].dtype}, {model.kv_bytes_per_token:,} KV bytes per token")
        if model.state_layers:
            print(f"  {len(model.state_layers)} state layers: not paged: state {model.state_bytes_per_seq:,} bytes "
                  "per sequence, managed by the engine")
        for note in model.notes:
            print(f"  {note}")
        print()
    _print_plan(summary)
    if model is not None or a.per_layer:
        print()
        _print_layers(rows)
    return 0


def cmd_pools(a: argparse.Namespace, c: BlockManagerClient) -> int:
    pools = c.list_pools()
    if a.json:
        print(json.dumps([_plan_from_reply(p) for p in pools], indent=2))
        return 0
    print(_table([[p.name, p.plan.page_size, len(p.plan.layers), p.stats.num_slots, p.stats.num_free_slots,
                   p.stats.num_sequences, p.plan.total_bytes] for p in pools],
                 ["pool", "page size", "layers", "slots", "free", "sequences", "cache bytes"]))
    return 0


def cmd_create_pool(a: argparse.Namespace, c: BlockManagerClient) -> int:
    spec, sizing = _spec_and_sizing(a, _model(a))
    info = c.create_pool(a.name, spec, sizing, tuple(a.backend), prefix_caching=a.prefix_caching, model=a.model)
    if a.json:
        print(json.dumps(_plan_from_reply(info), indent=2))
    else:
        print(f"created pool {info.name!r}: {info.plan.num_slots:,} slots, {info.plan.total_bytes:,} bytes")
    return 0


def cmd_delete_pool(a: argparse.Namespace, c: BlockManagerClient) -> int:
    c.delete_pool(a.name, force=a.force)
    if a.json:
        print(json.dumps({"deleted": a.name}))
    else:
        print(f"deleted pool {a.name!r}")
    return EXIT_OK


def cmd_seqs(a: argparse.Namespace, c: BlockManagerClient) -> int:
    reply = c.sequences(a.pool, a.limit)
    if a.json:
        print(json.dumps(_plan_from_reply(reply), indent=2))
        return 0
    print(_table([[s.seq_id, s.num_tokens, ",".join(str(n) for n in s.num_slots_per_group) or s.num_slots]
                  for s in reply.sequences], ["sequence", "tokens", "slots per group"]))
    print(f"({len(reply.sequences)} of {reply.total} shown)")
    return 0


def cmd_stats(a: argparse.Namespace, c: BlockManagerClient) -> int:
    stats = c.stats(a.pool or "")
    if a.json:
        print(json.dumps({k: _plan_from_reply(v) for k, v in stats.items()}, indent=2))
        return 0
    print(_table([[n, s.num_slots, s.num_free_slots, s.peak_used_slots, s.num_sequences, s.num_tokens, s.steps,
                   s.admitted, s.refused] for n, s in sorted(stats.items())],
                 ["pool", "slots", "free", "peak used", "sequences", "tokens", "steps", "admitted", "refused"]))
    return 0


def cmd_workers(a: argparse.Namespace, c: BlockManagerClient) -> int:
    workers = c.workers(a.pool or "")
    if a.json:
        print(json.dumps([_plan_from_reply(w) for w in workers], indent=2))
        return 0
    print(_table([[w.worker_id, w.pool, f"{w.layer_begin}-{w.layer_end - 1}", f"{w.tp_rank}/{w.tp_size}", w.backend,
                   w.device_name, w.epoch, "alive" if w.alive else "DEAD", f"{w.seconds_since_heartbeat:.1f}s",
                   w.address] for w in workers],
                 ["worker", "pool", "layers", "tp", "backend", "device", "epoch", "state", "last beat", "address"]))
    return 0


def _ints(text: str) -> np.ndarray:
    return np.array([int(x) for x in text.split(",") if x.strip()], dtype=np.int64)


def cmd_validate(a: argparse.Namespace, c: BlockManagerClient) -> int:
    if a.file:
        doc = json.loads(open(a.file).read())
        table = PageTable(np.asarray(doc["indptr"], np.int64), np.asarray(doc["indices"], np.int64),
                          np.asarray(doc["last_page_len"], np.int64))
    else:
        if a.indptr is None or a.indices is None or a.last_page_len is None:
            raise KVError("give --file, or all of --indptr, --indices and --last-page-len")
        table = PageTable(_ints(a.indptr), _ints(a.indices), _ints(a.last_page_len))
    report = c.validate(a.pool, a.layer, table, a.max_reports)
    if a.json:
        print(json.dumps({"ok": report.ok, "num_violations": report.num_violations,
                          "violations": [{"reason": v.reason, "row": v.row, "position": v.position,
                                          "value": v.value, "detail": v.detail} for v in report.violations]},
                         indent=2))
    elif report.ok:
        print(f"ok: table is valid for layer {a.layer} of pool {a.pool!r}")
    else:
        print(f"{report.num_violations} violation(s) for layer {a.layer} of pool {a.pool!r}:")
        print(_table([[v.reason, v.row, v.position, v.value, v.detail] for v in report.violations],
                     ["reason", "row", "position", "value", "rule"]))
    return EXIT_OK if report.ok else EXIT_VIOLATIONS


def _token_ids(a: argparse.Namespace) -> np.ndarray:
    if (a.tokens is None) == (a.tokens_file is None):
        raise KVError("give the prompt as --tokens 1,2,3 or --tokens-file FILE (a JSON list or whitespace-separated "
                      "ids)")
    if a.tokens is not None:
        return _ints(a.tokens)
    text = open(a.tokens_file).read()
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in text.split()]
    except ValueError as err:
        raise KVError(f"{a.tokens_file}: not a JSON list or whitespace-separated token ids ({err})") from None
    return np.asarray(ids, dtype=np.int64)


def cmd_score(a: argparse.Namespace, c: BlockManagerClient) -> int:
    reply = c.score_prefix(_token_ids(a), a.salt, a.extra_key, tuple(a.pool), a.model)
    if a.json:
        print(json.dumps(_plan_from_reply(reply), indent=2))
        return 0
    print(_table([[s.pool, s.cached_tokens, s.cached_pages, s.page_size, s.prefix_caching,
                   ", ".join(f"{w}@{addr}" for w, addr in zip(s.worker_ids, s.worker_addresses, strict=True)) or "-"]
                  for s in reply.scores],
                 ["pool", "cached tokens", "cached pages", "page size", "prefix caching", "live workers"]))
    print(f"({reply.num_tokens:,} prompt tokens)")
    return 0


def _cancel_when_stdout_closes(stream: Any) -> threading.Event:
    """Cancel `stream` once whoever reads stdout has gone (`kvctl events P | head -1`), instead of finding out
    at the next batch; a terminal or a file never hangs up. The event is set when that happened."""
    gone = threading.Event()
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLERR | select.POLLHUP)   # a pipe's reader closed it
    except (OSError, ValueError, AttributeError):
        return gone

    def watch() -> None:
        poller.poll()
        gone.set()
        stream.cancel()
    threading.Thread(target=watch, daemon=True, name="stdout-hangup").start()
    return gone


def cmd_events(a: argparse.Namespace, c: BlockManagerClient) -> int:
    """Print a pool's KV event batches (one line each, or JSON lines), each flushed as it arrives, until --count
    batches, Ctrl-C, or the reader of stdout goes away."""
    stream = c.watch_events(a.pool, a.from_sequence)
    gone = _cancel_when_stdout_closes(stream)
    try:
        return _print_events(a, stream)
    except ClientError:
        if gone.is_set():
            return EXIT_OK
        raise
    finally:
        stream.cancel()


def _print_events(a: argparse.Namespace, stream: Any) -> int:
    seen = 0
    for msg in stream:
        if a.json:
            line = json.dumps(_plan_from_reply(msg))
        else:
            kinds: dict[str, int] = {}
            for ev in msg.events:
                k = ev.WhichOneof("event")
                n = 1 if k == "all_blocks_cleared" else len(getattr(ev, k).block_hashes.data) // 8
                kinds[k] = kinds.get(k, 0) + n
            what = ", ".join(f"{k} {n}" for k, n in kinds.items()) or "empty"
            note = f"  RESET: {msg.reset_reason}" if msg.reset else ""
            line = f"{msg.sequence:>8}  {what}{note}"
        sys.stdout.write(line + "\n")
        sys.stdout.flush()                        # a line as its batch arrives, whatever stdout is
        seen += 1
        if a.count and seen >= a.count and not msg.more:
            break
    return EXIT_OK


def _p50_us(fn: Any, n: int) -> float:
    import time
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return float(np.percentile(np.array(lat) * 1e6, 50))


def cmd_ping(a: argparse.Namespace, c: BlockManagerClient) -> int:
    """Round trips with nothing to do: unary Echo and EchoStream (the floors of Step and StepStream)."""
    unary = _p50_us(c.echo, a.count)
    with c.echo_stream() as es:
        es.echo()
        stream = _p50_us(es.echo, a.count)
    if a.json:
        print(json.dumps({"echo_p50_us": unary, "echo_stream_p50_us": stream, "count": a.count}))
    else:
        print(_table([["Echo (unary)", f"{unary:.0f}"], ["EchoStream", f"{stream:.0f}"]],
                     ["round trip", "p50 us"]))
    return 0


def cmd_decode(a: argparse.Namespace, c: BlockManagerClient) -> int:
    """Decode steps (+1 token each) for the sequences named, unary Step vs StepStream (full tables, deltas).

    Changes the pool: each mode adds `steps` tokens to every sequence named. With --admit N the sequences are
    admitted first (N tokens each) and freed at the end; without it they must be live already.
    """
    ids = _ints(a.ids).astype(np.uint64)
    if a.admit:
        c.step(a.pool, admit=ids, admit_tokens=a.admit, tables=False)
    try:
        rows = [_decode_mode(a, c, ids, mode) for mode in a.mode]
    except ClientError as err:
        if err.code.name == "NOT_FOUND" and not a.admit:
            raise ClientError(err.code, f"{err.message} (decode times live sequences: admit them first, or "
                              "pass --admit TOKENS)", err.reason, err.metadata) from None
        raise
    finally:
        if a.admit:
            c.step(a.pool, free=ids, tables=False)
    if a.json:
        print(json.dumps([{"mode": m, "p50_us": float(p), "reply_bytes": int(b.replace(",", "")) if b else None}
                          for m, p, b in rows]))
    else:
        print(_table(rows, ["path", "p50 us", "reply bytes"]))
    return EXIT_OK


def _decode_mode(a: argparse.Namespace, c: BlockManagerClient, ids: np.ndarray, mode: str) -> list[str]:
    if mode == "unary":
        def step(**kw: Any) -> Any:
            return c.step(a.pool, **kw)
        stream = None
    else:
        stream = c.step_stream(a.pool, deltas=mode == "deltas")
        step = stream.step
    try:
        p50 = _p50_us(lambda: step(extend=ids, extend_tokens=1), a.steps)
        size = stream.last_reply.ByteSize() if stream is not None else None
    finally:
        if stream is not None:
            stream.close()
    return [mode, f"{p50:.0f}", "" if size is None else f"{size:,}"]


COMMANDS = {"pools": cmd_pools, "create-pool": cmd_create_pool, "delete-pool": cmd_delete_pool, "seqs": cmd_seqs,
            "stats": cmd_stats, "workers": cmd_workers, "validate": cmd_validate, "score": cmd_score,
            "events": cmd_events, "ping": cmd_ping, "decode": cmd_decode}


def main(argv: list[str] | None = None) -> int:
    """kvctl; returns its exit status (kvservice/tools/kvctl_parser.py: EXIT_CODES)."""
    args = build_parser().parse_args(argv)
    if getattr(args, "mode", 0) is None:
        args.mode = ["unary", "stream", "deltas"]
    try:
        if args.command == "plan":
            return cmd_plan(args)
        tls = None
        if args.tls_ca or args.tls_cert:
            tls = TLSOptions.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        token = open(args.token_file).read().strip() if args.token_file else os.environ.get("KVSERVICE_TOKEN")
        with BlockManagerClient(args.target, timeout=args.timeout, tls=tls, token=token or None,
                                failover=args.failover_timeout) as client:
            return COMMANDS[args.command](args, client)
    except KVError as err:
        print(f"kvctl: {err.message}", file=sys.stderr)
        return EXIT_REFUSED
    except ClientError as err:
        print(f"kvctl: {err.code.name}: {err.message}", file=sys.stderr)
        return EXIT_UNREACHABLE if err.code in RETRY_CODES else EXIT_REFUSED
    except BrokenPipeError:                   # the reader of stdout went away (`kvctl ... | head -1`)
        sys.stdout = open(os.devnull, "w")    # Python's own flush at exit would fail on the closed pipe again
        return EXIT_OK
    except OSError as err:
        print(f"kvctl: {err}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
