"""The manager as a real process: Step over gRPC, every error path, health, reflection, metrics."""

import asyncio
import itertools
import re
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvservice.client import ClientError
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.pagetable import PageTable, validate_page_table
from kvservice.contract.sizing import Sizing
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import block_manager_pb2_grpc as pb_grpc
from kvservice.v1 import common_pb2 as cpb

pytestmark = pytest.mark.integration
_names = itertools.count()


def new_pool(client, spec=None, sizing=None, backends=()):
    name = f"p{next(_names)}"
    spec = spec or CacheSpec.uniform(4, 2, 64, "float16", 16)
    client.create_pool(name, spec, sizing or Sizing(num_slots=128, max_seq_len=2048), backends)
    return name


def pool_state(client, name):
    seqs = client.sequences(name)
    return [(s.seq_id, s.num_tokens) for s in seqs.sequences], client.stats(name)[name].num_free_slots


def test_embedded_default_pool_exists(client):
    info = client.get_pool("default")
    assert info.plan.num_slots == 64 * 256 and len(info.plan.layers) == 32


def test_step_roundtrip_matches_local_validation(client):
    name = new_pool(client)
    rng = np.random.default_rng(1)
    ids = np.arange(1, 9, dtype=np.uint64)
    r = client.step(name, admit=ids, admit_tokens=rng.integers(1, 100, 8), block_table=True)
    assert r.seq_ids.tolist() == ids.tolist()
    t = r.for_layer(3)
    assert t.slot_mapping.dtype == np.int64 and len(t.slot_mapping) == r.new_token_indptr[-1]
    assert t.table.indices.dtype == np.int32
    assert validate_page_table(t.table, t.space, 16).ok
    assert client.validate(name, 0, t.table).ok
    r2 = client.step(name, extend=ids, extend_tokens=1)
    assert (r2.num_tokens == r.num_tokens + 1).all()
    # Pages of each row are a prefix-extension of the previous step's.
    for b in range(8):
        before, after = r.for_layer(0).table.row(b), r2.for_layer(0).table.row(b)
        assert after[:len(before)].tolist() == before.tolist()
    client.step(name, free=ids)
    assert client.stats(name)[name].num_free_slots == 128


def test_seed000_resource_exhausted_over_grpc(client):
    name = new_pool(client, CacheSpec.uniform(32, 8, 128, "float16", 16), Sizing(num_slots=128, max_seq_len=2048))
    before = pool_state(client, name)
    with pytest.raises(ClientError) as exc:
        client.step(name, admit=np.arange(8), admit_tokens=2048)
    e = exc.value
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needs 1024 slots" in e.message and "128 are free" in e.message
    assert e.reason == "RESOURCE_EXHAUSTED" and e.metadata["needed"] == "1024" and e.metadata["free"] == "128"
    assert pool_state(client, name) == before


