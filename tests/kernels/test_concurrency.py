"""Concurrent kernel calls on one CPU worker (the worker's gRPC server runs requests on a
thread pool): the emulated kernels keep their launch state per call and serialise launches
(function-static __shared__), NumPy has no shared state. Calls from several threads at once
must give exactly the bits and records of the same calls made one after another."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import make_cache, make_table, rand

from kvservice.worker import kernels_cpu, ops_numpy

THREADS, REPEATS = 4, 3


def jobs() -> list:
    """Different shapes, dtypes, splits and one table with violations: a call that read another
    call's grid, block index or shared memory would produce different bits or records."""
    out = []
    for i, (kind, dtype, hq, lens, split) in enumerate([
        ("per_layer", "float32", 4, [37, 8, 90], 0),
        ("interleaved", "float16", 8, [150, 1], 2),
        ("per_layer", "bfloat16", 2, [5, 60, 17, 33], 1),
        ("interleaved", "float32", 16, [70, 3, 44], 3),
    ]):
        rng = np.random.default_rng(100 + i)
        c = make_cache(rng, kind, 48, 8, 2, 64, dtype)
        indptr, indices, lpl = make_table(rng, c, lens)
        if i == 2:
            indices[indptr[1] + 2] = c.layout.upper_bound + 3        # a violation in row 1
        q = rand(rng, (len(lens), hq, 64), dtype)
        out.append((c, q, (indptr, indices, lpl), split))
    return out


def run(ops, job):
    c, q, table, split = job
    res = ops.decode_attention(q, c.buf, c.layout, *table, kv_chunk_pages=split)
    r = res.record
    v = ops.validate_page_table(*table, c.layout)
    return res.out.copy(), res.lse.copy(), (r.count, r.row, r.position, r.value, r.reason), \
        np.asarray(v.row_status).copy(), v.record


@pytest.mark.parametrize("ops", [kernels_cpu, ops_numpy], ids=["emu", "numpy"])
def test_concurrent_calls_equal_serial_calls(ops) -> None:
    work = jobs()
    serial = [run(ops, j) for j in work]
    assert serial[2][2][0] == 1 and all(s[2][0] == 0 for k, s in enumerate(serial) if k != 2)
    results: dict[int, list] = {i: [] for i in range(THREADS)}
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(i: int) -> None:
        try:
            start.wait()
            for _ in range(REPEATS):
                results[i].append(run(ops, work[i]))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(THREADS):
        assert len(results[i]) == REPEATS
        for got in results[i]:
            out, lse, rec, status, vrec = got
            s_out, s_lse, s_rec, s_status, s_vrec = serial[i]
            assert np.array_equal(out, s_out, equal_nan=True) and np.array_equal(lse, s_lse, equal_nan=True), i
            assert rec == s_rec and np.array_equal(status, s_status) and vrec == s_vrec, (i, rec, s_rec)
