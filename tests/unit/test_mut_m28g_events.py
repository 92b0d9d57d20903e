"""The manager's event log held to a plain-Python model: per-type event counts and batch totals of EventLog.commit,
per-transport counters (sent, dropped, resets) of subscribers, poll windows with max_batches, the batch that ends
a deleted pool's log, and the per-tenant watcher cap (docs/DESIGN.md: KV events)."""

import numpy as np
import pytest

from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.core import cache_events as ev
from kvservice.manager.event_log import EventHub, EventLog, LoggedBatch
from kvservice.manager.pools import BlockManager
from tests.kv_workload import PS, Workload, pool_step_args

SPEC = CacheSpec.uniform(2, 1, 64, page_size=PS)


def _event(rng, kind):
    n = int(rng.integers(1, 4))
    h = rng.integers(1, 2**62, n).astype(np.uint64)
    if kind == 0:
        return ev.BlockStored(0, h, 0, rng.integers(1, 1000, n * PS).astype(np.int64), PS)
    if kind == 1:
        return ev.BlockRemoved(0, h)
    return ev.AllBlocksCleared()


def test_commit_counts_each_event_of_each_newly_visible_batch_once():
    rng = np.random.default_rng(11)
    log = EventLog("p", 0, 10_000, 1 << 40)
    names = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
    batches = []
    for seq in range(1, 41):
        kinds = rng.integers(0, 3, int(rng.integers(1, 6))).tolist()
        batch = ev.Batch(seq, tuple(_event(rng, k) for k in kinds))
        batches.append(kinds)
        log.append(LoggedBatch(batch, 0.0, 0))
    committed = 0
    for target in (3, 3, 1, 9, 17, 16, 30, 40, 40):        # repeated and backwards commits count nothing again
        log.commit(target)
        committed = max(committed, target)
        want = dict.fromkeys(names, 0)
        for kinds in batches[:committed]:
            for k in kinds:
                want[names[k]] += 1
        assert log.events_by_type == want
        assert log.batches_total == committed
        assert log.committed == committed


def _manager(slots=48):
    m = BlockManager()
    m.create_pool("p", SPEC, Sizing(num_slots=slots, max_seq_len=slots * PS), prefix_caching=True)
    return m


def _steps(m, w, n):
    """n workload steps through the hub (each one batch when the cache changed)."""
    pool, lock = m.pool_and_lock("p")
    for _ in range(n):
        kw = w.step()
        try:
            with lock:
                pool.step(**pool_step_args(kw))
        except ResourceExhausted:
            kw = w.step(pressure=True)
            with lock:
                pool.step(**pool_step_args(kw))
        with lock:
            m.events.after_step(pool, None, False)
        w.applied(kw)
    return pool


def test_counters_of_a_transport_add_up_what_its_subscribers_were_handed():
    m = _manager()
    w = Workload(np.random.default_rng(5))
    _steps(m, w, 6)
    hub = m.events
    log = hub.logs["p"]
    first = hub.subscribe("p", 1, "grpc")
    other = hub.subscribe("p", 0, "zmq")                   # 0: a reset first
    assert log.counter("grpc") is log.counter("grpc")      # one Counters per transport, kept
    sent = {"grpc": 0, "zmq": 0}
    resets = {"grpc": 0, "zmq": 0}
    for _ in range(5):
        for sub in (first, other):
            got = sub.poll(0, max_batches=2) or []
            sent[sub.transport] += len(got)
            resets[sub.transport] += sum(lb.batch.reset for lb in got)
        _steps(m, w, 2)
    assert resets == {"grpc": 0, "zmq": 1} and sent["grpc"] >= 8 and sent["zmq"] >= 6
    for t in ("grpc", "zmq"):
        c = log.counters[t]
        assert (c.sent, c.resets, c.dropped) == (sent[t], resets[t], 0)


def test_a_subscriber_behind_the_ring_counts_what_it_missed_and_one_reset():
    m = BlockManager()
    m.events = EventHub(m, ring_batches=3)
    m.create_pool("p", SPEC, Sizing(num_slots=48, max_seq_len=48 * PS), prefix_caching=True)
    w = Workload(np.random.default_rng(8))
    pool = _steps(m, w, 1)
    sub = m.events.subscribe("p", 1, "t")
    _steps(m, w, 12)
    log = m.events.logs["p"]
    oldest = log.oldest
    assert oldest > 2 and log.committed == pool.events.seq
    (lb,) = sub.poll(0)
    assert lb.batch.reset and lb.seq == pool.events.seq
    c = log.counters["t"]
    assert (c.sent, c.resets, c.dropped) == (1, 1, oldest - 1)
    assert sub.next_seq == pool.events.seq + 1 and sub.poll(0) == []


