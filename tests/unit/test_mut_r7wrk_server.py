"""serve_worker(...) pinned whole against an in-process manager, with a recording LeaderClient (a subclass of the real
one that notes every argument and call) and a recording grpc_server: the manager client it makes (address, 10 s
calls, the TLS options and token given), the start-up calls and their 30 s deadlines, that the worker already
answers Info (epoch 0) when it registers, the registration it sends (every field, tensor parallelism included),
the server it builds (the service, the address, TLS, no interceptors without tokens, 4 threads), the identity it
keeps, the kernels asked for, the bounds of its persistent tables, its heartbeat thread, its metrics and the
state-rollback counter hooked to its client, and what each default means (every layer, test hooks off, the
documented table bounds)."""

from __future__ import annotations

import types
from typing import ClassVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.client.client import BlockManagerClient, TLSOptions
from kvservice.client.ha import LeaderClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker import kernels_cpu, server
from tests.clocks import until

LAYERS, SLOTS, PS = 3, 40, 4


class Recording(LeaderClient):
    """The real LeaderClient, noting its arguments and the start-up calls (TLS options are noted, not used: the
    manager here is plaintext). At RegisterWorker it first asks the worker, at the address registered, for Info
    (a loopback one)."""

    made: ClassVar[list[Recording]] = []

    def __init__(self, targets, timeout=10.0, retries=None, *, tls=None, token=None, **kw):
        Recording.made.append(self)
        self.asked = [("LeaderClient", targets, timeout, retries, tls, token, kw)]
        super().__init__(targets, timeout, retries, tls=None, token=token, **kw)

    def wait_ready(self, timeout=10.0):
        self.asked.append(("wait_ready", timeout))
        return super().wait_ready(timeout)

    def get_pool(self, pool, timeout=None):
        self.asked.append(("get_pool", pool, timeout))
        return super().get_pool(pool, timeout=timeout)

    def register_worker(self, request, timeout=None):
        before = None
        if request.address.startswith("127.0.0.1:"):           # (an advertised name is not asked)
            with grpc.insecure_channel(request.address) as ch:
                try:
                    before = wpb_grpc.WorkerStub(ch).Info(wpb.WorkerInfoRequest(), timeout=30).epoch
                except grpc.RpcError as err:                    # a worker that wants tokens
                    before = err.code()
        self.asked.append(("register_worker", pb.RegisterWorkerRequest.FromString(request.SerializeToString()),
                           timeout, before))
        return super().register_worker(request, timeout=timeout)


@pytest.fixture
def manager(monkeypatch):
    """(target, client, incarnation, device_info and grpc_server calls) of an in-process manager (lease 600 s)
    holding pool p of 3 layers, with serve_worker's LeaderClient, device_info and grpc_server recorded."""
    from kvservice.server.app import serve

    running = serve(lease_seconds=600)
    target = f"127.0.0.1:{running.port}"
    client = BlockManagerClient(target, timeout=60, retries=0)
    client.create_pool("p", CacheSpec.uniform(LAYERS, 2, 32, "float32", PS), Sizing(num_slots=SLOTS, max_seq_len=64))
    built = []
    real = server.grpc_server

    def grpc_server(service, servicer, listen, tls=None, interceptors=(), **kw):
        built.append((service, servicer, listen, tls, list(interceptors), kw))
        return real(service, servicer, listen, None, interceptors, **kw)      # (TLS noted, served plaintext)

    Recording.made.clear()
    facts = server.device_info

    def device_info(backend):
        built.append(("device_info", backend))
        return facts(backend)

    monkeypatch.setattr(server, "device_info", device_info)
    monkeypatch.setattr(server, "LeaderClient", Recording)
    monkeypatch.setattr(server, "grpc_server", grpc_server)
    try:
        yield target, client, client.get_pool("p").incarnation, built
    finally:
        client.close()
        running.stop()


