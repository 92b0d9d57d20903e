"""KV events of the prefix cache: a consumer of the batches holds exactly the cache's index after every step;
chains and tokens are right; staging, rings, resets, deleted pools and snapshots behave."""

import pickle

import numpy as np
import pytest

from kvservice.contract.errors import NotFound, ResourceExhausted
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.core import cache_events as ev
from kvservice.core.prefix import prompt_hashes
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from tests.kv_workload import PS, Workload, pool_step_args

SPEC = CacheSpec.uniform(2, 1, 64, page_size=PS)


def make_manager(num_slots=48, name="p"):
    m = BlockManager()
    m.create_pool(name, SPEC, Sizing(num_slots=num_slots, max_seq_len=num_slots * PS), prefix_caching=True)
    return m


class Reference:
    """What the test knows independently: every page hash of every prompt admitted (page_hashes), its tokens and
    its parent's hash, per tenant namespace (ids assigned as the cache assigns them: first use)."""

    def __init__(self):
        self.pages: dict[int, tuple[tuple[int, ...], int]] = {}     # hash -> (tokens, parent hash or 0)
        self.ns: dict[str, int] = {}

    def learn(self, prompt, salt):
        ns = self.ns.setdefault(salt, len(self.ns))
        full = len(prompt) // PS
        if not full:
            return
        pages = prompt[:full * PS].reshape(full, PS)
        h = prompt_hashes(pages, ns).tolist()
        for j in range(full):
            self.pages[h[j]] = (tuple(pages[j].tolist()), h[j - 1] if j else 0)


def check_event(e, ref: Reference):
    """A BlockStored is a chain of known pages with their own tokens, each the parent of the next."""
    if not isinstance(e, ev.BlockStored):
        return
    assert e.block_size == PS and e.group == 0 and e.kind == "full_attention" and e.sliding_window == 0
    hashes = e.block_hashes.tolist()
    assert len(e.token_ids) == len(hashes) * PS
    parent = e.parent_block_hash
    for i, h in enumerate(hashes):
        tokens, true_parent = ref.pages[h]
        assert tuple(e.token_ids[i * PS:(i + 1) * PS].tolist()) == tokens
        assert true_parent == parent, f"page {i} of a chain: parent {parent:#x}, truly {true_parent:#x}"
        parent = h


