"""Fencing (issue #11 item 6): worker_ids belong to the pool and token that registered them, pools have
incarnations, errors never name another tenant's pool. A real manager (tokens) and in-process workers."""

import time

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient, ClientError
from kvservice.contract.auth import TokenTable
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.status import error_info
from kvservice.contract.wire import to_tensor
from kvservice.server.app import serve
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker.reference import RawLayer, page_view
from kvservice.worker.server import serve_worker

pytestmark = pytest.mark.integration
TOKENS = {"admin": "admin-0123456789abcdef", "ta": "tenant-a-0123456789abcdef", "tb": "tenant-b-0123456789abcdef",
          "tb2": "tenant-b2-0123456789abcdef"}
TOKENS_YAML = "tokens:\n" + "".join(
    f"  - {{name: {n}, token: {t}, pools: {pools}, role: {role}}}\n" for n, t, pools, role in (
        ("admin", TOKENS["admin"], '["*"]', "admin"), ("ta", TOKENS["ta"], "[a]", "write"),
        ("tb", TOKENS["tb"], "[b]", "write"), ("tb2", TOKENS["tb2"], "[b]", "write")))
SPEC_B = CacheSpec.uniform(2, 1, 32, "float32", 4)
SPEC_B2 = CacheSpec.uniform(3, 2, 32, "float32", 8, layout="interleaved")   # another geometry, same name
LEASE = 0.6


