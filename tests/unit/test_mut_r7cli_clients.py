"""What each client's constructor builds, read whole (kvservice/client: aio_ha, ha, worker_client, client).

- AsyncLeaderClient / LeaderClient: one channel per address, each made with the client's TLS options, its retry
  policy's gRPC service config and (asyncio) its interceptors; the policy is FAILOVER_RETRY unless given (ha.py:
  "quick retries within the call's deadline, a silent manager left after 3 s, and no gRPC-level resend"), with
  `retries` extra attempts and `failover` replacing its bound; target is the addresses joined by commas, the token
  goes on every call, a registry gets the client's counters, and the route starts on the first address with no
  epoch seen.
- WorkerClient: one channel to its address whose service config lets gRPC resend only the calls that change
  nothing (worker_client.py: Info, DecodeAttention, ValidatePageTable, CheckGuards) with RetryPolicy's defaults.
- BlockManagerClient.step_stream / StepStream / AsyncStepStream: the stream's pool, page size (the pool's plan
  unless given), deltas, deadline (the client's unless given), stream id and the metadata of its calls (the
  client's token, then kvservice-stream-id).

Oracles: service configs written out by hand as gRFC A6 JSON (RetryPolicy's docstring: maxBackoff is
initial_backoff * multiplier, at most max_backoff), the proto's method lists, and the documented defaults.
"""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvservice.client import aio_ha, ha, worker_client
from kvservice.client.client import BlockManagerClient, TLSOptions
from kvservice.client.deadline import RetryPolicy
from kvservice.client.stream import AsyncStepStream, StepStream
from kvservice.client.worker_client import WorkerClient
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_mut_s21a_client import DEAD, Stub

MANAGER = "kvservice.v1.BlockManager"
#: The unary methods of block_manager.proto, in its order (WatchEvents, StepStream, EchoStream are streams).
UNARY = ["Plan", "CreatePool", "GetPool", "ListPools", "DeletePool", "Step", "ListSequences", "GetStats",
         "ValidatePageTable", "Echo", "RegisterWorker", "Heartbeat", "ListWorkers", "ScorePrefix"]
#: FAILOVER_RETRY as ha.py documents it.
FAILOVER = RetryPolicy(initial_backoff=0.05, max_backoff=0.25, attempt_timeout=3.0, grpc_attempts=1)
#: Its service config: no retryPolicy (one gRPC attempt), waitForReady off, for the whole service.
NO_RESEND = {"methodConfig": [{"name": [{"service": MANAGER}], "waitForReady": False}]}
#: A policy of our own: gRPC resends every unary call (4 tries, backoff 0.2 s capped at 0.2 * 1.5 s), waiting for ready.
OWN = RetryPolicy(attempts=6, initial_backoff=0.2, max_backoff=5.0, multiplier=1.5, grpc_attempts=4,
                  wait_for_ready=True)
OWN_CONFIG = {"methodConfig": [
    {"name": [{"service": MANAGER, "method": m} for m in UNARY], "waitForReady": True,
     "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.2s", "maxBackoff": "0.3s", "backoffMultiplier": 1.5,
                     "retryableStatusCodes": ["UNAVAILABLE"]}},
    {"name": [{"service": MANAGER}], "waitForReady": True}]}
#: RetryPolicy()'s service config (its defaults): gRPC resends every unary call, 3 tries, 0.05 s then 0.1 s.
DEFAULT_CONFIG = {"methodConfig": [
    {"name": [{"service": MANAGER, "method": m} for m in UNARY], "waitForReady": False,
     "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.1s", "backoffMultiplier": 2.0,
                     "retryableStatusCodes": ["UNAVAILABLE"]}},
    {"name": [{"service": MANAGER}], "waitForReady": False}]}
TLS = TLSOptions(ca=b"ca-pem", server_name="manager.example")


