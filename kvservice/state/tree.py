"""A manager's state as plain, ==-comparable values: what a recovery must reproduce (tests, check-state)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvservice.manager.pools import BlockManager


def state_tree(manager: BlockManager, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Everything a recovery must reproduce, as plain nested values (==-comparable).

    Pools: their exported state (pool_state.PoolState: meta and arrays, arrays as dtype, shape and bytes)
    except the meta or array names in `skip`, and the diagnostic counter of refused steps (refused
    steps are not journaled). Workers: every record field except the lease clock.
    """
    pools = {}
    for name in manager.pool_names():
        with manager.locked(name) as pool:
            st = pool.export_state()
        meta = {k: v for k, v in st.meta.items() if k not in skip | {"refused", "alloc_failures"}}
        if isinstance(meta.get("prefix"), dict):
            meta["prefix"] = {k: v for k, v in meta["prefix"].items() if k not in skip}
        arrays = tuple((k, ("ndarray", v.dtype.str, v.shape, np.ascontiguousarray(v).tobytes()))
                       for k, v in sorted(st.arrays.items()) if k not in skip)
        pools[name] = (("meta", _plain(meta)), ("arrays", arrays))
    workers = [(w.worker_id, w.pool, w.layer_begin, w.layer_end, w.tp_rank, w.tp_size, w.backend, w.epoch,
                w.address, w.alive) for w in manager.workers.workers()]
    return {"pools": pools, "workers": workers}


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple((k, _plain(x)) for k, x in sorted(v.items()))
    if isinstance(v, list):
        return tuple(_plain(x) for x in v)
    return v