def run_workload(m, pool_name, steps, seed, on_step=None):
    rng = np.random.default_rng(seed)
    w, ref = Workload(rng), Reference()
    w.looked = 0                      # prompt pages the admissions looked up: (n - 1) // page_size each
    api_pool, lock = m.pool_and_lock(pool_name)
    for k in range(steps):
        kw = w.step(pressure=False)
        try:
            with lock:
                api_pool.step(**pool_step_args(kw))
                m.events.after_step(api_pool, [len(p) for p in kw["prompts"]], True)
            w.looked += sum((len(p) - 1) // PS for p in kw["prompts"])
        except ResourceExhausted:
            kw = w.step(pressure=True)
            with lock:
                api_pool.step(**pool_step_args(kw))
                m.events.after_step(api_pool, None, False)
        w.applied(kw)
        for p, s in zip(kw["prompts"], kw["salts"], strict=True):
            ref.learn(p, s)
        if on_step is not None:
            on_step(k, api_pool, ref)
    return w, ref


def test_consumer_rebuilds_the_index_after_every_step():
    m = make_manager()
    sub = m.events.subscribe("p", 1, "test")
    view: dict[int, set[int]] = {}
    seen = {"stored": 0, "removed": 0, "batches": 0}

    def on_step(k, pool, ref):
        for lb in sub.poll(0) or []:
            assert lb.seq == seen["batches"] + 1 and not lb.batch.reset
            seen["batches"] += 1
            for e in lb.batch.events:
                check_event(e, ref)
                seen["stored" if isinstance(e, ev.BlockStored) else "removed"] += ev.event_pages(e)
            ev.apply_events(view, lb.batch.events)
        assert view.get(0, set()) == set(pool.prefix.by_hash), f"step {k}"
        assert sub.next_seq == pool.events.seq + 1

    run_workload(m, "p", 300, seed=1, on_step=on_step)
    # The workload really exercised both directions (the pool is small: registrations evict).
    assert seen["stored"] > 100 and seen["removed"] > 50, seen
    assert m.pool_and_lock("p")[0].allocators[0].evictions > 50


def test_reset_describes_the_whole_cache():
    m = make_manager()
    run_workload(m, "p", 80, seed=2)
    pool = m.pool_and_lock("p")[0]
    sub = m.events.subscribe("p", 0, "test")          # 0 = the current cache first
    (lb,) = sub.poll(0)
    assert lb.batch.reset and lb.seq == pool.events.seq and isinstance(lb.batch.events[0], ev.AllBlocksCleared)
    view = {0: {12345}}
    ev.apply_events(view, lb.batch.events)
    assert view[0] == set(pool.prefix.by_hash) and len(view[0]) > 5
    # Each page comes with its own tokens and parent (the cache's content, slot by slot).
    for e in lb.batch.events[1:]:
        slot = pool.prefix.by_hash[int(e.block_hashes[0])]
        assert e.token_ids.tolist() == pool.prefix.tokens[slot].tolist()
    assert sub.poll(0) == []                           # then nothing until the next step


def test_overflow_of_untaken_changes_becomes_a_reset(monkeypatch):
    monkeypatch.setattr(ev, "MAX_PENDING_PAGES", 10)
    m = make_manager()
    pool = m.pool_and_lock("p")[0]
    rng = np.random.default_rng(3)
    w = Workload(rng)
    for _ in range(30):                               # pool.step without the hub: nobody takes the batches
        kw = w.step()
        try:
            pool.step(**pool_step_args(kw))
        except ResourceExhausted:
            kw = w.step(pressure=True)
            pool.step(**pool_step_args(kw))
        w.applied(kw)
    assert pool.events.pending.overflowed and pool.events.pending.events == []
    batch = pool.events.take_batch(ev.pool_caches(pool))
    assert batch.reset and batch.seq == 1
    view: dict[int, set[int]] = {}
    ev.apply_events(view, batch.events)
    assert view[0] == set(pool.prefix.by_hash)
    assert pool.events.take_batch(ev.pool_caches(pool)) is None


def test_staged_batches_show_only_when_the_request_completes():
    m = make_manager()
    m.events.deferred = True
    api = ManagerAPI(m)
    sub = m.events.subscribe("p", None, "test")
    prompt = np.arange(1, 41, dtype=np.int64)

    def admit(seq_id):
        from kvservice.client.codec import step_request
        return api.Step(step_request("p", admit=[seq_id], admit_tokens=[40], admit_token_ids=prompt))

    with m.events.transaction():
        admit(1)
        assert sub.poll(0) == []                       # applied, not yet durable
    (lb,) = sub.poll(0)
    assert lb.seq == 1 and ev.apply_events(v := {}, lb.batch.events) is None and len(v[0]) == 10
    with pytest.raises(RuntimeError), m.events.transaction():
        api.Step(__import__("kvservice.client.codec", fromlist=["x"]).step_request("p", free=[1]))
        admit(2)                                      # hits: no new pages, no batch
        raise RuntimeError("the journal failed")
    assert sub.poll(0) == []                           # never shown


def test_ring_keeps_the_newest_batches_and_late_readers_get_a_reset():
    m = make_manager()
    m.events.ring_batches = 5
    early = m.events.subscribe("p", 1, "grpc")
    run_workload(m, "p", 60, seed=4)
    pool = m.pool_and_lock("p")[0]
    log = m.events.logs["p"]
    assert len(log.batches) == 5 and log.oldest == pool.events.seq - 4
    assert early.lag == pool.events.seq
    (lb,) = early.poll(0)                              # fell behind the ring: a reset, counted as dropped
    assert lb.batch.reset and lb.seq == pool.events.seq and "no longer retained" in lb.encoded["reset_reason"]
    c = log.counters["grpc"]
    assert c.dropped == log.oldest - 1 and c.resets == 1 and early.lag == 0
    resume = m.events.subscribe("p", log.oldest + 1, "grpc")   # still retained: exactly those batches
    got = resume.poll(0)
    assert [b.seq for b in got] == list(range(log.oldest + 1, pool.events.seq + 1))
    ahead = m.events.subscribe("p", pool.events.seq + 50, "grpc")
    (lb,) = ahead.poll(0)
    assert lb.batch.reset and "ahead" in lb.encoded["reset_reason"]


def test_deleted_pool_ends_its_subscribers_with_all_blocks_cleared():
    m = make_manager()
    run_workload(m, "p", 20, seed=5)
    sub = m.events.subscribe("p", None, "grpc")
    with m.locked("p") as pool:
        ids, _ = pool.sequences()
        pool.step(free_ids=ids)
        m.events.after_step(pool)
    sub.poll(0)
    m.delete_pool("p")
    (lb,) = sub.poll(0)
    assert lb.batch.events == (ev.AllBlocksCleared(),) and lb.batch.reset
    assert sub.poll(0) is None
    with pytest.raises(NotFound):
        m.events.subscribe("p", 0, "grpc")


def test_subscriber_limit():
    m = make_manager()
    m.events.max_subscribers = 2
    a, _ = m.events.subscribe("p", None, "grpc"), m.events.subscribe("p", None, "grpc")
    with pytest.raises(ResourceExhausted, match="--kv-events-max-watchers"):
        m.events.subscribe("p", None, "grpc")
    m.events.subscribe("p", None, "zmq", limit=False)        # publishers are not counted
    a.close()
    m.events.subscribe("p", None, "grpc")


def test_one_tenant_never_takes_another_tenants_watcher_slot():
    m = make_manager()
    m.events.max_subscribers, m.events.max_subscribers_per_tenant = 4, 2
    mine = [m.events.subscribe("p", None, "grpc", tenant="a-read") for _ in range(2)]
    with pytest.raises(ResourceExhausted, match=r"token 'a-read' has 2 WatchEvents streams open.*per-tenant") as exc:
        m.events.subscribe("p", None, "grpc", tenant="a-read")
    assert exc.value.metadata == {"limit": "2", "held": "2"}
    b = [m.events.subscribe("p", None, "grpc", tenant="b") for _ in range(2)]     # b's slots are still free
    with pytest.raises(ResourceExhausted, match=r"4 WatchEvents streams are open.*0 of them yours"):
        m.events.subscribe("p", None, "grpc", tenant="c")
    mine[0].close()
    again = m.events.subscribe("p", None, "grpc", tenant="a-read")       # a closed stream gives its slot back
    for s in (again, mine[1], *b):
        s.close()
    unnamed = [m.events.subscribe("p", None, "grpc") for _ in range(4)]    # no tokens: only the global cap
    assert len(unnamed) == 4


def test_pickled_pool_keeps_the_sequence_and_the_sink():
    m = make_manager()
    run_workload(m, "p", 40, seed=6)
    pool = m.pool_and_lock("p")[0]
    copy = pickle.loads(pickle.dumps(pool))
    assert copy.events.seq == pool.events.seq > 0
    assert copy.prefix.sink is copy.events.sources[0]
    assert np.array_equal(copy.prefix.sink.parent_hash, pool.prefix.sink.parent_hash)


def test_metrics_count_lookups_hits_events_and_lag():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvservice.events.metrics import EventCollector

    m = make_manager()
    reg = CollectorRegistry()
    reg.register(EventCollector(m))
    slow = m.events.subscribe("p", 1, "grpc")                  # never reads: its lag is every batch
    fast = m.events.subscribe("p", 1, "zmq", limit=False)
    w, _ = run_workload(m, "p", 50, seed=7, on_step=lambda *_: fast.poll(0))
    pool = m.pool_and_lock("p")[0]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}
    lbl = (("group", "0"), ("pool", "p"))
    assert samples[("kvservice_prefix_cache_hit_pages_total", lbl)] == pool.prefix.hits > 0
    assert samples[("kvservice_prefix_cache_lookup_pages_total", lbl)] == w.looked > pool.prefix.hits
    assert samples[("kvservice_kv_event_sequence", (("pool", "p"),))] == pool.events.seq
    assert samples[("kvservice_kv_event_subscriber_lag_batches", (("pool", "p"), ("transport", "grpc")))] == \
        pool.events.seq == slow.lag
    assert samples[("kvservice_kv_event_subscriber_lag_batches", (("pool", "p"), ("transport", "zmq")))] == 0
    assert samples[("kvservice_kv_event_batches_sent_total", (("pool", "p"), ("transport", "zmq")))] == pool.events.seq
    assert samples[("kvservice_kv_event_subscribers", (("pool", "p"), ("transport", "grpc")))] == 1
    stored = samples[("kvservice_kv_events_published_total", (("pool", "p"), ("type", "BlockStored")))]
    assert stored > 0 and samples[("kvservice_kv_event_batches_total", (("pool", "p"),))] == pool.events.seq


