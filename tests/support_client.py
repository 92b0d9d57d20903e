"""Stand-ins and expectations the client tests share (kvservice/client: client.py, aio.py, stream.py).

- RpcErr: a failed call as grpc hands it over (code, details, trailing metadata), for the code under test to read.
- QueuedStub / AsyncQueuedStub: a BlockManager stub, sync or asyncio, that records each unary call (method, request,
  timeout, metadata) and answers with the outcome queued for its method (the last one stays): a reply, or an error
  raised.
- The requests both BlockManager clients send for the same read calls and pool calls, written out by hand as protos,
  and the checks that hold both clients to them (the call's own timeout, else the client's).
"""

from __future__ import annotations

import re

import grpc

from kvservice.contract import convert
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.v1 import block_manager_pb2 as pb

SPEC = CacheSpec.uniform(3, 2, 16, "float16", 8)
SIZING = Sizing(max_batch=5, max_seq_len=256, memory_budget_bytes=2**33 + 7, num_slots=96, max_num_batched_tokens=640,
                prefix_headroom_slots=3, equal_groups=True, group_slots=(96, 40))
WIRE_SIZING = pb.Sizing(max_batch=5, max_seq_len=256, memory_budget_bytes=2**33 + 7, num_slots=96,
                        max_num_batched_tokens=640, prefix_headroom_slots=3, equal_groups=True, group_slots=[96, 40])
#: a fresh request_id: uuid4's hex
HEX = re.compile(r"[0-9a-f]{32}")


class RpcErr(grpc.RpcError):
    """A failed call as grpc hands it over: its code, its details and its trailing metadata (none: no rich status)."""

    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


class _Queued:
    def __init__(self, **outcomes):
        self.outcomes, self.calls = {k: v if isinstance(v, list) else [v] for k, v in outcomes.items()}, []

    def _answer(self, method, request, timeout, metadata):
        self.calls.append((method, request, timeout, metadata))
        queued = self.outcomes[method]
        got = queued.pop(0) if len(queued) > 1 else queued[0]
        if isinstance(got, Exception):
            raise got
        return got


class QueuedStub(_Queued):
    """Records each call (method, request, timeout, metadata); answers with the outcomes queued for the method (the
    last one stays): a reply, or an error raised."""

    def __getattr__(self, method):
        def call(request, timeout=None, metadata=None):
            return self._answer(method, request, timeout, metadata)
        return call


class AsyncQueuedStub(_Queued):
    """QueuedStub for the asyncio client: each method is a coroutine."""

    def __getattr__(self, method):
        async def call(request, timeout=None, metadata=None):
            return self._answer(method, request, timeout, metadata)
        return call


def at_position(lineage, seq):
    """A PoolInfo reply at journal position (lineage, incarnation 2, seq)."""
    return pb.PoolInfo(name="p", position=pb.JournalPosition(lineage=lineage, incarnation=2, seq=seq))


#: the stub's replies for the read calls below
POOLS = [pb.PoolInfo(name="a", incarnation=3), pb.PoolInfo(name="b", incarnation=9)]
SEQS = pb.ListSequencesReply(total=2, sequences=[pb.SequenceInfo(seq_id=5, num_tokens=7, num_slots=1)])
STATS = pb.StatsReply(pools={"a": pb.PoolStats(num_sequences=4, num_tokens=44)})
PLAN = pb.PlanReply(page_size=8, num_slots=96)
READ_REPLIES = dict(Plan=PLAN, GetPool=POOLS[1], ListPools=pb.ListPoolsReply(pools=POOLS), ListSequences=SEQS,
                    GetStats=STATS, Echo=pb.EchoReply(payload=b"\x01pong"))


def check_read_calls(calls, token):
    """The stub saw, in order, the requests of: plan(SPEC, SIZING, ("native", "flashinfer"), timeout=2.0),
    plan(SPEC, SIZING), get_pool("b", timeout=3.0), list_pools(timeout=4.0), sequences("a", limit=17, timeout=5.0),
    sequences("b"), stats("a", timeout=6.0), stats(), echo(b"\\x01ping", timeout=7.0), echo(); each with `token`, under
    its own timeout, else the client's 300 s."""
    cache = convert.cache_spec_to_proto(SPEC)
    want = [("Plan", pb.PlanRequest(cache=cache, sizing=WIRE_SIZING, backends=["native", "flashinfer"]), 2.0),
            ("Plan", pb.PlanRequest(cache=cache, sizing=WIRE_SIZING), None),
            ("GetPool", pb.GetPoolRequest(pool="b"), 3.0),
            ("ListPools", pb.ListPoolsRequest(), 4.0),
            ("ListSequences", pb.ListSequencesRequest(pool="a", limit=17), 5.0),
            ("ListSequences", pb.ListSequencesRequest(pool="b"), None),
            ("GetStats", pb.GetStatsRequest(pool="a"), 6.0),
            ("GetStats", pb.GetStatsRequest(), None),
            ("Echo", pb.EchoRequest(payload=b"\x01ping"), 7.0),
            ("Echo", pb.EchoRequest(), None)]
    assert [(m, r) for m, r, _, _ in calls] == [(m, r) for m, r, _ in want]
    for (_, _, t, md), (_, _, own) in zip(calls, want, strict=True):
        assert md == token
        assert 0 < t <= own if own else 7.0 < t <= 300.0


def check_pool_requests(c1, c2, d1, d2):
    """The requests of create_pool("np", SPEC, SIZING, ("native",), request_id="cp-1", prefix_caching=True,
    model="m7"), create_pool("np2", SPEC, SIZING), delete_pool("np", force=True, request_id="dp-1") and
    delete_pool("np2"): every field, a fresh uuid4 hex request_id where none was given."""
    cache = convert.cache_spec_to_proto(SPEC)
    assert c1 == pb.CreatePoolRequest(name="np", cache=cache, sizing=WIRE_SIZING, backends=["native"],
                                      request_id="cp-1", enable_prefix_caching=True, model="m7")
    assert HEX.fullmatch(c2.request_id) and c2 == pb.CreatePoolRequest(name="np2", cache=cache, sizing=WIRE_SIZING,
                                                                      request_id=c2.request_id)
    assert d1 == pb.DeletePoolRequest(pool="np", force=True, request_id="dp-1")
    assert HEX.fullmatch(d2.request_id) and d2 == pb.DeletePoolRequest(pool="np2", request_id=d2.request_id)
