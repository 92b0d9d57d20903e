"""Wire encoding of arrays, pool YAML config, and proto conversions."""

import numpy as np
import pytest

from kvservice.contract import convert
from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.server.config import DEFAULT_POOLS_YAML, load_pools
from kvservice.v1 import common_pb2 as cpb


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint64, np.float16, np.float32])
def test_roundtrip(dtype):
    a = (np.random.default_rng(0).random((3, 5)) * 100).astype(dtype)
    t = to_tensor(a)
    assert list(t.shape) == [3, 5] and len(t.data) == a.nbytes
    b = from_tensor(t, "x", kinds="iuf")
    assert b.dtype == a.dtype and (b == a).all()


def test_big_endian_input_is_written_little_endian():
    a = np.array([1, 2, 258], dtype=">i4")
    assert to_tensor(a).data == np.array([1, 2, 258], dtype="<i4").tobytes()


@pytest.mark.parametrize(("t", "match"), [
    (cpb.Tensor(dtype=cpb.INT64, data=b"\x00" * 7), "whole number"),
    (cpb.Tensor(dtype=cpb.INT32, shape=[3], data=b"\x00" * 8), "declares 3 items but the data holds 2"),
    # issue #11 item 1: the int64 product of these extents wraps to 0 (or 1), matching empty (or 1-item) data
    (cpb.Tensor(dtype=cpb.UINT64, shape=[2**32, 2**32]), "declares 18446744073709551616 items"),
    (cpb.Tensor(dtype=cpb.INT64, shape=[2**32, 2**32, 1], data=b"\x01" * 8), "declares 18446744073709551616"),
    (cpb.Tensor(dtype=cpb.INT32, shape=[2**63 - 1, 2**63 - 1, 2**63 - 1], data=b"\x01" * 4), "declares"),
    # empty data, but extents NumPy cannot even describe
    (cpb.Tensor(dtype=cpb.INT64, shape=[2**62, 0]), "more than 2\\^62 bytes"),
    (cpb.Tensor(dtype=cpb.INT32, shape=[2**31, 0, 2**31]), "more than 2\\^62 bytes"),
    (cpb.Tensor(dtype=cpb.INT32, shape=[1] * 9, data=b"\x00" * 4), "at most 8 dimensions"),
    (cpb.Tensor(dtype=cpb.INT32, shape=[-1, 2], data=b"\x00" * 8), "bad shape"),
    (cpb.Tensor(dtype=cpb.FLOAT32, data=b"\x00" * 8), "not allowed"),
    (cpb.Tensor(dtype=cpb.DTYPE_UNSPECIFIED, data=b""), "not an array dtype"),
    (cpb.Tensor(dtype=99, data=b""), "not an array dtype"),
])
def test_malformed_tensors(t, match):
    with pytest.raises(InvalidArgument, match=match):
        from_tensor(t, "field")


@pytest.mark.parametrize(("shape", "n"), [([0, 2], 0), ([0], 0), ([2**40, 0], 0), ([1, 3, 1], 3)])
def test_empty_and_degenerate_shapes_decode(shape, n):
    """Shapes with a zero extent (empty pairs [0, 2]) and unit extents are legal when the data agrees."""
    data = np.arange(1, n + 1, dtype="<i8").tobytes()
    a = from_tensor(cpb.Tensor(dtype=cpb.INT64, shape=shape, data=data), "f")
    assert a.shape == tuple(shape) and a.ravel().tolist() == list(range(1, n + 1))


def test_cache_spec_proto_roundtrip_run_length():
    layers = (LayerSpec(8, 128),) * 3 + (LayerSpec(4, 256, "bfloat16", 1024),) + (LayerSpec(8, 128),)
    spec = CacheSpec(layers, 32, "interleaved")
    msg = convert.cache_spec_to_proto(spec)
    assert [ls.count for ls in msg.layers] == [3, 1, 1]
    assert convert.cache_spec_from_proto(msg) == spec


