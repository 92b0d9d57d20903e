"""startup.ensure_pools: each configured pool missing from the state is created through the journal (returned, in
configuration order; docs/HA.md: "create configured pools that are missing"); one already there is kept as the
state has it, with a warning naming it (the exact text below) when its configured geometry differs."""

import logging
from types import SimpleNamespace

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.startup import ensure_pools

WARNING = ("pool %r from the state dir differs from its configuration; serving the state's (delete the pool to "
           "recreate it from the configuration)")


def pool(name, heads):
    return SimpleNamespace(name=name, spec=CacheSpec.uniform(2, heads, 64, page_size=16),
                           sizing=Sizing(num_slots=64, max_seq_len=512), backends=())


def test_missing_pools_are_created_and_a_differing_existing_one_is_named_in_a_warning(caplog):
    """First start: both created (journaled). Second: none created; only the pool whose geometry changed is
    named, in one WARNING record whose text is exact; the state's geometry is kept."""
    j = Journal(BlockManager(), config=JournalConfig(compact_every=1000, background_snapshots=False))
    with caplog.at_level(logging.DEBUG, logger="kvservice"):
        assert ensure_pools(j, [pool("zeta-7", 1), pool("alpha", 2)]) == ["zeta-7", "alpha"]
    assert j.seq == 2 and sorted(j.manager.pool_names()) == ["alpha", "zeta-7"]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvservice"):
        assert ensure_pools(j, [pool("zeta-7", 4), pool("alpha", 2), pool("new", 1)]) == ["new"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [(r.levelno, r.getMessage()) for r in warnings] == [(logging.WARNING, WARNING % "zeta-7")]
    assert j.seq == 3
    with j.manager.locked("zeta-7") as p:
        assert p.plan.geometry.spec == CacheSpec.uniform(2, 1, 64, page_size=16)
