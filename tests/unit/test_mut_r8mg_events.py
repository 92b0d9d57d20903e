"""EventsConfig (the --kv-events-* settings): its defaults and the per-tenant watcher cap in force. Oracle: the
class docstring and docs/SECURITY.md#fairness: max_watchers_per_tenant 0 means half of max_watchers, at least 1;
any other value is the cap itself. And EventHub.pool_deleted for a pool without a log (the hub keeps no log)."""

import pytest

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.event_log import DEFAULT_RING_BATCHES, DEFAULT_RING_BYTES, EventsConfig
from kvservice.manager.pools import BlockManager


@pytest.mark.parametrize(("max_watchers", "cap"), [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 3), (9, 4), (64, 32)])
def test_the_default_cap_per_tenant_is_half_the_watchers_and_at_least_one(max_watchers, cap):
    assert EventsConfig(max_watchers=max_watchers).watchers_per_tenant() == cap


@pytest.mark.parametrize("given", [1, 3, 7])
def test_an_explicit_cap_per_tenant_is_the_cap(given):
    assert EventsConfig(max_watchers=64, max_watchers_per_tenant=given).watchers_per_tenant() == given


def test_the_defaults():
    c = EventsConfig()
    assert (c.ring_batches, c.ring_bytes, c.max_watchers, c.max_watchers_per_tenant, c.zmq, c.read_share,
            c.read_burst) == (10_000, 64 << 20, 4, 0, (), 0.05, 1.0)
    assert (DEFAULT_RING_BATCHES, DEFAULT_RING_BYTES) == (10_000, 64 << 20)
    assert c.watchers_per_tenant() == 2


def test_deleting_a_pool_that_never_logged_a_batch_leaves_no_log():
    """A pool deleted before any Step or subscriber has no log: nothing to close, nothing is kept."""
    m = BlockManager()
    m.create_pool("quiet", CacheSpec.uniform(1, 1, 64, page_size=4), Sizing(num_slots=8, max_seq_len=32))
    m.delete_pool("quiet")
    m.events.pool_deleted("never-created")
    assert m.events.logs == {} and m.pool_names() == []
