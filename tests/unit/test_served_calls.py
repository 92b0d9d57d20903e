"""The manager served in-process (kvservice.server.app.serve on 127.0.0.1, port 0) with pool-scoped tokens, driven
by the real clients: sync, asyncio, leader-following and streaming, over loopback gRPC.

Fast (one server for the module, no subprocess), so the mutation run's client, contract and server selections can
reach the code between the client's call and the servicer's reply: the token check, the admission interceptor, the
journal hook and the streams. Oracles: the documented behaviour (exactly once by request_id, bearer tokens,
RETRIES_EXHAUSTED naming the call's id and address, leader following) and, for incremental tables, a twin pool
driven by unary Steps with full tables.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.aio_ha import AsyncLeaderClient
from kvservice.client.codec import ClientError
from kvservice.client.deadline import RetryPolicy
from kvservice.client.ha import LeaderClient
from kvservice.contract.auth import TokenTable
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.pagetable import PageTable
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve
from kvservice.v1 import block_manager_pb2 as pb
from tests.faultnet import dead_address

ADMIN, WA, WA2, RD = "admin-token-0123456789", "writer-a-token-0123456789", "writer-a2-token-0123456789", \
    "reader-a-token-0123456789"
TOKENS = f"""tokens:
  - {{name: adm, token: {ADMIN}, pools: ["*"], role: admin}}
  - {{name: wa, token: {WA}, pools: [a], role: write}}
  - {{name: wa2, token: {WA2}, pools: [a], role: write}}
  - {{name: rd, token: {RD}, pools: [a], role: read}}
"""
SPEC = CacheSpec.uniform(2, 2, 8, "float16", 4)
SIZING = Sizing(num_slots=64, max_seq_len=128)


@pytest.fixture(scope="module")
def server():
    running = serve("127.0.0.1:0", tokens=TokenTable.from_yaml(TOKENS))
    target = f"127.0.0.1:{running.port}"
    with BlockManagerClient(target, token=ADMIN) as c:
        for name in ("a", "b"):
            c.create_pool(name, SPEC, SIZING, prefix_caching=True)
    yield target
    running.stop()


def _lens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1, 20, n).tolist()


# ---- unary calls through the token check, the admission interceptor and the journal ---------------------------
def test_a_retried_step_is_applied_once_and_answered_with_its_original_reply(server):
    """Exactly once (client.py): a Step sent again with its request_id returns the original reply and changes
    nothing; a new id for the same admission is refused (the sequence exists)."""
    rng = np.random.default_rng(1)
    lens = _lens(rng, 3)
    ids = rng.integers(1000, 2**40, 3).tolist()
    with BlockManagerClient(server, token=WA) as c:
        first = c.step("a", admit=ids, admit_tokens=lens, request_id="once-1")
        again = c.step("a", admit=ids, admit_tokens=lens, request_id="once-1")
        assert first.seq_ids.tolist() == again.seq_ids.tolist() == ids
        for sid in first.tables:
            assert first.tables[sid].slot_mapping.tolist() == again.tables[sid].slot_mapping.tolist()
            assert len(first.tables[sid].slot_mapping) == sum(lens)
        with pytest.raises(ClientError) as err:
            c.step("a", admit=ids, admit_tokens=lens, request_id="once-2")
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        held = {s.seq_id: s.num_tokens for s in c.sequences("a").sequences if s.seq_id in ids}
        assert held == dict(zip(ids, lens, strict=True))                  # admitted once, not twice
        c.step("a", free=ids)


def test_a_token_limited_to_a_pool_reads_only_that_pool(server):
    with BlockManagerClient(server, token=RD) as c:
        assert [p.name for p in c.list_pools()] == ["a"]
        assert c.get_pool("a").name == "a"
        with pytest.raises(ClientError) as err:
            c.get_pool("b")
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and "may not use pool 'b'" in err.value.message
    with BlockManagerClient(server) as anon:
        with pytest.raises(ClientError) as err:
            anon.echo(b"x")
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_refusal_for_the_pool_of_another_tenants_worker_does_not_name_that_pool(server):
    """A Heartbeat names a worker, not a pool: refused for a worker of pool b, the message says "the pool this
    request touches", never b (another tenant's pool name is not disclosed: auth.Rule.named)."""
    with BlockManagerClient(server, token=ADMIN) as adm:
        adm.register_worker(pb.RegisterWorkerRequest(worker_id="wb-1", pool="b", layer_begin=0, layer_end=2,
                                                     backend="cpu"))
    with BlockManagerClient(server, token=WA) as c:
        with pytest.raises(ClientError) as err:
            c.heartbeat("wb-1", 1)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "may not use the pool this request touches" in err.value.message and "'b'" not in err.value.message


