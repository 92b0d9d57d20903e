"""Stale pages on every kernel that reads or writes through a table, as one matrix of records: run in-process on
the NumPy ops and in a subprocess on the AddressSanitizer build (asan_driver.py "stale"), each layer's cache an
exact-size NumPy buffer, so a stale page that were read or written anyway would be a wrong result, and a check
that indexed the generation record wrongly an ASan report."""

from __future__ import annotations

from typing import Any

import numpy as np
from conftest import make_cache, rand

from kvservice.core.allocator import SlotAllocator

PS, SLOTS, KH, D = 4, 6, 2, 64


def _rec(r: Any) -> list:
    return [r.count, r.row, r.position, r.value, r.reason]


def _admit(alloc: SlotAllocator, layout: Any, n: int) -> tuple:
    """A sequence of n tokens: (slots, their generations, slot mapping, its generations, page indices)."""
    slots = alloc.allocate(-(-n // PS))
    gens = alloc.generation[slots].copy()
    idx = np.asarray(layout.page_index(slots), np.int64)
    tok = np.arange(n)
    return slots, gens, np.ascontiguousarray(idx[tok // PS] * PS + tok % PS), gens[tok // PS], idx


def stale_matrix(ops: Any) -> dict[str, list]:
    """Records, poisoned rows and whether anything was written, for A's table after B took A's slots."""
    out: dict[str, list] = {}
    for kind in ("per_layer", "interleaved"):
        rng = np.random.default_rng(3)
        c = make_cache(rng, kind, SLOTS, PS, KH, D, "float16")
        L = c.layout
        pg = np.zeros(L.num_pages, np.uint32)
        alloc = SlotAllocator(SLOTS)

        a = _admit(alloc, L, 7)
        k = rand(rng, (7, KH, D), "float16")
        out[f"write-a-{kind}"] = _rec(ops.append_kv(c.buf, L, k, k, a[2], slot_generations=a[3], page_gen=pg).record)
        alloc.free(a[0])
        b = _admit(alloc, L, 7)
        out[f"write-b-{kind}"] = _rec(ops.append_kv(c.buf, L, k, k, b[2], slot_generations=b[3], page_gen=pg).record)
        table = (np.array([0, 2, 4], np.int32), np.concatenate((b[4], a[4])).astype(np.int32),
                 np.array([3, 3], np.int32))
        gens = np.concatenate((b[1], a[1]))
        q = rand(rng, (2, 4, D), "float16")
        for split in (0, 1):
            r = ops.decode_attention(q, c.buf, L, *table, generations=gens, page_gen=pg, kv_chunk_pages=split)
            out[f"decode-{kind}-{split}"] = [*_rec(r.record), np.isnan(r.lse).all(axis=1).tolist()]
        v = ops.validate_page_table(*table, L, generations=gens, page_gen=pg)
        out[f"validate-{kind}"] = [*_rec(v.record), np.asarray(v.row_status).tolist()]
        before, rec_before = c.buf.copy(), pg.copy()
        r = ops.append_kv(c.buf, L, k, k, a[2], slot_generations=a[3], page_gen=pg)
        untouched = np.array_equal(c.buf, before) and np.array_equal(pg, rec_before)
        out[f"append-{kind}"] = [*_rec(r.record), bool(untouched)]
        dst = alloc.allocate(1)
        pairs = np.array([[b[4][0], L.page_index(dst[0])]], np.int64)
        r = ops.copy_blocks([c.buf], L, pairs, generations=np.array([[a[1][0], alloc.generation[dst[0]]]], np.uint32),
                            page_gens=[pg])
        out[f"copy-{kind}"] = [*_rec(r.record), bool(np.array_equal(c.buf, before))]
    return out
