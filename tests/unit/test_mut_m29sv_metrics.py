"""ManagerMetrics (kvservice/server/metrics.py) read back through Prometheus' own text parser.

A stream request's reply says how it ended: a StepReply whose ``error`` (RequestStatus, block_manager.proto) is set
was refused with that google.rpc.Code number and ErrorInfo reason, and counts as such: one sample in
kvservice_rpc_duration_seconds{method, code=<the code's name>} and one in
kvservice_requests_refused_total{method, code, reason}; any other reply is an OK call. The code names are the
google.rpc.Code table (hand-written here), not read from gRPC.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.manager.pools import BlockManager
from kvservice.server.metrics import ManagerMetrics
from kvservice.v1 import block_manager_pb2 as pb

#: google.rpc.Code numbers (google/rpc/code.proto).
CODES = {3: "INVALID_ARGUMENT", 5: "NOT_FOUND", 6: "ALREADY_EXISTS", 8: "RESOURCE_EXHAUSTED",
         9: "FAILED_PRECONDITION", 14: "UNAVAILABLE", 13: "INTERNAL", 4: "DEADLINE_EXCEEDED"}


def _samples(mm: ManagerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    fams = text_string_to_metric_families(generate_latest(mm.registry).decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def test_stream_replies_are_counted_by_the_code_and_reason_their_error_names() -> None:
    rng = np.random.default_rng(71)
    mm = ManagerMetrics(BlockManager())
    base = _samples(mm)
    count: dict[tuple[str, str], int] = {}
    total: dict[tuple[str, str], float] = {}
    refused: dict[tuple[str, str, str], int] = {}
    for _ in range(40):
        seconds = float(rng.integers(1, 4000)) / 1e5
        method = ("Step", "Echo")[int(rng.integers(2))]
        kind = int(rng.integers(4))
        if kind == 0:
            reply: object = pb.StepReply(layer_index_space=[0, 1])      # served: no error set
            code, reason = "OK", ""
        elif kind == 1:
            reply = pb.EchoReply(payload=rng.bytes(8))                 # a reply type without an error field
            code, reason = "OK", ""
        else:
            num = list(CODES)[int(rng.integers(len(CODES)))]
            reason = ("", "LIMIT_EXCEEDED", "MEMORY_BUDGET", "OUT_OF_SLOTS")[int(rng.integers(4))]
            reply = pb.StepReply(error=pb.RequestStatus(code=num, message="refused", reason=reason))
            code = CODES[num]
        mm.observe_reply(method, seconds, reply)
        count[(method, code)] = count.get((method, code), 0) + 1
        total[(method, code)] = total.get((method, code), 0.0) + seconds
        if code != "OK":
            key = (method, code, reason or code)               # no ErrorInfo reason: the code stands for it
            refused[key] = refused.get(key, 0) + 1
    s = _samples(mm)
    got_count = {(dict(k[1])["method"], dict(k[1])["code"]): v for k, v in s.items()
                 if k[0] == "kvservice_rpc_duration_seconds_count" and v}
    assert got_count == count
    for (method, code), want in total.items():
        key = ("kvservice_rpc_duration_seconds_sum", (("code", code), ("method", method)))
        assert abs(s[key] - want) < 1e-9
    got_refused = {(dict(k[1])["method"], dict(k[1])["code"], dict(k[1])["reason"]): v
                   for k, v in s.items() if k[0] == "kvservice_requests_refused_total"}
    want_refused = {(m, c, r): 0.0 for (m, c, r) in
                    ((d["method"], d["code"], d["reason"]) for d in
                     (dict(k[1]) for k in base if k[0] == "kvservice_requests_refused_total"))}
    for key, n in refused.items():
        want_refused[key] = want_refused.get(key, 0.0) + n
    assert got_refused == want_refused
    assert any(code != "OK" for _, code in count) and ("Step", "OK") in count


def test_an_error_code_outside_grpcs_table_is_counted_under_its_number() -> None:
    mm = ManagerMetrics(BlockManager())
    mm.observe_reply("Step", 0.002, pb.StepReply(error=pb.RequestStatus(code=77, reason="ODD")))
    s = _samples(mm)
    assert s[("kvservice_requests_refused_total", (("code", "77"), ("method", "Step"), ("reason", "ODD")))] == 1
    assert s[("kvservice_rpc_duration_seconds_count", (("code", "77"), ("method", "Step")))] == 1
    assert s[("kvservice_rpc_duration_seconds_count", (("code", "OK"), ("method", "Step")))] == 0


def test_any_methods_ok_calls_and_refusals_land_in_their_own_series() -> None:
    """observe(): an OK call of a method not pre-created gets its own code="OK" series; a refusal without a reason is
    counted with the code as its reason; the histogram's buckets are the documented RPC_BUCKETS (le labels)."""
    from kvservice.server.metrics import RPC_BUCKETS

    rng = np.random.default_rng(73)
    mm = ManagerMetrics(BlockManager())
    secs = [float(x) / 1e6 for x in rng.integers(10, 3_000_000, 9)]
    for x in secs[:5]:
        mm.observe("ScorePrefix", x)
    mm.observe("ScorePrefix", secs[5], "NOT_FOUND")
    mm.observe("ScorePrefix", secs[6], "NOT_FOUND", "POOL_NOT_FOUND")
    s = _samples(mm)
    ok = (("code", "OK"), ("method", "ScorePrefix"))
    assert s[("kvservice_rpc_duration_seconds_count", ok)] == 5
    assert abs(s[("kvservice_rpc_duration_seconds_sum", ok)] - sum(secs[:5])) < 1e-9
    for le in RPC_BUCKETS:
        key = ("kvservice_rpc_duration_seconds_bucket", (("code", "OK"), ("le", str(float(le))),
                                                           ("method", "ScorePrefix")))
        assert s[key] == sum(x <= le for x in secs[:5])
    assert s[("kvservice_requests_refused_total", (("code", "NOT_FOUND"), ("method", "ScorePrefix"),
                                                   ("reason", "NOT_FOUND")))] == 1
    assert s[("kvservice_requests_refused_total", (("code", "NOT_FOUND"), ("method", "ScorePrefix"),
                                                   ("reason", "POOL_NOT_FOUND")))] == 1
    assert s[("kvservice_rpc_duration_seconds_count", (("code", "NOT_FOUND"), ("method", "ScorePrefix")))] == 2
    assert RPC_BUCKETS[0] == 25e-6 and RPC_BUCKETS[-1] == 2.5 and list(RPC_BUCKETS) == sorted(RPC_BUCKETS)


