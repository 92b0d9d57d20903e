"""kvservice/server pieces the seed-21 survivors showed unpinned.

- admission._on_end: a call's charges are released when the call terminates "even if its handler never runs to its
  end" (its docstring): the release is registered with the call's context, and made at once when the call has
  already ended (grpc's add_callback returns False then). After that nothing more is charged to the call
  (CallCharges' docstring).
- ManagerCollector / ManagerMetrics: every series' HELP reads as a sentence on a dashboard (capital first letter,
  full stop), as every kvservice series' does (tests/unit/test_kv_events.py checks the KV event series the same way).
- The servicer's state reads (GetPool, ListPools, ListSequences, GetStats) go through the journal: their replies
  carry where it stood (block_manager.proto: "where the journal stood when the pools / sequences / figures were
  read"), the same incarnation, seq and lineage as the journal's.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.client.codec import create_pool_request, step_request
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager
from kvservice.server.admission import AdmissionInterceptor
from kvservice.server.budget import WIRE_FACTOR, BudgetLimits, MemoryBudget
from kvservice.server.metrics import ManagerMetrics
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_mut_m28b_servicer import served  # noqa: F401  (the in-process server fixture)

MIB = 1 << 20


class Context:
    """A servicer context as grpc's: add_callback keeps the callback while the call runs (True), refuses it once the
    call has ended (False); the end of the call runs each callback, logging (here: keeping) what one raises."""

    def __init__(self, ended: bool = False) -> None:
        self.ended, self.callbacks, self.errors = ended, [], []

    def add_callback(self, callback) -> bool:
        if self.ended:
            return False
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        self.ended = True
        for cb in self.callbacks:
            try:
                cb()
            except Exception as exc:            # grpc logs it and goes on
                self.errors.append(exc)


def _stream_handler(shape: str):
    def replies(*_):
        yield b"never sent"
    make = {"unary_stream": grpc.unary_stream_rpc_method_handler,
            "stream_stream": grpc.stream_stream_rpc_method_handler}[shape]
    return make(replies, request_deserializer=lambda b: b, response_serializer=lambda b: b)


@pytest.mark.parametrize("shape", ["unary_stream", "stream_stream"])
@pytest.mark.parametrize("ended", [False, True])
def test_a_calls_charges_go_when_it_ends_though_its_handler_never_ran(shape, ended):
    budget = MemoryBudget(BudgetLimits(100 * MIB, 60 * MIB))
    admission = AdmissionInterceptor(budget, "kv.S", tenant_of=lambda md: dict(md)["tenant"])
    details = SimpleNamespace(method=f"/kv.S/{shape}", invocation_metadata=(("tenant", "a"),))
    handler = admission.intercept_service(lambda d: _stream_handler(shape), details)
    request = handler.request_deserializer(b"x" * 1000)
    assert budget.tenant_bytes("a") == WIRE_FACTOR * 1000 == budget.charged_bytes
    ctx = Context(ended=ended)
    behaviour = getattr(handler, shape)
    behaviour(request if shape == "unary_stream" else iter([request]), ctx)     # its replies: never iterated
    if not ended:
        assert budget.tenant_bytes("a") == WIRE_FACTOR * 1000              # the call still runs
        ctx.end()                                                          # the client cancels it
    assert ctx.errors == []
    assert budget.tenant_bytes("a") == 0 == budget.charged_bytes and budget.tenants() == {}
    handler.request_deserializer(b"y" * 500)                               # parsed late: never charged
    assert budget.charged_bytes == 0


def test_every_manager_series_has_a_sentence_of_help():
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=64, max_seq_len=1024),
                  prefix_caching=True)
    metrics = ManagerMetrics(m)
    fams = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    helps = {f.name: f.documentation for f in fams}
    for name in ("kvservice_slots_total", "kvservice_slots_free", "kvservice_sequences", "kvservice_alloc_failures",
                 "kvservice_prefix_cache_hits", "kvservice_prefix_cache_evictions", "kvservice_workers"):
        assert name in helps, name
    for name, text in helps.items():
        assert re.fullmatch(r"[A-Z].*\.", text), (name, text)
        shouted = [w for w in re.findall(r"[A-Za-z]+", text) if len(w) > 1 and w.isupper()]
        assert set(shouted) <= {"KV", "RPC", "LRU"}, (name, text)
    assert helps["kvservice_prefix_cache_hits"] == "Pages served from the prefix cache instead of being recomputed."


def test_state_reads_carry_the_journal_position(served):  # noqa: F811
    running, stub = served
    rng = np.random.default_rng(2123)
    stub.CreatePool(create_pool_request("q", CacheSpec.uniform(2, 2, 8, "float16", 4), Sizing(num_slots=128)),
                    timeout=10)
    for i in range(int(rng.integers(2, 5))):
        stub.Step(step_request("q", admit=[i + 1], admit_tokens=[int(rng.integers(1, 9))]), timeout=10)
    j = running.journal
    want = (j.incarnation, j.seq, j.store.lineage)
    assert j.seq >= 3 and j.incarnation >= 1 and j.store.lineage != 0
    for reply in (stub.GetPool(pb.GetPoolRequest(pool="q"), timeout=10),
                  stub.ListPools(pb.ListPoolsRequest(), timeout=10),
                  stub.ListSequences(pb.ListSequencesRequest(pool="q"), timeout=10),
                  stub.GetStats(pb.GetStatsRequest(pool="q"), timeout=10)):
        assert reply.HasField("position"), type(reply).__name__
        assert (reply.position.incarnation, reply.position.seq, reply.position.lineage) == want
