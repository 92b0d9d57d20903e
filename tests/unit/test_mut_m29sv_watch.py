"""WatchEvents (kvservice/server/watch.py) refusals on the wire: a stream the hub will not open ends with the hub's own
status (code, message and ErrorInfo), never an internal error, and the next stream still works.

docs/SECURITY.md#fairness: an unknown pool is NOT_FOUND; past --kv-events-max-watchers RESOURCE_EXHAUSTED, reason
LIMIT_EXCEEDED, with the limit and what the caller holds in the ErrorInfo metadata.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvservice.client.codec import create_pool_request, step_request
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.status import error_info
from kvservice.server.app import serve
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc

SPEC = CacheSpec.uniform(2, 2, 8, "float16", 4)


def test_a_watch_the_hub_refuses_ends_with_its_status_and_the_next_one_streams() -> None:
    rng = np.random.default_rng(91)
    running = serve("127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.BlockManagerStub(channel)
    try:
        missing = "pool-" + rng.bytes(4).hex()
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stub.WatchEvents(pb.WatchEventsRequest(pool=missing, from_sequence=0), timeout=10)))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and missing in err.value.details()
        assert error_info(err.value) is not None
        stub.CreatePool(create_pool_request("p", SPEC, Sizing(num_slots=64, max_seq_len=64), prefix_caching=True),
                        timeout=10)
        stub.Step(step_request("p", admit=[1], admit_tokens=[8], admit_token_ids=rng.integers(1, 30000, 8)),
                  timeout=10)
        hub = running.manager.events
        hub.max_subscribers = 1
        first = stub.WatchEvents(pb.WatchEventsRequest(pool="p", from_sequence=0), timeout=10)
        assert next(iter(first)).reset                           # holds the one watcher slot
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stub.WatchEvents(pb.WatchEventsRequest(pool="p", from_sequence=0), timeout=10)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details().startswith("1 WatchEvents streams are open on this manager, its limit")
        info = error_info(err.value)
        assert info.reason == "LIMIT_EXCEEDED" and dict(info.metadata) == {"limit": "1", "held": "1"}
        first.cancel()
        hub.max_subscribers = 8
        again = stub.WatchEvents(pb.WatchEventsRequest(pool="p", from_sequence=0), timeout=10)
        batch = next(iter(again))
        again.cancel()
        assert batch.reset and batch.sequence >= 1
    finally:
        channel.close()
        running.stop(0)


def test_a_reset_waits_for_its_tenants_read_budget_then_is_sent() -> None:
    """docs/SECURITY.md#fairness: a WatchEvents stream whose tenant's read budget is spent waits (holding only its
    watcher slot) until the balance is positive again, then sends its reset; it does not end. The budget's clock is
    injected: each reading advances it 10 ms, at a share of 100 CPU-seconds a second, so the debt is repaid after a
    few readings whatever the machine's load."""
    from kvservice.manager.read_budget import ReadBudget

    class Counted(ReadBudget):
        def __init__(self, **kw: object) -> None:
            super().__init__(**kw)
            self.waits: list[float] = []

        def try_start(self, tenant: str) -> float:
            wait = super().try_start(tenant)
            self.waits.append(wait)
            return wait

    now = [1000.0]

    def clock() -> float:
        now[0] += 0.01
        return now[0]

    rng = np.random.default_rng(97)
    running = serve("127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.BlockManagerStub(channel)
    try:
        stub.CreatePool(create_pool_request("p", SPEC, Sizing(num_slots=64, max_seq_len=64), prefix_caching=True),
                        timeout=10)
        stub.Step(step_request("p", admit=[1], admit_tokens=[8], admit_token_ids=rng.integers(1, 30000, 8)),
                  timeout=10)
        budget = Counted(share=100.0, burst=1.0, clock=clock)
        budget.charge("", 3.0)                                     # the tenant owes 2 CPU-seconds
        running.manager.events.read_budget = budget
        replies = stub.WatchEvents(pb.WatchEventsRequest(pool="p", from_sequence=0), timeout=10)
        first = next(iter(replies))
        replies.cancel()
        assert first.reset
        assert budget.waits[0] > 0 and budget.waits[-1] == 0      # waited, then started
        counters = running.manager.events.logs["p"].counters      # kvservice_kv_event_batches_sent_total{transport}
        assert set(counters) == {"grpc"} and counters["grpc"].sent >= 1 and counters["grpc"].resets == 1
    finally:
        channel.close()
        running.stop(0)


def test_catch_up_is_read_and_charged_in_pieces_of_256_batches() -> None:
    """watch.py CATCHUP_BATCHES: batches committed before a stream began are read 256 at a time, each piece started
    on the tenant's read budget before the next; live batches are not charged. 257 batches of catch-up are two
    pieces (256 + 1), each started once; the stream delivers all 257 in order."""
    from kvservice.manager.read_budget import ReadBudget

    class Counted(ReadBudget):
        def __init__(self, **kw: object) -> None:
            super().__init__(**kw)
            self.waits: list[float] = []

        def try_start(self, tenant: str) -> float:
            wait = super().try_start(tenant)
            self.waits.append(wait)
            return wait

    rng = np.random.default_rng(101)
    running = serve("127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.BlockManagerStub(channel)
    try:
        hub = running.manager.events
        hub.ring_batches, hub.ring_bytes = 4096, 1 << 30
        stub.CreatePool(create_pool_request("p", SPEC, Sizing(num_slots=600, max_seq_len=16), prefix_caching=True),
                        timeout=10)
        for i in range(257):                                   # one full page stored: one batch each
            stub.Step(step_request("p", admit=[i + 1], admit_tokens=[4], admit_token_ids=rng.integers(1, 30000, 4),
                                   tables=False), timeout=10)
        assert hub.logs["p"].committed == 257
        budget = Counted(share=1.0, burst=1000.0)
        hub.read_budget = budget
        replies = stub.WatchEvents(pb.WatchEventsRequest(pool="p", from_sequence=1), timeout=30)
        seqs = []
        for batch in replies:
            seqs.append(batch.sequence)
            if batch.sequence == 257:
                break
        replies.cancel()
        assert seqs == list(range(1, 258))
        assert budget.waits == [0.0, 0.0]
    finally:
        channel.close()
        running.stop(0)
