"""kvservice.server through a real in-process gRPC server on 127.0.0.1 (port 0): what only the wire shows.

The memory budget's admission of requests (docs/SECURITY.md), durable and idempotent mutations through the
journal (docs/DURABILITY.md), the server-set RegisterWorker.registered_by (block_manager.proto), the
leader gate's refusals and epoch metadata (docs/HA.md) and a WatchEvents refused mid-stream by the budget.
Expected values are the requests sent and the documented rules.
"""

from __future__ import annotations

import uuid

import grpc
import numpy as np
import pytest

from kvservice.client.codec import create_pool_request, step_request
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.status import error_info
from kvservice.contract.transport import EPOCH_METADATA, NODE_METADATA
from kvservice.server.app import serve
from kvservice.server.budget import WIRE_FACTOR, BudgetLimits
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

MIB = 1 << 20
SPEC = CacheSpec.uniform(2, 2, 8, "float16", 4)


class Served:
    """serve(**kw) on 127.0.0.1:0 and a BlockManager stub on it; stop() ends both."""

    def __init__(self, **kw: object) -> None:
        self.running = serve("127.0.0.1:0", **kw)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.running.port}")
        self.stub = pb_grpc.BlockManagerStub(self.channel)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.channel.close()
        self.running.stop(0)


def _refused(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, timeout=10, **kw)
    return err.value


def test_requests_are_charged_to_the_memory_budget_before_they_are_parsed() -> None:
    """docs/SECURITY.md: a request whose WIRE_FACTOR x bytes do not fit is refused RESOURCE_EXHAUSTED, reason
    MEMORY_BUDGET, before its handler; one that fits is served and its charge given back when it ends."""
    rng = np.random.default_rng(5)
    limit = 256 * 1024
    with Served(budget=BudgetLimits(limit, limit)) as s:
        fits = rng.bytes(limit // WIRE_FACTOR - 64)
        assert s.stub.Echo(pb.EchoRequest(payload=fits), timeout=10).payload == fits
        too_big = rng.bytes(limit // WIRE_FACTOR + 64)
        err = _refused(s.stub.Echo, pb.EchoRequest(payload=too_big))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error_info(err).reason == "MEMORY_BUDGET"
        assert "Echo request needs" in err.details()
        assert s.running.budget.refused == {"Echo request": 1} and s.running.budget.charged_bytes == 0


def _admit(stub, pool: str, rng: np.random.Generator, request_id: str = "") -> tuple[dict[int, int], pb.StepReply]:
    ids = sorted(int(i) for i in rng.choice(np.arange(1, 5000), 4, replace=False))
    tokens = [int(t) for t in rng.integers(1, 40, len(ids))]
    reply = stub.Step(step_request(pool, admit=ids, admit_tokens=tokens, request_id=request_id), timeout=10)
    return dict(zip(ids, tokens, strict=True)), reply


def _live(manager, pool: str) -> dict[int, int]:
    ids, ntok = manager.pool_and_lock(pool)[0].sequences()
    return dict(zip(ids.tolist(), ntok.tolist(), strict=True))


def test_mutations_through_a_durable_journal_survive_a_restart_and_retries_apply_once(tmp_path) -> None:
    """docs/DURABILITY.md: a mutating RPC is durable before its reply; a retried request_id gets the stored
    reply and is not applied twice."""
    from kvservice.state.journal import Journal

    rng = np.random.default_rng(11)
    with Served(journal=Journal.open(tmp_path / "state")) as s:
        s.stub.CreatePool(create_pool_request("p", SPEC, Sizing(num_slots=64, max_seq_len=64)), timeout=10)
        want, reply = _admit(s.stub, "p", rng, request_id="step-1")
        retry = s.stub.Step(step_request("p", admit=list(want), admit_tokens=list(want.values()),
                                         request_id="step-1"), timeout=10)
        assert retry == reply                            # the stored reply, not ALREADY_EXISTS
        assert _live(s.running.manager, "p") == want
    again = Journal.open(tmp_path / "state", readonly=True)
    try:
        assert again.manager.pool_names() == ["p"] and _live(again.manager, "p") == want
    finally:
        again.close(snapshot=False)


def test_registered_by_is_set_by_the_server_whatever_the_client_sent() -> None:
    """block_manager.proto: registered_by is the caller's token name (empty without tokens); a client's value is
    replaced. So a worker re-registering without it is the same owner, not another token's worker."""
    with Served() as s:
        s.stub.CreatePool(create_pool_request("p", SPEC, Sizing(num_slots=64, max_seq_len=64)), timeout=10)
        forged = "mallory-" + uuid.uuid4().hex[:6]
        first = s.stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id="w1", pool="p", backend="cpu",
                                                               registered_by=forged), timeout=10)
        (rec,) = s.running.manager.workers.workers("p")
        assert rec.owner == ""
        second = s.stub.RegisterWorker(pb.RegisterWorkerRequest(worker_id="w1", pool="p", backend="cpu"), timeout=10)
        assert (first.epoch, second.epoch) == (1, 2)


