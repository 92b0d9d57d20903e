"""Every call of the asyncio clients (kvservice/client/aio.py, aio_ha.py) against a manager served in-process, with
hand-computed figures: a pool of 2 layers, 2 KV heads of 8, float16, pages of 4 tokens, 64 slots (a slot is
2 (K, V) x 4 x 2 x 8 x 2 bytes per layer). Random non-zero sequence ids and lengths; the twin sync client's view
of the same manager as the second oracle where the figure is the manager's state."""

from __future__ import annotations

import asyncio
import socket

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.aio_ha import AsyncLeaderClient
from kvservice.client.codec import ClientError
from kvservice.client.deadline import RetryPolicy
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.pagetable import PageTable
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve

PAGE = 4
SPEC = CacheSpec.uniform(2, 2, 8, "float16", PAGE)
SIZING = Sizing(num_slots=64, max_seq_len=128)
SLOT = 2 * (2 * 4 * 2 * 8 * 2)


@pytest.fixture(scope="module")
def server():
    running = serve("127.0.0.1:0")
    with BlockManagerClient(f"127.0.0.1:{running.port}") as c:
        c.create_pool("other", SPEC, SIZING)                      # a pool the calls on one pool must not show
    yield f"127.0.0.1:{running.port}"
    running.stop()


def _dead_address() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


async def _exercise(c: AsyncBlockManagerClient, pool: str, rng: np.random.Generator) -> None:
    plan = await c.plan(SPEC, SIZING)
    assert (plan.page_size, plan.num_slots, plan.max_seq_len, plan.max_pages_per_seq) == (4, 64, 128, 32)
    assert plan.bytes_per_slot == SLOT and plan.total_bytes == 64 * SLOT
    info = await c.create_pool(pool, SPEC, SIZING, request_id=f"create-{pool}", model=f"m-{pool}")
    again = await c.create_pool(pool, SPEC, SIZING, request_id=f"create-{pool}", model=f"m-{pool}")
    assert (info.name, info.model, info.plan.page_size, info.plan.num_slots) == (pool, f"m-{pool}", 4, 64)
    assert again.incarnation == info.incarnation                     # the retry's original reply
    assert (await c.get_pool(pool)).incarnation == info.incarnation
    assert pool in [p.name for p in await c.list_pools()]
    ids = [int(x) for x in rng.integers(1, 2**40, 3)]
    assert len(set(ids)) == 3
    lens = [int(x) for x in rng.integers(1, 30, 3)]
    res = await c.step(pool, admit=ids, admit_tokens=lens)
    assert res.seq_ids.tolist() == ids and res.num_tokens.tolist() == lens
    t = res.for_layer(0).table
    assert t.indptr.tolist() == np.cumsum([0] + [_cdiv(n, PAGE) for n in lens]).tolist()
    assert t.last_page_len.tolist() == [(n - 1) % PAGE + 1 for n in lens]
    assert len(res.for_layer(1).slot_mapping) == sum(lens)
    seqs = await c.sequences(pool)
    assert seqs.total == 3 and {(s.seq_id, s.num_tokens, s.num_slots) for s in seqs.sequences} == \
        {(s, n, _cdiv(n, PAGE)) for s, n in zip(ids, lens, strict=True)}
    assert len((await c.sequences(pool, limit=2)).sequences) == 2
    by_pool = await c.stats(pool)
    assert list(by_pool) == [pool]                                   # that pool's only
    st = by_pool[pool]
    used = sum(_cdiv(n, PAGE) for n in lens)
    assert (st.num_sequences, st.num_tokens, st.num_free_slots) == (3, sum(lens), 64 - used)
    assert set(await c.stats()) >= {pool, "other"}
    grown = await c.step(pool, extend=ids[:1], extend_tokens=[PAGE])
    assert grown.num_tokens.tolist() == [lens[0] + PAGE]
    t = grown.for_layer(0).table
    assert (await c.validate(pool, 0, t)).ok
    bad = await c.validate(pool, 1, PageTable(t.indptr, t.indices + 10**6, t.last_page_len), max_reports=2)
    assert not bad.ok and bad.num_violations == len(t.indices) and len(bad.violations) == 2
    payload = rng.bytes(17)
    assert await c.echo(payload) == payload
    with pytest.raises(ClientError) as err:                          # live sequences: refused unless forced
        await c.delete_pool(pool)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    await c.delete_pool(pool, force=True)
    assert pool not in [p.name for p in await c.list_pools()]
    with pytest.raises(ClientError) as err:
        await c.get_pool(pool)
    assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_the_asyncio_client_answers_every_call_with_what_the_pool_holds(server):
    async def run() -> None:
        async with AsyncBlockManagerClient(server, timeout=20.0, token="tok-1") as c:
            assert repr(c) == f"AsyncBlockManagerClient({server!r}, token=set)"
            await _exercise(c, "aio-a", np.random.default_rng(291))
            assert c.position.seq > 0
            c.reset_position()
            assert (c.position.lineage, c.position.seq) == (0, 0)
        assert repr(AsyncBlockManagerClient(server)) == f"AsyncBlockManagerClient({server!r}, token=none)"
    asyncio.run(run())


def test_the_async_leader_client_answers_every_call_past_a_dead_address(server):
    dead = _dead_address()

    async def run() -> None:
        c = AsyncLeaderClient([dead, server], timeout=20.0, retry=RetryPolicy(initial_backoff=0.01, max_backoff=0.05))
        try:
            assert repr(c) == f"AsyncLeaderClient({dead + ',' + server!r}, token=none)"
            await _exercise(c, "aio-b", np.random.default_rng(292))
        finally:
            await c.close()
    asyncio.run(run())
    with BlockManagerClient(server) as sync:                      # the sync twin sees the same manager
        assert "aio-b" not in [p.name for p in sync.list_pools()]


def test_an_asyncio_step_stream_learns_the_page_size_and_steps(server):
    async def run() -> None:
        async with AsyncBlockManagerClient(server, timeout=20.0) as c:
            await c.create_pool("aio-s", SPEC, SIZING)
            s = await c.step_stream("aio-s")
            try:
                res = await s.step(admit=[17, 23], admit_tokens=[9, 4])
                assert res.seq_ids.tolist() == [17, 23] and res.num_tokens.tolist() == [9, 4]
                t = res.for_layer(0).table                          # pages of 4 tokens: 3 and 1, the last of 1 and 4
                assert (t.indptr.tolist(), t.last_page_len.tolist()) == ([0, 3, 4], [1, 4])
                assert len(res.for_layer(1).slot_mapping) == 13
            finally:
                await s.close()
            assert {(q.seq_id, q.num_slots) for q in (await c.sequences("aio-s")).sequences} == {(17, 3), (23, 1)}
            await c.delete_pool("aio-s", force=True)
    asyncio.run(run())