def test_poll_returns_the_next_batches_in_windows_of_max_batches():
    m = _manager()
    w = Workload(np.random.default_rng(21))
    pool = _steps(m, w, 12)
    head = pool.events.seq
    assert head >= 8
    sub = m.events.subscribe("p", 2, "t")
    got = []
    for size in (3, 1, 2, None):
        out = sub.poll(0, max_batches=size)
        want = list(range(2 + len(got), min(head, 1 + len(got) + size) + 1 if size else head + 1))
        assert [lb.seq for lb in out] == want
        got += want
    assert got == list(range(2, head + 1)) and sub.poll(0) == []
    assert m.events.logs["p"].counters["t"].sent == head - 1


def test_a_deleted_pools_log_ends_with_one_cleared_batch_after_its_head():
    m = _manager()
    w = Workload(np.random.default_rng(4))
    pool = _steps(m, w, 5)
    head = pool.events.seq
    sub = m.events.subscribe("p", None, "t")
    m.delete_pool("p", force=True)
    assert "p" not in m.events.logs
    (lb,) = sub.poll(0)
    assert lb.seq == head + 1 and lb.batch.reset and lb.batch.events == (ev.AllBlocksCleared(),)
    assert sub.poll(0) is None


def test_each_tenant_holds_at_most_its_cap_of_watchers():
    m = _manager()
    hub = m.events
    hub.max_subscribers, hub.max_subscribers_per_tenant = 5, 2
    a = [hub.subscribe("p", None, "t", tenant="alice") for _ in range(2)]
    with pytest.raises(ResourceExhausted) as e:
        hub.subscribe("p", None, "t", tenant="alice")
    assert e.value.metadata["held"] == "2" and e.value.metadata["limit"] == "2"
    b = [hub.subscribe("p", None, "t", tenant="bob") for _ in range(2)]
    hub.subscribe("p", None, "t", limit=False, tenant="alice")     # not counted
    a[0].close()
    a.append(hub.subscribe("p", None, "t", tenant="alice"))
    assert hub.watchers("alice") == 2 and hub.watchers("bob") == 2 and hub.watchers() == 4
    hub.subscribe("p", None, "t", tenant="carol")
    with pytest.raises(ResourceExhausted) as e:
        hub.subscribe("p", None, "t", tenant="dave")
    assert e.value.metadata["limit"] == "5" and e.value.metadata["held"] == "0"
    assert len(b) == 2


def test_the_ring_keeps_the_newest_batches_within_its_bounds_and_never_drops_an_uncommitted_one():
    rng = np.random.default_rng(77)
    for max_batches, max_bytes in ((4, 1 << 40), (1000, 300), (3, 200), (1, 1)):
        log = EventLog("p", 10, max_batches, max_bytes)
        kept: list[tuple[int, int]] = []                    # (seq, nbytes), the model's ring
        committed = head = 10
        for seq in range(11, 80):
            nb = int(rng.integers(0, 120))
            log.append(LoggedBatch(ev.Batch(seq, ()), 0.0, nb))
            kept.append((seq, nb))
            head = seq
            while len(kept) > 1 and (len(kept) > max_batches or sum(b for _, b in kept) > max_bytes) \
                    and kept[0][0] <= committed:            # trimmed as a batch comes, of committed ones only
                kept.pop(0)
            if rng.random() < 0.6:
                committed = int(rng.integers(committed, head + 1))
                log.commit(committed)
            assert [lb.seq for lb in log.batches] == [s for s, _ in kept]
            assert log.bytes == sum(b for _, b in kept) and log.head == head and log.committed == committed
            assert log.oldest == kept[0][0]
    log = EventLog("p", 0, 8, 1 << 20)
    log.append(LoggedBatch(ev.Batch(1, ()), 0.0, 5))
    log.append(LoggedBatch(ev.Batch(7, ()), 0.0, 9))           # not the next number: the ring starts anew
    assert [lb.seq for lb in log.batches] == [7] and (log.head, log.committed, log.bytes) == (7, 6, 9)
    assert EventLog("q", 4, 8, 8).oldest == 5                    # empty: committed + 1


def test_lag_and_heavy_follow_the_subscribers_position():
    m = _manager()
    w = Workload(np.random.default_rng(13))
    pool = _steps(m, w, 20)
    head = pool.events.seq
    assert head >= 6
    sub = m.events.subscribe("p", 3, "t")
    assert sub.lag == head - 2
    assert sub.heavy(live_from=3) and not sub.heavy(live_from=2)
    got = sub.poll(0, max_batches=2)
    assert [lb.seq for lb in got] == [3, 4], [lb.seq for lb in got]
    assert sub.next_seq == 5 and sub.lag == head - 4
    ahead = m.events.subscribe("p", head + 5, "t")
    assert ahead.lag == 0 and ahead.heavy(live_from=0)          # ahead of the log: a reset comes
    assert m.events.pool_seq("p") == head