def test_a_worker_started_with_every_option_uses_each_as_documented(manager):
    target, client, inc, built = manager
    tls = TLSOptions(ca=b"-----BEGIN CERTIFICATE-----\n", server_name="kv.example")
    own_tls = types.SimpleNamespace(name="the worker's ServerTLS")
    worker = server.serve_worker(target, "p", "w-8", 1, 3, tp_rank=1, tp_size=2, manager_tls=tls, tls=own_tls,
                                 manager_token="tok-8", max_table_rows=5, max_tables=3, table_quota_bytes=123456,
                                 test_hooks=True, cpu_kernels="emulated")
    try:
        (made,) = Recording.made
        (rec,) = client.workers("p")
        name, memory = server.device_info("cpu")
        want = pb.RegisterWorkerRequest(worker_id="w-8", pool="p", layer_begin=1, layer_end=3, tp_rank=1, tp_size=2,
                                        backend="cpu", device_name=name, device_memory_bytes=memory,
                                        address=f"127.0.0.1:{worker.port}", incarnation=inc)
        assert made.asked == [("LeaderClient", target, 10, None, tls, "tok-8", {}), ("wait_ready", 30),
                              ("get_pool", "p", 30), ("register_worker", want, 30, 0)]
        assert (rec.tp_rank, rec.tp_size, rec.layer_begin, rec.layer_end) == (1, 2, 1, 3)
        asked_facts, (service, servicer, listen, stls, interceptors, kw) = built[:2]
        assert asked_facts == ("device_info", "cpu")                  # the machine's facts for the backend served
        assert (service, servicer, listen, stls, interceptors, kw) == \
            ("kvservice.v1.Worker", worker.servicer, "127.0.0.1:0", own_tls, [], {"max_workers": 4})
        assert worker.identity == {"worker_id": "w-8", "pool": "p", "backend": "cpu", "device_name": name,
                                   "epoch": rec.epoch, "incarnation": inc, "all_layers": False}
        assert worker.servicer.identity is worker.identity and rec.epoch > 0
        s = worker.servicer
        assert (s.test_hooks, s.max_table_rows, s.tables.max_tables, s.tables.quota_bytes, s.tables.plan.max_rows) == \
            (True, 5, 3, 123456, 5)
        assert (s.caches.layer_begin, s.caches.layer_end, s.caches.max_seq_len) == (1, 3, 64)
        assert s.ops is s.caches.ops is kernels_cpu                  # cpu_kernels="emulated": the g++-built .cu
        assert s.leader_fence.seen == made.epoch
        (beat,) = worker._threads
        assert (beat.name, beat.daemon, beat.is_alive()) == ("heartbeat", True, True)
        assert worker.metrics_port is None and worker._http is None
        with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as ch:       # registered: SERVING under both names
            health = health_pb2_grpc.HealthStub(ch)
            assert [health.Check(health_pb2.HealthCheckRequest(service=n), timeout=30).status
                    for n in ("", "kvservice.v1.Worker")] == [health_pb2.HealthCheckResponse.SERVING] * 2
        assert s.metrics.pool == "p" and s.metrics.registry.get_sample_value(
            "kvworker_cache_bytes", {"pool": "p"}) == s.caches.cache_bytes == 2 * SLOTS * 2 * PS * 2 * 32 * 4
        assert s.metrics.registry.get_sample_value("kvworker_state_rollbacks_total") == 0
        made.position.on_rollback(RuntimeError("rolled back"))
        assert s.metrics.registry.get_sample_value("kvworker_state_rollbacks_total") == 1
    finally:
        worker.stop()
    assert until(lambda: not beat.is_alive())