def test_default_pools_parse():
    (pc,) = load_pools(DEFAULT_POOLS_YAML)
    assert pc.name == "default" and len(pc.spec.layers) == 32 and pc.sizing.max_batch == 64


@pytest.mark.parametrize(("text", "match"), [
    ("pools: 3", "expected a list, got 3"),
    ("pools: [{page_size: 16}]", "each pool needs a name"),
    ("pools: [{name: a, layers: [{kv_heads: 1, head_dim: 64, colour: red}]}]", "layers\\[0\\]"),
    ("pools: [{name: a, layers: [{kv_heads: 1, head_dim: 64}], sizing: {slots: 3}}]", "pools\\[0\\]"),
    ("pools: [", "not valid YAML"),
])
def test_bad_pool_yaml(text, match):
    with pytest.raises(InvalidArgument, match=match):
        load_pools(text)


STRICT = """pools:
  - name: chat
    page_size: 16
    layers:
      - {count: 2, kv_heads: 8, head_dim: 128, dtype: bfloat16}
    sizing:
      max_batch: 8
      max_seq_len: 1024
    prefix_cachng: true
"""


@pytest.mark.parametrize(("text", "message"), [
    (STRICT, "pools.yaml: pools[0]: unknown key 'prefix_cachng' (line 9); did you mean 'prefix_caching'?"),
    (STRICT.replace("prefix_cachng", "prefix_caching").replace("max_seq_len", "max_seqlen"),
     "pools.yaml: pools[0].sizing: unknown key 'max_seqlen' (line 8); did you mean 'max_seq_len'?"),
    (STRICT.replace("    prefix_cachng: true\n", "").replace("dtype: bfloat16", "dtype: bfloat16, colour: red"),
     "pools.yaml: pools[0].layers[0]: unknown key 'colour' (line 5)"),
    (STRICT.replace("prefix_cachng: true", "prefix_caching: yes please"),
     "pools.yaml: pools[0].prefix_caching (line 9): expected true or false, got 'yes please'"),
    (STRICT.replace("prefix_cachng: true", "page_size: 32"),
     "line 9: key 'page_size' is given twice (first on line 3)"),
    (STRICT.replace("prefix_cachng: true", "block_size: 32"),
     "'block_size' (line 9) and 'page_size' are the same setting"),
    (STRICT.replace("prefix_cachng: true", "tp: 2"), "'tp' (line 9) goes with model_config"),
    # a setting given under its vLLM alias has no line of its own under the canonical name: the pool's line
    (STRICT.replace("prefix_cachng: true", "tensor_parallel_size: 2"),
     "pools[0]: 'tp' (line 2) goes with model_config"),
    (STRICT.replace("prefix_cachng: true", "allow_unknown_keys: true"),
     "pools.yaml: pools[0]: 'allow_unknown_keys' (line 9) goes with model_config"),
    (STRICT.replace("prefix_cachng: true", "dtype: float16"),
     "pools.yaml: pools[0]: 'dtype' (line 9) of a pool goes with model_config; give each layer run its dtype"),
    (STRICT.replace("name: chat", 'name: ""'), "pools.yaml: pools[0].name (line 2): expected a non-empty string, "
     "got ''"),
    (STRICT.replace("max_batch: 8", "max_batch: -8").replace("    prefix_cachng: true\n", ""),
     "pools[0].sizing.max_batch (line 7): expected an integer >= 0"),
    (STRICT.replace("    prefix_cachng: true\n", "")
     + "  - name: chat\n    layers: [{kv_heads: 1, head_dim: 64}]\n    sizing: {num_slots: 4}\n",
     "pool name 'chat' is used twice"),
])
def test_pools_yaml_is_strict_and_names_key_and_line(text, message):
    with pytest.raises(InvalidArgument) as err:
        load_pools(text, "pools.yaml")
    assert message in err.value.message, err.value.message


