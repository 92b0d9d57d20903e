"""Client contracts the seed-20 survivors showed untested (kvservice/client: codec, ha, stream).

- step_request's admit_token_ids travel as INT64 whatever integer dtype the caller holds (the proto's
  admit_token_ids: int64 token ids), read back byte by byte, little-endian.
- LeaderClient's health loop: a SERVING report of address i sends the next call there (docs/HA.md: the standby
  that took over is served at once); NOT_SERVING moves nothing.
- StepStream's deadline watchdog is a daemon thread: a forgotten stream must not keep the interpreter alive.
- AsyncBlockManagerClient.create_pool sends its backends: the pool's plan lists them (the proto's
  PoolPlan.backends, "backends checked and satisfied"), and one whose page-size rule the pool breaks is refused.
"""

from __future__ import annotations

import asyncio
import struct
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.codec import ClientError, step_request
from kvservice.client.ha import LeaderClient
from kvservice.client.stream import StepStream
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve
from kvservice.v1 import common_pb2 as pb

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"


def test_admit_token_ids_are_sent_as_int64_from_any_integer_input():
    rng = np.random.default_rng(2020)
    ids = rng.integers(1, 2**31 - 1, 7).astype(np.int32)
    for given in (ids, ids.astype(np.uint32), [int(x) for x in ids]):
        t = step_request("p", admit=[5], admit_tokens=7, admit_token_ids=given).admit_token_ids
        want = np.asarray(given).astype(np.int64)
        assert t.dtype == pb.INT64 and list(t.shape) == []
        assert len(t.data) == 8 * len(want)
        assert list(struct.unpack(f"<{len(want)}q", t.data)) == [int(x) for x in want]


def test_a_serving_report_from_the_health_watch_moves_the_next_call_there():
    c = LeaderClient([A, B, C], timeout=3.0)
    seen = []

    def watch(index):                 # address 2's readiness watch: NOT_SERVING, then SERVING, then it ends
        assert index == 2
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        seen.append((c.current_target, c.serving_reports))
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        seen.append((c.current_target, c.serving_reports))
        c.close()                     # ends the loop after this watch

    c._health_watch = watch
    try:
        c._health_loop(2)
        assert seen == [(A, 0), (C, 1)]
        assert c.current_target == C and c.stream_channel() == (2, c._channels[2])
    finally:
        c.close()


class _Call:
    def cancel(self):
        pass


class _Channel:
    def stream_stream(self, method, request_serializer=None, response_deserializer=None):
        return lambda requests, metadata=None: _Call()


class _Client:
    timeout = 0.2
    _metadata = ()

    def stream_channel(self):
        return 0, _Channel()


def test_the_deadline_watchdog_of_a_stream_is_a_daemon_thread():
    s = StepStream(_Client(), "p", page_size=16, stream_id="s-r3cl-daemon")
    s._open()
    try:
        dogs = [t for t in threading.enumerate() if t.name == "deadline-s-r3cl-daemon"]
        assert len(dogs) == 1 and dogs[0] is s._watchdog
        assert dogs[0].daemon
    finally:
        s.close()
        s._watchdog.join(5)
    assert not s._watchdog.is_alive()


@pytest.fixture(scope="module")
def server():
    running = serve("127.0.0.1:0")
    yield f"127.0.0.1:{running.port}"
    running.stop()


def test_the_async_client_creates_a_pool_for_the_backends_it_names(server):
    spec, sizing = CacheSpec.uniform(2, 2, 8, "float16", 4), Sizing(num_slots=64, max_seq_len=128)

    async def go():
        async with AsyncBlockManagerClient(server) as c:
            info = await c.create_pool("r3cl-b", spec, sizing, ("flashinfer", "trtllm"))
            assert list(info.plan.backends) == ["flashinfer", "trtllm"]
            assert list((await c.get_pool("r3cl-b")).plan.backends) == ["flashinfer", "trtllm"]
            with pytest.raises(ClientError) as e:       # flash-attn2 needs page_size % 256 == 0; pages of 4 here
                await c.create_pool("r3cl-f", spec, sizing, backends=("flash-attn2",))
            assert (e.value.code, e.value.message) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                       "flash-attn 2 needs page_size % 256 == 0, got page_size 4")
            assert "r3cl-f" not in [p.name for p in await c.list_pools()]

    asyncio.run(go())