def test_a_worker_started_with_the_defaults_serves_every_layer_without_test_hooks(manager):
    """Defaults: layers [0, all), tp 0 of 1, backend cpu on 127.0.0.1, no metrics port, no test hooks, the NumPy
    kernels, the documented table bounds (kvworker serve: --max-table-rows 1024, at most the pool's slots;
    --max-tables 8; quota 4 x what one table of the pool holds), no token and no TLS towards the manager."""
    from kvservice.worker import ops_numpy

    target, _, _, built = manager
    worker = server.serve_worker(target, "p", "w-9")
    try:
        (made,) = Recording.made
        assert made.asked[0] == ("LeaderClient", target, 10, None, None, None, {})
        req = made.asked[-1][1]
        assert (req.layer_begin, req.layer_end, req.tp_rank, req.tp_size, req.backend) == (0, LAYERS, 0, 1, "cpu")
        s = worker.servicer
        assert (s.caches.layer_begin, s.caches.layer_end, s.caches.ops, s.test_hooks) == (0, LAYERS, ops_numpy, False)
        assert worker.identity["all_layers"] is True
        assert (s.max_table_rows, s.tables.max_tables, s.tables.plan.max_rows) == (1024, 8, SLOTS)
        assert s.tables.quota_bytes == 4 * s.tables.plan.held_bytes
        assert built[1][2] == "127.0.0.1:0" and worker.metrics_port is None
    finally:
        worker.stop()


def test_an_advertised_address_is_registered_as_given_and_metrics_listen_where_asked(manager):
    target, client, _, _ = manager
    worker = server.serve_worker(target, "p", "w-a", advertise="worker-a.example:7443", metrics_port=0,
                                 metrics_addr="127.0.0.1")
    try:
        (rec,) = client.workers("p")
        assert rec.address == "worker-a.example:7443"
        assert worker._http.server_address[0] == "127.0.0.1" and worker.metrics_port == worker._http.server_port > 0
    finally:
        worker.stop()


def test_a_worker_given_tokens_lets_in_only_a_token_of_its_pool(manager):
    """tokens: every call needs a bearer token granted the worker's pool (docs/SECURITY.md): none is UNAUTHENTICATED,
    one of another pool PERMISSION_DENIED, one of the pool answers."""
    from kvservice.contract.auth import TokenTable

    target, _, _, built = manager
    mine, other = "tok-pool-p-0123456789", "tok-pool-q-0123456789"
    table = TokenTable.from_yaml(f"tokens:\n  - {{name: pp, token: {mine}, pools: [p]}}\n"
                                 f"  - {{name: qq, token: {other}, pools: [q]}}\n")
    worker = server.serve_worker(target, "p", "w-t", tokens=table)
    try:
        assert len(built[1][4]) == 1
        with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as ch:
            stub = wpb_grpc.WorkerStub(ch)
            for md, code in (([], grpc.StatusCode.UNAUTHENTICATED),
                             ([("authorization", f"Bearer {other}")], grpc.StatusCode.PERMISSION_DENIED)):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Info(wpb.WorkerInfoRequest(), metadata=md, timeout=30)
                assert e.value.code() == code
            info = stub.Info(wpb.WorkerInfoRequest(), metadata=[("authorization", f"Bearer {mine}")], timeout=30)
            assert (info.worker_id, info.pool) == ("w-t", "p")
    finally:
        worker.stop()


def test_the_warm_check_reads_every_other_spaces_first_page_that_an_int32_table_can_name():
    """_warm validates, per layer, its first and last slot's pages and the first page (base + offset) of every other
    index space of the pool whose index fits int32 (<= 2^31 - 1, the last one a table can name), and no other.
    Pool: spaces [0, 4) (layer 0, served), [4, 2^31 - 1) and [2^31 - 1, 2^31 + 1) (not served, never allocated)."""
    import types

    from kvservice.contract.geometry import LayerSpec
    from kvservice.worker import ops_numpy
    from kvservice.worker.caches import CacheSet

    seen = []

    def validate_page_table(indptr, indices, last_page_len, layout, **kw):
        seen.append(indices.tolist())
        return ops_numpy.validate_page_table(indptr, indices, last_page_len, layout, **kw)

    ops = types.SimpleNamespace(guard_fill=ops_numpy.guard_fill, validate_page_table=validate_page_table)
    spec = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=16), LayerSpec(1, 64, sliding_window=32)), 16)
    caches = CacheSet(spec, [4, 2**31 - 5, 2], 0, 1, ops, guard_bytes=64)
    server._warm(caches)
    assert seen == [[0, 3, 4, 2**31 - 1]]
