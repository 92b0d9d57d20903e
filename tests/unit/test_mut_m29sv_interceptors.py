"""The two server interceptors of kvservice/server on all four gRPC call shapes, through a real in-process server.

BlockManager has no client-streaming method, so a small generic service (``kvtest.Probe``, EchoRequest in,
EchoReply out) carries one method of each shape: unary, server streaming, bidirectional and client streaming. Its
handlers record what they saw (the parsed request, the call's metadata, the budget's charges at that moment) so the
interceptors are checked from both ends of the wire.

Oracles are the documented rules, never the interceptors' own code:
- docs/SECURITY.md#memory-budget: a request is charged 6 x its size on the wire (WIRE_FACTOR) before its bytes are
  parsed, a reply 4 x its bound (REPLY_FACTOR); a unary call's charges go when its handler returns, a stream's request
  when its next request arrives; one that does not fit ends the call RESOURCE_EXHAUSTED, reason MEMORY_BUDGET,
  before its handler sees it; calls without a known token are neither parsed nor charged.
- docs/HA.md / leader_gate.py's module doc: a standby refuses UNAVAILABLE with the refusal text, a leader whose lease
  lapsed refuses UNAVAILABLE, the leader stamps epoch and node id on the initial metadata; other services pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest

from kvservice.contract.serving import Malformed, _parser
from kvservice.contract.status import error_info
from kvservice.contract.transport import EPOCH_METADATA, NODE_METADATA
from kvservice.server import admission
from kvservice.server.admission import AdmissionInterceptor
from kvservice.server.budget import BudgetLimits, MemoryBudget
from kvservice.server.leader_gate import LeaderGate
from kvservice.v1 import block_manager_pb2 as pb

SERVICE, OTHER = "kvtest.Probe", "kvtest.Other"
WIRE, REPLY = 6, 4                       # docs/SECURITY.md#memory-budget: 6 x a request's wire size, 4 x a reply's
SHAPES = ("Unary", "ServerStream", "BiStream", "ClientStream")


class Probe:
    """The handlers of kvtest.Probe / kvtest.Other; `seen` lists (method, request payload or its type, tenant bytes
    charged, all bytes charged, the call's metadata) at the moment each request reached a handler."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget
        self.seen: list[tuple[str, object, int, int, dict[str, str]]] = []

    def _see(self, method: str, request: object, context: grpc.ServicerContext) -> None:
        md = dict(context.invocation_metadata())
        what = request.payload if isinstance(request, pb.EchoRequest) else type(request).__name__
        self.seen.append((method, what, self.budget.tenant_bytes(md.get("tenant", "")), self.budget.charged_bytes,
                          md))

    def unary(self, request: pb.EchoRequest, context: grpc.ServicerContext) -> pb.EchoReply:
        self._see("Unary", request, context)
        return pb.EchoReply(payload=request.payload[::-1] if isinstance(request, pb.EchoRequest) else b"malformed")

    def server_stream(self, request: pb.EchoRequest, context: grpc.ServicerContext) -> Iterator[pb.EchoReply]:
        self._see("ServerStream", request, context)
        for i in range(0, len(request.payload), 7):
            yield pb.EchoReply(payload=request.payload[i:i + 7])

    def bi_stream(self, requests: Iterator[pb.EchoRequest], context: grpc.ServicerContext) -> Iterator[pb.EchoReply]:
        for r in requests:
            self._see("BiStream", r, context)
            admission.reserve_reply(len(r.payload) // 2 + 1)    # what a Step does before it is applied
            self.seen.append(("reserved", None, self.budget.tenant_bytes(dict(context.invocation_metadata())
                                                                         .get("tenant", "")),
                              self.budget.charged_bytes, {}))
            yield pb.EchoReply(payload=r.payload[::-1])

    def client_stream(self, requests: Iterator[pb.EchoRequest], context: grpc.ServicerContext) -> pb.EchoReply:
        out = b""
        for r in requests:
            self._see("ClientStream", r, context)
            out += r.payload
        return pb.EchoReply(payload=out)

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        kw = {"request_deserializer": _parser(pb.EchoRequest),        # the servers' own lenient parser
              "response_serializer": pb.EchoReply.SerializeToString}
        probe = grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(self.unary, **kw),
            "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream, **kw),
            "BiStream": grpc.stream_stream_rpc_method_handler(self.bi_stream, **kw),
            "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream, **kw),
        })
        other = grpc.method_handlers_generic_handler(OTHER, {
            "Unary": grpc.unary_unary_rpc_method_handler(self.unary, **kw)})
        return [probe, other]