class Tap(grpc.aio.UnaryUnaryClientInterceptor):
    """A client interceptor that passes every call on (its identity is what the tests follow)."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(client_call_details, request)


def test_the_proto_lists_the_unary_methods_these_configs_name():
    methods = pb.DESCRIPTOR.services_by_name["BlockManager"].methods
    assert [m.name for m in methods if not (m.client_streaming or m.server_streaming)] == UNARY


class Made:
    """Records each channel a constructor makes (its arguments) and hands out a real plaintext one."""

    def __init__(self, factory):
        self.factory, self.calls, self.channels = factory, [], []

    def __call__(self, target, *args):
        self.calls.append((target, *args))
        ch = self.factory(target)
        self.channels.append(ch)
        return ch


def _route_is_fresh(c, channels):
    assert c._channels == channels and c._channel is channels[0] and len(c._stubs) == len(channels)
    assert (c._current, c.epoch, c.leader_node, c.stale_replies, c.serving_reports, c._closed) == (0, 0, "", 0, 0,
                                                                                                     False)
    assert c._health_calls == {} and c._watchers == []


def test_an_async_leader_client_makes_one_channel_per_address_with_its_tls_config_and_interceptors(monkeypatch):
    made = Made(grpc.aio.insecure_channel)
    monkeypatch.setattr(aio_ha, "make_aio_channel", made)
    tap = Tap()
    registry = CollectorRegistry()

    async def run():
        c = aio_ha.AsyncLeaderClient("127.0.0.1:1, 127.0.0.1:2,,127.0.0.1:3", timeout=7.5, tls=TLS, token="tk",
                                     registry=registry, interceptors=[tap])
        try:
            assert [call[0] for call in made.calls] == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
            for _, tls, config, interceptors in made.calls:
                assert tls is TLS and json.loads(config) == NO_RESEND and list(interceptors) == [tap]
            assert c.targets == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
            assert (c.target, c.timeout, c.retry) == ("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", 7.5, FAILOVER)
            assert c._metadata == (("authorization", "Bearer tk"),)
            assert repr(c) == "AsyncLeaderClient('127.0.0.1:1,127.0.0.1:2,127.0.0.1:3', token=set)"   # never the token
            assert registry.get_sample_value("kvservice_client_state_rollbacks_total") == 0.0
            assert c.position.on_rollback is not None and c.position.on_new_lineage is not None
            _route_is_fresh(c, made.channels)
            assert c._waiters == set()
        finally:
            await c.close()
    asyncio.run(run())


@pytest.mark.parametrize("kw, want", [
    ({}, FAILOVER),
    ({"retries": 2}, RetryPolicy(attempts=3, initial_backoff=0.05, max_backoff=0.25, attempt_timeout=3.0,
                                 grpc_attempts=1)),
    ({"failover": 4.0}, RetryPolicy(initial_backoff=0.05, max_backoff=0.25, attempt_timeout=3.0, grpc_attempts=1,
                                    failover=4.0)),
    ({"retry": OWN, "retries": 0}, OWN),
    ({"retry": OWN, "failover": 2.5}, RetryPolicy(attempts=6, initial_backoff=0.2, max_backoff=5.0, multiplier=1.5,
                                                  grpc_attempts=4, wait_for_ready=True, failover=2.5)),
])
def test_a_leader_clients_policy_and_its_channels_service_config(monkeypatch, kw, want):
    """Both leader clients: the policy (FAILOVER_RETRY unless given) is the client's and its channels'."""
    amade = Made(grpc.aio.insecure_channel)
    smade = Made(grpc.insecure_channel)
    monkeypatch.setattr(aio_ha, "make_aio_channel", amade)
    monkeypatch.setattr(ha, "make_channel", smade)
    config = OWN_CONFIG if "retry" in kw else NO_RESEND

    async def run():
        c = aio_ha.AsyncLeaderClient(["127.0.0.1:4", "127.0.0.1:5"], **kw)
        try:
            assert c.retry == want and c.timeout == 10.0 and c._metadata is None
            assert repr(c) == "AsyncLeaderClient('127.0.0.1:4,127.0.0.1:5', token=none)"
            assert [(t, tls, json.loads(cfg), tuple(i)) for t, tls, cfg, i in amade.calls] == \
                [("127.0.0.1:4", None, config, ()), ("127.0.0.1:5", None, config, ())]
        finally:
            await c.close()
    asyncio.run(run())
    with ha.LeaderClient(["127.0.0.1:4", "127.0.0.1:5"], **kw) as c:
        assert c.retry == want and c.timeout == 10.0 and c._metadata is None
        assert [(t, tls, json.loads(cfg)) for t, tls, cfg in smade.calls] == \
            [("127.0.0.1:4", None, config), ("127.0.0.1:5", None, config)]


def test_a_leader_client_makes_one_channel_per_address_with_its_tls_and_config(monkeypatch):
    made = Made(grpc.insecure_channel)
    monkeypatch.setattr(ha, "make_channel", made)
    registry = CollectorRegistry()
    with ha.LeaderClient(["127.0.0.1:6", " 127.0.0.1:7 "], timeout=4.25, tls=TLS, token="tk2",
                         registry=registry) as c:
        assert [(t, tls, json.loads(cfg)) for t, tls, cfg in made.calls] == \
            [("127.0.0.1:6", TLS, NO_RESEND), ("127.0.0.1:7", TLS, NO_RESEND)]
        assert c.targets == ["127.0.0.1:6", "127.0.0.1:7"]
        assert (c.target, c.timeout, c.retry) == ("127.0.0.1:6,127.0.0.1:7", 4.25, FAILOVER)
        assert c._metadata == (("authorization", "Bearer tk2"),)
        assert registry.get_sample_value("kvservice_client_lineage_changes_total") == 0.0
        _route_is_fresh(c, made.channels)


def test_a_worker_clients_channel_resends_only_the_calls_that_change_nothing(monkeypatch):
    made = Made(grpc.insecure_channel)
    monkeypatch.setattr(worker_client, "make_channel", made)
    resend = {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.1s", "backoffMultiplier": 2.0,
              "retryableStatusCodes": ["UNAVAILABLE"]}
    want = {"methodConfig": [
        {"name": [{"service": "kvservice.v1.Worker", "method": m}
                  for m in ("Info", "DecodeAttention", "ValidatePageTable", "CheckGuards")],     # worker.proto order
         "waitForReady": False, "retryPolicy": resend},
        {"name": [{"service": "kvservice.v1.Worker"}], "waitForReady": False}]}
    epoch = lambda: 9                                                             # noqa: E731
    with WorkerClient("127.0.0.1:8", "w-8", 2.5, tls=TLS, token="wt", pool_incarnation=12, leader_epoch=epoch) as w:
        [(target, tls, config)] = made.calls
        assert (target, tls, json.loads(config)) == ("127.0.0.1:8", TLS, want)
        assert (w.address, w.worker_id, w.timeout, w.pool_incarnation, w.leader_epoch) == \
            ("127.0.0.1:8", "w-8", 2.5, 12, epoch)
        assert w._metadata == (("authorization", "Bearer wt"),) and w._channel is made.channels[0]
    with WorkerClient("127.0.0.1:9") as w:                                        # the defaults
        assert (made.calls[1][0], made.calls[1][1], json.loads(made.calls[1][2])) == ("127.0.0.1:9", None, want)
        assert (w.worker_id, w.timeout, w.pool_incarnation, w.leader_epoch, w._metadata) == \
            ("127.0.0.1:9", 30.0, 0, 0, None)


STREAM_ID = re.compile(r"s-[0-9a-f]{32}")


def test_step_stream_hands_the_stream_its_pool_deltas_deadline_and_id():
    """BlockManagerClient.step_stream: nothing is opened yet; the page size is the pool's plan's (one GetPool)."""
    with BlockManagerClient(DEAD, timeout=42.0, token="st") as c:
        c._stub = stub = Stub(GetPool=pb.PoolInfo(name="p", plan=pb.PlanReply(page_size=16)))
        s = c.step_stream("p", deltas=False, timeout=2.5, stream_id="s-given")
        assert (s.client, s.pool, s.deltas, s.timeout, s.stream_id, s.mirror.page_size) == \
            (c, "p", False, 2.5, "s-given", 16)
        assert s._metadata == (("authorization", "Bearer st"), ("kvservice-stream-id", "s-given"))
        d = c.step_stream("q")
        assert (d.pool, d.deltas, d.timeout, d.mirror.page_size) == ("q", True, 42.0, 16)
        assert STREAM_ID.fullmatch(d.stream_id) and d.stream_id != s.stream_id
        assert (d.seq, d.pending, d.reconnects, d._call, d._watchdog) == (0, None, 0, None, None)
    assert [(m, r) for m, r, _, _ in stub.calls] == [("GetPool", pb.GetPoolRequest(pool="p")),
                                                      ("GetPool", pb.GetPoolRequest(pool="q"))]


@pytest.mark.parametrize("token", [None, "tok"])
def test_a_streams_calls_carry_the_clients_token_then_the_stream_id(token):
    md = (("authorization", f"Bearer {token}"),) if token else None
    client = SimpleNamespace(timeout=3.0, _metadata=md)
    s = StepStream(client, "p", page_size=8, stream_id="s-1")
    a = AsyncStepStream(client, "p", 8, stream_id="s-2")
    head = (("authorization", "Bearer tok"),) if token else ()
    assert s._metadata == (*head, ("kvservice-stream-id", "s-1"))
    assert a._metadata == (*head, ("kvservice-stream-id", "s-2"))
    assert (s.pool, s.deltas, s.timeout, s.mirror.page_size) == ("p", True, 3.0, 8)
    assert (a.client, a.pool, a.deltas, a.timeout, a.stream_id, a.mirror.page_size) == (client, "p", True, 3.0,
                                                                                          "s-2", 8)
    b = AsyncStepStream(client, "r", 32, False, 0.75)
    assert (b.pool, b.deltas, b.timeout, b.mirror.page_size, b._call, b._checked_call) == ("r", False, 0.75, 32,
                                                                                           None, None)
    assert STREAM_ID.fullmatch(b.stream_id)


BASE = [("grpc.max_receive_message_length", 256 * 1024 * 1024), ("grpc.max_send_message_length", 256 * 1024 * 1024),
        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000)]


def test_make_channel_and_make_aio_channel_pass_target_options_credentials_and_interceptors(monkeypatch):
    """A plaintext channel, or a TLS one with the options' credentials (client.py's make_channel; aio.py's twin
    adds the interceptors): the channel options are the limits and reconnect backoff, the TLS name, the config."""
    from kvservice.client import aio
    from kvservice.client.client import make_channel

    got = []
    monkeypatch.setattr(grpc, "ssl_channel_credentials", lambda **kw: ("creds", tuple(sorted(kw.items()))))
    for mod, kind in ((grpc, "sync"), (grpc.aio, "aio")):
        monkeypatch.setattr(mod, "insecure_channel",
                            lambda target, options=None, kind=kind, **kw: got.append((kind, "plain", target, None,
                                                                                      options, kw)) or "ch")
        monkeypatch.setattr(mod, "secure_channel",
                            lambda target, creds, options=None, kind=kind, **kw: got.append((kind, "tls", target, creds,
                                                                                             options, kw)) or "ch")
    tls = TLSOptions(ca=b"ca", cert=b"crt", key=b"k", server_name="m.example")
    tap = Tap()
    cfg = '{"methodConfig": []}'
    assert make_channel("h:1") == make_channel("h:2", tls, cfg) == "ch"
    assert aio.make_aio_channel("h:3", None, cfg, [tap]) == aio.make_aio_channel("h:4", tls) == "ch"
    creds = ("creds", (("certificate_chain", b"crt"), ("private_key", b"k"), ("root_certificates", b"ca")))
    named = ("grpc.ssl_target_name_override", "m.example")
    assert got == [("sync", "plain", "h:1", None, BASE, {}),
                   ("sync", "tls", "h:2", creds, [*BASE, named, ("grpc.service_config", cfg)], {}),
                   ("aio", "plain", "h:3", None, [*BASE, ("grpc.service_config", cfg)], {"interceptors": [tap]}),
                   ("aio", "tls", "h:4", creds, [*BASE, named], {"interceptors": ()})]


def test_an_async_clients_constructor_defaults_and_arguments(monkeypatch):
    from kvservice.client import aio

    made = []
    monkeypatch.setattr(aio, "make_aio_channel", lambda *a: made.append(a) or grpc.aio.insecure_channel(a[0]))
    registry = CollectorRegistry()

    async def run():
        d = aio.AsyncBlockManagerClient("h:5")
        assert (d.target, d.timeout, d.retry, d._metadata, d.position.on_rollback) == ("h:5", 10.0, RetryPolicy(),
                                                                                       None, None)
        c = aio.AsyncBlockManagerClient("h:6", 2.5, tls=TLS, token="t6", registry=registry, failover=3.0)
        assert (c.retry, c._metadata) == (RetryPolicy(failover=3.0), (("authorization", "Bearer t6"),))
        assert c.position.on_rollback is not None and c._channel is not None and c._stub is not None
        assert registry.get_sample_value("kvservice_client_state_rollbacks_total") == 0.0
        assert [(a[0], a[1], a[3]) for a in made] == [("h:5", None, ()), ("h:6", TLS, ())]
        assert repr(c) == "AsyncBlockManagerClient('h:6', token=set)" and "t6" not in repr(c)
        assert repr(d) == "AsyncBlockManagerClient('h:5', token=none)"
        for x in (c, d):
            await x.close()
    asyncio.run(run())