def test_big_resets_split_into_messages_of_one_sequence_and_round_trip(monkeypatch):
    from kvservice.events import messages as events_proto

    monkeypatch.setattr(events_proto, "MESSAGE_PAGES", 7)
    m = make_manager()
    run_workload(m, "p", 40, seed=8)
    (lb,) = m.events.subscribe("p", 0, "grpc").poll(0)
    msgs = events_proto.batch_to_protos(lb)
    assert len(msgs) > 2 and {x.sequence for x in msgs} == {lb.seq} and all(x.reset for x in msgs)
    assert [x.more for x in msgs] == [True] * (len(msgs) - 1) + [False]
    back = [e for x in msgs for e in events_proto.proto_to_events(x)]
    assert len(back) == len(lb.batch.events)
    for a, b in zip(back, lb.batch.events, strict=True):
        assert type(a) is type(b)
        if isinstance(a, ev.BlockStored):
            assert a.block_hashes.tolist() == b.block_hashes.tolist() and a.token_ids.tolist() == b.token_ids.tolist()
            assert (a.parent_block_hash, a.group, a.kind, a.sliding_window, a.block_size) == \
                (b.parent_block_hash, b.group, b.kind, b.sliding_window, b.block_size)


def test_read_budget_lets_a_piece_start_while_in_credit_then_makes_the_tenant_repay_its_debt():
    from kvservice.manager.read_budget import BUSY_WAIT, ReadBudget

    now = [0.0]
    b = ReadBudget(share=0.1, burst=0.5, clock=lambda: now[0], max_in_flight=2)
    assert b.try_start("a") == 0
    b.finish("a", 2.0)                          # one large piece goes through at once: 0.5 - 2.0 = -1.5 s of debt
    assert b.try_start("a") == pytest.approx((1e-3 + 1.5) / 0.1)
    assert b.try_start("b") == 0                # another tenant: a bucket of its own
    now[0] = 16.0                               # repaid at 0.1 s per s
    assert b.try_start("a") == 0 and b.try_start("a") == 0
    assert b.try_start("a") == BUSY_WAIT        # two pieces running: the third waits
    b.finish("a", 0.0)
    with pytest.raises(ResourceExhausted, match=r"token 'a' used its share.*--tenant-read-share 0.1.*retry in") \
            as exc:
        b.try_start("a")                        # (holds a slot again)
        with b.piece("a", "ScorePrefix"):
            pass
    assert exc.value.reason == "RATE_LIMITED" and float(exc.value.metadata["retry_after_seconds"]) > 0
    assert ReadBudget(share=0).try_start("a") == 0          # share 0: no limit