class Served:
    """A grpc.server on 127.0.0.1:0 with `interceptors`, serving Probe; calls(method) gives a callable per shape."""

    def __init__(self, probe: Probe, interceptors: list[grpc.ServerInterceptor]) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=interceptors)
        self.server.add_generic_rpc_handlers(probe.handlers())
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *_: object) -> None:
        self.channel.close()
        self.server.stop(None)

    def call(self, shape: str, service: str = SERVICE, raw: bool = False):
        ser = None if raw else pb.EchoRequest.SerializeToString
        kw = {"request_serializer": ser, "response_deserializer": pb.EchoReply.FromString}
        path = f"/{service}/{shape}"
        return {"Unary": self.channel.unary_unary, "ServerStream": self.channel.unary_stream,
                "BiStream": self.channel.stream_stream, "ClientStream": self.channel.stream_unary}[shape](path, **kw)


def _tenant_of(metadata) -> str:
    return dict(metadata).get("tenant", "")


def _admitted(budget: MemoryBudget) -> tuple[Probe, Served]:
    probe = Probe(budget)
    return probe, Served(probe, [AdmissionInterceptor(budget, SERVICE, _tenant_of, unparsed="anon")])


def _wire(payload: bytes) -> int:
    return len(pb.EchoRequest(payload=payload).SerializeToString())


def _invoke(s: Served, shape: str, payloads: list[bytes], tenant: str, service: str = SERVICE):
    """The replies' payloads of one call of `shape` carrying `payloads` (one for the unary-request shapes)."""
    md = (("tenant", tenant),)
    stub = s.call(shape, service)
    reqs = [pb.EchoRequest(payload=p) for p in payloads]
    if shape == "Unary":
        return [stub(reqs[0], timeout=10, metadata=md).payload]
    if shape == "ServerStream":
        return [r.payload for r in stub(reqs[0], timeout=10, metadata=md)]
    if shape == "BiStream":
        return [r.payload for r in stub(iter(reqs), timeout=10, metadata=md)]
    return [stub(iter(reqs), timeout=10, metadata=md).payload]


