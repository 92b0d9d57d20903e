"""Our ZeroMQ event payloads decoded by vLLM's own structs (vllm/distributed/kv_events.py of the 0.11 and 0.33
wheels, tests/vllm_ref.py), each in the wire format of its version (--kv-events-format)."""

import time

import msgspec
import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.cache_events import AllBlocksCleared, Batch, BlockRemoved, BlockStored, pool_caches, state_events
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.events.zmq import FORMATS, to_vllm
from kvservice.manager.event_log import LoggedBatch
from tests.vllm_ref import module

PS = 4
VERSION = {"vllm-0.33": "0.33.0", "vllm-0.11": "0.11.0"}
ENCODER = msgspec.msgpack.Encoder()


def _pool() -> Pool:
    """A hybrid pool (a full and a sliding group), so events name layer groups of both kinds."""
    spec = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=6)), PS, "per_layer")
    return Pool("e", plan(spec, Sizing(num_slots=24, max_seq_len=64)), prefix_caching=True)


def _batches(pool: Pool) -> list[LoggedBatch]:
    """Random prompts with salts and extra keys, some frees and evictions: every step's batch."""
    rng = np.random.default_rng(23)
    out, live, nxt = [], [], 1
    system = rng.integers(1, 30_000, 8)
    for _ in range(30):
        free = [live.pop(0)] if len(live) > 2 else []
        n = int(rng.integers(5, 21))
        tok = np.concatenate((system, rng.integers(1, 30_000, n)))
        salt, key = [("", ""), ("tenant-a", ""), ("", "lora-3"), ("tenant-b", "lora-9")][int(rng.integers(4))]
        pool.step(free_ids=free or None, admit_ids=[nxt], admit_tokens=[len(tok)], admit_token_ids=tok,
                  admit_salts=[salt], admit_extra_keys=[key])
        live.append(nxt)
        nxt += 1
        b = pool.events.take_batch(pool_caches(pool))
        if b is not None:
            out.append(LoggedBatch(b, time.time(), 0))
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_vllms_own_structs_decode_every_batch(fmt):
    kv = module(VERSION[fmt], "vllm.distributed.kv_events")
    decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    pool = _pool()
    batches = _batches(pool)
    reset = LoggedBatch(Batch(99, (AllBlocksCleared(), *state_events(pool_caches(pool))), reset=True), time.time(), 0)
    kinds, salted = set(), 0
    for lb in [*batches, reset]:
        payload = ENCODER.encode(to_vllm(lb, fmt=fmt))
        got = decoder.decode(payload)
        assert ENCODER.encode(got) == payload                    # byte for byte what vLLM itself encodes
        assert got.data_parallel_rank == 0 and len(got.events) == len(lb.batch.events)
        for mine, theirs in zip(lb.batch.events, got.events, strict=True):
            assert type(theirs).__name__ == type(mine).__name__
            kinds.add(type(mine).__name__)
            if isinstance(mine, AllBlocksCleared):
                continue
            assert theirs.block_hashes == mine.block_hashes.tolist() and theirs.medium == "GPU"
            if fmt == "vllm-0.33":
                assert theirs.group_idx == mine.group
            if isinstance(mine, BlockStored):
                assert theirs.parent_block_hash == (mine.parent_block_hash or None)
                assert theirs.token_ids == mine.token_ids.tolist() and theirs.block_size == PS
                if fmt == "vllm-0.33":
                    assert theirs.kv_cache_spec_kind == mine.kind
                    assert theirs.kv_cache_spec_sliding_window == (mine.sliding_window or None)
                    want = None if not mine.extra_keys or not any(mine.extra_keys) else \
                        [tuple(k) if k else None for k in mine.extra_keys]
                    assert theirs.extra_keys == want
                    salted += bool(want)
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert fmt == "vllm-0.11" or salted > 3


def test_extra_keys_carry_the_salt_on_first_pages_and_the_extra_key_on_all():
    pool = _pool()
    tok = np.arange(1, 14)
    pool.step(admit_ids=[1], admit_tokens=[13], admit_token_ids=tok, admit_salts=["t"], admit_extra_keys=["lora"])
    full = [e for e in pool.events.take_batch(pool_caches(pool)).events if e.group == 0]
    assert [tuple(k) for e in full for k in e.extra_keys] == [("lora", "t"), ("lora",), ("lora",)]
    msg = to_vllm(LoggedBatch(Batch(1, tuple(full)), 0.0, 0))
    assert msg.events[0].extra_keys == [("lora", "t"), ("lora",), ("lora",)]


def test_the_0_11_decoder_refuses_the_0_33_format():
    """Why the flag exists: vLLM 0.11's decoder rejects the tagged maps of 0.33 (issue 23)."""
    kv = module("0.11.0", "vllm.distributed.kv_events")
    pool = _pool()
    lb = _batches(pool)[0]
    with pytest.raises(msgspec.ValidationError, match="Expected `array`, got `object`"):
        msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(ENCODER.encode(to_vllm(lb, fmt="vllm-0.33")))