def test_metrics_export_a_caching_pool_at_zero_before_its_first_batch():
    """The module's promise: every pool with prefix caching exports each series from the first scrape, at 0."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvservice.events.metrics import EVENT_TYPES, TRANSPORTS, EventCollector

    m = make_manager(name="fresh")
    reg = CollectorRegistry()
    reg.register(EventCollector(m))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}
    pool = (("pool", "fresh"),)
    assert samples[("kvservice_kv_event_sequence", pool)] == 0
    assert samples[("kvservice_kv_event_batches_total", pool)] == 0
    assert samples[("kvservice_kv_event_buffer_batches", pool)] == m.events.ring_batches > 0
    for kind in EVENT_TYPES:
        assert samples[("kvservice_kv_events_published_total", (("pool", "fresh"), ("type", kind)))] == 0
    for t in TRANSPORTS:
        assert samples[("kvservice_kv_event_subscribers", (("pool", "fresh"), ("transport", t)))] == 0


def test_configure_events_defers_batches_until_the_transaction_commits():
    """Under `kvservice serve` a Step's batch is visible only once its transaction (the durable commit) returns."""
    from kvservice.events.publish import configure_events
    from kvservice.manager.event_log import EventsConfig

    m = make_manager()
    assert configure_events(m, EventsConfig(ring_batches=17)) == []         # no ZeroMQ publishers asked for
    assert m.events.ring_batches == 17
    sub = m.events.subscribe("p", 1, "grpc")
    with m.events.transaction():
        run_workload(m, "p", 1, seed=11)
        assert sub.poll(0) == []                                                # recorded, not yet visible
    (lb,) = sub.poll(0)
    assert lb.seq == 1