def test_prefix_cache_series_export_the_pools_own_counters() -> None:
    """A prefix-cached pool's hits and evictions, as its cache counted them, after real Steps that hit and evict;
    slots free and sequences after them, counted by hand from the pages each sequence holds."""
    from prometheus_client import CollectorRegistry

    from kvservice.client.codec import step_request
    from kvservice.contract.geometry import CacheSpec
    from kvservice.contract.sizing import Sizing
    from kvservice.manager.api import ManagerAPI
    from kvservice.server.metrics import ManagerCollector

    rng = np.random.default_rng(79)
    m = BlockManager()
    m.create_pool("c", CacheSpec.uniform(2, 1, 64, page_size=4), Sizing(num_slots=16, max_seq_len=64),
                  prefix_caching=True)
    api = ManagerAPI(m)
    prompt = rng.integers(1, 30000, 16)
    api.Step(step_request("c", admit=[1], admit_tokens=[16], admit_token_ids=prompt))        # 4 pages
    api.Step(step_request("c", free=[1]))
    api.Step(step_request("c", admit=[2], admit_tokens=[16], admit_token_ids=prompt))        # hits its pages
    for k in range(6):                                         # new prompts: the cache must give pages back
        api.Step(step_request("c", free=[2 + k], admit=[3 + k], admit_tokens=[16],
                              admit_token_ids=rng.integers(1, 30000, 16)))
    reg = CollectorRegistry()
    reg.register(ManagerCollector(m))
    fams = text_string_to_metric_families(generate_latest(reg).decode())
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in fams for x in f.samples}
    c = (("pool", "c"),)
    with m.locked("c") as pool:
        hits, evictions = pool.prefix.hits, pool.allocators[0].evictions
    assert hits > 0 and evictions > 0
    reasons = {dict(k[1])["reason"] for k in s if k[0] == "kvservice_alloc_failures_total"}
    assert reasons == {"out_of_slots"}          # docs/operations.md: {reason="out_of_slots"}
    assert (s[("kvservice_prefix_cache_hits_total", c)], s[("kvservice_prefix_cache_evictions_total", c)]) == \
        (hits, evictions)
    assert (s[("kvservice_slots_total", c)], s[("kvservice_sequences", c)]) == (16, 1)
    assert s[("kvservice_slots_free", c)] == 16 - 4              # the live sequence's 4 pages


def test_a_step_refusal_series_exists_for_every_code_the_error_model_sends() -> None:
    """docs/DESIGN.md#errors lists the status codes of a refusal; each one the manager sends (not DATA_LOSS, raised
    by clients only) has its Step series at 0 from the first scrape, reason = the code."""
    import pathlib
    import re

    design = (pathlib.Path(__file__).parents[2] / "docs" / "DESIGN.md").read_text()
    table = design.split("## Errors", 1)[1].split("Nothing reaches a client", 1)[0]
    codes = {c for row in re.findall(r"^\| ([A-Z_ /]+) \|", table, re.M) for c in row.split(" / ")}
    sent = codes - {"DATA_LOSS", "status"}
    assert len(sent) == 6 and "UNAVAILABLE" in sent
    s = _samples(ManagerMetrics(BlockManager()))
    refused = {dict(k[1])["code"] for k, v in s.items() if k[0] == "kvservice_requests_refused_total"
               and dict(k[1])["method"] == "Step" and dict(k[1])["reason"] == dict(k[1])["code"] and v == 0}
    assert refused == sent