def wait_for(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def refused(fn, code):
    with pytest.raises(ClientError) as exc:
        fn()
    assert exc.value.code == code, exc.value
    return exc.value


@pytest.fixture
def cluster():
    running = serve(tokens=TokenTable.from_yaml(TOKENS_YAML), lease_seconds=LEASE)
    target = f"127.0.0.1:{running.port}"
    clients = {n: BlockManagerClient(target, timeout=10, retries=0, token=t) for n, t in TOKENS.items()}
    clients["admin"].create_pool("a", CacheSpec.uniform(2, 1, 32, "float32", 4), Sizing(num_slots=32))
    clients["admin"].create_pool("b", SPEC_B, Sizing(num_slots=32, max_seq_len=64))
    wb = serve_worker(target, "b", "wb", backend="cpu", manager_token=TOKENS["tb"])
    yield {"running": running, "target": target, "c": clients, "wb": wb}
    wb.stop()
    for c in clients.values():
        c.close()
    running.stop()


def workers_by_id(client, pool=""):
    return {w.worker_id: w for w in client.workers(pool)}


def heartbeat(target, token, **fields):
    with grpc.insecure_channel(target) as ch:
        try:
            pb_grpc.BlockManagerStub(ch).Heartbeat(pb.HeartbeatRequest(**fields), timeout=5,
                                                  metadata=(("authorization", f"Bearer {token}"),))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_another_tenant_cannot_take_a_worker_id(cluster):
    c = cluster["c"]
    before = workers_by_id(c["admin"])["wb"]
    err = refused(lambda: c["ta"].register_worker(pb.RegisterWorkerRequest(worker_id="wb", pool="a", backend="cpu")),
                  grpc.StatusCode.ALREADY_EXISTS)
    assert "registered to another pool" in err.message and "'b'" not in err.message
    # B's worker is untouched: same pool, epoch and incarnation, and its heartbeats keep working.
    time.sleep(3 * LEASE)
    after = workers_by_id(c["admin"])["wb"]
    assert (after.pool, after.epoch, after.incarnation, after.alive) == ("b", before.epoch, before.incarnation, True)
    assert cluster["wb"].identity["epoch"] == before.epoch
    # Another token of the same tenant cannot take it over while its lease holds.
    err = refused(lambda: c["tb2"].register_worker(pb.RegisterWorkerRequest(worker_id="wb", pool="b", backend="cpu")),
                  grpc.StatusCode.ALREADY_EXISTS)
    assert "another token" in err.message
    assert workers_by_id(c["admin"])["wb"].epoch == before.epoch


def test_refusals_never_name_another_tenants_pool(cluster):
    c, target = cluster["c"], cluster["target"]
    wb = workers_by_id(c["admin"])["wb"]
    code, msg = heartbeat(target, TOKENS["ta"], worker_id="wb", epoch=wb.epoch)      # pool found from the id
    assert code == grpc.StatusCode.PERMISSION_DENIED and "'b'" not in msg, msg
    code, msg = heartbeat(target, TOKENS["ta"], worker_id="wb", epoch=wb.epoch, pool="a")
    assert code == grpc.StatusCode.NOT_FOUND and "not registered in pool 'a'" in msg and "'b'" not in msg, msg
    err = refused(lambda: c["admin"].get_pool("nope"), grpc.StatusCode.NOT_FOUND)
    assert err.message == "pool 'nope' does not exist"                                # no list of pools
    assert heartbeat(target, TOKENS["tb"], worker_id="wb", epoch=wb.epoch, pool="b",
                     incarnation=wb.incarnation)[0] == grpc.StatusCode.OK


def test_recreated_pool_fences_the_old_worker_until_it_replans(cluster):
    c, running = cluster["c"], cluster["wb"]
    old_info = c["admin"].get_pool("b")
    old_inc = old_info.incarnation
    assert workers_by_id(c["admin"])["wb"].incarnation == old_inc == running.identity["incarnation"] != 0
    worker = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    stub = wpb_grpc.WorkerStub(worker)
    old_bytes = stub.Info(wpb.WorkerInfoRequest()).cache_bytes
    c["admin"].delete_pool("b", force=True)
    assert "wb" not in workers_by_id(c["admin"])                                       # its record went with it
    new_info = c["admin"].create_pool("b", SPEC_B2, Sizing(num_slots=24, max_seq_len=64))
    assert new_info.incarnation not in (0, old_inc)
    # A registration planned from the old incarnation is refused, and says what to do.
    err = refused(lambda: c["tb"].register_worker(pb.RegisterWorkerRequest(worker_id="wx", pool="b", backend="cpu",
                                                                           incarnation=old_inc)),
                  grpc.StatusCode.FAILED_PRECONDITION)
    assert err.reason == "STALE_INCARNATION" and "re-plan" in err.message
    # The worker hears it on its next heartbeat, re-plans its memory and registers with the new incarnation.
    wait_for(lambda: running.identity["incarnation"] == new_info.incarnation, "the worker to re-plan")
    rec = wait_for(lambda: workers_by_id(c["admin"], "b").get("wb"), "the worker to register again")
    assert rec.incarnation == new_info.incarnation and rec.alive
    status = stub.Info(wpb.WorkerInfoRequest())
    layer_bytes = 2 * 8 * 2 * 32 * 4                                    # K and V, page 8, 2 heads, dim 32, fp32
    assert status.pool_incarnation == new_info.incarnation and status.buffers == ["group0"]
    assert status.cache_bytes == 24 * 3 * layer_bytes != old_bytes
    guards = stub.CheckGuards(wpb.CheckGuardsRequest(), timeout=10)
    assert guards.ok and [b.buffer for b in guards.buffers] == ["group0"]
    assert running.servicer.metrics.registry.get_sample_value(
        "kvworker_guard_corruptions_total", {"buffer": "group0"}) == 0            # its series start at 0
    # Kernel requests planned in the old incarnation are refused before they touch memory ...
    sc = c["tb"].step("b", admit=[1], admit_tokens=[5])
    layer = 2
    mapping = sc.for_layer(layer).slot_mapping
    rng = np.random.default_rng(6)
    k, v = (rng.standard_normal((5, 2, 32)).astype(np.float32) for _ in range(2))
    req = wpb.AppendKVRequest(layer=layer, k=to_tensor(k), v=to_tensor(v), slot_mapping=to_tensor(mapping),
                              pool_incarnation=old_inc)
    cache = running.servicer.caches.cache(layer)
    untouched = np.asarray(cache).copy()
    with pytest.raises(grpc.RpcError) as exc:
        stub.AppendKV(req, timeout=10)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "planned in incarnation" in exc.value.details()
    assert error_info(exc.value).reason == "STALE_INCARNATION"
    assert np.array_equal(np.asarray(cache), untouched)
    # ... and those of the new one land exactly where the new geometry puts them.
    req.pool_incarnation = new_info.incarnation
    assert not stub.AppendKV(req, timeout=10).violations
    raw = RawLayer.from_geometry(running.servicer.caches.geometry, layer)     # byte offsets from the geometry
    for t in range(5):
        page, off = divmod(int(mapping[t]), raw.page_size)
        got = page_view(np.asarray(cache), raw, page)
        assert np.array_equal(got[0, off], k[t]) and np.array_equal(got[1, off], v[t])
    worker.close()


def test_recreated_pool_with_the_same_geometry_keeps_the_caches(cluster):
    c, running = cluster["c"], cluster["wb"]
    caches = running.servicer.caches
    c["admin"].delete_pool("b", force=True)
    info = c["admin"].create_pool("b", SPEC_B, Sizing(num_slots=32, max_seq_len=64))
    wait_for(lambda: running.identity["incarnation"] == info.incarnation, "the worker to register again")
    assert running.servicer.caches is caches
    assert wait_for(lambda: workers_by_id(c["admin"], "b").get("wb"), "its record").incarnation == info.incarnation


def test_incarnations_are_stamped_by_the_server_and_survive_replay_and_retries(tmp_path):
    """The server chooses the incarnation (a client's value is replaced); a retried CreatePool gets the stored
    reply; a journal replay recreates the same incarnation, and registrations replay under it."""
    from kvservice.state.journal import Journal, JournalConfig

    running = serve(journal=Journal.open(tmp_path, config=JournalConfig(sync="normal")))
    target = f"127.0.0.1:{running.port}"
    try:
        with BlockManagerClient(target, timeout=10) as c:
            first = c.create_pool("p", SPEC_B, Sizing(num_slots=16), request_id="create-p-1")
            again = c.create_pool("p", SPEC_B, Sizing(num_slots=16), request_id="create-p-1")
            assert again.incarnation == first.incarnation != 0
            req = pb.CreatePoolRequest(name="q", cache=first.cache, sizing=pb.Sizing(num_slots=16), incarnation=5)
            with grpc.insecure_channel(target) as ch:
                chosen = pb_grpc.BlockManagerStub(ch).CreatePool(req, timeout=10).incarnation
            assert chosen not in (0, 5)
            c.register_worker(pb.RegisterWorkerRequest(worker_id="w", pool="p", backend="cpu",
                                                       incarnation=first.incarnation, registered_by="forged"))
        recovered = Journal.open(tmp_path, readonly=True)        # replays the journal's entries
        try:
            assert recovered.manager.incarnations() == {"p": first.incarnation, "q": chosen}
            (w,) = recovered.manager.workers.workers()
            assert (w.incarnation, w.owner) == (first.incarnation, "")   # no tokens: the forged name was replaced
        finally:
            recovered.close(snapshot=False)
    finally:
        running.stop()


def test_worker_client_sends_its_token_and_incarnation(cluster):
    """A worker with --tokens-file (as the manifests run it): WorkerClient's token and pool_incarnation reach it."""
    from kvservice.client.worker_client import WorkerClient
    from kvservice.contract.pagetable import PageTable

    table = TokenTable.from_yaml(TOKENS_YAML)
    w = serve_worker(cluster["target"], "b", "wb-tokens", backend="cpu", manager_token=TOKENS["tb"], tokens=table)
    address = f"127.0.0.1:{w.port}"
    inc = w.identity["incarnation"]
    one_row = PageTable(np.array([0, 1], np.int32), np.array([0], np.int32), np.array([1], np.int32))
    try:
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (TOKENS["ta"], grpc.StatusCode.PERMISSION_DENIED)):
            with WorkerClient(address, "wb-tokens", token=token, pool_incarnation=inc) as wc:
                assert refused(lambda wc=wc: wc.validate(0, one_row), code)
        with WorkerClient(address, "wb-tokens", token=TOKENS["tb"], pool_incarnation=inc) as wc:
            assert wc.validate(0, one_row).ok and "token=set" in repr(wc) and TOKENS["tb"] not in repr(wc)
            wc.pool_incarnation = inc + 1
            err = refused(lambda: wc.validate(0, one_row), grpc.StatusCode.FAILED_PRECONDITION)
            assert err.reason == "STALE_INCARNATION" and "worker wb-tokens" in err.message
    finally:
        w.stop()
