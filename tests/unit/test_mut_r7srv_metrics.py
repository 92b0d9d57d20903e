"""kvservice/server/metrics.py: the HELP text of the RPC series (docs/DESIGN.md's metrics, written out here), and a
scrape that meets a pool deleted between listing and locking skips that pool only (ManagerCollector: "a pool deleted
between listing and locking" is left out, the others are exported)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager
from kvservice.server.metrics import ManagerMetrics


def _families(metrics: ManagerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}


def test_the_rpc_series_carry_their_help_text() -> None:
    fams = _families(ManagerMetrics(BlockManager()))
    assert fams["kvservice_rpc_duration_seconds"].documentation == \
        "Server-side time per RPC, by its gRPC status code."
    assert fams["kvservice_requests_refused"].documentation == \
        "Requests answered with an error status, by method, code and reason (the ErrorInfo reason, else the code)."


def test_a_pool_deleted_while_scraping_is_skipped_and_the_pools_after_it_are_exported() -> None:
    m = BlockManager()
    spec = CacheSpec.uniform(2, 1, 64, page_size=16)
    for name, slots in (("a", 24), ("b", 40)):
        m.create_pool(name, spec, Sizing(num_slots=slots, max_seq_len=128))
    listed = m.pool_names
    m.pool_names = lambda: ["a", "gone", *[n for n in listed() if n != "a"]]     # "gone": deleted since listed
    fams = _families(ManagerMetrics(m))
    got = {s.labels["pool"]: s.value for s in fams["kvservice_slots_total"].samples}
    assert got == {"a": 24.0, "b": 40.0}
    assert {s.labels["pool"] for s in fams["kvservice_slots_free"].samples} == {"a", "b"}