def test_a_source_without_parent_hashes_chains_each_page_under_the_one_before():
    """GroupEventSource.stored without parent_hashes (the caller does not know them): a kept page's parent
    is the offered page before it when that is its parent page (same prompt), else the hash the cache holds
    for its parent slot, else none (0); a page whose parent is not the page before starts a new chain."""
    rng = np.random.default_rng(2815)
    events = ev.PoolEvents()
    src = events.source(1, 0, 16)
    slot_hash = np.zeros(16, dtype=np.uint64)
    old = int(rng.integers(1, 2**63))
    slot_hash[9] = old                                   # slot 9: a page the cache registered earlier
    hashes = rng.integers(1, 2**63, 5, dtype=np.int64).astype(np.uint64)
    slots = np.array([3, 7, 11, 4, 12], dtype=np.int64)
    parents = np.array([-1, 3, 7, 9, 4], dtype=np.int64)  # 3 <- 7 <- 11 one prompt; 9 <- 4 <- 12 another
    keep = np.array([0, 1, 2, 3, 4], dtype=np.int64)
    slot_hash[slots] = hashes
    pages = rng.integers(1, 50_000, (5, PS))
    src.stored(slots, parents, hashes, pages, keep, slot_hash)
    h = hashes.tolist()
    assert src.parent_hash[slots].tolist() == [0, h[0], h[1], old, h[3]]
    batch = events.take_batch([])
    got = [(e.group, e.block_hashes.tolist(), e.parent_block_hash, e.token_ids.tolist()) for e in batch.events]
    assert got == [(1, h[:3], 0, pages[:3].reshape(-1).tolist()), (1, h[3:], old, pages[3:].reshape(-1).tolist())]


def test_removals_in_a_row_of_one_group_are_one_block_removed():
    """Runs of removals of one layer group become one BlockRemoved (in order); another group's removal
    between them ends the run."""
    events = ev.PoolEvents()
    a, b = events.source(0, 0, 16), events.source(1, 8, 16)
    a.removed(11, 1)
    a.removed_many([12, 13], [2, 3])
    a.removed_many([14], [4])
    b.removed_many([21, 22], [1, 2])
    a.removed_many([15], [5])
    a.removed(16, 6)
    got = [(e.group, e.block_hashes.tolist()) for e in events.take_batch([]).events]
    assert got == [(0, [11, 12, 13, 14]), (1, [21, 22]), (0, [15, 16])]