def test_the_leader_gate_serves_only_a_leader_with_a_valid_lease_and_stamps_its_epoch() -> None:
    """docs/HA.md: a standby refuses UNAVAILABLE naming the leader; a leader whose lease lapsed refuses until it
    renews; the leader's replies carry its epoch and node id in the initial metadata."""
    from kvservice.server.leader_gate import LeaderGate

    gate = LeaderGate()
    gate.node = "node-" + uuid.uuid4().hex[:6]
    with Served(interceptors=[gate]) as s:
        err = _refused(s.stub.Echo, pb.EchoRequest(payload=b"x"))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "does not serve requests (standby" in err.details()
        gate.promote(7)
        reply, call = s.stub.Echo.with_call(pb.EchoRequest(payload=b"hello"), timeout=10)
        assert reply.payload == b"hello"
        assert dict(call.initial_metadata())[EPOCH_METADATA] == "7"
        assert dict(call.initial_metadata())[NODE_METADATA] == gate.node
        gate.valid = lambda: False                      # the lease lapsed (NATS unreachable, process paused)
        err = _refused(s.stub.Echo, pb.EchoRequest(payload=b"x"))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "lease lapsed" in err.details()
        gate.valid = lambda: True
        assert s.stub.Echo(pb.EchoRequest(payload=b"back"), timeout=10).payload == b"back"


