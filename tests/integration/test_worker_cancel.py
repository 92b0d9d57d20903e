"""A CPU worker does not wedge behind kernel work its callers abandoned (issue 27): the call's deadline reaches the
kernel loop (the NumPy decode between rows, the emulated .cu launch between blocks), so after four huge decodes
that pass their deadlines, with every server thread and the emulation's launch lock taken by them, the next small
call is answered within its own ordinary deadline, with the same values as before.

Nothing is timed: the huge calls are sized to run for minutes (each stop is counted by
kvworker_kernels_stopped_total, which stays at 0 for a call that completes), and the small call only has to
succeed within its deadline.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.server.app import serve
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker.server import serve_worker
from tests.ci import need_tool

pytestmark = pytest.mark.integration
PAGE = 256                      # big pages: much work per index entry, so a huge call is a small request
TOKENS = 256 * PAGE             # tokens of each row (256 pages)
HUGE_DEADLINE_S = 3.0           # each huge call's deadline (its work would take minutes)
SMALL_DEADLINE_S = 60.0         # the small call's ordinary deadline
ABANDONED = 4                   # = the worker's gRPC threads


def _request(row: np.ndarray, last: int, rows: int, rng: np.random.Generator) -> wpb.DecodeAttentionRequest:
    """Decode of `rows` rows that all read the pages of one sequence (int32 page ids `row`)."""
    q = rng.standard_normal((rows, 1, 64)).astype(np.float16)
    indptr = (np.arange(rows + 1, dtype=np.int64) * len(row)).astype(np.int32)
    return wpb.DecodeAttentionRequest(layer=0, q=to_tensor(q), indptr=to_tensor(indptr),
                                      indices=to_tensor(np.tile(row, rows)),
                                      last_page_len=to_tensor(np.full(rows, last, dtype=np.int32)))


@pytest.mark.parametrize(("kernels", "huge_rows"), [("numpy", 5000), ("emulated", 400)])
def test_abandoned_huge_calls_do_not_wedge_the_next_small_one(kernels, huge_rows):
    if kernels == "emulated":
        need_tool("g++", "apt package g++; deploy/ci-install.sh installs it")
    manager = serve()
    target = f"127.0.0.1:{manager.port}"
    with BlockManagerClient(target) as c:
        c.create_pool("p", CacheSpec.uniform(1, 1, 64, "float16", PAGE), Sizing(num_slots=512, max_seq_len=TOKENS))
        table = c.step("p", admit=[1], admit_tokens=[TOKENS - 3]).for_layer(0).table
    w = serve_worker(target, "p", "wc", backend="cpu", cpu_kernels=kernels)
    try:
        row = table.indices[table.indptr[0]:table.indptr[1]].astype(np.int32)
        last = int(table.last_page_len[0])
        rng = np.random.default_rng(7)
        small = _request(row[:4], PAGE, 2, rng)

        def stopped() -> float:
            return w.servicer.metrics.registry.get_sample_value("kvworker_kernels_stopped_total")

        with grpc.insecure_channel(f"127.0.0.1:{w.port}") as ch:
            stub = wpb_grpc.WorkerStub(ch)
            before = stub.DecodeAttention(small, timeout=SMALL_DEADLINE_S)
            assert stopped() == 0
            huge = [stub.DecodeAttention.future(_request(row, last, huge_rows, rng), timeout=HUGE_DEADLINE_S)
                    for _ in range(ABANDONED)]
            for f in huge:
                with pytest.raises(grpc.RpcError) as exc:
                    f.result()
                assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            after = stub.DecodeAttention(small, timeout=SMALL_DEADLINE_S)     # no wait for the abandoned work
            assert after.out.data == before.out.data and after.lse.data == before.lse.data
            # every huge call reached its kernel and was stopped in it, not run to its end (bounded wait, counted)
            for _ in range(600):
                if stopped() == ABANDONED:
                    break
                time.sleep(0.1)
            assert stopped() == ABANDONED
    finally:
        w.stop()
        manager.stop()
