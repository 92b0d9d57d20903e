"""How much work a StepStream round trip has room for: a stand-in manager whose stream requests cost a set time.

The stand-in is the real `kvservice serve` process with one change, made here and never in the service:
after a stream's first two real requests, `kvservice.server.stream.step_one` answers each request with the
stream's last real reply (its seq renumbered) after spinning for --work microseconds. So the bytes on the
wire are exactly a decode step's at that batch (the client's real request, the real delta reply) and the
server-side work is a known busy wait. The client spins for --client-work microseconds after each reply,
in place of its own work (reply handling, the mirror). Each configuration is interleaved with EchoStream
round trips on the same server (8 rounds), and the ratio is the StepStream p50 over the EchoStream p50.

Usage: python bench/stream_floor.py [--batch 256] [--work 0,20,40,80] [--client-work 0,10] [--out FILE]
It answers "what must a served steady decode request cost for StepStream to stay under 1.3x EchoStream"
on the machine it runs on (docs/ARCHITECTURE.md, Streams: Latency).
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_WORK_ENV = "KVSERVICE_BENCH_STANDIN_WORK_US"


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def serve_standin(argv: list[str]) -> int:
    """`kvservice serve argv` with stream requests answered by the stand-in (see the module docstring)."""
    import kvservice.server.stream as stream
    from kvservice.server.cli import main

    real = stream.step_one
    work = float(os.environ[_WORK_ENV]) * 1e-6
    replies: dict[str, list] = {}

    def step_one(servicer, session, request, broken, observe):     # type: ignore[no-untyped-def]
        got = replies.setdefault(session.stream_id, [])
        if len(got) < 2:                       # the first (full tables) and second (a delta) are real
            got.append(real(servicer, session, request, broken, observe))
            return got[-1]
        _spin(work)
        reply = got[-1]
        reply.stream_seq = request.stream_seq
        return reply

    stream.step_one = step_one
    return main(["serve", *argv])


def measure(batch: int, work_us: float, client_us: float, steps: int = 400,
            rounds: int = 8) -> tuple[float, float, int, int]:
    """(StepStream p50 us, EchoStream p50 us, reply bytes, request body bytes) against a stand-in manager doing
    work_us per request."""
    import grpc

    from bench.bench_manager import _decode_pools
    from kvservice.client import BlockManagerClient
    from kvservice.client.stream import METHOD
    from kvservice.contract.transport import STREAM_ID_KEY
    from kvservice.tools.launch import wait_for_ports
    from kvservice.v1 import block_manager_pb2 as pb

    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "ports"
        proc = subprocess.Popen([sys.executable, __file__, "--serve", "--listen", "127.0.0.1:0", "--metrics-port",
                                 "-1", "--no-pools", "--port-file", str(port_file), "--log-level", "ERROR"], cwd=ROOT,
                                env=dict(os.environ, **{_WORK_ENV: str(work_us)}))
        try:
            port, _ = wait_for_ports(proc, port_file, 30, what="stand-in manager")
            with BlockManagerClient(f"127.0.0.1:{port}", timeout=30) as c, c.echo_stream() as es:
                c.wait_ready()
                ids = _decode_pools(c, batch, steps + 50, "f", modes=1)
                real = c.step_stream(f"fb{batch}m0")
                real.step(extend=ids, extend_tokens=1)
                real.request_bytes(None, ids, 1, None, None, True, False, {})
                body = real._cached[1]                # a steady decode request's bytes, before seq and delta fields
                q: queue.SimpleQueue = queue.SimpleQueue()
                seq = [0]
                sizes: list[int] = []

                def requests() -> Iterator[bytes]:
                    while (item := q.get()) is not None:
                        yield item

                method = c._channel.stream_stream(METHOD, request_serializer=None,
                                                  response_deserializer=pb.StepReply.FromString)
                call = method(requests(), metadata=((STREAM_ID_KEY, "floor"),))

                def step() -> None:
                    seq[0] += 1                       # request 1 gets full tables, the rest deltas on the last
                    q.put(body + pb.StepRequest(stream_seq=seq[0], delta_tables=True,
                                                delta_base=seq[0] - 1).SerializeToString())
                    reply = next(call)
                    if reply.HasField("error"):
                        raise RuntimeError(f"stand-in refused request {seq[0]}: {reply.error.message}")
                    sizes.append(reply.ByteSize())
                    _spin(client_us * 1e-6)

                calls = {"step": step, "echo": es.echo}
                lat: dict[str, list[float]] = {k: [] for k in calls}
                for fn in calls.values():
                    for _ in range(20):
                        fn()
                for _ in range(rounds):
                    for k, fn in calls.items():
                        for _ in range(steps // rounds):
                            t0 = time.perf_counter()
                            fn()
                            lat[k].append(time.perf_counter() - t0)
                q.put(None)
                call.cancel()
                real.close()
                return float(np.median(lat["step"]) * 1e6), float(np.median(lat["echo"]) * 1e6), sizes[-1], len(body)
        except grpc.RpcError as err:
            raise RuntimeError(f"stand-in manager failed: {err}") from None
        finally:
            proc.terminate()
            proc.wait(10)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return serve_standin(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--work", default="0,20,40,80", help="server microseconds per request, comma-separated")
    ap.add_argument("--client-work", default="0,10", help="client microseconds per step, comma-separated")
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args()
    from bench.bench_manager import machine
    lines = [f"# StepStream round trip vs a stand-in manager's work (B={args.batch}; {machine()})", "",
             f"`python bench/stream_floor.py --batch {args.batch} --work {args.work} --client-work "
             f"{args.client_work}`: real request and reply bytes of a decode step, a busy wait in place of the "
             "server's and the client's work (bench/stream_floor.py).", "",
             "| server work us | client work us | StepStream p50 us | EchoStream p50 us | ratio | reply bytes | "
             "request bytes |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for w in (float(x) for x in args.work.split(",")):
        for cw in (float(x) for x in args.client_work.split(",")):
            p50, e50, reply, body = measure(args.batch, w, cw)
            lines.append(f"| {w:.0f} | {cw:.0f} | {p50:.0f} | {e50:.0f} | {p50 / e50:.2f}x | {reply:,} | ~{body:,} |")
            print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
