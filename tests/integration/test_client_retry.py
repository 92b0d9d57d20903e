"""Clients: one request_id per logical call, retries within its deadline, the id in the error, a rolled-back manager is
refused and a new lineage accepted and reported.

Real servers on loopback (kvservice.server.app.serve, in process), started and stopped on one port.
"""

import asyncio
import shutil
import socket

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.client import RetryPolicy
from kvservice.client.position import StateRolledBack
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve
from kvservice.state.journal import Journal, JournalConfig

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


def _restored_from_an_older_copy(tmp_path):
    """A state dir whose manager acknowledged more after a backup was taken, then the backup put back.

    Returns (state dir, backup): the backup is a valid, consistent state dir of the same lineage
    (taken while its manager was stopped), so the manager starts from it without complaint.
    """
    d = tmp_path / "state"
    running = serve(journal=Journal.open(d, config=JournalConfig(sync="normal")))
    with BlockManagerClient(f"127.0.0.1:{running.port}") as c:
        c.create_pool("p", SPEC, SIZING)
    running.stop(0)
    backup = shutil.copytree(d, tmp_path / "backup")
    return d, backup


def test_a_manager_restored_from_an_older_copy_is_refused_and_a_fresh_one_is_a_new_lineage(tmp_path):
    target = f"127.0.0.1:{free_port()}"
    d, backup = _restored_from_an_older_copy(tmp_path)
    registry = CollectorRegistry()
    with BlockManagerClient(target, retry=RetryPolicy(failover=20), registry=registry) as c:
        first = serve(listen=target, journal=Journal.open(d, config=JournalConfig(sync="normal")))
        try:
            for i in range(3):
                r = c.step("p", admit=[i + 1], admit_tokens=[5])
            lineage = r.lineage
            assert r.position == (2, 4) and lineage and (c.position.lineage, c.position.seq) == (lineage, 4)
        finally:
            first.stop(0)
        shutil.rmtree(d)
        shutil.copytree(backup, d)                           # the operator restores last week's backup
        second = serve(listen=target, journal=Journal.open(d, config=JournalConfig(sync="normal")))
        try:
            with pytest.raises(StateRolledBack) as exc:
                c.step("p", admit=[9], admit_tokens=[5])     # the manager applies it; the client refuses the reply
            err = exc.value
            assert err.code == grpc.StatusCode.DATA_LOSS and err.reason == "STATE_ROLLED_BACK"
            assert (err.metadata["seen_seq"], err.metadata["seq"], err.metadata["lineage"]) == \
                ("4", "2", f"{lineage:016x}")
            assert err.request_id and "rolled back" in err.message and "reset_position()" in err.message
            for read in (lambda: c.stats("p"), lambda: c.sequences("p"), lambda: c.list_pools()):
                with pytest.raises(StateRolledBack):         # reads too, and sticky: its lineage went back once
                    read()
            assert c.position.rollbacks == 4
            assert registry.get_sample_value("kvservice_client_state_rollbacks_total") == 4
            c.reset_position()                               # the scheduler resynchronised
            assert c.step("p", extend=[9], extend_tokens=1).position == (2, 3)   # the backup's second start
        finally:
            second.stop(0)
        third = serve(listen=target)                         # a fresh in-memory manager: another history
        try:
            info = c.create_pool("p", SPEC, SIZING)
            assert info.position.lineage not in (0, lineage) and info.position.seq == 1
            assert c.position.lineage_changes == 1
            assert registry.get_sample_value("kvservice_client_lineage_changes_total") == 1
        finally:
            third.stop(0)


def test_the_asyncio_client_retries_and_checks_positions_alike(tmp_path):
    target = f"127.0.0.1:{free_port()}"
    d, backup = _restored_from_an_older_copy(tmp_path)

    async def go():
        async with AsyncBlockManagerClient(target, timeout=0.8) as c:
            with pytest.raises(ClientError) as exc:
                await c.step("p", admit=[1], admit_tokens=[20])
            assert exc.value.reason == "RETRIES_EXHAUSTED" and exc.value.request_id
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE and target in exc.value.message
            rid = exc.value.request_id
            c.timeout = 30.0
            running = serve(listen=target, journal=Journal.open(d, config=JournalConfig(sync="normal")))
            try:
                a = await c.step("p", admit=[1], admit_tokens=[20], request_id=rid)
                b = await c.step("p", admit=[1], admit_tokens=[20], request_id=rid)
                assert a.position == b.position == (2, 2) and (await c.stats("p"))["p"].steps == 1
            finally:
                running.stop(0)
            shutil.rmtree(d)
            shutil.copytree(backup, d)
            again = serve(listen=target, journal=Journal.open(d, config=JournalConfig(sync="normal")))
            try:
                with pytest.raises(StateRolledBack) as exc:
                    await c.get_pool("p")
                assert exc.value.metadata["seen_seq"] == "2" and exc.value.metadata["seq"] == "1"
            finally:
                again.stop(0)
    asyncio.run(go())
