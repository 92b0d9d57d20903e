"""The pools a manager is configured with, created through its journal at start (journaled like any CreatePool)."""

from __future__ import annotations

import logging
from typing import Any

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.state.journal import Journal
from kvservice.v1 import block_manager_pb2 as pb

log = logging.getLogger("kvservice.state.journal")


def create_request(name: str, spec: CacheSpec, sizing: Sizing, backends: tuple[str, ...],
                   prefix_caching: bool = False, model: str = "", prefix_hash: str = "",
                   prefix_hash_seed: str = "") -> pb.CreatePoolRequest:
    """The CreatePool request of a configured pool (config pools are journaled like API-created ones)."""
    from kvservice.contract.convert import cache_spec_to_proto, sizing_to_proto
    return pb.CreatePoolRequest(name=name, cache=cache_spec_to_proto(spec), backends=list(backends),
                                sizing=sizing_to_proto(sizing), enable_prefix_caching=prefix_caching, model=model,
                                prefix_hash=prefix_hash, prefix_hash_seed=prefix_hash_seed)


def ensure_pools(journal: Journal, pools: list[Any]) -> list[str]:
    """Create (through the journal) each configured pool that does not exist yet; returns the names created."""
    created = []
    existing = set(journal.manager.pool_names())
    for pc in pools:
        if pc.name in existing:
            with journal.manager.locked(pc.name) as pool:
                if pool.plan.geometry.spec != pc.spec:
                    log.warning("pool %r from the state dir differs from its configuration; serving the state's "
                                "(delete the pool to recreate it from the configuration)", pc.name)
            continue
        journal.execute("CreatePool", create_request(pc.name, pc.spec, pc.sizing, pc.backends,
                                                     getattr(pc, "prefix_caching", False), getattr(pc, "model", ""),
                                                     getattr(pc, "prefix_hash", ""),
                                                     getattr(pc, "prefix_hash_seed", "")),
                        journal.api.CreatePool)
        created.append(pc.name)
    return created
