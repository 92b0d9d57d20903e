"""A hostile read-only tenant, in a process of its own (its client work must not share the victim's GIL).

usage: python -m tests.integration.fairness_attacker TARGET TOKEN POOL PROMPT_FILE CONTROL_DIR

While CONTROL_DIR/on exists it runs its worst legal behaviour against POOL: two threads storm
WatchEvents resets (from_sequence 0) and replays from the ring's start (from_sequence 1), reading one
message and cancelling; two threads send ScorePrefix of the long prompt in PROMPT_FILE (int64 .npy,
cached in the pool) with no pool filter, again at once when refused; two more streams (over the
tenant's watcher cap) are asked for again and again. It idles while the file is absent and ends when
CONTROL_DIR/stop appears, writing its counts to CONTROL_DIR/counts.json.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kvservice.client import BlockManagerClient, ClientError


def main(target: str, token: str, pool: str, prompt_file: str, control: str) -> None:
    os.nice(19)           # its own client work yields the test machine's 2 cores; what it makes the manager do does not
    ctl = Path(control)
    prompt = np.load(prompt_file)
    client = BlockManagerClient(target, timeout=30, retries=0, token=token)
    counts = {"resets": 0, "replays": 0, "scores": 0, "refused": {}}
    lock = threading.Lock()

    def count(key: str, err: ClientError | None = None) -> None:
        with lock:
            if err is None:
                counts[key] += 1
                if counts[key] == 1:                 # progress the test waits for: a first success of each kind
                    tmp = ctl / "progress.tmp"
                    tmp.write_text(json.dumps({k: counts[k] for k in ("resets", "replays", "scores")}))
                    tmp.replace(ctl / "progress.json")
            else:
                name = f"{key}:{err.code.name}:{err.reason}"
                counts["refused"][name] = counts["refused"].get(name, 0) + 1

    def idle() -> bool:
        while not (ctl / "on").exists():
            if (ctl / "stop").exists():
                return False
            time.sleep(0.01)
        return not (ctl / "stop").exists()

    open_streams: dict[int, object] = {}

    def storm(first: int) -> None:
        k = first
        while idle():
            frm = (0, 1)[k % 2]                      # a reset, then a replay from the ring's start
            key = ("resets", "replays")[k % 2]
            k += 1
            try:
                s = open_streams[first] = client.watch_events(pool, frm, timeout=30)
                for _ in s:
                    break
                s.cancel()
                count(key)
            except ClientError as err:
                count(key, err)

    def scores() -> None:
        while idle():
            try:
                client.score_prefix(prompt)
                count("scores")
            except ClientError as err:
                count("scores", err)

    parts = os.environ.get("FAIRNESS_ATTACK", "storm,scores").split(",")       # a subset, to find what costs most
    threads = [threading.Thread(target=storm, args=(i,)) for i in range(4) if "storm" in parts] + \
        [threading.Thread(target=scores) for _ in range(2) if "scores" in parts]
    for t in threads:
        t.start()
    while not (ctl / "stop").exists():
        time.sleep(0.05)
    for s in list(open_streams.values()):            # a stream waiting for its tenant's share ends now
        s.cancel()
    for t in threads:
        t.join()
    (ctl / "counts.json").write_text(json.dumps(counts))


if __name__ == "__main__":
    main(*sys.argv[1:6])
