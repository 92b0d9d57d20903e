"""Workers fence kernel calls by the replicated manager's leader epoch (issue #14 item 2, docs/HA.md).

A real manager behind the real LeaderGate (the interceptor that stamps a replicated manager's replies
with its epoch; promoting it to a higher epoch is what a takeover does to the replies), a real worker
registered through its LeaderClient, and schedulers calling it through WorkerClient.
"""

import time

import grpc
import numpy as np
import pytest

from kvservice.client import ClientError
from kvservice.client.ha import EPOCH_METADATA as LEADER_EPOCH_METADATA
from kvservice.client.ha import LeaderClient
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.errors import FailedPrecondition, InvalidArgument
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.status import error_info
from kvservice.server.app import serve
from kvservice.server.leader_gate import LeaderGate
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker.fencing import LeaderEpochFence
from kvservice.worker.server import serve_worker
from kvservice.worker.service import EPOCH_FENCED

pytestmark = pytest.mark.integration
IDENTITY = {"worker_id": "w0", "pool": "p"}


def wait_for(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# ---- the fence alone --------------------------------------------------------------------------------------

def test_fence_orders_epochs_and_requires_one_once_replicated():
    polled = [0]
    reasons: list[str] = []
    fence = LeaderEpochFence(lambda: polled[0], on_refuse=reasons.append)
    fence.check((), IDENTITY, "AppendKV")                         # unreplicated manager: nothing to check
    fence.check(((LEADER_EPOCH_METADATA, "3"),), IDENTITY, "AppendKV")
    assert fence.seen == 0                                        # a caller's stamp teaches the worker nothing
    polled[0] = 5                                                 # its manager client saw epoch 5
    assert fence.seen == 5
    with pytest.raises(FailedPrecondition) as exc:
        fence.check(((LEADER_EPOCH_METADATA, "4"),), IDENTITY, "DecodeAttention")
    assert exc.value.reason == "STALE_LEADER_EPOCH"
    assert "epoch 5" in exc.value.message and "epoch 4" in exc.value.message and "'p'" in exc.value.message
    with pytest.raises(FailedPrecondition) as exc:
        fence.check((("authorization", "Bearer x"),), IDENTITY, "CopyBlocks")
    assert exc.value.reason == "LEADER_EPOCH_REQUIRED" and LEADER_EPOCH_METADATA in exc.value.message
    fence.check(((LEADER_EPOCH_METADATA, "5"),), IDENTITY, "AppendKV")
    fence.check(((LEADER_EPOCH_METADATA, str(2**62)),), IDENTITY, "AppendKV")   # ahead of the worker: accepted
    fence.check(((LEADER_EPOCH_METADATA, "5"),), IDENTITY, "AppendKV")         # ... and it fenced nobody off
    assert fence.seen == 5 and fence.refused == 2
    assert reasons == ["STALE_LEADER_EPOCH", "LEADER_EPOCH_REQUIRED"]
    for bad in ("x", "0", "-2"):
        with pytest.raises(InvalidArgument):
            fence.check(((LEADER_EPOCH_METADATA, bad),), IDENTITY, "AppendKV")
    assert fence.seen == 5 and fence.refused == 2


# ---- a worker of a replicated manager ---------------------------------------------------------------------

@pytest.fixture
def gated():
    gate = LeaderGate()
    gate.promote(5)
    manager = serve(interceptors=[gate], lease_seconds=0.6)
    target = f"127.0.0.1:{manager.port}"
    sched = LeaderClient([target], timeout=5)
    sched.create_pool("p", CacheSpec.uniform(2, 1, 32, "float32", 4), Sizing(num_slots=32, max_seq_len=64))
    running = serve_worker(target, "p", "w0", backend="cpu")
    try:
        yield gate, sched, running
    finally:
        running.stop()
        sched.close()
        manager.stop(0)


def _append(wc: WorkerClient, layer: int, mapping: np.ndarray, seed: int):
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((len(mapping), 1, 32)).astype(np.float32) + 0.5 for _ in range(2))
    return wc.append_kv(layer, k, v, mapping)


def test_worker_refuses_tables_of_a_deposed_leader_and_touches_nothing(gated):
    gate, sched, running = gated
    address = f"127.0.0.1:{running.port}"
    reply = sched.step("p", admit=[1], admit_tokens=[6])
    mapping = reply.for_layer(0).slot_mapping
    assert sched.epoch == 5
    wait_for(lambda: running.servicer.leader_fence.seen == 5, "the worker to learn epoch 5 from its registration")
    current = WorkerClient(address, "w0", leader_epoch=lambda: sched.epoch)
    assert not _append(current, 0, mapping, 1).violations       # stamped with the current epoch: applied

    gate.promote(6)                                                  # a takeover: the successor stamps epoch 6
    wait_for(lambda: running.servicer.leader_fence.seen == 6, "the worker's heartbeat to see epoch 6")
    cache = running.servicer.caches.cache(0)
    before = np.asarray(cache).copy()
    stale = WorkerClient(address, "w0", leader_epoch=5)               # a scheduler still on the old leader
    with pytest.raises(ClientError) as exc:
        _append(stale, 0, mapping, 2)
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION and exc.value.reason == "STALE_LEADER_EPOCH"
    assert "seen leader epoch 6" in exc.value.message and "from epoch 5" in exc.value.message
    unstamped = WorkerClient(address, "w0")
    with pytest.raises(ClientError) as exc:
        _append(unstamped, 0, mapping, 3)
    assert exc.value.reason == "LEADER_EPOCH_REQUIRED"
    np.testing.assert_array_equal(np.asarray(cache), before)         # neither refused call wrote anything
    # The current scheduler's next manager call sees epoch 6, and its stamp follows.
    sched.step("p", extend=[1], extend_tokens=[1])
    layer1 = running.servicer.caches.cache(1)
    before1 = np.asarray(layer1).copy()
    assert sched.epoch == 6 and not _append(current, 1, mapping, 4).violations
    assert not np.array_equal(np.asarray(layer1), before1, equal_nan=True)   # this one was written
    reg = running.servicer.metrics.registry
    assert reg.get_sample_value("kvworker_leader_epoch_refusals_total", {"reason": "STALE_LEADER_EPOCH"}) == 1
    assert reg.get_sample_value("kvworker_leader_epoch_refusals_total", {"reason": "LEADER_EPOCH_REQUIRED"}) == 1
    for wc in (current, stale, unstamped):
        wc.close()


def test_every_table_carrying_rpc_is_fenced_and_the_others_are_not(gated):
    gate, _sched, running = gated
    gate.promote(7)
    wait_for(lambda: running.servicer.leader_fence.seen == 7, "the worker to see epoch 7")
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    stub = wpb_grpc.WorkerStub(channel)
    requests = {"AppendKV": wpb.AppendKVRequest(), "DecodeAttention": wpb.DecodeAttentionRequest(),
                "CopyBlocks": wpb.CopyBlocksRequest(), "UpdateTables": wpb.UpdateTablesRequest()}
    assert set(requests) == EPOCH_FENCED
    for name, request in requests.items():
        with pytest.raises(grpc.RpcError) as exc:
            getattr(stub, name)(request, timeout=10, metadata=((LEADER_EPOCH_METADATA, "6"),))
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
        assert error_info(exc.value).reason == "STALE_LEADER_EPOCH", name
    # Calls that carry no manager-issued tables answer without an epoch.
    assert stub.Info(wpb.WorkerInfoRequest(), timeout=10).worker_id == "w0"
    assert stub.CheckGuards(wpb.CheckGuardsRequest(), timeout=10).ok
    channel.close()
