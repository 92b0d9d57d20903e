"""The worker's side: the backend named "cuda" (docs/operations.md: CuPy and raw CUDA kernels), the deadline of its
start-up registration (longer than the client's 10 s calls: a start-up call may wait out a failover), and
persistent tables kept by the steady decode delta (every row + tokens_added), against a twin manager's full
tables. Managers are real and in process."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.client.client import BlockManagerClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import from_tensor
from tests.unit.test_mut_m29w2_tables import Stream, _full_space, _manager, _tables


def test_backend_cuda_loads_cupy_and_the_cuda_kernels_and_is_not_refused_by_name():
    """kernel_module("cuda") is CuPy + kernels_cuda where CuPy is installed; without it the import of cupy fails
    (ModuleNotFoundError naming cupy), never the 'backend must be cuda or cpu' refusal."""
    from kvservice.worker.server import kernel_module
    try:
        import cupy
    except ImportError:
        with pytest.raises(ImportError) as err:
            kernel_module("cuda")
        assert not isinstance(err.value, ValueError) and "cupy" in str(err.value)
        return
    from kvservice.worker import kernels_cuda
    assert kernel_module("cuda") == (kernels_cuda, cupy)


def test_the_workers_registration_has_a_30_s_deadline_not_the_clients_10_s(monkeypatch):
    """serve_worker's RegisterWorker call: its whole deadline (every attempt and pause, the LeaderClient's
    failover) is 30 s, not the 10 s of the worker's other calls. The real CallBudget of each call is recorded by
    a subclass that only notes (RPC name, timeout)."""
    from kvservice.client import client as client_mod
    from kvservice.client.deadline import CallBudget
    from kvservice.server.app import serve
    from kvservice.worker.server import serve_worker

    seen: list[tuple[str, float]] = []

    class Recorded(CallBudget):
        def __init__(self, policy, timeout, name, *rest, **kw) -> None:
            seen.append((name, timeout))
            super().__init__(policy, timeout, name, *rest, **kw)

    running = serve("127.0.0.1:0")
    target = f"127.0.0.1:{running.port}"
    client = BlockManagerClient(target, timeout=60, retries=0)
    try:
        client.create_pool("p", CacheSpec.uniform(1, 1, 32, "float32", 4), Sizing(num_slots=8, max_seq_len=16))
        monkeypatch.setattr(client_mod, "CallBudget", Recorded)
        worker = serve_worker(target, "p", "w-r", listen="127.0.0.1:0")
        monkeypatch.undo()
        try:
            assert [t for name, t in seen if name.endswith("RegisterWorker")] == [30]
            assert [t for name, t in seen if name.endswith("GetPool")] == [30], seen   # start-up GetPool too
            assert worker.identity["epoch"] > 0
        finally:
            worker.stop()
    finally:
        client.close()
        running.stop()


@pytest.mark.parametrize("seed", [1, 2])
def test_tables_kept_by_steady_decode_deltas_equal_the_full_tables(seed):
    """Admit a random batch, then decode it token by token (each step extends every live sequence by 1: the
    manager sends a delta with tokens_added): after each step the worker's table of every layer equals the twin's
    full reply."""
    rng = np.random.default_rng(18_000 + seed)
    incarnation = int(rng.integers(1, 2**63))
    full, delta = Stream(_manager(incarnation), False), Stream(_manager(incarnation), True)
    tables = _tables(delta)
    ids = [int(x) for x in rng.choice(10**6, int(rng.integers(2, 6)), replace=False) + 1]
    lens = [int(x) for x in rng.integers(1, 30, len(ids))]
    kw = {"admit_seq_ids": ids, "admit_num_tokens": lens}
    tokens_added = 0
    for step in range(8):
        want, got = full.step(**kw), delta.step(**kw)
        tables.update("tenant", "t", got)
        if step:
            assert got.HasField("delta")
            tokens_added += got.delta.tokens_added
        for layer, space in enumerate(want.layer_index_space):
            st = _full_space(want, space)
            sm, sg = tables.slot_mapping("tenant", "t", layer)
            assert np.asarray(sm).tolist() == from_tensor(st.slot_mapping, "sm").tolist(), (step, layer)
            assert np.asarray(sg).tolist() == from_tensor(st.slot_generations, "sg").tolist(), (step, layer)
            ip, idx, lpl, gens = tables.csr("tenant", "t", layer)
            assert np.asarray(ip).tolist() == from_tensor(st.indptr, "ip").tolist()
            assert np.asarray(idx).tolist() == from_tensor(st.indices, "idx").tolist()
            assert np.asarray(lpl).tolist() == from_tensor(st.last_page_len, "lpl").tolist()
            assert np.asarray(gens).tolist() == from_tensor(st.generations, "g").tolist()
        kw = {"extend_seq_ids": ids, "extend_num_tokens": [1] * len(ids)}
    assert tokens_added == 7                                            # every decode step was a tokens_added delta
