"""kvservice/client/codec.py's requests read back field by field, against the .proto and the Tensor byte layout.

Oracles: protos/kvservice/v1/common.proto's Tensor (dtype code, shape, prod(shape) * itemsize bytes
little-endian: DType INT32 = 10, INT64 = 11, UINT64 = 12) decoded here with struct, and the Sizing message's
fields as listed in the .proto; values are random and non-zero.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvservice.client import codec
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.pagetable import ValidationReport, Violation
from kvservice.contract.sizing import Sizing
from kvservice.v1 import block_manager_pb2 as pb

INT32, INT64, UINT64 = 10, 11, 12
FMT = {INT32: "i", INT64: "q", UINT64: "Q"}


def _decode(t) -> tuple[int, list[int], list[int]]:
    """(dtype code, shape, values) of a Tensor, by its documented byte layout."""
    size = struct.calcsize(FMT[t.dtype])
    n = len(t.data) // size
    assert len(t.data) == n * size
    return t.dtype, list(t.shape), list(struct.unpack(f"<{n}{FMT[t.dtype]}", t.data))


def _sizing(rng: np.random.Generator) -> Sizing:
    v = [int(x) for x in rng.integers(1, 2**40, 6)]
    return Sizing(max_batch=v[0], max_seq_len=v[1], memory_budget_bytes=v[2], num_slots=v[3],
                  max_num_batched_tokens=v[4], prefix_headroom_slots=v[5], equal_groups=True,
                  group_slots=tuple(int(x) for x in rng.integers(1, 2**20, 3)))


@pytest.mark.parametrize("seed", range(3))
def test_plan_and_create_pool_requests_carry_every_sizing_field(seed):
    rng = np.random.default_rng(2810 + seed)
    s = _sizing(rng)
    spec = CacheSpec.uniform(2, 4, 64, "float16", 16)
    want = {"max_batch": s.max_batch, "max_seq_len": s.max_seq_len, "memory_budget_bytes": s.memory_budget_bytes,
            "num_slots": s.num_slots, "max_num_batched_tokens": s.max_num_batched_tokens,
            "prefix_headroom_slots": s.prefix_headroom_slots, "equal_groups": True,
            "group_slots": list(s.group_slots)}
    names = [f.name for f in pb.Sizing.DESCRIPTOR.fields]
    assert sorted(names) == sorted(want)                      # every field of the message is checked
    plan = pb.PlanRequest.FromString(codec.plan_request(spec, s, ("flashinfer",)).SerializeToString())
    create = pb.CreatePoolRequest.FromString(
        codec.create_pool_request("pool-q", spec, s, ("flashinfer",), True, "m-1").SerializeToString())
    for got in (plan.sizing, create.sizing):
        assert {n: (list(getattr(got, n)) if n == "group_slots" else getattr(got, n)) for n in names} == want
    assert list(plan.backends) == ["flashinfer"] and create.name == "pool-q" and create.enable_prefix_caching
    assert create.model == "m-1"


def test_score_request_sends_int32_when_every_id_fits_else_int64():
    rng = np.random.default_rng(2811)
    small = [int(x) for x in rng.integers(-(2**31), 2**31, 9)] + [2**31 - 1, -(2**31)]
    req = codec.score_request(small, "salt", "ek", ("a", "b"), "m")
    assert _decode(req.token_ids)[::2] == (INT32, small)
    assert (req.cache_salt, req.extra_key, list(req.pools), req.model) == ("salt", "ek", ["a", "b"], "m")
    for big in ([5, 2**31], [-(2**31) - 1, 3], [int(rng.integers(2**40, 2**50))]):
        code, _, vals = _decode(codec.score_request(big).token_ids)
        assert (code, vals) == (INT64, big)
    code, _, vals = _decode(codec.score_request([]).token_ids)
    assert (code, vals) == (INT32, [])


def test_step_request_fork_pairs_split_into_parents_and_children():
    rng = np.random.default_rng(2812)
    pairs = rng.integers(1, 2**40, (4, 2))
    req = codec.step_request("p", fork=pairs.tolist())
    assert _decode(req.fork_parent_ids)[::2] == (UINT64, pairs[:, 0].tolist())
    assert _decode(req.fork_child_ids)[::2] == (UINT64, pairs[:, 1].tolist())
    flat = codec.step_request("p", fork=pairs.reshape(-1).tolist())              # a flat list of pairs
    assert _decode(flat.fork_child_ids)[2] == pairs[:, 1].tolist()
    one = codec.step_request("p", fork=(7, 9))
    assert (_decode(one.fork_parent_ids)[2], _decode(one.fork_child_ids)[2]) == ([7], [9])
    assert not codec.step_request("p").HasField("fork_parent_ids")


def test_step_request_ids_and_counts_go_int32_when_they_fit_and_broadcast_scalars():
    rng = np.random.default_rng(2813)
    ext = [int(x) for x in rng.integers(1, 2**31 - 1, 3)]
    adm = [int(x) for x in rng.integers(2**32, 2**40, 2)]
    toks = [int(x) for x in rng.integers(1, 10**6, 6)]
    req = codec.step_request("p", free=[3, 4], extend=ext, extend_tokens=5, admit=adm, admit_tokens=[2**33, 7],
                             tables=False, block_table=True, admit_token_ids=toks, salts=["s1", "s2"],
                             extra_keys=["k1", "k2"], request_id="r")
    assert _decode(req.free_seq_ids)[::2] == (UINT64, [3, 4])
    assert _decode(req.extend_seq_ids)[::2] == (INT32, ext)
    assert _decode(req.extend_num_tokens)[::2] == (INT32, [5, 5, 5])
    assert _decode(req.admit_seq_ids)[::2] == (UINT64, adm)
    assert _decode(req.admit_num_tokens)[::2] == (INT64, [2**33, 7])
    assert _decode(req.admit_token_ids)[::2] == (INT64, toks)
    assert req.omit_tables and req.include_block_table and req.request_id == "r"
    assert list(req.admit_cache_salts) == ["s1", "s2"] and list(req.admit_extra_keys) == ["k1", "k2"]


def test_parse_validate_keeps_the_count_and_every_violation():
    rng = np.random.default_rng(2814)
    vs = [Violation(r, int(rng.integers(0, 99)), int(rng.integers(-1, 99)), int(rng.integers(-5, 10**6)), d)
          for r, d in (("out_of_range", "page 9 > 8"), ("duplicate", ""), ("bad_indptr", "x"))]
    total = len(vs) + int(rng.integers(1, 50))           # more than were reported (max_reports)
    reply = pb.ValidatePageTableReply(num_violations=total, violations=[
        pb.Violation(reason=v.reason, row=v.row, position=v.position, value=v.value, detail=v.detail) for v in vs])
    got = codec.parse_validate(pb.ValidatePageTableReply.FromString(reply.SerializeToString()))
    assert got == ValidationReport(total, vs) and got.num_violations == total and not got.ok
    assert codec.parse_validate(pb.ValidatePageTableReply()).ok
