"""ManagerAPI's smaller replies checked whole: ListSequences' refusal (manager/api.py's documented rule: 64 bytes
for the reply's own fields and SEQUENCE_INFO_BYTES + 11 per layer group for each listed sequence) with its exact
message, reason and metadata, for a pool of one and of two layer groups, with and without a limit in the request;
ValidatePageTable's every Violation field for each kind of bad entry, checked against the index space of the layer
asked (docs/DESIGN.md: space s of an interleaved pool holds pages [base, upper_bound) on the lattice base + offset
+ k * scale); GetPool's every PoolInfo field; and a ManagerAPI made with no options has no reply limit, no fencing
and nothing to reserve."""

import numpy as np
import pytest

from kvservice.contract.convert import cache_spec_to_proto, sizing_to_proto
from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.api import SEQUENCE_INFO_BYTES, ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from tests.unit.test_mut_s18mgr_api import _i64, _u64


def test_a_manager_api_made_with_no_options_has_no_limit_no_fence_and_no_reservation():
    m = BlockManager()
    api = ManagerAPI(m)
    assert (api.manager, api.max_reply_bytes, api.fence, api.reserve_reply) == (m, 0, False, None)


@pytest.mark.parametrize("groups", [1, 2])
def test_list_sequences_over_the_limit_names_the_pool_the_counts_the_limit_and_what_fits(groups):
    rng = np.random.default_rng(7075 + groups)
    layers = (LayerSpec(1, 64),) if groups == 1 else (LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=8))
    m = BlockManager()
    m.create_pool("seqs-1", CacheSpec(layers, 4), Sizing(num_slots=400, max_seq_len=64))
    n = int(rng.integers(20, 40))
    ids = rng.permutation(np.unique(rng.integers(1, 10**9, 2 * n))[:n])
    ManagerAPI(m).Step(pb.StepRequest(pool="seqs-1", admit_seq_ids=_u64(ids),
                                      admit_num_tokens=_i64(rng.integers(1, 30, n))))
    per_seq = SEQUENCE_INFO_BYTES + 11 * groups
    k = int(rng.integers(3, n - 5))
    limit = 64 + k * per_seq + int(rng.integers(per_seq))        # room for k sequences, not k + 1
    api = ManagerAPI(m, max_reply_bytes=limit)
    for asked, listing in ((0, n), (k + 1, k + 1), (n + 10, n)):
        with pytest.raises(ResourceExhausted) as e:
            api.ListSequences(pb.ListSequencesRequest(pool="seqs-1", limit=asked))
        assert (e.value.message, e.value.reason, e.value.metadata) == (
            f"pool 'seqs-1' holds {n} sequences; listing {listing} of them could pass this server's message limit "
            f"of {limit} bytes; pass limit <= {k}", "REPLY_TOO_LARGE", {"limit": str(limit), "fits": str(k)})
    reply = api.ListSequences(pb.ListSequencesRequest(pool="seqs-1", limit=k))
    assert reply.total == n and [s.seq_id for s in reply.sequences] == sorted(ids.tolist())[:k]
    assert len(ManagerAPI(m).ListSequences(pb.ListSequencesRequest(pool="seqs-1")).sequences) == n


def test_validate_page_table_reports_every_field_of_each_violation_in_the_layers_own_space():
    """Layer 1 of a 2-layer interleaved pool of 10 slots (40 pages, page size 4): its space 1 holds pages [20, 40),
    those with (page - 21) % 2 == 0. Row 0: 21 fine, 22 off the lattice. Row 1 (last_page_len 0: bad): 4 is
    space 0's, 23 fine, 45 past the pool's 40 pages. Listed by (row, position); a row-level field at -1."""
    m = BlockManager()
    m.create_pool("v", CacheSpec.uniform(2, 1, 64, page_size=4, layout="interleaved"), Sizing(num_slots=10))
    api = ManagerAPI(m)
    r = api.ValidatePageTable(pb.ValidatePageTableRequest(
        pool="v", layer=1, indptr=_i64([0, 2, 5]), indices=_i64([21, 22, 4, 23, 45]), last_page_len=_i64([4, 0])))
    assert (r.ok, r.num_violations) == (False, 4)
    assert (r.index_space.id, r.index_space.base, r.index_space.upper_bound, r.index_space.scale,
            r.index_space.offset, list(r.index_space.layers), r.index_space.index_dtype) == (1, 20, 40, 2, 1, [1],
                                                                                             cpb.INT32)
    assert [(v.reason, v.row, v.position, v.value, v.detail) for v in r.violations] == [
        ("off_lattice", 0, 1, 22, "page index must be 21 + k * 2 in index space 1"),
        ("bad_last_page_len", 1, -1, 0, "last_page_len of a non-empty row must be in (0, 4]"),
        ("wrong_index_space", 1, 2, 4, "page index of another index space of this pool (was this table converted "
                                       "for another layer?); index space 1 has pages [20, 40)"),
        ("out_of_bounds", 1, 4, 45, "page index must be in [0, 40) (the pool's pages)"),
    ]
    ok = api.ValidatePageTable(pb.ValidatePageTableRequest(
        pool="v", layer=0, indptr=_i64([0, 2]), indices=_i64([0, 18]), last_page_len=_i64([3])))
    assert (ok.ok, ok.num_violations, list(ok.violations), ok.index_space.id) == (True, 0, [], 0)


