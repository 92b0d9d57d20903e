"""state_tree (kvservice/state/tree.py), whole, against the layout its docstring gives, built here by hand.

{"pools": {name: (("meta", meta as sorted (key, value) pairs, lists as tuples, less refused/alloc_failures and
the skipped names, also inside the prefix cache's meta), ("arrays", ((name, ("ndarray", dtype.str, shape,
bytes)), ... sorted by name, less the skipped names)))}, "workers": [(worker_id, pool, layer_begin, layer_end,
tp_rank, tp_size, backend, epoch, address, alive), ...]}: every worker field but the lease clock.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import ResourceExhausted
from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_journal import prefix_workload, run, setup_pools, step_req, workload


def plain(v):
    if isinstance(v, dict):
        return tuple(sorted((k, plain(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(plain(x) for x in v)
    return v


def by_hand(manager, skip=frozenset()):
    pools = {}
    for name in manager.pool_names():
        st = manager.pool_and_lock(name)[0].export_state()
        meta = {k: v for k, v in st.meta.items() if k not in skip and k not in ("refused", "alloc_failures")}
        if isinstance(meta.get("prefix"), dict):
            meta["prefix"] = {k: v for k, v in meta["prefix"].items() if k not in skip}
        arrays = []
        for k in sorted(st.arrays):
            if k in skip:
                continue
            a = np.asarray(st.arrays[k])
            arrays.append((k, ("ndarray", a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes())))
        pools[name] = (("meta", plain(meta)), ("arrays", tuple(arrays)))
    workers = [(w.worker_id, w.pool, w.layer_begin, w.layer_end, w.tp_rank, w.tp_size, w.backend, w.epoch,
                w.address, w.alive) for w in manager.workers.workers()]
    return {"pools": pools, "workers": workers}


def test_the_tree_is_the_exported_state_in_its_documented_layout():
    rng = np.random.default_rng(2934)
    j = Journal(BlockManager(lease_seconds=10.0), config=JournalConfig(compact_every=1000,
                                                                       background_snapshots=False))
    now = [1000.0]
    j.manager.workers._clock = lambda: now[0]            # an injected clock: w0's lease lapses, w1's does not
    setup_pools(j)
    now[0] += 8.0
    run(j, "RegisterWorker", pb.RegisterWorkerRequest(worker_id="w1", pool="b", backend="cpu",
                                                      address="127.0.0.1:2"))
    now[0] += 4.0
    workload(j, rng, 40)
    prefix_workload(j, rng, 20)
    tree = state_tree(j.manager)
    assert tree == by_hand(j.manager)
    assert sorted(tree["pools"]) == ["a", "b", "c"]
    assert [(w[0], w[-1]) for w in tree["workers"]] == [("w0", False), ("w1", True)]
    for meta, arrays in tree["pools"].values():
        assert meta[0] == "meta" and arrays[0] == "arrays"
        keys = [k for k, _ in meta[1]]
        assert keys == sorted(keys) and "refused" not in keys and "alloc_failures" not in keys
        assert any(len(a[1][3]) for a in arrays[1])                       # real arrays, not empty ones
    assert dict(tree["pools"]["c"][0][1])["prefix"]                        # the prefix cache's meta is there
    skip = frozenset({"steps", "hits", sorted(j.manager.pool_and_lock("a")[0].export_state().arrays)[0]})
    assert state_tree(j.manager, skip) == by_hand(j.manager, skip) != tree


def test_what_the_tree_leaves_out_does_not_change_it():
    """A refused step moves only the refused/alloc-failure counters, and a heartbeat only the lease clock."""
    rng = np.random.default_rng(2935)
    j = Journal(BlockManager(), config=JournalConfig(compact_every=1000, background_snapshots=False))
    setup_pools(j)
    workload(j, rng, 10)
    before = state_tree(j.manager)
    pool = j.manager.pool_and_lock("a")[0]
    r0, f0 = int(pool.refused), pool.alloc_failures.get("out_of_slots", 0)
    with pytest.raises(ResourceExhausted):
        run(j, "Step", step_req("a", admit=[10**5 + k for k in range(4)], n=[500] * 4))     # 128 pages > 96
    assert int(pool.refused) == r0 + 1 and pool.alloc_failures["out_of_slots"] == f0 + 1
    (w,) = [w for w in j.manager.workers.workers() if w.worker_id == "w0"]
    j.manager.heartbeat("w0", w.epoch)
    assert state_tree(j.manager) == before