def test_a_role_refusal_is_logged_with_the_method(server, caplog):
    caplog.set_level(logging.WARNING, logger="kvservice.contract.auth")
    with BlockManagerClient(server, token=RD) as c:
        with pytest.raises(ClientError) as err:
            c.step("a", admit=[1], admit_tokens=[3])
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and "Step needs write" in err.value.message
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvservice.contract.auth"]
    assert "refused /kvservice.v1.BlockManager/Step for token 'rd': role read, needs write" in msgs, msgs


def test_a_worker_id_belongs_to_the_token_that_registered_it(server):
    """RegisterWorker is stamped with the caller's token (whatever registered_by the client sent): another token
    may not take over a live worker_id of the same pool (ALREADY_EXISTS, WORKER_ID_TAKEN)."""
    req = pb.RegisterWorkerRequest(worker_id="wa-7", pool="a", layer_begin=0, layer_end=2, backend="cpu")
    with BlockManagerClient(server, token=WA) as c:
        assert c.register_worker(req).epoch >= 1
        assert c.register_worker(req).epoch >= 2                     # the same token may register it again
    forged = pb.RegisterWorkerRequest()
    forged.CopyFrom(req)
    forged.registered_by = "wa"
    with BlockManagerClient(server, token=WA2) as c2:
        for attempt in (req, forged):
            with pytest.raises(ClientError) as err:
                c2.register_worker(attempt)
            assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and err.value.reason == "WORKER_ID_TAKEN"


def test_the_asyncio_client_validates_a_page_table(server):
    """AsyncBlockManagerClient.validate returns the manager's report: a table from a Step is clean; a page of
    another index space's range (the pool's last index + 1) is reported at its position."""
    async def run() -> None:
        async with AsyncBlockManagerClient(server, token=WA) as c:
            res = await c.step("a", admit=[77, 78], admit_tokens=[9, 5])
            t = res.for_layer(0).table
            assert (await c.validate("a", 0, t)).ok
            bad = t.indices.copy()
            bad[2] = 10**6
            rep = await c.validate("a", 0, PageTable(t.indptr, bad, t.last_page_len))
            assert rep.num_violations == 1 and rep.violations[0].position == 2 and rep.violations[0].value == 10**6
            await c.step("a", free=[77, 78])
    asyncio.run(run())


def test_an_asyncio_call_that_meets_no_manager_names_its_request_id_and_address():
    """client.py: a call that gives up raises RETRIES_EXHAUSTED carrying its request_id (safe to send again) and
    the address it tried."""
    dead = dead_address()

    async def run() -> ClientError:
        c = AsyncBlockManagerClient(dead, timeout=0.6, retry=RetryPolicy(initial_backoff=0.02, max_backoff=0.05))
        try:
            with pytest.raises(ClientError) as err:
                await c.create_pool("x", SPEC, SIZING, request_id="rid-async-1")
            return err.value
        finally:
            await c.close()
    e = asyncio.run(run())
    assert e.code == grpc.StatusCode.UNAVAILABLE and e.reason == "RETRIES_EXHAUSTED"
    assert e.request_id == "rid-async-1" and e.metadata["request_id"] == "rid-async-1"
    assert e.metadata["target"] == dead and f"CreatePool to {dead}" in e.message


# ---- leader-following clients --------------------------------------------------------------------------------
def test_leader_clients_send_their_token(server):
    with LeaderClient(server, token=RD) as c:
        assert c.echo(b"sync") == b"sync"

    async def run() -> bytes:
        c = AsyncLeaderClient(server, token=RD)
        try:
            return await c.echo(b"aio")
        finally:
            await c.close()
    assert asyncio.run(run()) == b"aio"


