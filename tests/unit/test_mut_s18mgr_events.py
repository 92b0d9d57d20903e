"""What a subscriber of the manager's event log gets for every starting sequence, against a plain-Python table
(docs/DESIGN.md, KV events: 0 = a reset first; older than the ring = a reset, "behind"; past the log's head + 1 =
a reset, "ahead"; head + 1 = live batches only; otherwise the retained batches from there), the last sequence a
fresh hub reports for a pool it has no log of, and a deleted pool's closing batch staged in a transaction."""

import numpy as np

from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.cache_events import AllBlocksCleared, BlockStored
from kvservice.manager.event_log import RESET_REASONS, EventHub
from kvservice.manager.pools import BlockManager
from tests.kv_workload import PS, Workload, pool_step_args

SPEC = CacheSpec.uniform(2, 1, 64, page_size=PS)


def _world(ring_batches, seed):
    m = BlockManager()
    m.create_pool("p", SPEC, Sizing(num_slots=48, max_seq_len=48 * PS), prefix_caching=True)
    m.events = EventHub(m, ring_batches=ring_batches)
    pool, lock = m.pool_and_lock("p")
    w = Workload(np.random.default_rng(seed))
    for _ in range(30):
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
    return m, pool


def test_every_starting_sequence_gets_what_the_table_says():
    m, pool = _world(ring_batches=5, seed=1899)
    hub = m.events
    log = hub.logs["p"]
    head = pool.events.seq
    assert head == log.head == log.committed > 8
    retained = [b.seq for b in log.batches]
    assert retained == list(range(head - 4, head + 1))            # the ring keeps the last 5
    for start in range(0, head + 5):
        sub = hub.subscribe("p", start, "grpc")
        got = sub.poll(0)
        if start == 0 or start < head - 4 or start > head + 1:
            why = "requested" if start == 0 else "behind" if start < head - 4 else "ahead"
            (lb,) = got
            assert lb.batch.reset and lb.seq == head, start
            assert lb.encoded == {"reset_reason": RESET_REASONS[why]}, start
            assert isinstance(lb.batch.events[0], AllBlocksCleared)
            assert all(isinstance(e, BlockStored) for e in lb.batch.events[1:])
            assert lb.nbytes == sum(e.block_hashes.nbytes + e.token_ids.nbytes for e in lb.batch.events[1:])
        elif start == head + 1:
            assert got == [], start
        else:
            assert [b.seq for b in got] == list(range(start, head + 1)), start
            assert not any(b.batch.reset for b in got)
        assert sub.next_seq == head + 1 and sub.lag == 0, start
        c = log.counter("grpc")
        sub.close()
    assert c.resets == (head - 5) + 1 + 3            # behind (1 .. head - 5), requested, ahead (3 starts)
    assert c.dropped == sum(head - 4 - s for s in range(1, head - 4))


def test_a_fresh_hub_reports_the_pools_own_last_sequence():
    m, pool = _world(ring_batches=8, seed=7)
    seq = m.events.pool_seq("p")
    assert seq == pool.events.seq > 5
    fresh = EventHub(m)                      # a hub that has recorded nothing of this pool (no log yet)
    assert "p" not in fresh.logs
    assert fresh.pool_seq("p") == seq


def test_a_deleted_pools_closing_batch_is_seen_only_after_its_transaction_commits():
    m, pool = _world(ring_batches=8, seed=3)
    hub = m.events
    head = pool.events.seq
    sub = hub.subscribe("p", head + 1, "grpc")
    hub.deferred = True
    with hub.transaction():
        hub.pool_deleted("p")
        assert sub.poll(0) == []             # staged: more is coming, the stream is not over yet
        assert sub.log.closed and sub.log.head == head + 1 and sub.log.committed == head
    (lb,) = sub.poll(0)
    assert lb.seq == head + 1 and lb.batch.reset and lb.batch.events == (AllBlocksCleared(),)
    assert sub.poll(0) is None
