"""AsyncLeaderClient (kvservice/client/aio_ha.py) against small managers of its own built with the real server
builder (kvservice/contract/serving.py): each stamps its replies with a leader epoch and node id
(kvservice-leader-epoch / kvservice-leader-node, transport.py) and can refuse UNAVAILABLE on demand. Oracles: the
rules of the aio_ha module doc (a reply below the highest epoch seen is refused and the call moves on; the epoch
and node of the last accepted reply are the client's), one readiness watch per address however often a broken call
asks for it, the backoff between attempts when no address reports SERVING, and the streams' deltas argument."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvservice.client.aio_ha import AsyncLeaderClient
from kvservice.client.codec import ClientError
from kvservice.client.deadline import RetryPolicy
from kvservice.contract.serving import grpc_server
from kvservice.contract.transport import EPOCH_METADATA, NODE_METADATA
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc


class Stamped(pb_grpc.BlockManagerServicer):
    def __init__(self, epoch: int, node: str) -> None:
        self.epoch, self.node, self.down, self.calls = epoch, node, False, 0

    def Echo(self, request, context):
        self.calls += 1
        if self.down:
            context.abort(grpc.StatusCode.UNAVAILABLE, "standing by")
        context.send_initial_metadata(((EPOCH_METADATA, str(self.epoch)), (NODE_METADATA, self.node)))
        return pb.EchoReply(payload=request.payload + self.node.encode())


@pytest.fixture(scope="module")
def managers():
    out = []
    for epoch, node in ((7, "n-a"), (3, "n-b")):
        servicer = Stamped(epoch, node)
        server, port, _ = grpc_server("kvservice.v1.BlockManager", servicer, "127.0.0.1:0")
        server.start()
        out.append((f"127.0.0.1:{port}", servicer, server))
    yield out
    for _, _, server in out:
        server.stop(None)


def test_a_reply_below_the_highest_epoch_is_refused_and_the_last_accepted_one_names_the_leader(managers):
    (a, sa, _), (b, sb, _) = managers
    sa.down = sb.down = False

    async def run() -> None:
        c = AsyncLeaderClient([a, b], timeout=1.5, retry=RetryPolicy(initial_backoff=0.01, max_backoff=0.02))
        try:
            assert await c.echo(b"x") == b"xn-a"
            assert (c.epoch, c.leader_node, c.stale_replies) == (7, "n-a", 0)
            sa.down = True                       # the leader refuses: the client moves to b, whose epoch is older
            before = sb.calls
            with pytest.raises(ClientError) as err:
                await c.echo(b"y")
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert sb.calls > before and c.stale_replies == sb.calls - before      # every reply of b refused
            assert (c.epoch, c.leader_node) == (7, "n-a")
        finally:
            sa.down = False
            await c.close()
        c = AsyncLeaderClient([b], timeout=5)       # a client that saw no higher epoch takes b's
        try:
            assert await c.echo(b"z") == b"zn-b" and (c.epoch, c.leader_node) == (3, "n-b")
        finally:
            await c.close()
    asyncio.run(run())


def test_the_pause_between_attempts_is_the_backoff_while_no_address_reports_serving(managers):
    (a, sa, _), _ = managers
    sa.down = True

    async def run() -> int:
        c = AsyncLeaderClient([a], timeout=1.5, retry=RetryPolicy(initial_backoff=30.0, max_backoff=30.0,
                                                                 grpc_attempts=1))
        try:
            with pytest.raises(ClientError):
                await c.echo(b"x")
        finally:
            await c.close()
        return sa.calls
    try:
        sa.calls = 0
        calls = asyncio.run(run())
    finally:
        sa.down = False
    # a 30 s backoff inside a 1.5 s call (no gRPC-level resend): one attempt, perhaps one more at the deadline's
    # end, never a busy loop
    assert 1 <= calls <= 3


def test_one_readiness_watch_per_address_however_often_it_is_asked_for(managers):
    (a, _, _), (b, _, _) = managers

    async def run() -> tuple[int, int]:
        c = AsyncLeaderClient([a, b], timeout=5)
        try:
            c._watch_health()
            c._watch_health()                        # a second broken call: the watches already run
            await asyncio.sleep(0)
            loops = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith("_health_loop")]
            running = len(loops)
        finally:
            await c.close()
        await asyncio.gather(*loops, return_exceptions=True)       # the closed client's watches end
        c._watch_health()                            # closed: none is started again
        await asyncio.sleep(0)
        left = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith("_health_loop")]
        for t in left:
            t.cancel()
        return running, len(left)
    assert asyncio.run(run()) == (2, 0)


def test_a_stream_asks_for_incremental_tables_unless_told_not_to(managers):
    class Pool(Stamped):
        def GetPool(self, request, context):
            return pb.PoolInfo(name=request.pool, plan=pb.PlanReply(page_size=8))

    servicer = Pool(1, "n-p")
    server, port, _ = grpc_server("kvservice.v1.BlockManager", servicer, "127.0.0.1:0")
    server.start()

    async def run() -> list:
        c = AsyncLeaderClient([f"127.0.0.1:{port}"], timeout=5)
        try:
            out = []
            for kw in ({}, {"deltas": True}, {"deltas": False}):
                s = await c.step_stream("p", **kw)
                out.append((s.deltas, s.mirror.page_size, s.pool))
                await s.close()
            return out
        finally:
            await c.close()
    try:
        assert asyncio.run(run()) == [(True, 8, "p"), (True, 8, "p"), (False, 8, "p")]
    finally:
        server.stop(None)