def test_metrics_are_the_documented_series_with_their_labels_and_a_sentence_of_help():
    """The series the module's docstring lists (name{labels}) are exactly the ones exported, with those labels;
    each HELP line reads as a sentence on a dashboard (capital first letter, full stop), as every kvservice
    series' does."""
    import re

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvservice.events import metrics as event_metrics

    documented = {name: set(labels.split(",")) for name, labels in
                  re.findall(r"^(kvservice_\w+)\{([\w,]+)\}", event_metrics.__doc__, re.M)}
    assert len(documented) == 11
    m = make_manager()
    reg = CollectorRegistry()
    reg.register(event_metrics.EventCollector(m))
    fams = list(text_string_to_metric_families(generate_latest(reg).decode()))
    exported = {(f.name + "_total" if f.type == "counter" else f.name): f for f in fams}
    assert set(exported) == set(documented)
    for name, fam in exported.items():
        assert {k for s in fam.samples for k in s.labels} == documented[name], name
        assert re.fullmatch(r"[A-Z].*\.", fam.documentation), (name, fam.documentation)
        # sentence case: the only words in capitals are the acronym KV (and a one-letter word)
        shouted = [w for w in re.findall(r"[A-Za-z]+", fam.documentation) if len(w) > 1 and w.isupper()]
        assert set(shouted) <= {"KV"}, (name, fam.documentation)


def test_a_poll_waits_for_the_next_batch_of_a_live_pool():
    """Subscription.poll(timeout) on a live pool with nothing new waits on the hub's condition until a batch is
    committed, and returns it (not [] at once). The waiter is seen through the condition (no sleeps)."""
    import threading

    m = make_manager()
    waiting = threading.Event()

    class SeenCondition(threading.Condition):
        def wait(self, timeout=None):
            waiting.set()
            return super().wait(timeout)

    m.events.cond = SeenCondition(threading.Lock())
    sub = m.events.subscribe("p", None, "test")
    got = []
    reader = threading.Thread(target=lambda: got.append(sub.poll(120)))
    reader.start()
    while reader.is_alive() and not waiting.wait(0.05):
        pass
    assert waiting.is_set(), f"poll returned {got} without waiting"
    pool, lock = m.pool_and_lock("p")
    tokens = np.random.default_rng(3).integers(1, 30_000, 2 * PS + 1)
    with lock:
        pool.step(admit_ids=[1], admit_tokens=[len(tokens)], admit_token_ids=tokens)
        m.events.after_step(pool, [len(tokens)], True)
    reader.join(120)
    assert not reader.is_alive() and [lb.seq for lb in got[0]] == [1]
    assert got[0][0].batch.events[0].token_ids.tolist() == tokens[:2 * PS].tolist()


def test_a_subscriber_owed_a_reset_when_its_pool_is_deleted_gets_all_blocks_cleared_naming_why():
    """from_sequence 0 asks for a reset (the whole cache); the pool is deleted before the first poll: the reset is
    AllBlocksCleared alone at the log's last batch, its reason 'the pool was deleted', and then the stream ends."""
    m = make_manager()
    run_workload(m, "p", 20, seed=6)
    sub = m.events.subscribe("p", 0, "grpc")
    log = m.events.logs["p"]
    m.delete_pool("p", force=True)                    # its last batch: the forced frees' removals
    head = log.head
    (lb,) = sub.poll(0)
    assert (lb.seq, lb.batch.events, lb.batch.reset) == (head, (ev.AllBlocksCleared(),), True)
    assert lb.encoded == {"reset_reason": "the pool was deleted"}
    assert sub.poll(0) is None