def _expected_replies(shape: str, payloads: list[bytes]) -> list[bytes]:
    if shape == "Unary":
        return [payloads[0][::-1]]
    if shape == "ServerStream":
        return [payloads[0][i:i + 7] for i in range(0, len(payloads[0]), 7)]
    if shape == "BiStream":
        return [p[::-1] for p in payloads]
    return [b"".join(payloads)]


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_is_served_parsed_and_charged_six_times_its_wire_size_while_handled(shape) -> None:
    """Every call shape reaches its handler with the parsed request and the call's own context (its metadata), and
    while the handler holds request k the tenant is charged exactly 6 x request k's wire size (a stream's earlier
    requests already released), plus 4 x what the handler reserved for its reply; when the call ends nothing is
    left charged and the replies are what the handler built."""
    rng = np.random.default_rng(sum(map(ord, shape)))
    budget = MemoryBudget(BudgetLimits(1 << 20, 1 << 20))
    probe, served = _admitted(budget)
    n = 1 if shape in ("Unary", "ServerStream") else 4
    payloads = [rng.bytes(int(k)) for k in rng.integers(20, 3000, n)]
    tenant = "t-" + rng.bytes(3).hex()
    with served as s:
        assert _invoke(s, shape, payloads, tenant) == _expected_replies(shape, payloads)
    seen = [x for x in probe.seen if x[0] == shape]
    assert [x[1] for x in seen] == payloads                          # parsed EchoRequests, in order
    assert all(x[4].get("tenant") == tenant for x in seen)           # the handler got the call's own context
    assert [(x[2], x[3]) for x in seen] == [(WIRE * _wire(p), WIRE * _wire(p)) for p in payloads]
    if shape == "BiStream":
        reserved = [x for x in probe.seen if x[0] == "reserved"]
        assert [(x[2], x[3]) for x in reserved] == \
            [(WIRE * _wire(p) + REPLY * (len(p) // 2 + 1),) * 2 for p in payloads]
    assert budget.charged_bytes == 0 and budget.tenants() == {} and budget.refused == {}
    assert budget.peak_bytes == max(WIRE * _wire(p) + (REPLY * (len(p) // 2 + 1) if shape == "BiStream" else 0)
                                    for p in payloads)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_request_over_the_budget_ends_the_call_resource_exhausted_before_its_handler(shape) -> None:
    """The budget holds `limit` bytes; a request whose 6 x wire size is over it is never parsed nor handled: the call
    ends RESOURCE_EXHAUSTED, reason MEMORY_BUDGET, naming the method's request. In a stream it may follow requests
    that fit: those were answered (bidirectional) and handled; the charges all come back."""
    rng = np.random.default_rng(7 + len(shape))
    limit = 6000
    budget = MemoryBudget(BudgetLimits(limit, limit))
    probe, served = _admitted(budget)
    small = [rng.bytes(int(k)) for k in rng.integers(10, 200, 2)]     # 6 x wire + 4 x its reply reserve fit
    big = rng.bytes(limit // WIRE + 1)                       # 6 x (its size + framing) > limit by a few bytes
    payloads = [big] if shape in ("Unary", "ServerStream") else [*small, big, small[0]]
    got: list[bytes] = []
    md = (("tenant", "t1"),)
    with served as s, pytest.raises(grpc.RpcError) as err:
        stub = s.call(shape)
        reqs = [pb.EchoRequest(payload=p) for p in payloads]
        if shape == "Unary":
            stub(reqs[0], timeout=10, metadata=md)
        elif shape == "ServerStream":
            list(stub(reqs[0], timeout=10, metadata=md))
        elif shape == "BiStream":
            for r in stub(iter(reqs), timeout=10, metadata=md):
                got.append(r.payload)
        else:
            stub(iter(reqs), timeout=10, metadata=md)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    info = error_info(err.value)
    assert info is not None and info.reason == "MEMORY_BUDGET"
    assert info.metadata["needed"] == str(WIRE * _wire(big)) and info.metadata["limit"] == str(limit)
    assert err.value.details().startswith(f"{shape} request needs ")
    handled = [x[1] for x in probe.seen if x[0] == shape]
    assert handled == payloads[:payloads.index(big)]          # the handler never saw the one over the budget
    if shape == "BiStream":
        assert got == [p[::-1] for p in small]
    assert budget.refused == {f"{shape} request": 1}
    assert budget.charged_bytes == 0 and budget.tenants() == {}


def test_calls_without_a_known_token_are_neither_parsed_nor_charged() -> None:
    """The tenant `unparsed` (no known token): its handler (which refuses such calls) gets a Malformed stand-in, for
    a well-formed EchoRequest as for bytes that are none, and nothing is charged; a known tenant's bytes are charged
    and parsed (the lenient parser makes undecodable ones a Malformed too)."""
    rng = np.random.default_rng(29)
    budget = MemoryBudget(BudgetLimits(1 << 20, 1 << 20))
    probe, served = _admitted(budget)
    garbage = b"\xff\xff\xff\xff" + rng.bytes(40)            # field 0x1fffffff... of wire type 7: never parses
    assert isinstance(_parser(pb.EchoRequest)(garbage), Malformed)   # the bytes are no EchoRequest
    with served as s:
        reply = s.call("Unary", raw=True)(garbage, timeout=10, metadata=(("tenant", "anon"),))
        assert reply.payload == b"malformed"
        assert probe.seen[-1][:4] == ("Unary", "Malformed", 0, 0)
        ok = rng.bytes(100)
        assert _invoke(s, "Unary", [ok], "anon") == [b"malformed"]       # parseable or not: never read
        assert probe.seen[-1][:4] == ("Unary", "Malformed", 0, 0)
        assert s.call("Unary", raw=True)(garbage, timeout=10, metadata=(("tenant", "t2"),)).payload == b"malformed"
        assert probe.seen[-1][:4] == ("Unary", "Malformed", WIRE * len(garbage), WIRE * len(garbage))
        assert _invoke(s, "Unary", [ok], "t2") == [ok[::-1]]
    assert isinstance(admission._skip(garbage), Malformed)
    assert budget.refused == {} and budget.charged_bytes == 0 and budget.peak_bytes == WIRE * _wire(ok)


def test_calls_of_another_service_pass_uncharged() -> None:
    rng = np.random.default_rng(31)
    budget = MemoryBudget(BudgetLimits(1 << 20, 1 << 20))
    probe, served = _admitted(budget)
    p = rng.bytes(500)
    with served as s:
        assert _invoke(s, "Unary", [p], "t3", service=OTHER) == [p[::-1]]
    assert probe.seen == [("Unary", p, 0, 0, probe.seen[0][4])] and budget.peak_bytes == 0


# ---------------------------------------------------------------------------------------------- the leader gate

STANDBY_TEXT = ("this manager does not serve requests (standby: following the journal); no leader right now "
                "(failover in progress): retry (the clients retry UNAVAILABLE with the same request_id)")
LAPSED_TEXT = ("the leader's lease lapsed (NATS unreachable or the process was paused); it serves again once "
               "renewed, or a standby takes over: retry")


def _gated(gate: LeaderGate) -> tuple[Probe, Served]:
    probe = Probe(MemoryBudget(BudgetLimits(1 << 20, 1 << 20)))
    return probe, Served(probe, [gate])


def _call_with_metadata(s: Served, shape: str, payloads: list[bytes], service: str = SERVICE):
    """(reply payloads, initial metadata) of one call."""
    stub = s.call(shape, service)
    reqs = [pb.EchoRequest(payload=p) for p in payloads]
    if shape == "Unary":
        reply, call = stub.with_call(reqs[0], timeout=10)
        return [reply.payload], dict(call.initial_metadata())
    if shape == "ClientStream":
        reply, call = stub.with_call(iter(reqs), timeout=10)
        return [reply.payload], dict(call.initial_metadata())
    it = stub(reqs[0] if shape == "ServerStream" else iter(reqs), timeout=10)
    out = [r.payload for r in it]
    return out, dict(it.initial_metadata())


@pytest.mark.parametrize("shape", SHAPES)
def test_the_gate_refuses_every_shape_unless_leading_with_a_valid_lease_and_stamps_the_epoch(shape) -> None:
    """A new gate is a standby (epoch 0, no leader hint): UNAVAILABLE with the documented text, the handler never
    runs. Promoted (its lease valid by default), it serves each shape and stamps its epoch and node on the initial
    metadata; with the lease lapsed it refuses again, with the lapse's text; deposed, with the reason given."""
    rng = np.random.default_rng(41 + len(shape))
    gate = LeaderGate(service=SERVICE)
    assert (gate.leader, gate.epoch, gate.node, gate.leader_hint(), gate.valid()) == (False, 0, "", "", True)
    gate.node = "node-" + rng.bytes(3).hex()
    payloads = [rng.bytes(int(k)) for k in rng.integers(5, 60, 1 if shape in ("Unary", "ServerStream") else 3)]
    probe, served = _gated(gate)
    with served as s:
        with pytest.raises(grpc.RpcError) as err:
            _call_with_metadata(s, shape, payloads)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, STANDBY_TEXT)
        assert probe.seen == []
        epoch = int(rng.integers(2, 1 << 40))
        gate.promote(epoch)
        replies, md = _call_with_metadata(s, shape, payloads)
        assert replies == _expected_replies(shape, payloads)
        assert (md[EPOCH_METADATA], md[NODE_METADATA]) == (str(epoch), gate.node)
        assert [x[1] for x in probe.seen if x[0] == shape] == payloads
        gate.valid = lambda: False
        with pytest.raises(grpc.RpcError) as err:
            _call_with_metadata(s, shape, payloads)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, LAPSED_TEXT)
        gate.valid = lambda: True
        gate.leader_hint = lambda: "node-x at 10.1.2.3:50051 (epoch 9)"
        gate.depose("leadership lost: lease taken")
        with pytest.raises(grpc.RpcError) as err:
            _call_with_metadata(s, shape, payloads)
        assert (err.value.code(), err.value.details()) == (
            grpc.StatusCode.UNAVAILABLE,
            "this manager does not serve requests (leadership lost: lease taken); the leader is node-x at "
            "10.1.2.3:50051 (epoch 9): retry (the clients retry UNAVAILABLE with the same request_id)")
    assert len([x for x in probe.seen if x[0] == shape]) == len(payloads)


def test_the_gate_lets_other_services_through_unstamped() -> None:
    """Health checks and the like are served by a standby too, and carry no epoch."""
    gate = LeaderGate(service=SERVICE)
    probe, served = _gated(gate)
    with served as s:
        replies, md = _call_with_metadata(s, "Unary", [b"standby-ok"], service=OTHER)
    assert replies == [b"ko-ybdnats"] and EPOCH_METADATA not in md and NODE_METADATA not in md
    assert [x[1] for x in probe.seen] == [b"standby-ok"]             # its handler ran on the standby


class Recorded(MemoryBudget):
    """The real budget, keeping everyone's charged bytes after each change it accepted."""

    def __init__(self, limits: BudgetLimits) -> None:
        super().__init__(limits)
        self.history: list[int] = []

    def _move(self, c, nbytes: int) -> None:
        super()._move(c, nbytes)
        self.history.append(self.charged_bytes)


@pytest.mark.parametrize("shape", SHAPES)
def test_charges_come_and_go_in_the_documented_order(shape) -> None:
    """docs/SECURITY.md#memory-budget, step by step: request k is charged (6 x its wire size) before it is parsed, its
    reply (4 x what the handler reserves) before it is built; both go when the handler asks for the next request
    (request first, then its reply), a unary call's when its handler returns. Nothing else is charged or released."""
    rng = np.random.default_rng(53 + len(shape))
    budget = Recorded(BudgetLimits(1 << 20, 1 << 20))
    probe = Probe(budget)
    n = 1 if shape in ("Unary", "ServerStream") else 5
    payloads = [rng.bytes(int(k)) for k in rng.integers(20, 2000, n)]
    with Served(probe, [AdmissionInterceptor(budget, SERVICE, _tenant_of, unparsed="anon")]) as s:
        assert _invoke(s, shape, payloads, "t9") == _expected_replies(shape, payloads)
    want: list[int] = []
    for p in payloads:
        w = WIRE * _wire(p)
        if shape == "BiStream":
            r = REPLY * (len(p) // 2 + 1)
            want += [w, w + r, r, 0]
        else:
            want += [w, 0]
    assert budget.history == want
