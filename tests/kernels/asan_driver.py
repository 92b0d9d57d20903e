"""Run in a subprocess under LD_PRELOAD=libasan+libubsan by test_sanitizers.py:
feeds bad tables to the sanitizer build of the kernels on NumPy-allocated caches
and prints each violation record as JSON. Usage: asan_driver.py VARIANT [only],
only = "decode" (the first decode call alone), "spaces" (the cross-space matrix of
spaces.py for every pool kind, each layer on its own exact-size buffer) or "stale" (stale_cases.py:
page generations on every kernel)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["KVK_CPU_VARIANT"] = sys.argv[1]

import numpy as np
from conftest import make_cache, make_table, rand

from kvservice.worker import kernels_cpu as kc


def rec(r) -> list:
    return [r.count, r.row, r.position, r.value, r.reason]


def main() -> None:
    only = sys.argv[2] if len(sys.argv) > 2 else None
    if only == "stale":
        from stale_cases import stale_matrix

        print(json.dumps(stale_matrix(kc)))
        return
    if only == "spaces":
        from spaces import POOLS, layer_caches, matrix

        print(json.dumps({name: matrix(kc, spec, layer_caches(kc, spec)) for name, spec in POOLS.items()}))
        return
    rng = np.random.default_rng(50)
    out: dict[str, list] = {}
    for kind in ("per_layer", "interleaved"):
        c = make_cache(rng, kind, 12, 4, 2, 64, "float16")
        indptr, indices, lpl = make_table(rng, c, [9, 7, 12])
        indices[indptr[1] + 1] = c.layout.upper_bound  # one page past the end of the buffer
        if kind == "interleaved":
            indices[indptr[2]] += 1  # off lattice
        q = rand(rng, (3, 4, 64), "float16")
        for split in (0, 1):
            r = kc.decode_attention(q, c.buf, c.layout, indptr, indices, lpl, kv_chunk_pages=split)
            out[f"decode-{kind}-{split}"] = rec(r.record)
            if only == "decode":
                print(json.dumps(out))
                return
        out[f"validate-{kind}"] = rec(kc.validate_page_table(indptr, indices, lpl, c.layout).record)
        sm = np.array([0, c.layout.upper_bound * 4, -2, 5], dtype=np.int64)
        sm[[0, 3]] = np.asarray(c.layout.page_index(np.array([0, 1]))) * 4 + np.array([0, 1])
        kv = rand(rng, (4, 2, 64), "float16")
        out[f"append-{kind}"] = rec(kc.append_kv(c.buf, c.layout, kv, kv, sm).record)
        pairs = np.array([[c.layout.page_index(1), c.layout.upper_bound]], dtype=np.int64)
        out[f"copy-{kind}"] = rec(kc.copy_blocks([c.buf], c.layout, pairs).record)
    buf = np.zeros(8192 + 2 * 512, dtype=np.uint8)
    kc.guard_fill(buf, 512)
    buf[600] = 1  # payload: not a guard byte
    buf[9000] ^= 0xFF  # back guard
    g = kc.guard_check(buf, 512)
    out["guard"] = [g.corrupted_bytes, g.first_offset]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