def test_get_pool_fills_every_field_of_pool_info():
    """PoolInfo (block_manager.proto): the pool's name, its plan (what Plan answers for the same cache, sizing and
    backends, named by their canonical names), stats, cache spec, incarnation, model, hash mode, and no seed for the
    kvservice hash mode (whose pool keeps the default seed); CreatePool's own reply for a vllm-hashed pool."""
    m = BlockManager()
    api = ManagerAPI(m)
    spec, sizing = CacheSpec.uniform(2, 1, 64, page_size=4, layout="interleaved"), Sizing(num_slots=10)
    api.CreatePool(pb.CreatePoolRequest(name="info-1", cache=cache_spec_to_proto(spec), sizing=sizing_to_proto(sizing),
                                        enable_prefix_caching=True, incarnation=8_080_808, model="llm-z",
                                        backends=["FlashInfer", "tensorrt-llm"]))
    api.Step(pb.StepRequest(pool="info-1", admit_seq_ids=_u64([7]), admit_num_tokens=_i64([9])))
    info = api.GetPool(pb.GetPoolRequest(pool="info-1"))
    plan = api.Plan(pb.PlanRequest(cache=cache_spec_to_proto(spec), sizing=sizing_to_proto(sizing),
                                   backends=["flashinfer", "trtllm"]))
    assert (info.name, info.plan, info.plan.num_slots, info.plan.pool_pages, list(info.plan.backends)) == \
        ("info-1", plan, 10, 40, ["flashinfer", "trtllm"])
    assert (info.stats.num_slots, info.stats.num_free_slots, info.stats.num_sequences, info.stats.num_tokens,
            info.stats.steps, info.stats.prefix_caching) == (10, 7, 1, 9, 1, True)
    assert (info.cache, info.incarnation, info.model, info.prefix_hash, info.prefix_hash_seed) == \
        (cache_spec_to_proto(spec), 8_080_808, "llm-z", "kvservice", "")
    assert api.ListPools(pb.ListPoolsRequest()).pools == [info]
    vl = api.CreatePool(pb.CreatePoolRequest(name="info-2", cache=cache_spec_to_proto(spec),
                                             sizing=sizing_to_proto(sizing), prefix_hash="vllm-sha256-cbor",
                                             prefix_hash_seed="seed-33", incarnation=5))
    assert (vl.prefix_hash, vl.prefix_hash_seed, vl.stats.prefix_caching, vl.incarnation, vl.model) == \
        ("vllm-sha256-cbor", "seed-33", False, 5, "")
    assert (m.pool_and_lock("info-1")[0].prefix_hash_seed, m.pool_and_lock("info-2")[0].prefix_hash_seed) == \
        ("vllm-none-hash", "seed-33")
    assert [p.name for p in api.ListPools(pb.ListPoolsRequest()).pools] == ["info-1", "info-2"]


def test_validate_page_table_names_each_missing_array_and_echo_returns_its_payload():
    m = BlockManager()
    m.create_pool("v", CacheSpec.uniform(1, 1, 64, page_size=4), Sizing(num_slots=10))
    api = ManagerAPI(m)
    full = {"indptr": _i64([0, 1]), "indices": _i64([3]), "last_page_len": _i64([2])}
    for missing in full:
        with pytest.raises(InvalidArgument) as e:
            api.ValidatePageTable(pb.ValidatePageTableRequest(pool="v", **{k: v for k, v in full.items()
                                                                           if k != missing}))
        assert (e.value.message, e.value.reason) == (f"{missing} is required", "INVALID_ARGUMENT")
    assert api.ValidatePageTable(pb.ValidatePageTableRequest(pool="v", **full)).ok
    payload = bytes(range(256)) * 3
    assert api.Echo(pb.EchoRequest(payload=payload)) == pb.EchoReply(payload=payload)