def test_a_reset_lists_every_parent_before_its_children():
    pool = _pool()
    _batches(pool)
    seen: dict[int, set[int]] = {}
    events = state_events(pool_caches(pool))
    assert len(events) == sum(len(c.by_hash) for c in pool_caches(pool)) > 20
    chained = 0
    for e in events:
        mine = seen.setdefault(e.group, set())
        if e.parent_block_hash and e.parent_block_hash in {int(h) for c in pool_caches(pool)
                                                           if c.sink.group == e.group for h in c.by_hash}:
            assert e.parent_block_hash in mine, "a child came before its parent"
            chained += 1
        mine.update(e.block_hashes.tolist())
    assert chained > 10


def test_removed_events_name_their_group():
    assert BlockRemoved(1, np.array([5], dtype=np.uint64)).group == 1


def test_watch_events_messages_carry_the_same_extra_keys():
    from kvservice.events.messages import event_to_proto, proto_to_events
    from kvservice.v1 import block_manager_pb2 as pb

    pool = _pool()
    tok = np.arange(1, 14)
    pool.step(admit_ids=[1], admit_tokens=[13], admit_token_ids=tok, admit_salts=["t"], admit_extra_keys=["lora"])
    pool.step(admit_ids=[2], admit_tokens=[13], admit_token_ids=tok + 100)          # no keys at all
    events = pool.events.take_batch(pool_caches(pool)).events
    back = proto_to_events(pb.KVEventBatch(events=[event_to_proto(e) for e in events]))
    assert [getattr(e, "extra_keys", None) for e in back] == [getattr(e, "extra_keys", None) for e in events]
    assert any(e.extra_keys for e in back if isinstance(e, BlockStored))
    assert any(isinstance(e, BlockStored) and e.extra_keys is None for e in back)


def test_a_reset_carries_the_same_extra_keys_as_the_live_events():
    """A subscriber that falls behind gets the cache's whole content again (state_events): each page's BlockStored
    carries the salt on the prompt's first page and the extra key on all, as the live events did."""
    from kvservice.core.cache_events import state_events

    pool = _pool()
    pool.step(admit_ids=[1], admit_tokens=[13], admit_token_ids=np.arange(1, 14), admit_salts=["t"],
              admit_extra_keys=["lora"])
    pool.step(admit_ids=[2], admit_tokens=[9], admit_token_ids=np.arange(50, 59))         # no salt, no key
    reset = [e for e in state_events(pool_caches(pool)) if e.group == 0]
    keys = [[tuple(k) for k in e.extra_keys] if e.extra_keys else None for e in reset]
    assert sorted(map(repr, keys)) == sorted(map(repr, [[("lora", "t")], [("lora",)], [("lora",)], None, None]))


def test_pool_info_names_the_hash_mode_and_only_vllms_mode_carries_a_seed():
    """PoolInfo.prefix_hash_seed is the vllm-sha256-cbor seed (block_manager.proto); a kvservice-hash pool has
    none to report, so GetPool and ListPools leave it empty."""
    from kvservice.manager.api import ManagerAPI
    from kvservice.manager.pools import BlockManager
    from kvservice.v1 import block_manager_pb2 as pb

    m = BlockManager()
    spec, sizing = CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=16, max_seq_len=64)
    m.create_pool("own", spec, sizing, prefix_caching=True)
    m.create_pool("vl", spec, sizing, prefix_caching=True, prefix_hash="vllm-sha256-cbor", prefix_hash_seed="4242")
    api = ManagerAPI(m)
    own, vl = api.GetPool(pb.GetPoolRequest(pool="own")), api.GetPool(pb.GetPoolRequest(pool="vl"))
    assert (own.prefix_hash, own.prefix_hash_seed) == ("kvservice", "")
    assert (vl.prefix_hash, vl.prefix_hash_seed) == ("vllm-sha256-cbor", "4242")
    listed = {p.name: (p.prefix_hash, p.prefix_hash_seed) for p in api.ListPools(pb.ListPoolsRequest()).pools}
    assert listed == {"own": ("kvservice", ""), "vl": ("vllm-sha256-cbor", "4242")}


def test_prefix_hash_seed_is_1_to_256_printable_characters():
    """A 256-character seed is a pool's; 257 characters, an empty or unprintable seed is refused, no pool made."""
    from kvservice.contract.errors import InvalidArgument
    from kvservice.manager.pools import BlockManager

    m = BlockManager()
    spec, sizing = CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=16, max_seq_len=64)
    seed = "".join(np.random.default_rng(256).choice(list("abcdefxyz0189-"), 256))
    m.create_pool("ok", spec, sizing, prefix_caching=True, prefix_hash="vllm-sha256-cbor", prefix_hash_seed=seed)
    for i, bad in enumerate((seed + "q", "", "tab\there")):
        with pytest.raises(InvalidArgument,
                           match=f"prefix_hash_seed must be 1..256 printable characters, got {len(bad)}"):
            m.create_pool(f"bad{i}", spec, sizing, prefix_caching=True, prefix_hash="vllm-sha256-cbor",
                          prefix_hash_seed=bad)
    assert m.pool_names() == ["ok"]
