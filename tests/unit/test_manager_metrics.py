"""The manager's /metrics series (kvservice/server/metrics.py, ManagerCollector) read back through Prometheus' own
text parser, against values worked out by hand from the pools' sizes and the steps sent."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.server.metrics import ManagerCollector
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_limits import counts, ids


def _scrape(m):
    reg = CollectorRegistry()
    reg.register(ManagerCollector(m))
    fams = list(text_string_to_metric_families(generate_latest(reg).decode()))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}
    return {f.name: f.documentation for f in fams}, samples


def test_slots_sequences_and_refusals_per_pool():
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=64, max_seq_len=1024))
    m.create_pool("q", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=8, max_seq_len=128),
                  prefix_caching=True)
    api = ManagerAPI(m)
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=ids([1, 2]), admit_num_tokens=counts([20, 40])))  # 2 + 3 pages
    with pytest.raises(ResourceExhausted):
        api.Step(pb.StepRequest(pool="q", admit_seq_ids=ids([5, 6]), admit_num_tokens=counts([100, 100])))  # 14 > 8
    docs, s = _scrape(m)
    assert all(docs[f] for f in ("kvservice_slots_total", "kvservice_slots_free", "kvservice_sequences",
                                 "kvservice_alloc_failures", "kvservice_prefix_cache_hits",
                                 "kvservice_prefix_cache_evictions", "kvservice_workers"))
    p, q = (("pool", "p"),), (("pool", "q"),)
    assert (s[("kvservice_slots_total", p)], s[("kvservice_slots_free", p)], s[("kvservice_sequences", p)]) == \
        (64, 59, 2)
    assert (s[("kvservice_slots_total", q)], s[("kvservice_slots_free", q)], s[("kvservice_sequences", q)]) == \
        (8, 8, 0)
    assert s[("kvservice_alloc_failures_total", (("pool", "q"), ("reason", "out_of_slots")))] == 1
    assert all(v == 0 for k, v in s.items() if k[0] == "kvservice_alloc_failures_total" and ("pool", "p") in k[1])
    assert s[("kvservice_prefix_cache_hits_total", q)] == 0 == s[("kvservice_prefix_cache_evictions_total", q)]
    assert ("kvservice_prefix_cache_hits_total", p) not in s             # no prefix cache, no series


def test_workers_are_counted_by_pool_and_state():
    """kvservice_workers{pool, state}: live and lapsed workers of each pool, counted from the registry (a worker
    silent for longer than its lease is dead); the counts are compared with a plain count of the records."""
    from kvservice.manager.workers import WorkerRegistry

    now = [0.0]
    m = BlockManager()
    m.workers = WorkerRegistry(10.0, clock=lambda: now[0])
    for wid, pool in (("a1", "p"), ("a2", "p"), ("a3", "p"), ("b1", "q")):
        m.workers.register(wid, pool, 2)
    now[0] = 8.0
    for wid in ("a1", "a2", "b1"):
        m.workers.heartbeat(wid, 1)
    now[0] = 12.0                                             # a3 silent for 12 s > its 10 s lease
    _, s = _scrape(m)
    got = {k[1]: v for k, v in s.items() if k[0] == "kvservice_workers"}
    assert got == {(("pool", "p"), ("state", "alive")): 2, (("pool", "p"), ("state", "dead")): 1,
                   (("pool", "q"), ("state", "alive")): 1}


def test_every_step_refusal_series_exists_from_the_first_scrape():
    """docs: a healthy manager shows 0, never "no data": each refusal code of a Step is exported at 0 before any
    request, labelled method="Step" and reason = the code."""
    from kvservice.server.metrics import REFUSAL_CODES, ManagerMetrics

    mm = ManagerMetrics(BlockManager())
    fams = list(text_string_to_metric_families(generate_latest(mm.registry).decode()))
    refused = {tuple(sorted(s.labels.items())): s.value for f in fams for s in f.samples
               if s.name == "kvservice_requests_refused_total"}
    assert refused == {(("code", c), ("method", "Step"), ("reason", c)): 0.0 for c in REFUSAL_CODES}
    assert set(REFUSAL_CODES) >= {"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"}


def test_ok_duration_series_of_step_and_echo_exist_from_the_first_scrape():
    """The same rule for the OK latency histogram: Step's and Echo's code="OK" series are exported with count 0
    before any call (so a rate() over them starts at 0), under the RPC method names exactly as gRPC spells them;
    a later observe() lands in that same series."""
    from kvservice.server.metrics import ManagerMetrics

    def counts(mm):
        fams = list(text_string_to_metric_families(generate_latest(mm.registry).decode()))
        return {tuple(sorted(s.labels.items())): s.value for f in fams for s in f.samples
                if s.name == "kvservice_rpc_duration_seconds_count"}

    mm = ManagerMetrics(BlockManager())
    assert counts(mm) == {(("code", "OK"), ("method", "Step")): 0.0, (("code", "OK"), ("method", "Echo")): 0.0}
    mm.observe("Step", 0.003)
    mm.observe("Step", 0.004)
    assert counts(mm) == {(("code", "OK"), ("method", "Step")): 2.0, (("code", "OK"), ("method", "Echo")): 0.0}