def test_the_async_leader_clients_health_watch_is_opened_again_after_each_break():
    """A broken readiness watch is opened again after a backoff that doubles up to HEALTH_RETRY's maximum (ha.py),
    for as long as the client is open: here on an address where nothing listens, so every watch breaks at once."""
    opened = []

    class Counting(AsyncLeaderClient):
        def _health_watch(self, index: int):
            opened.append(index)
            if len(opened) == 4:
                reopened.set()
            return super()._health_watch(index)

    async def run() -> None:
        c = Counting(dead_address(), token=RD)
        try:
            c._watch_health()                      # what the first call that breaks starts
            waiting = asyncio.ensure_future(reopened.wait())
            await asyncio.wait([waiting, *c._watchers], timeout=30, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            assert reopened.is_set() and not any(t.done() for t in c._watchers)     # still watching
        finally:
            await c.close()
    reopened = asyncio.Event()
    asyncio.run(run())
    assert opened[:4] == [0, 0, 0, 0]


def test_a_leader_client_moves_past_an_address_where_no_manager_answers(server):
    dead = dead_address()
    with LeaderClient([dead, server], token=RD, timeout=10) as c:
        assert c.echo(b"hop") == b"hop"
        assert c.current_target == server


def test_a_leader_clients_event_stream_starts_at_the_sequence_asked(server):
    """watch_events(pool, from_sequence): the first batch is that sequence (a stored block's), then live ones."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(1, 30_000, 12)
    with BlockManagerClient(server, token=WA) as c:
        c.step("a", admit=[501], admit_tokens=[12], admit_token_ids=prompt)
        with LeaderClient(server, token=RD) as lc:
            reset = next(iter(lc.watch_events("a", 0, timeout=10)))
            assert reset.reset
            c.step("a", admit=[502], admit_tokens=[12], admit_token_ids=prompt[::-1].copy())
            stream = lc.watch_events("a", reset.sequence + 1, timeout=10)
            first = next(iter(stream))
            stream.cancel()
        c.step("a", free=[501, 502])
    assert first.sequence == reset.sequence + 1 and not first.reset


# ---- streams -------------------------------------------------------------------------------------------------
def _space_fields(st) -> dict:
    t = st.table
    return {"slot_mapping": st.slot_mapping.tolist(), "indptr": t.indptr.tolist(), "indices": t.indices.tolist(),
            "last": t.last_page_len.tolist(), "block_table": None if st.block_table is None else
            st.block_table.tolist()}


def _same_generations(got, want, gen_map: dict[int, int]) -> None:
    """Page generations are seeded per pool incarnation (allocator.generation_seed), so twin pools' values differ;
    what must agree is which entries share a generation: one bijection maps the twin's values onto the stream's,
    for slot_generations (one per new token) and generations (one per CSR entry) alike."""
    assert got.slot_generations is not None and got.generations is not None
    assert len(got.slot_generations) == len(want.slot_generations) == len(want.slot_mapping)
    assert len(got.generations) == len(want.generations) == len(want.table.indices)
    for w, g in zip(np.concatenate([want.slot_generations, want.generations]).tolist(),
                    np.concatenate([got.slot_generations, got.generations]).tolist(), strict=True):
        assert gen_map.setdefault(w, g) == g
    assert len(set(gen_map.values())) == len(gen_map)


def test_a_stream_with_incremental_tables_gives_what_full_unary_replies_give(server):
    """The same steps on twin pools: StepStream with deltas on one, unary Step with full tables on the other. Every
    field of every index space (slot mapping, CSR, block table, page generations) is equal."""
    rng = np.random.default_rng(9)
    with BlockManagerClient(server, token=ADMIN) as c:
        for name in ("s1", "s2"):
            c.create_pool(name, SPEC, SIZING)
        live: list[int] = []
        gen_map: dict[int, int] = {}
        with c.step_stream("s1") as s:
            for i in range(8):
                kw: dict = {}
                if not live or i % 3 == 0:
                    new = [100 + i * 4 + k for k in range(int(rng.integers(1, 4)))]
                    kw = {"admit": new, "admit_tokens": _lens(rng, len(new))}
                    live += new
                elif i % 3 == 1:
                    kw = {"extend": live, "extend_tokens": 1}
                else:
                    gone = live.pop(0)
                    kw = {"free": [gone], "extend": live or None, "extend_tokens": 2 if live else None}
                got = s.step(block_table=True, **kw)
                want = c.step("s2", block_table=True, **kw)
                assert got.seq_ids.tolist() == want.seq_ids.tolist()
                assert sorted(got.tables) == sorted(want.tables)
                for sid in want.tables:
                    assert _space_fields(got.tables[sid]) == _space_fields(want.tables[sid]), (i, sid)
                    _same_generations(got.tables[sid], want.tables[sid], gen_map)
        for name in ("s1", "s2"):
            c.delete_pool(name, force=True)


def test_a_refused_stream_step_raises_the_unary_steps_error(server):
    with BlockManagerClient(server, token=WA) as c:
        with pytest.raises(ClientError) as unary:
            c.step("a", extend=[987654], extend_tokens=1)
        with c.step_stream("a") as s, pytest.raises(ClientError) as streamed:
            s.step(extend=[987654], extend_tokens=1)
    u, v = unary.value, streamed.value
    assert s.route == 0                    # the address index of its call: a one-address client has only 0
    assert (v.code, v.message, v.reason) == (u.code, u.message, u.reason) and u.code == grpc.StatusCode.NOT_FOUND
    assert "987654" in v.message


def test_an_asyncio_stream_steps_on_its_pool(server):
    async def run() -> None:
        async with AsyncBlockManagerClient(server, token=WA) as c:
            s = await c.step_stream("a")
            res = await s.step(admit=[801], admit_tokens=[6])
            assert res.seq_ids.tolist() == [801] and len(res.for_layer(0).slot_mapping) == 6
            assert s.route == 0
            res = await s.step(extend=[801], extend_tokens=1)
            assert res.for_layer(0).table.indptr.tolist() == [0, 2]          # 7 tokens, page size 4
            await s.step(free=[801], tables=False)
            await s.close()
    asyncio.run(run())


def test_an_asyncio_stream_reopens_until_its_deadline_then_keeps_the_request_pending():
    """stream.py: a broken stream is reopened (UNAVAILABLE) within the step's deadline; when none answered, the step
    raises UNAVAILABLE (RETRIES_EXHAUSTED) and the request stays pending, to be resent under its seq."""
    dead = dead_address()

    async def run():
        c = AsyncBlockManagerClient(dead, timeout=2.0, retry=RetryPolicy(initial_backoff=0.02, max_backoff=0.05))
        try:
            from kvservice.client.stream import AsyncStepStream
            s = AsyncStepStream(c, "a", 4)
            with pytest.raises(ClientError) as err:
                await s.step(admit=[1], admit_tokens=[3])
            return s, err.value
        finally:
            await c.close()
    s, e = asyncio.run(run())
    assert e.code == grpc.StatusCode.UNAVAILABLE and e.reason == "RETRIES_EXHAUSTED"
    assert s.reconnects >= 1 and s.pending is not None and s.pending.seq == 1
    assert e.metadata["stream_seq"] == "1" and "stays pending" in e.message


def test_an_undecodable_echo_stream_request_is_refused_naming_its_type(server):
    with BlockManagerClient(server, token=RD) as c:
        method = c._channel.stream_stream("/kvservice.v1.BlockManager/EchoStream", request_serializer=None,
                                          response_deserializer=pb.EchoReply.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(method(iter([b"\xff\xff\xff"]), metadata=c._metadata, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "request is not a valid kvservice.v1.EchoRequest message"


def test_a_leader_client_goes_round_the_addresses_in_order():
    """ha.py: a call that meets no manager moves the client to the next address, wrapping round; after one
    attempt each (attempts=1: no retry) the current address is the next one, then the first again."""
    dead = [dead_address() for _ in range(2)]
    with LeaderClient(dead, timeout=5, retry=RetryPolicy(attempts=1, attempt_timeout=3.0, grpc_attempts=1)) as c:
        for want in (dead[1], dead[0], dead[1]):
            with pytest.raises(ClientError) as err:
                c.echo(b"x")
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert c.current_target == want


# ---- the server's transport options and the leader gate --------------------------------------------------------
def test_the_message_limit_holds_for_replies_as_well_as_requests():
    """serve(max_message_bytes=N): gRPC's limit both ways (contract/serving.py). A request over N is refused, and
    so is a reply over N (a ListPools of many pools), while small calls go through."""
    running = serve("127.0.0.1:0", max_message_bytes=4096)
    try:
        with BlockManagerClient(f"127.0.0.1:{running.port}", retry=RetryPolicy(attempts=1)) as c:
            for i in range(40):
                c.create_pool(f"pool-{i:02d}", SPEC, SIZING)
            assert c.get_pool("pool-07").name == "pool-07"
            assert c.echo(b"x" * 1000) == b"x" * 1000
            with pytest.raises(ClientError) as big_request:
                c.echo(b"x" * 5000)
            with pytest.raises(ClientError) as big_reply:
                c.list_pools()
    finally:
        running.stop()
    assert big_request.value.code == big_reply.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_leader_gate_serves_only_while_it_leads_and_its_lease_is_valid():
    """leader_gate.py: a standby refuses UNAVAILABLE naming the leader it knows; the leader stamps its epoch and
    node on every reply (a LeaderClient records them); a leader whose lease lapsed refuses until renewed."""
    from kvservice.server.leader_gate import LeaderGate

    gate = LeaderGate()
    gate.node = "node-b"
    gate.leader_hint = lambda: "node-a at 10.0.0.1:50051 (epoch 3)"
    running = serve("127.0.0.1:0", interceptors=[gate])
    target = f"127.0.0.1:{running.port}"
    once = RetryPolicy(attempts=1, grpc_attempts=1)
    try:
        with BlockManagerClient(target, retry=once) as c:
            with pytest.raises(ClientError) as standby:
                c.echo(b"x")
            assert standby.value.code == grpc.StatusCode.UNAVAILABLE
            assert ("(last: UNAVAILABLE: this manager does not serve requests (standby: following the journal); the "
                    "leader is node-a at 10.0.0.1:50051 (epoch 3): retry (the clients retry UNAVAILABLE with the same "
                    "request_id))") in standby.value.message
            gate.promote(4)
            with LeaderClient(target, retry=once) as lc:
                assert lc.echo(b"led") == b"led" and (lc.epoch, lc.leader_node) == (4, "node-b")
            gate.valid = lambda: False
            with pytest.raises(ClientError) as lapsed:
                c.echo(b"x")
            assert lapsed.value.code == grpc.StatusCode.UNAVAILABLE and "lease lapsed" in lapsed.value.message
            gate.valid = lambda: True
            assert c.echo(b"renewed") == b"renewed"
            gate.depose("leadership lost: test")
            with pytest.raises(ClientError) as deposed:
                c.echo(b"x")
            assert "(leadership lost: test)" in deposed.value.message
    finally:
        running.stop()


def test_a_broken_health_watch_is_opened_again_after_a_doubling_pause():
    """ha.py HEALTH_RETRY = (first, most): a readiness watch that breaks (no manager at the address) is opened again
    after 0.05 s, then 0.1, 0.2, 0.4 s ... doubling up to 1 s. The pauses are read from the client's condition
    (what its watch thread waits on), not timed."""
    import threading

    pauses: list[float] = []
    enough = threading.Event()

    class Recording(threading.Condition):
        def wait_for(self, predicate, timeout=None):
            if threading.current_thread().name == "leader-watch-0":
                pauses.append(timeout)
                if len(pauses) >= 4:
                    enough.set()
            return super().wait_for(predicate, timeout)

    c = LeaderClient(dead_address(), timeout=5)
    c._serving = Recording(c._lock)
    try:
        c._watch_health()
        assert enough.wait(30)
    finally:
        c.close()
    assert pauses[:4] == [0.05, 0.1, 0.2, 0.4]


def test_a_reset_over_the_memory_budget_ends_the_watch_resource_exhausted():
    """watch.py: a reset is charged to the memory budget before it is converted; one that does not fit ends the
    stream RESOURCE_EXHAUSTED (reason MEMORY_BUDGET), as a unary reply over it would, while small Steps fit."""
    from kvservice.server.budget import REPLY_FACTOR, BudgetLimits

    limit = 24_000
    running = serve("127.0.0.1:0", budget=BudgetLimits(limit, limit))
    try:
        with BlockManagerClient(f"127.0.0.1:{running.port}", retry=RetryPolicy(attempts=1)) as c:
            c.create_pool("p", SPEC, Sizing(num_slots=512, max_seq_len=512), prefix_caching=True)
            rng = np.random.default_rng(23)
            for i in range(16):
                c.step("p", admit=[i + 1], admit_tokens=[64], admit_token_ids=rng.integers(1, 30_000, 64),
                       tables=False)
            sub = running.manager.events.subscribe("p", 0, "test")
            (reset,) = sub.poll(0)
            sub.close()
            assert reset.batch.reset and REPLY_FACTOR * reset.nbytes > limit      # the reset alone is over it
            with pytest.raises(ClientError) as err:
                next(iter(c.watch_events("p", 0, timeout=10)))
    finally:
        running.stop()
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "MEMORY_BUDGET"
    assert err.value.message.startswith("WatchEvents reply needs")


def test_an_asyncio_client_deletes_the_pool_it_names(server):
    """AsyncBlockManagerClient.delete_pool removes that pool (and only it): ListPools no longer shows it, the
    others stay."""
    name = f"tmp-{np.random.default_rng(67).integers(1, 1 << 30)}"

    async def run() -> tuple[list[str], list[str]]:
        async with AsyncBlockManagerClient(server, token=ADMIN) as c:
            await c.create_pool(name, SPEC, SIZING)
            before = sorted(p.name for p in await c.list_pools())
            await c.delete_pool(name)
            return before, sorted(p.name for p in await c.list_pools())
    before, after = asyncio.run(run())
    assert name in before and after == sorted(set(before) - {name}) and {"a", "b"} <= set(after)


def test_closing_a_step_stream_that_never_stepped_or_twice_is_quiet(server):
    """close() ends a StepStream whether or not it ever opened its call, and again after it was closed; a closed
    stream's step left the pool as a unary call sees it."""
    with BlockManagerClient(server, token=ADMIN) as c:
        s = c.step_stream("b")
        s.close()                                   # no call was ever opened
        s.close()
        with c.step_stream("b") as s2:
            assert s2.step(admit=[9101], admit_tokens=[5]).seq_ids.tolist() == [9101]
        s2.close()                                  # closed again after __exit__
        assert c.step("b", free=[9101], tables=False).seq_ids.tolist() == []


def test_a_leader_clients_interceptors_see_its_calls(server):
    """LeaderClient(interceptors=...) puts them on its calls: each unary call passes through them, by method name,
    with the request and the reply the server gave."""
    seen: list[tuple[str, bytes]] = []

    class Record(grpc.UnaryUnaryClientInterceptor):
        def intercept_unary_unary(self, continuation, details, request):
            outcome = continuation(details, request)
            seen.append((details.method, outcome.result().payload))
            return outcome

    payload = np.random.default_rng(71).bytes(24)
    with LeaderClient(server, timeout=30, token=ADMIN, interceptors=[Record()]) as c:
        c.echo(payload)
    assert seen == [("/kvservice.v1.BlockManager/Echo", payload)]



def test_score_prefix_answers_only_the_pools_the_token_may_read(server):
    """docs/SECURITY.md: a read token scoped to pool a learns nothing of pool b's cache. The same prompt cached in
    both pools: the admin token is scored on both, the reader of pool a on a alone."""
    rng = np.random.default_rng(41)
    tokens = rng.integers(1, 30000, 4 * 5).astype(np.int64)            # five full pages of page_size 4
    ids = [int(rng.integers(1 << 40, 1 << 50))]
    with BlockManagerClient(server, token=ADMIN) as c:
        for pool in ("a", "b"):
            c.step(pool, admit=ids, admit_tokens=[len(tokens)], admit_token_ids=tokens, tables=False)
        try:
            both = {s.pool: s.cached_tokens for s in c.score_prefix(tokens, timeout=10).scores}
            with BlockManagerClient(server, token=RD) as r:
                mine = {s.pool: s.cached_tokens for s in r.score_prefix(tokens, timeout=10).scores}
        finally:
            for pool in ("a", "b"):
                c.step(pool, free=ids, tables=False)
    assert {"a", "b"} <= set(both) and both["a"] == both["b"] > 0
    assert mine == {"a": both["a"]}


def test_score_prefix_is_refused_rate_limited_while_its_tenant_is_in_read_debt():
    """read_budget.py / docs/SECURITY.md#fairness: ScorePrefix is a tenant's heavy read, refused at once
    (RESOURCE_EXHAUSTED, reason RATE_LIMITED, with when to retry) while that tenant's read budget is in debt;
    another tenant's bucket is its own, and a call that runs is charged to its tenant."""
    running = serve("127.0.0.1:0", tokens=TokenTable.from_yaml(TOKENS))
    target = f"127.0.0.1:{running.port}"
    try:
        budget = running.manager.events.read_budget
        with BlockManagerClient(target, token=ADMIN) as c:
            c.create_pool("a", SPEC, SIZING, prefix_caching=True)
            tokens = np.random.default_rng(43).integers(1, 30000, 12).astype(np.int64)
            c.score_prefix(tokens, timeout=10)
            assert "adm" in budget._buckets                   # the admin's call ran as a piece of its own budget
            budget.charge("rd", 10_000.0)                     # the reader owes far more than any refill in a test
            with BlockManagerClient(target, token=RD, retries=0) as r:
                with pytest.raises(ClientError) as e:
                    r.score_prefix(tokens, timeout=10)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.reason == "RATE_LIMITED"
            assert float(e.value.metadata["retry_after_seconds"]) > 0 and budget.refused == 1
            assert [s.pool for s in c.score_prefix(tokens, timeout=10).scores] == ["a"]   # the admin is not in debt
    finally:
        running.stop()
