"""Recovery time of a journal tail of decode Steps, by how many replies the restart rebuilds (issue 21: replay builds
no tables for the Steps whose reply nobody will read; JournalConfig.replay_replies).

Usage: python bench/bench_replay_replies.py [B ...]   (default 64 256; prints a markdown table, min of 2 runs)
"""
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_durability import SPEC, _admit, _decode

from kvservice.contract.sizing import Sizing
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.startup import create_request

MODES = (("every reply (before)", 10**9), ("the last 1,024 (default)", 1024), ("none", 0))


def recovery(b: int, entries: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        j = Journal.open(tmp, config=JournalConfig(sync="normal", compact_every=10**9))
        j.execute("CreatePool", create_request("bench", SPEC, Sizing(max_batch=b, max_seq_len=16384), ()),
                  j.api.CreatePool)
        j.execute("Step", _admit(b), j.api.Step)
        make = _decode(b)
        for _ in range(entries):
            j.execute("Step", make(), j.api.Step)
        j.close(snapshot=False)
        out: dict[str, float] = {}
        for _ in range(2):
            for label, keep in MODES:
                t0 = time.perf_counter()
                cfg = JournalConfig(sync="normal", compact_every=10**9, replay_replies=keep)
                Journal.open(tmp, config=cfg).close(snapshot=False)
                out[label] = min(out.get(label, 1e9), time.perf_counter() - t0)
        return out


def main() -> None:
    bs = [int(a) for a in sys.argv[1:]] or [64, 256]
    print("| B | tail (entries) | " + " | ".join(label for label, _ in MODES) + " |")
    print("|---:|---:|" + "---:|" * len(MODES))
    for b in bs:
        for entries in (2000, 7500):
            t = recovery(b, entries)
            cells = " | ".join(f"{t[label]:.2f} s ({t[label] / entries * 1e3:.3f} ms/entry)" for label, _ in MODES)
            print(f"| {b} | {entries:,} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