def test_pools_yaml_prefix_caching_vllm_names_and_human_sizes():
    text = STRICT.replace("prefix_cachng", "enable_prefix_caching").replace("page_size", "block_size") \
        .replace("max_batch", "max_num_seqs").replace("max_seq_len: 1024", "max_model_len: 1024\n      "
                                                      "memory_budget: 50%\n      device_memory: 2GiB")
    (pc,) = load_pools(text)
    assert pc.prefix_caching and pc.spec.page_size == 16
    assert (pc.sizing.max_batch, pc.sizing.max_seq_len, pc.sizing.memory_budget_bytes) == (8, 1024, 2**30)
    (plain,) = load_pools(STRICT.replace("    prefix_cachng: true\n", ""))
    assert not plain.prefix_caching


def test_configured_pools_are_created_with_their_prefix_caching_model_and_sizing():
    from kvservice.manager.pools import BlockManager
    from kvservice.state.journal import Journal
    from kvservice.state.startup import ensure_pools

    text = STRICT.replace("prefix_cachng: true", "prefix_caching: true\n    model: org/chat-model") \
        .replace("max_seq_len: 1024", "max_seq_len: 1024\n      max_num_batched_tokens: 512") \
        .replace("head_dim: 128, dtype: bfloat16}", "head_dim: 128, dtype: bfloat16}\n      "
                 "- {kv_heads: 8, head_dim: 128, dtype: bfloat16, sliding_window: 64}")
    j = Journal(BlockManager())
    assert ensure_pools(j, load_pools(text)) == ["chat"]
    with j.manager.locked("chat") as pool:
        assert pool.prefix is not None and pool.model == "org/chat-model"
        # full group 8 x 64 pages; sliding group 8 x (64 / 16 + 1) + 512 / 16
        assert pool.plan.group_slots == (8 * 64, 8 * 5 + 32)


def test_plan_reply_lists_every_groups_layers():
    """PlanReply's groups name their layers: each layer exactly once, in the group its LayerPlan names, and only
    layers of that group's window (checked from the spec's own per-layer windows, not the geometry's grouping)."""
    from kvservice.contract.sizing import Sizing
    from kvservice.core.planner import plan

    rng = np.random.default_rng(28)
    for _ in range(5):
        windows = [int(w) for w in rng.choice([0, 0, 64, 256], size=int(rng.integers(2, 9)))]
        spec = CacheSpec(tuple(LayerSpec(2, 64, "float16", w) for w in windows), 16)
        reply = convert.plan_to_proto(plan(spec, Sizing(max_batch=3, max_seq_len=512)))
        listed = sorted(la for g in reply.groups for la in g.layers)
        assert listed == list(range(len(windows)))
        for g in reply.groups:
            assert list(g.layers) == sorted(g.layers) and len(g.layers) > 0
            assert {windows[la] for la in g.layers} == {g.sliding_window}
            assert {reply.layers[la].group for la in g.layers} == {g.group}


def test_pools_yaml_errors_name_the_document_even_without_a_source():
    """load_pools without a source names the document "<pools>", as its signature says."""
    with pytest.raises(InvalidArgument) as err:
        load_pools("pools: [{name: a, layers: [{kv_heads: 1, head_dim: 64}], colour: red}]")
    assert err.value.message.startswith("<pools>: pools[0]: unknown key 'colour' (line 1)"), err.value.message


def test_a_configured_pool_is_created_with_its_prefix_hash_mode_and_seed():
    """PoolConfig.prefix_hash / prefix_hash_seed reach the pool ensure_pools creates (not the server's default
    mode, "kvservice", docs: core/hashing.py's modes)."""
    from kvservice.contract.sizing import Sizing
    from kvservice.manager.pools import BlockManager
    from kvservice.server.config import PoolConfig
    from kvservice.state.journal import Journal
    from kvservice.state.startup import ensure_pools

    pc = PoolConfig("h", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=8, max_seq_len=64), (),
                    prefix_caching=True, prefix_hash="vllm-sha256-cbor", prefix_hash_seed="seed-41")
    j = Journal(BlockManager())
    assert ensure_pools(j, [pc]) == ["h"]
    with j.manager.locked("h") as pool:
        assert (pool.prefix_hash, pool.prefix_hash_seed) == ("vllm-sha256-cbor", "seed-41")
