"""startup.ensure_pools journals each pool it creates as a "CreatePool" entry (the method name replay dispatches on;
docs/DURABILITY.md: an entry is a method and its serialized request), holding exactly the request create_request
builds, so a second process recovering the same store rebuilds the same pools.

Oracle: the entries read back from the store (method, request bytes parsed as CreatePoolRequest) and a recovery
into a fresh manager, compared with the configured specs.
"""

from types import SimpleNamespace

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.startup import create_request, ensure_pools
from kvservice.state.stores import MemoryStore
from kvservice.v1 import block_manager_pb2 as pb

CONFIG = JournalConfig(compact_every=1000, background_snapshots=False)


def _pool(name: str, heads: int, page_size: int, slots: int) -> SimpleNamespace:
    return SimpleNamespace(name=name, spec=CacheSpec.uniform(3, heads, 64, page_size=page_size),
                           sizing=Sizing(num_slots=slots, max_seq_len=1024), backends=())


def test_each_created_pool_is_one_create_pool_entry_that_recovery_replays():
    store = MemoryStore()
    j = Journal(BlockManager(), store, CONFIG)
    pools = [_pool("p-east", 2, 16, 96), _pool("p-west", 4, 32, 40)]
    assert ensure_pools(j, pools) == ["p-east", "p-west"]
    entries = list(store.entries_after(0))
    assert [(e.seq, e.method) for e in entries] == [(1, "CreatePool"), (2, "CreatePool")]
    for e, pc in zip(entries, pools, strict=True):
        got = pb.CreatePoolRequest.FromString(bytes(e.request))
        assert got == create_request(pc.name, pc.spec, pc.sizing, pc.backends, False, "", "", "")
    again = Journal.recover(store, config=CONFIG)
    assert sorted(again.manager.pool_names()) == ["p-east", "p-west"]
    for pc in pools:
        with again.manager.locked(pc.name) as p:
            assert p.plan.geometry.spec == pc.spec
            assert [a.num_slots for a in p.allocators] == [pc.sizing.num_slots]