@pytest.mark.parametrize(("kwargs", "code", "words"), [
    ({"free": [999]}, grpc.StatusCode.NOT_FOUND, "sequence 999 is not in pool"),
    ({"admit": [1], "admit_tokens": 3}, grpc.StatusCode.ALREADY_EXISTS, "already in pool"),
    ({"extend": [1], "extend_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "must be > 0"),
    ({"admit": [5, 5], "admit_tokens": 1}, grpc.StatusCode.INVALID_ARGUMENT, "more than once"),
    ({"admit": [6], "admit_tokens": 5000}, grpc.StatusCode.INVALID_ARGUMENT, "max_seq_len=2048"),
    # salts and extra keys are counted on every pool, whether it caches prefixes or not, token ids or not
    ({"admit": [7, 8], "admit_tokens": 3, "salts": ["tenant-a"]}, grpc.StatusCode.INVALID_ARGUMENT,
     "admit_cache_salts has 1 entries for 2 admissions"),
    ({"admit": [7], "admit_tokens": 3, "extra_keys": ["lora-a", "lora-b"]}, grpc.StatusCode.INVALID_ARGUMENT,
     "admit_extra_keys has 2 entries for 1 admissions"),
    ({"admit": [7, 8], "admit_tokens": 3, "salts": ["a", "b", "c"], "prefix_caching": True},
     grpc.StatusCode.INVALID_ARGUMENT, "admit_cache_salts has 3 entries for 2 admissions"),
    ({"admit": [7, 8], "admit_tokens": 3, "extra_keys": ["k"], "prefix_caching": True},
     grpc.StatusCode.INVALID_ARGUMENT, "admit_extra_keys has 1 entries for 2 admissions"),
])
def test_bad_steps_over_grpc_change_nothing(client, kwargs, code, words):
    kwargs = dict(kwargs)
    if kwargs.pop("prefix_caching", False):
        name = f"p{next(_names)}"
        client.create_pool(name, CacheSpec.uniform(4, 2, 64, "float16", 16), Sizing(num_slots=128, max_seq_len=2048),
                           prefix_caching=True)
    else:
        name = new_pool(client)
    client.step(name, admit=[1], admit_tokens=20)
    before = pool_state(client, name)
    with pytest.raises(ClientError) as exc:
        client.step(name, **kwargs)
    assert exc.value.code == code and words in exc.value.message
    assert pool_state(client, name) == before


def test_malformed_wire_arrays_are_invalid_argument(manager):
    with grpc.insecure_channel(manager.target) as ch:
        stub = pb_grpc.BlockManagerStub(ch)
        bad = pb.StepRequest(pool="default", admit_seq_ids=cpb.Tensor(dtype=cpb.UINT64, data=b"\x01" * 7),
                             admit_num_tokens=cpb.Tensor(dtype=cpb.INT64, data=b"\x01" * 8))
        with pytest.raises(grpc.RpcError) as exc:
            stub.Step(bad, timeout=5)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "admit_seq_ids" in exc.value.details()
        with pytest.raises(grpc.RpcError) as exc:
            stub.Step(pb.StepRequest(pool="nope"), timeout=5)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "pool 'nope' does not exist" in exc.value.details()


def test_pool_errors(client):
    name = new_pool(client)
    with pytest.raises(ClientError) as exc:
        client.create_pool(name, CacheSpec.uniform(1, 1, 64), Sizing(num_slots=4))
    assert exc.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(ClientError) as exc:
        client.create_pool("fa2", CacheSpec.uniform(1, 1, 64, page_size=16), Sizing(num_slots=4), ("flash-attn2",))
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "flash-attn 2 needs page_size % 256 == 0" in exc.value.message
    assert exc.value.metadata["backend"] == "flash-attn2"
    with pytest.raises(ClientError) as exc:
        client.create_pool("bad name!", CacheSpec.uniform(1, 1, 64), Sizing(num_slots=4))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    client.step(name, admit=[1], admit_tokens=1)
    with pytest.raises(ClientError) as exc:
        client.delete_pool(name)
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    client.delete_pool(name, force=True)
    assert name not in [p.name for p in client.list_pools()]


def test_interleaved_pool_over_grpc_validates_per_layer(client):
    spec = CacheSpec((LayerSpec(2, 256), LayerSpec(2, 512)), 16, "interleaved")
    name = new_pool(client, spec, Sizing(num_slots=64, max_seq_len=512))
    info = client.get_pool(name)
    assert [s.scale for s in info.plan.index_spaces] == [4, 2]
    r = client.step(name, admit=np.arange(1, 7), admit_tokens=np.array([150, 60, 33, 100, 90, 70]))
    for layer in (0, 1):
        t = r.for_layer(layer)
        assert client.validate(name, layer, t.table).ok
    # Seed 004: the other layer's table. Disjoint index spaces: every entry is reported, whatever the numbers.
    for layer, other in ((1, 0), (0, 1)):
        table = r.for_layer(other).table
        wrong = client.validate(name, layer, table)
        assert not wrong.ok and wrong.num_violations == len(table.indices)
        assert {v.reason for v in wrong.violations} == {"wrong_index_space"}


def test_validate_reports_positions(client):
    name = new_pool(client)
    table = PageTable(np.array([0, 2, 3]), np.array([5, 128, 7]), np.array([16, 0]))
    rep = client.validate(name, 2, table)
    assert rep.num_violations == 2
    assert {(v.reason, v.row, v.position, v.value) for v in rep.violations} == {
        ("out_of_bounds", 0, 1, 128), ("bad_last_page_len", 1, -1, 0)}   # row-level: position -1
    with pytest.raises(ClientError) as exc:
        client.validate(name, 99, table)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "layer 99 does not exist" in exc.value.message


def test_plan_rpc(client):
    reply = client.plan(CacheSpec.uniform(32, 32, 128, "float16", 16), Sizing(max_batch=8, max_seq_len=2048))
    assert (reply.num_slots, reply.bytes_per_layer) == (1024, 268_435_456)


def test_health_and_reflection(manager):
    with grpc.insecure_channel(manager.target) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "kvservice.v1.BlockManager"):
            assert h.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        r = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=5)))
        names = {s.name for s in resp.list_services_response.service}
        assert {"kvservice.v1.BlockManager", "grpc.health.v1.Health"} <= names


def test_metrics_endpoint(client, manager):
    name = new_pool(client, sizing=Sizing(num_slots=8, max_seq_len=128))
    client.step(name, admit=[1, 2], admit_tokens=[17, 3])
    with pytest.raises(ClientError):
        client.step(name, admit=[3], admit_tokens=128)
    text = urllib.request.urlopen(manager.metrics_url, timeout=5).read().decode()
    assert f'kvservice_slots_total{{pool="{name}"}} 8.0' in text
    assert f'kvservice_slots_free{{pool="{name}"}} 5.0' in text
    assert f'kvservice_sequences{{pool="{name}"}} 2.0' in text
    assert f'kvservice_alloc_failures_total{{pool="{name}",reason="out_of_slots"}} 1.0' in text
    def value(series: str) -> float:
        return float(re.search(re.escape(series) + r" (\S+)", text).group(1))

    assert value('kvservice_rpc_duration_seconds_count{code="OK",method="Step"}') >= 1
    assert value('kvservice_rpc_duration_seconds_count{code="RESOURCE_EXHAUSTED",method="Step"}') >= 1
    assert value('kvservice_requests_refused_total{code="RESOURCE_EXHAUSTED",method="Step",'
                 'reason="RESOURCE_EXHAUSTED"}') >= 1


def test_async_client(manager):
    async def go():
        async with AsyncBlockManagerClient(manager.target, timeout=5) as c:
            await c.create_pool("async1", CacheSpec.uniform(2, 1, 64), Sizing(num_slots=16, max_seq_len=64))
            r = await c.step("async1", admit=[1, 2], admit_tokens=[5, 20])
            assert r.num_tokens.tolist() == [5, 20]
            with pytest.raises(ClientError) as exc:
                await c.step("async1", admit=[3], admit_tokens=64 * 16)
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert (await c.stats("async1"))["async1"].num_sequences == 2
            assert await c.echo(b"x") == b"x"
    asyncio.run(go())


def test_deadline_and_unavailable_are_reported():
    from kvservice.client import BlockManagerClient
    with BlockManagerClient("127.0.0.1:1", timeout=0.5, retries=1) as c:
        with pytest.raises(ClientError) as exc:
            c.list_pools()
        assert exc.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
