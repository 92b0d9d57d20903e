"""Clients: one request_id per logical call, retries within its deadline, the id in the error, a manager behind is
caught.

Real servers on loopback (kvservice.server.app.serve, in process), started and stopped on one port.
"""

import asyncio
import socket

import grpc
import pytest

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.client import ManagerBehind, RetryPolicy
from kvservice.core.geometry import CacheSpec
from kvservice.core.planner import Sizing
from kvservice.server.app import serve

pytestmark = pytest.mark.integration
SPEC = CacheSpec.uniform(2, 1, 64, page_size=16)
SIZING = Sizing(num_slots=64, max_seq_len=512)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_call_that_gives_up_names_its_request_id_and_a_later_retry_applies_it_once():
    target = f"127.0.0.1:{free_port()}"
    with BlockManagerClient(target, timeout=0.8) as c:
        with pytest.raises(ClientError) as exc:                  # nobody listens yet
            c.step("p", admit=[1], admit_tokens=[20])
        err = exc.value
        assert err.reason == "RETRIES_EXHAUSTED" and err.code == grpc.StatusCode.UNAVAILABLE
        assert err.request_id and err.metadata["request_id"] == err.request_id and int(err.metadata["attempts"]) >= 1
        assert f"request_id={err.request_id!r}" in err.message and f"Step to {target}" in err.message
        c.timeout = 30.0                                          # from here on the manager is up
        running = serve(listen=target)
        try:
            c.create_pool("p", SPEC, SIZING)
            first = c.step("p", admit=[1], admit_tokens=[20], request_id=err.request_id)
            again = c.step("p", admit=[1], admit_tokens=[20], request_id=err.request_id)
            stats = c.stats("p")["p"]
        finally:
            running.stop(0)
    assert first.num_tokens.tolist() == again.num_tokens.tolist() == [20]
    assert first.for_layer(0).slot_mapping.tolist() == again.for_layer(0).slot_mapping.tolist()
    assert (stats.steps, stats.num_sequences, stats.num_free_slots) == (1, 1, 64 - 2)
    assert again.position[1] == first.position[1] == 2          # CreatePool, then the step: applied once


def test_a_non_retryable_error_carries_the_request_id_at_once():
    running = serve()
    try:
        with BlockManagerClient(f"127.0.0.1:{running.port}") as c:
            with pytest.raises(ClientError) as exc:
                c.step("missing", admit=[1], admit_tokens=[3], request_id="nf-1")
    finally:
        running.stop(0)
    assert exc.value.code == grpc.StatusCode.NOT_FOUND and exc.value.request_id == "nf-1"


def test_a_manager_that_came_back_behind_is_caught():
    target = f"127.0.0.1:{free_port()}"
    first = serve(listen=target)
    with BlockManagerClient(target, retry=RetryPolicy(failover=20)) as c:
        try:
            c.create_pool("p", SPEC, SIZING)
            for i in range(3):
                c.step("p", admit=[i + 1], admit_tokens=[5])
            assert c.position.seq == 4 and c.position.incarnation == 1
        finally:
            first.stop(0)
        second = serve(listen=target)                        # a fresh manager: it lost everything
        try:
            with pytest.raises(ManagerBehind) as exc:
                c.create_pool("p", SPEC, SIZING)
            assert exc.value.code == grpc.StatusCode.DATA_LOSS and exc.value.reason == "MANAGER_BEHIND"
            assert exc.value.metadata["seen_seq"] == "4" and exc.value.reply.name == "p"
            c.reset_position()                               # the scheduler resynchronised
            assert c.step("p", admit=[1], admit_tokens=[5]).position == (1, 2)
        finally:
            second.stop(0)


def test_the_asyncio_client_retries_and_checks_positions_alike():
    target = f"127.0.0.1:{free_port()}"

    async def go():
        async with AsyncBlockManagerClient(target, timeout=0.8) as c:
            with pytest.raises(ClientError) as exc:
                await c.step("p", admit=[1], admit_tokens=[20])
            assert exc.value.reason == "RETRIES_EXHAUSTED" and exc.value.request_id
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE and target in exc.value.message
            rid = exc.value.request_id
            c.timeout = 30.0
            running = serve(listen=target)
            try:
                await c.create_pool("p", SPEC, SIZING)
                a = await c.step("p", admit=[1], admit_tokens=[20], request_id=rid)
                b = await c.step("p", admit=[1], admit_tokens=[20], request_id=rid)
                assert a.position == b.position == (1, 2) and (await c.stats("p"))["p"].steps == 1
            finally:
                running.stop(0)
            again = serve(listen=target)
            try:
                with pytest.raises(ManagerBehind):
                    await c.create_pool("p", SPEC, SIZING)
            finally:
                again.stop(0)
    asyncio.run(go())
