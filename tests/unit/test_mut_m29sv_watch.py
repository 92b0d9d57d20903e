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
