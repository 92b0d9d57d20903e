"""events/metrics.py's whole scrape against a hand-computed model: every series of a caching pool with a lagging
and a caught-up WatchEvents subscriber (and no ZeroMQ ones), every HELP line as dashboards show it, and nothing
for a pool without prefix caching."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.events.metrics import EventCollector
from kvservice.manager.pools import BlockManager

PS = 4
HELP = {
    "kvservice_prefix_cache_lookup_pages": "Prompt pages admissions looked up in the prefix cache (full pages but "
                                           "the last token's).",
    "kvservice_prefix_cache_hit_pages": "Prompt pages found in the prefix cache.",
    "kvservice_kv_event_sequence": "Sequence number of the pool's last KV event batch.",
    "kvservice_kv_event_batches": "KV event batches published (one per Step that changed the prefix cache).",
    "kvservice_kv_events_published": "KV events published, by type.",
    "kvservice_kv_event_batches_sent": "KV event batches sent to subscribers.",
    "kvservice_kv_event_batches_dropped": "KV event batches a subscriber could not get any more (it got a reset "
                                          "instead).",
    "kvservice_kv_event_resets": "Resets (AllBlocksCleared + the whole cache) sent to subscribers.",
    "kvservice_kv_event_subscribers": "Connected KV event subscribers.",
    "kvservice_kv_event_subscriber_lag_batches": "Batches the furthest-behind subscriber has not read yet.",
    "kvservice_kv_event_buffer_batches": "Batches each pool's ring retains; a subscriber lagging more gets a reset.",
}
COUNTERS = {"kvservice_prefix_cache_lookup_pages", "kvservice_prefix_cache_hit_pages", "kvservice_kv_event_batches",
            "kvservice_kv_events_published", "kvservice_kv_event_batches_sent", "kvservice_kv_event_batches_dropped",
            "kvservice_kv_event_resets"}


def _admit(m: BlockManager, name: str, seq_id: int, tokens: np.ndarray) -> None:
    pool, lock = m.pool_and_lock(name)
    with lock:
        pool.step(admit_ids=[seq_id], admit_tokens=[len(tokens)], admit_token_ids=tokens)
        m.events.after_step(pool, [len(tokens)], True)


def test_a_scrape_is_the_model_series_by_series():
    m = BlockManager()
    m.events.ring_batches = 37
    for name, caching in (("p", True), ("plain", False)):
        m.create_pool(name, CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=64, max_seq_len=64),
                      prefix_caching=caching)
    rng = np.random.default_rng(77)
    prompts = [rng.integers(1, 30_000, n) for n in (3 * PS + 1, 2 * PS + 3, 4 * PS + 2)]
    slow = m.events.subscribe("p", 1, "grpc")                   # never reads
    fast = m.events.subscribe("p", 1, "grpc")
    for i, t in enumerate(prompts):
        _admit(m, "p", i + 1, t)
        pool, lock = m.pool_and_lock("plain")
        with lock:                                              # no prefix caching: no token ids, no events
            pool.step(admit_ids=[i + 1], admit_tokens=[len(t)])
    _admit(m, "p", 10, prompts[2])                              # the same prompt again: its pages are hits
    seq = m.pool_and_lock("p")[0].events.seq
    assert seq == 3                                             # one batch per admission that stored pages
    read = fast.poll(0, max_batches=1)
    assert [lb.seq for lb in read] == [1]                       # fast lags 2, slow 3: the worst is 3
    m.events.ring_batches = 50                                  # pools' rings from now on; p's keeps 37
    m.create_pool("fresh", CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=64, max_seq_len=64),
                  prefix_caching=True)
    lookups = sum((len(t) - 1) // PS for t in prompts) + (len(prompts[2]) - 1) // PS
    hits = (len(prompts[2]) - 1) // PS
    stored = 3                                                  # one BlockStored per batch

    reg = CollectorRegistry()
    reg.register(EventCollector(m))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    assert {n: f.documentation for n, f in fams.items()} == HELP
    assert {n for n, f in fams.items() if f.type == "counter"} == COUNTERS
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples
           if not s.name.endswith("_created")}
    want = {
        ("kvservice_prefix_cache_lookup_pages_total", (("group", "0"), ("pool", "p"))): lookups,
        ("kvservice_prefix_cache_hit_pages_total", (("group", "0"), ("pool", "p"))): hits,
        ("kvservice_kv_event_sequence", (("pool", "p"),)): seq,
        ("kvservice_kv_event_batches_total", (("pool", "p"),)): seq,
        ("kvservice_kv_event_buffer_batches", (("pool", "p"),)): 37,
    }
    for kind, n in (("BlockStored", stored), ("BlockRemoved", 0), ("AllBlocksCleared", 0)):
        want[("kvservice_kv_events_published_total", (("pool", "p"), ("type", kind)))] = n
    per_transport = {"grpc": (1, 0, 0, 2, seq), "zmq": (0, 0, 0, 0, 0), "zmq-replay": (0, 0, 0, 0, 0)}
    for t, values in per_transport.items():
        for name, v in zip(("kvservice_kv_event_batches_sent_total", "kvservice_kv_event_batches_dropped_total",
                            "kvservice_kv_event_resets_total", "kvservice_kv_event_subscribers",
                            "kvservice_kv_event_subscriber_lag_batches"), values, strict=True):
            want[(name, (("pool", "p"), ("transport", t)))] = v
            want[(name, (("pool", "fresh"), ("transport", t)))] = 0      # a caching pool before its first batch
    fresh = (("pool", "fresh"),)
    want |= {("kvservice_prefix_cache_lookup_pages_total", (("group", "0"), ("pool", "fresh"))): 0,
             ("kvservice_prefix_cache_hit_pages_total", (("group", "0"), ("pool", "fresh"))): 0,
             ("kvservice_kv_event_sequence", fresh): 0, ("kvservice_kv_event_batches_total", fresh): 0,
             ("kvservice_kv_event_buffer_batches", fresh): 50}
    for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        want[("kvservice_kv_events_published_total", (("pool", "fresh"), ("type", kind)))] = 0
    assert got == want
    slow.close()
    fast.close()
