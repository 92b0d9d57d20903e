"""EventsConfig (the --kv-events-* settings): its defaults and the per-tenant watcher cap in force. Oracle: the
class docstring and docs/SECURITY.md#fairness: max_watchers_per_tenant 0 means half of max_watchers, at least 1;
any other value is the cap itself. And EventHub.pool_deleted for a pool without a log (the hub keeps no log)."""

import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.event_log import DEFAULT_RING_BATCHES, DEFAULT_RING_BYTES, EventsConfig
from kvservice.manager.pools import BlockManager
from tests.kv_workload import Workload
from tests.unit.test_mut_m28g_events import _manager, _steps


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


def test_a_subscriber_at_the_oldest_retained_batch_or_caught_up_is_not_heavy():
    """heavy(): a reset (older than the ring's oldest, ahead of head + 1) or catch-up (at or before live_from) is
    heavy; reading the ring's oldest batch itself, or waiting for the next batch (head + 1), is not."""
    m = _manager()
    pool = _steps(m, Workload(np.random.default_rng(29)), 12)
    head = pool.events.seq
    oldest = m.events.logs["p"].oldest
    assert head >= 3 and oldest == 1
    assert not m.events.subscribe("p", oldest, "t", limit=False).heavy(live_from=0)
    assert m.events.subscribe("p", oldest, "t", limit=False).heavy(live_from=oldest)
    assert not m.events.subscribe("p", head + 1, "t", limit=False).heavy(live_from=0)
    assert m.events.subscribe("p", head + 2, "t", limit=False).heavy(live_from=0)


class _CountedCondition:
    """The hub's condition, counting the waits a poll makes (a poll with a batch ready makes none)."""

    def __init__(self, cond):
        self.cond, self.waits = cond, []

    def __enter__(self):
        return self.cond.__enter__()

    def __exit__(self, *exc):
        return self.cond.__exit__(*exc)

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return self.cond.wait(0)

    def __getattr__(self, name):
        return getattr(self.cond, name)


def test_a_poll_with_the_last_committed_batch_ready_returns_it_without_waiting():
    """Subscription.poll waits only while nothing at or after next_seq is committed: a subscriber at the newest
    committed batch (next_seq == committed) gets it at once, and one past it waits (timeout passed on)."""
    m = _manager()
    pool = _steps(m, Workload(np.random.default_rng(31)), 6)
    head = pool.events.seq
    log = m.events.logs["p"]
    assert log.committed == head >= 2
    counted = _CountedCondition(m.events.cond)
    m.events.cond = counted
    at_last = m.events.subscribe("p", head, "t", limit=False)
    got = at_last.poll(timeout=600.0)
    assert [lb.seq for lb in got] == [head] and counted.waits == []
    past = m.events.subscribe("p", head + 1, "t", limit=False)
    assert past.poll(timeout=7.5) == [] and counted.waits == [7.5]