def test_a_watch_whose_reset_does_not_fit_the_memory_budget_ends_resource_exhausted() -> None:
    """kvservice/server/watch.py: a reset is charged to the memory budget before it is converted; past it the
    stream ends RESOURCE_EXHAUSTED, reason MEMORY_BUDGET (not an internal error)."""
    rng = np.random.default_rng(17)
    with Served(budget=BudgetLimits(64 * MIB, 64 * MIB)) as s:
        s.stub.CreatePool(create_pool_request("p", SPEC, Sizing(num_slots=512, max_seq_len=1024),
                                              prefix_caching=True), timeout=10)
        prompts = rng.integers(1, 30000, (8, 120))
        s.stub.Step(step_request("p", admit=list(range(1, 9)), admit_tokens=[120] * 8,
                                 admit_token_ids=prompts.ravel()), timeout=10)
        b = s.running.budget
        held = b.charge("", b.limits.total_bytes - 4096, "other calls")    # others hold all but 4 KiB
        try:
            replies = s.stub.WatchEvents(pb.WatchEventsRequest(pool="p", from_sequence=0), timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                next(iter(replies))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_info(err.value).reason == "MEMORY_BUDGET"
        finally:
            held.release()
        replies = s.stub.WatchEvents(pb.WatchEventsRequest(pool="p", from_sequence=0), timeout=10)
        first = next(iter(replies))                   # with room again the same reset is sent
        replies.cancel()
        assert first.reset


def test_a_live_watcher_that_fell_behind_while_it_waited_is_charged_the_cpu_of_its_reset() -> None:
    """watch.py: a stream that was live when it asked (not heavy) but whose ring overflowed before it read gets a
    reset, and that reset's CPU time (this thread's, from just before the read) is charged to its tenant's read
    budget. The hub is the server's own, with its subscription's reads hooked at two points of the stream's thread:
    before the live check the thread burns BURN CPU seconds (so what it used before the read is known to be large),
    and just before the read more batches than the ring keeps are committed (real Steps), so that read is a reset.
    The budget's clock stands still, so its balance is the burst less exactly what was charged."""
    import time

    from kvservice.manager.event_log import EventHub, Subscription
    from kvservice.manager.read_budget import ReadBudget

    BURN, BURST, RING = 0.3, 0.5, 4
    rng = np.random.default_rng(43)
    with Served() as s:
        hub = s.running.manager.events
        hub.ring_batches = RING
        s.stub.CreatePool(create_pool_request("p", SPEC, Sizing(num_slots=512, max_seq_len=64),
                                              prefix_caching=True), timeout=10)
        s.stub.Step(step_request("p", admit=[1], admit_tokens=[8], admit_token_ids=rng.integers(1, 30000, 8)),
                    timeout=10)                                 # the pool's first batch: its ring exists
        api = s.running.servicer.api
        hooked = {"heavy": False, "poll": False}

        class Hooked(Subscription):
            def heavy(self, live_from: int) -> bool:
                if not hooked["heavy"]:
                    hooked["heavy"] = True
                    t0 = time.thread_time()
                    while time.thread_time() - t0 < BURN:       # CPU of this thread, not wall-clock time
                        pass
                return super().heavy(live_from)

            def poll(self, timeout: float, max_batches: int | None = None):
                if not hooked["poll"]:
                    hooked["poll"] = True
                    for i in range(2 * RING):                  # each Step stores a full page: one batch each
                        with hub.transaction():
                            api.Step(step_request("p", admit=[100 + i], admit_tokens=[4],
                                                  admit_token_ids=rng.integers(1, 30000, 4)))
                return super().poll(timeout, max_batches)

        class HookedHub(EventHub):
            def subscribe(self, *args, **kw) -> Subscription:
                sub = super().subscribe(*args, **kw)
                sub.__class__ = Hooked
                return sub

        hub.__class__ = HookedHub
        hub.read_budget = ReadBudget(share=0.01, burst=BURST, clock=lambda: 1000.0)
        live = hub.logs["p"].committed + 1
        replies = s.stub.WatchEvents(pb.WatchEventsRequest(pool="p", from_sequence=live), timeout=30)
        first = next(iter(replies))
        replies.cancel()
        assert hooked == {"heavy": True, "poll": True} and first.reset
        assert hub.logs["p"].oldest > live                   # the batch it asked for had left the ring
        balance = hub.read_budget._buckets[""][0]
    assert 0 < BURST - balance < BURST                          # charged: its reset's CPU, not what came before


def test_a_step_is_decoded_once_for_the_limits_and_the_pool(monkeypatch) -> None:
    """servicer.py: a Step's request is decoded once and that decoding is what the Limits and the pool read (the
    module docs of stream.py say the same of a stream's requests). decode_step is counted where each module calls it
    (the real function runs); the caps are on, so the Limits did read the Step: an over-cap one is refused."""
    from kvservice.manager import api as api_module
    from kvservice.manager.step_input import decode_step
    from kvservice.server import limits as limits_module
    from kvservice.server import servicer as servicer_module
    from kvservice.server.limits import Limits

    calls = []

    def counted(request, *a, **kw):
        calls.append(request.pool)
        return decode_step(request, *a, **kw)

    for module in (api_module, limits_module, servicer_module):
        monkeypatch.setattr(module, "decode_step", counted)
    rng = np.random.default_rng(47)
    lens = rng.integers(1, 40, 3).tolist()
    with Served(limits=Limits(max_step_tokens=100)) as s:
        s.stub.CreatePool(create_pool_request("q", SPEC, Sizing(num_slots=128, max_seq_len=64)), timeout=10)
        reply = s.stub.Step(step_request("q", admit=[5, 6, 7], admit_tokens=lens), timeout=10)
        assert calls == ["q"]
        assert np.frombuffer(reply.num_tokens.data, np.int64).tolist() == lens
        err = _refused(s.stub.Step, step_request("q", admit=[8], admit_tokens=[101]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and error_info(err).reason == "LIMIT_EXCEEDED"
    assert calls == ["q", "q"]
