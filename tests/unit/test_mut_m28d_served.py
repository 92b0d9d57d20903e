"""Client calls against the manager served in-process (kvservice.server.app.serve, port 0), checked by what the
manager then holds (docs/DESIGN.md): a stream's unanswered request is resent under its own stream_seq and
applied once, DeletePool refuses a pool with live sequences unless forced, wait_ready returns once an address
connects and raises UNAVAILABLE when none does.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.codec import ClientError
from kvservice.client.ha import LeaderClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.pagetable import PageTable
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve
from tests.faultnet import dead_address

PAGE = 4
SPEC = CacheSpec.uniform(2, 2, 8, "float16", PAGE)
SIZING = Sizing(num_slots=64, max_seq_len=128)


@pytest.fixture(scope="module")
def server():
    running = serve("127.0.0.1:0")
    target = f"127.0.0.1:{running.port}"
    with BlockManagerClient(target) as c:
        for name in ("s", "as", "d"):
            c.create_pool(name, SPEC, SIZING)
    yield target
    running.stop()


def _held(c: BlockManagerClient, pool: str) -> dict[int, int]:
    """seq_id -> tokens the manager holds for the pool."""
    return {int(s.seq_id): int(s.num_tokens) for s in c.sequences(pool).sequences}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_a_stream_resends_its_unanswered_request_first_and_applies_it_once(server):
    rng = np.random.default_rng(2820)
    ids = [int(x) for x in rng.choice(np.arange(100, 9000), 3, replace=False)]
    lens = [int(x) for x in rng.integers(2, 30, 3)]
    with BlockManagerClient(server) as c, c.step_stream("s") as s:
        # request 1 (admit ids[0]) was sent and its reply never came: it is pending
        p = s.start(s.body(None, None, None, [ids[0]], [lens[0]], True, False, {}), True, False, c.position.seen())
        res = s.step(admit=[ids[0]], admit_tokens=[lens[0]])           # the caller's retry of it
        assert (s.resolved, s.seq, s.pending, s.settled) == (1, 1, None, None)
        assert res.seq_ids.tolist() == [ids[0]] and res.num_tokens.tolist() == [lens[0]]
        assert res.new_token_indptr.tolist() == [0, lens[0]]
        assert res.for_layer(0).table.indptr.tolist() == [0, _cdiv(lens[0], PAGE)]
        assert _held(c, "s") == {ids[0]: lens[0]}
        # request 2 (admit ids[1]) unanswered, then a different step: 2 is resent and settled, then 3 is sent
        p = s.start(s.body(None, None, None, [ids[1]], [lens[1]], True, False, {}), True, False, c.position.seen())
        assert p.seq == 2
        res = s.step(admit=[ids[2]], admit_tokens=[lens[2]])
        assert s.resolved == 2 and s.seq == 3 and s.pending is None
        seq, first = s.settled
        assert seq == 2 and first.seq_ids.tolist() == [ids[1]] and first.num_tokens.tolist() == [lens[1]]
        assert res.seq_ids.tolist() == [ids[2]] and res.new_token_indptr.tolist() == [0, lens[2]]
        assert _held(c, "s") == dict(zip(ids, lens, strict=True))
        assert s.resolve() is None                                     # nothing pending any more
        p = s.start(s.body(ids, None, None, None, None, False, False, {}), False, False, c.position.seen())
        assert s.resolve().seq_ids.tolist() == [] and s.pending is None and s.resolved == 3
        assert _held(c, "s") == {}


def test_an_asyncio_stream_resends_its_unanswered_request_first_and_applies_it_once(server):
    rng = np.random.default_rng(2821)
    ids = [int(x) for x in rng.choice(np.arange(100, 9000), 3, replace=False)]
    lens = [int(x) for x in rng.integers(2, 30, 3)]

    async def run() -> None:
        async with AsyncBlockManagerClient(server) as c:
            s = await c.step_stream("as")
            s.start(s.body(None, None, None, [ids[0]], [lens[0]], True, True, {}), True, True, c.position.seen())
            res = await s.step(admit=[ids[0]], admit_tokens=[lens[0]], block_table=True)
            assert (s.resolved, s.seq, s.pending, s.settled) == (1, 1, None, None)
            assert res.seq_ids.tolist() == [ids[0]] and res.num_tokens.tolist() == [lens[0]]
            bt = res.for_layer(0).block_table
            assert bt.shape == (1, _cdiv(lens[0], PAGE))
            np.testing.assert_array_equal(bt[0], res.for_layer(0).table.indices)
            # pending with a block table; the retry without one is a different request: settled first
            s.start(s.body(None, None, None, [ids[1]], [lens[1]], True, True, {}), True, True, c.position.seen())
            with pytest.raises(ClientError) as e:                 # request 3 admits ids[1] again: refused
                await s.step(admit=[ids[1]], admit_tokens=[lens[1]])
            assert e.value.code == grpc.StatusCode.ALREADY_EXISTS and str(ids[1]) in e.value.message
            assert s.resolved == 2 and s.seq == 3 and s.pending is None
            seq, first = s.settled                                # request 2 was applied, once
            assert seq == 2 and first.seq_ids.tolist() == [ids[1]] and first.num_tokens.tolist() == [lens[1]]
            assert first.for_layer(0).block_table.shape == (1, _cdiv(lens[1], PAGE))
            res = await s.step(admit=[ids[2]], admit_tokens=[lens[2]])
            assert s.seq == 4 and res.seq_ids.tolist() == [ids[2]] and res.for_layer(0).block_table is None
            await s.step(free=[ids[2]], tables=False)
            await s.step(free=ids[:2], tables=False)
            await s.close()
            async with await c.step_stream("as", deltas=False) as r:
                assert await r.resolve() is None
                r.start(r.body(None, None, None, [ids[0]], [lens[0]], True, False, {}), True, False,
                        c.position.seen())
                got = await r.resolve()
                assert got.seq_ids.tolist() == [ids[0]] and r.resolved == 1 and r.pending is None
                assert got.for_layer(0).table.indptr.tolist() == [0, _cdiv(lens[0], PAGE)]
                await r.step(free=[ids[0]], tables=False)
            assert r._call is None
    asyncio.run(run())
    with BlockManagerClient(server) as c:
        assert _held(c, "as") == {}


def test_delete_pool_refuses_a_pool_with_live_sequences_unless_forced(server):
    with BlockManagerClient(server) as c:
        c.step("d", admit=[5, 6], admit_tokens=[3, 9])
        with pytest.raises(ClientError) as e:
            c.delete_pool("d")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "2 sequences" in e.value.message
        assert "d" in [p.name for p in c.list_pools()] and _held(c, "d") == {5: 3, 6: 9}
        c.delete_pool("d", force=True)
        assert "d" not in [p.name for p in c.list_pools()]
        c.create_pool("d", SPEC, SIZING)
        c.delete_pool("d")                                  # empty: no force needed
        assert "d" not in [p.name for p in c.list_pools()]


def test_a_leader_clients_wait_ready_returns_once_an_address_connects_and_raises_when_none_does(server):
    dead = dead_address()
    c = LeaderClient([dead, server], timeout=5.0)
    try:
        c.wait_ready(30.0)
    finally:
        c.close()
    c = LeaderClient([dead], timeout=5.0)
    try:
        with pytest.raises(ClientError) as e:
            c.wait_ready(0.3)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert e.value.message == f"no manager answered at {c.target} within 0 s"
    finally:
        c.close()


def test_echo_stream_returns_each_payload_and_a_stream_names_itself(server):
    rng = np.random.default_rng(2822)
    with BlockManagerClient(server) as c:
        with c.echo_stream() as e:
            for n in (0, 1, 17, 4096):
                payload = rng.bytes(n)
                assert e.echo(payload) == payload
        with c.step_stream("s", deltas=False, stream_id="s-named-2822") as s:
            res = s.step(admit=[4242], admit_tokens=[6])
            assert s.stream_id == "s-named-2822" and s.last_reply.stream_id == "s-named-2822"
            assert s.last_reply.stream_seq == 1 and not s.last_reply.HasField("delta")
            assert res.for_layer(0).table.indptr.tolist() == [0, 2]
            assert s.step(extend=[4242], extend_tokens=3).num_tokens.tolist() == [9]
            assert s.step(extend=[4242], extend_tokens=3).num_tokens.tolist() == [12] and s.reused == 1
            s.step(free=[4242], tables=False)
            assert s.seq == 4 and s.reconnects == 0 and s.resolved == 0


def test_a_sync_stream_without_a_manager_keeps_its_request_pending():
    from kvservice.client.deadline import RetryPolicy
    from kvservice.client.stream import StepStream

    dead = dead_address()
    with BlockManagerClient(dead, timeout=1.0, retry=RetryPolicy(initial_backoff=0.02, max_backoff=0.05)) as c:
        s = StepStream(c, "s", page_size=PAGE)
        with pytest.raises(ClientError) as err:
            s.step(admit=[1], admit_tokens=[3])
        s.close()
    e = err.value
    assert e.code == grpc.StatusCode.UNAVAILABLE and e.reason == "RETRIES_EXHAUSTED"
    assert s.reconnects >= 1 and s.pending is not None and s.pending.seq == 1 and s.seq == 1
    assert e.metadata["stream_seq"] == "1" and e.metadata["stream_id"] == s.stream_id
    assert "stays pending" in e.message
    with BlockManagerClient(dead, timeout=5.0, retries=0) as c:
        s = StepStream(c, "s", page_size=PAGE)
        with pytest.raises(ClientError) as err:
            s.step(admit=[1], admit_tokens=[3])
        s.close()
    assert err.value.reason == "RETRIES_EXHAUSTED" and s.reconnects == 0 and err.value.metadata["attempts"] == "1"


def test_the_unary_calls_answer_what_the_pool_holds(server):
    """Each read of BlockManagerClient against hand-computed figures of a pool of 2 layers, 2 KV heads of 8,
    float16, pages of 4 tokens, 64 slots: a slot is 2 (K, V) * 4 * 2 * 8 * 2 bytes per layer."""
    rng = np.random.default_rng(2823)
    with BlockManagerClient(server, timeout=20.0) as c:
        c.wait_ready(30.0)
        plan = c.plan(SPEC, SIZING)
        assert (plan.page_size, plan.num_slots, plan.max_seq_len, plan.max_pages_per_seq) == (4, 64, 128, 32)
        assert plan.bytes_per_slot == 2 * (2 * 4 * 2 * 8 * 2) and plan.total_bytes == 64 * plan.bytes_per_slot
        info = c.create_pool("u", SPEC, SIZING, prefix_caching=True, model="m-u")
        assert (info.name, info.model, info.plan.page_size) == ("u", "m-u", 4) and info.incarnation >= 1
        assert c.get_pool("u").incarnation == info.incarnation and "u" in [p.name for p in c.list_pools()]
        prompt = [int(x) for x in rng.integers(1, 50000, 13)]
        res = c.step("u", admit=[71, 72], admit_tokens=[13, 5], admit_token_ids=prompt + prompt[:5])
        assert res.cached_tokens.tolist() == [0, 0] and res.num_tokens.tolist() == [13, 5]
        seqs = c.sequences("u")
        assert seqs.total == 2 and {(s.seq_id, s.num_tokens, s.num_slots) for s in seqs.sequences} == \
            {(71, 13, 4), (72, 5, 2)}
        assert len(c.sequences("u", limit=1).sequences) == 1
        st = c.stats("u")["u"]
        assert (st.num_sequences, st.num_tokens, st.num_free_slots, st.admitted) == (2, 18, 58, 2)
        assert set(c.stats()) >= {"s", "u"}
        t = res.for_layer(0).table
        assert c.validate("u", 0, t).ok
        bad = c.validate("u", 1, PageTable(t.indptr, t.indices + 10**6, t.last_page_len), max_reports=2)
        assert not bad.ok and bad.num_violations == len(t.indices) and len(bad.violations) == 2
        assert {v.reason for v in bad.violations} == {"out_of_bounds"}
        c.step("u", free=[71, 72])
        score = c.score_prefix([*prompt, 7], pools=("u",))
        assert score.num_tokens == 14
        (ps,) = score.scores
        assert (ps.pool, ps.cached_tokens, ps.cached_pages, ps.page_size) == ("u", 12, 3, 4)
        assert c.echo(b"\x00\x01u") == b"\x00\x01u"
        c.delete_pool("u")
    dead = dead_address()
    with BlockManagerClient(dead) as c, pytest.raises(ClientError) as e:
        c.wait_ready(0.2)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.message.startswith(f"no manager answered at {dead}")


def test_positions_counted_in_a_registry_are_forgotten_on_reset_and_events_start_with_a_reset(server):
    from prometheus_client import CollectorRegistry

    from kvservice.client.position import StateRolledBack
    from kvservice.v1 import block_manager_pb2 as pb

    reg = CollectorRegistry()
    with BlockManagerClient(server, registry=reg) as c:
        c.step("s", admit=[555], admit_tokens=[3])
        seen = dict(c.position.seen())
        assert len(seen) == 1 and next(iter(seen.values())) >= 1
        (lineage, top), = seen.items()
        behind = pb.StepReply(position=pb.JournalPosition(incarnation=1, seq=top - 1, lineage=lineage))
        with pytest.raises(StateRolledBack):
            c.position.check("Step", behind, c.position.seen(), None)
        assert reg.get_sample_value("kvservice_client_state_rollbacks_total") == 1.0
        c.reset_position()
        assert dict(c.position.seen()) == {} and c.position.seq == 0
        c.step("s", free=[555])                                 # accepted again after the reset
        assert dict(c.position.seen())[lineage] > top
        events = c.watch_events("s")
        first = next(iter(events))
        assert first.reset and first.reset_reason.startswith("from_sequence 0")
        assert first.events[0].HasField("all_blocks_cleared")
        events.cancel()
        with pytest.raises(ClientError) as e:
            for _ in events:
                pass
        assert e.value.code == grpc.StatusCode.CANCELLED


def test_every_mutating_call_carries_a_request_id_fresh_or_given():
    """client.py: a mutating call gets one request_id (uuid4 hex unless given), named by the error of a call that
    gave up."""
    from kvservice.client.deadline import RetryPolicy

    dead = dead_address()
    with BlockManagerClient(dead, timeout=2.0, retry=RetryPolicy(attempts=1)) as c:
        calls = {"step": lambda rid: c.step("s", admit=[1], admit_tokens=[2], request_id=rid),
                 "delete_pool": lambda rid: c.delete_pool("s", request_id=rid),
                 "create_pool": lambda rid: c.create_pool("s", SPEC, SIZING, request_id=rid)}
        for name, call in calls.items():
            for given in (None, f"rid-{name}"):
                with pytest.raises(ClientError) as e:
                    call(given)
                rid = e.value.request_id
                assert e.value.reason == "RETRIES_EXHAUSTED", name
                if given:
                    assert rid == given
                else:
                    assert len(rid) == 32 and int(rid, 16) >= 0
                assert f"request_id={rid!r}" in e.value.message and e.value.metadata["request_id"] == rid
        with pytest.raises(ClientError) as e:
            c.get_pool("s")
        assert e.value.request_id is None and "request_id" not in e.value.metadata     # a read has none


class StreamFault(grpc.ServerInterceptor):
    """Faults of a manager's StepStream calls, as a server interceptor on the real manager: `hold` set = the
    manager is paused (each request waits until `release` is set); `end_next` = the next call ends without a
    reply (a manager that stops serving)."""

    def __init__(self) -> None:
        import threading
        self.hold, self.release, self.end_next = False, threading.Event(), 0

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.stream_stream is None or not details.method.endswith("/StepStream"):
            return handler
        inner = handler.stream_stream

        def stream(request_iterator, context):
            if self.end_next:
                self.end_next -= 1
                return
            def requests():
                for r in request_iterator:
                    if self.hold:
                        self.release.wait(30.0)
                    yield r
            yield from inner(requests(), context)
        return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)


def test_a_paused_manager_cuts_the_step_at_its_deadline_and_an_ended_call_is_reopened():
    from kvservice.client.deadline import RetryPolicy

    fault = StreamFault()
    running = serve("127.0.0.1:0", interceptors=[fault])
    target = f"127.0.0.1:{running.port}"
    try:
        with BlockManagerClient(target, timeout=10.0, retry=RetryPolicy(initial_backoff=0.01, max_backoff=0.02)) as c:
            c.create_pool("f", SPEC, SIZING)
            with c.step_stream("f", timeout=0.6) as s:
                assert s.step(admit=[61], admit_tokens=[5]).seq_ids.tolist() == [61]
                fault.end_next = 1                    # the next call the stream opens ends at once
                s._drop_call()                        # (the open call is dropped: a new one is opened)
                res = s.step(extend=[61], extend_tokens=2)
                assert res.num_tokens.tolist() == [7] and s.reconnects == 1 and s.seq == 2
                fault.hold = True                     # paused: no reply before the step's deadline
                with pytest.raises(ClientError) as e:
                    s.step(extend=[61], extend_tokens=1)
                assert e.value.reason == "RETRIES_EXHAUSTED" and e.value.metadata["stream_seq"] == "3"
                assert e.value.metadata["last_code"] == "DEADLINE_EXCEEDED"
                assert "no reply in time (the call was cancelled)" in e.value.message
                assert s.pending is not None and s.pending.seq == 3
                fault.hold = False
                fault.release.set()                   # the manager goes on; the step is retried by the caller
                res = s.step(extend=[61], extend_tokens=1)
                assert res.num_tokens.tolist() == [8] and s.pending is None and s.resolved == 1
            assert _held(c, "f") == {61: 8}            # applied once
    finally:
        fault.release.set()
        running.stop()


def test_a_leader_clients_event_stream_moves_past_a_dead_address_and_raises_a_refusal(server):
    from kvservice.client.deadline import RetryPolicy

    dead = dead_address()
    with LeaderClient([dead, server], timeout=10.0, retry=RetryPolicy(initial_backoff=0.01, max_backoff=0.02,
                                                                      attempt_timeout=3.0, grpc_attempts=1)) as c:
        events = c.watch_events("s", from_sequence=0)
        it = iter(events)
        first = next(it)
        assert first.reset and events.reconnects == 1 and c.current_target == server
        assert events.next_sequence == first.sequence + 1
        events.cancel()
        assert list(it) == []                                # a cancelled stream ends quietly
        with pytest.raises(ClientError) as e:
            next(iter(c.watch_events("no-such-pool")))
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-pool" in e.value.message
