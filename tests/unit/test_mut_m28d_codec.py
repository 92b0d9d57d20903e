"""kvservice/client/codec.py's requests read back field by field, against the .proto and the Tensor byte layout.

Oracles: protos/kvservice/v1/common.proto's Tensor (dtype code, shape, prod(shape) * itemsize bytes
little-endian: DType INT32 = 10, INT64 = 11, UINT64 = 12) decoded here with struct, and the Sizing message's
fields as listed in the .proto; values are random and non-zero.
"""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest

from kvservice.client import codec
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.pagetable import ValidationReport, Violation
from kvservice.contract.sizing import Sizing
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb

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


UINT32 = 13


def _t(code: int, values: list[int], shape: list[int] | None = None) -> cpb.Tensor:
    """A Tensor written by hand from common.proto's layout (not by kvservice's encoder)."""
    fmt = {INT32: "i", INT64: "q", UINT64: "Q", UINT32: "I"}[code]
    return cpb.Tensor(dtype=code, shape=shape or [len(values)], data=struct.pack(f"<{len(values)}{fmt}", *values))


def test_parse_step_reads_every_field_of_a_hand_written_reply():
    rng = np.random.default_rng(2815)
    seq_ids = [int(x) for x in rng.integers(2**33, 2**60, 2)]
    slots = [int(x) for x in rng.integers(0, 500, 5)]
    gens = [int(x) for x in rng.integers(1, 2**32, 3)]
    slot_gens = [int(x) for x in rng.integers(1, 2**32, 5)]
    pairs, pair_gens = [3, 40, 7, 41], [int(x) for x in rng.integers(1, 2**32, 4)]
    inc, seq, lin = (int(x) for x in rng.integers(1, 2**62, 3))
    st = pb.SpaceTables(index_space=2, group=1, scale=3, offset=1, upper_bound=900, base=17,
                        slot_mapping=_t(INT64, slots), indptr=_t(INT32, [0, 1, 3]), indices=_t(INT32, [20, 23, 26]),
                        last_page_len=_t(INT32, [4, 2]), block_table=_t(INT32, [20, -1, 23, 26], [2, 2]),
                        generations=_t(UINT32, gens), slot_generations=_t(UINT32, slot_gens))
    bare = pb.SpaceTables(index_space=0, group=0, scale=1, offset=0, upper_bound=64, slot_mapping=_t(INT64, [9]))
    reply = pb.StepReply(seq_ids=_t(UINT64, seq_ids), num_tokens=_t(INT64, [5, 9]),
                         new_token_indptr=_t(INT64, [0, 2, 5]), tables=[st, bare], layer_index_space=[2, 0, 2],
                         num_free_slots=77, admit_cached_tokens=_t(INT64, [0, 4]), pool_incarnation=6,
                         copies=[pb.SlotCopies(group=1, pairs=_t(INT64, pairs, [2, 2]),
                                               generations=_t(UINT32, pair_gens, [2, 2]))],
                         position=pb.JournalPosition(incarnation=inc, seq=seq, lineage=lin))
    r = codec.parse_step(pb.StepReply.FromString(reply.SerializeToString()))
    assert r.seq_ids.tolist() == seq_ids and r.num_tokens.tolist() == [5, 9]
    assert r.new_token_indptr.tolist() == [0, 2, 5] and r.layer_index_space == (2, 0, 2)
    assert r.num_free_slots == 77 and r.cached_tokens.tolist() == [0, 4] and r.pool_incarnation == 6
    assert (r.position, r.lineage) == ((inc, seq), lin)
    assert sorted(r.tables) == [0, 2]
    two = r.for_layer(0)
    assert two is r.for_layer(2) and r.for_layer(1) is r.tables[0]
    sp = two.space
    assert (sp.id, sp.group, sp.scale, sp.offset, sp.upper_bound, sp.base) == (2, 1, 3, 1, 900, 17)
    assert two.slot_mapping.tolist() == slots
    assert (two.table.indptr.tolist(), two.table.indices.tolist(), two.table.last_page_len.tolist()) == \
        ([0, 1, 3], [20, 23, 26], [4, 2])
    assert two.block_table.tolist() == [[20, -1], [23, 26]]
    assert two.generations.tolist() == gens and two.slot_generations.tolist() == slot_gens
    assert two.generations.dtype == np.uint32
    zero = r.tables[0]
    assert zero.table is None and zero.block_table is None and zero.generations is None
    assert zero.slot_generations is None and zero.slot_mapping.tolist() == [9]
    assert r.copies[1].tolist() == [[3, 40], [7, 41]]
    assert r.copy_generations[1].tolist() == [pair_gens[:2], pair_gens[2:]]
    plain = codec.parse_step(pb.StepReply(seq_ids=_t(UINT64, []), num_tokens=_t(INT64, []),
                                          new_token_indptr=_t(INT64, [0])))
    assert plain.position is None and plain.lineage == 0 and plain.cached_tokens is None
    assert plain.copies == {} and plain.tables == {}


def test_copies_without_generations_on_every_group_give_none():
    with_g = pb.SlotCopies(group=0, pairs=_t(INT64, [1, 2], [1, 2]), generations=_t(UINT32, [5, 6], [1, 2]))
    without = pb.SlotCopies(group=3, pairs=_t(INT64, [8, 9, 10, 11], [2, 2]))
    copies, gens = codec.parse_copies(pb.StepReply(copies=[with_g, without]))
    assert {g: a.tolist() for g, a in copies.items()} == {0: [[1, 2]], 3: [[8, 9], [10, 11]]}
    assert gens is None
    copies, gens = codec.parse_copies(pb.StepReply(copies=[with_g]))
    assert gens[0].tolist() == [[5, 6]]
    assert codec.parse_copies(pb.StepReply()) == ({}, {})


def test_position_and_lineage_of_replies_with_and_without_one():
    assert codec.position_of(pb.StepReply()) is None and codec.lineage_of(pb.StepReply()) == 0
    assert codec.position_of(pb.EchoReply()) is None and codec.lineage_of(pb.EchoReply()) == 0  # no such field
    r = pb.StepReply(position=pb.JournalPosition(incarnation=3, seq=0, lineage=0))
    assert codec.position_of(r) == (3, 0) and codec.lineage_of(r) == 0


def test_validate_request_carries_the_table_as_given():
    rng = np.random.default_rng(2816)
    indices = rng.integers(0, 2**20, 6).astype(np.int32)
    table = codec.PageTable(np.array([0, 4, 6], np.int32), indices, np.array([3, 1], np.int32))
    req = pb.ValidatePageTableRequest.FromString(codec.validate_request("v", 5, table, 17).SerializeToString())
    assert (req.pool, req.layer, req.max_reports) == ("v", 5, 17)
    assert _decode(req.indptr)[::2] == (INT32, [0, 4, 6]) and _decode(req.indices)[::2] == (INT32, indices.tolist())
    assert _decode(req.last_page_len)[::2] == (INT32, [3, 1])
    assert codec.validate_request("v", 0, table).max_reports == 100


def test_ids_and_counts_go_int32_up_to_int32_max_only():
    m = 2**31 - 1
    for ids, code in (([m], INT32), ([m + 1], UINT64), ([0, 5], INT32)):
        req = codec.step_request("p", extend=ids, extend_tokens=[m] * len(ids))
        assert _decode(req.extend_seq_ids)[::2] == (code, ids)
        assert _decode(req.extend_num_tokens)[::2] == (INT32, [m] * len(ids))
    req = codec.step_request("p", extend=[1], extend_tokens=[-3])            # a negative count stays int64
    assert _decode(req.extend_num_tokens)[::2] == (INT64, [-3])
    req = codec.step_request("p", admit=[2], admit_tokens=[m + 1])
    assert _decode(req.admit_num_tokens)[::2] == (INT64, [m + 1])
    req = codec.step_request("p", admit=[], admit_tokens=[])
    assert _decode(req.admit_seq_ids)[::2] == (UINT64, []) and _decode(req.admit_num_tokens)[::2] == (INT64, [])


def test_a_client_error_keeps_its_fields_and_names_its_request_id():
    e = codec.ClientError(grpc.StatusCode.ABORTED, "busy", "R", {"a": "1"}, "rid-7")
    assert str(e) == "ABORTED: busy" and (e.code, e.message, e.reason) == (grpc.StatusCode.ABORTED, "busy", "R")
    assert e.metadata == {"a": "1", "request_id": "rid-7"} and e.request_id == "rid-7"
    kept = codec.ClientError(grpc.StatusCode.ABORTED, "busy", "", {"request_id": "x"}, "rid-8")
    assert kept.metadata == {"request_id": "x"}
    plain = codec.ClientError(grpc.StatusCode.NOT_FOUND, "no")
    assert plain.metadata == {} and plain.reason == "" and plain.request_id is None


class _Call(grpc.RpcError):
    """A failed call as grpc hands it over: code, details, trailing metadata (the rich status, if any)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing


def _status_bin(code: grpc.StatusCode, message: str, reason: str, metadata: dict) -> tuple:
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="kvservice", metadata=metadata))
    st = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return (("grpc-status-details-bin", st.SerializeToString()),)


def test_from_rpc_reads_the_error_info_and_survives_a_status_it_cannot_parse():
    trailing = _status_bin(grpc.StatusCode.NOT_FOUND, "no pool 'q'", "POOL_NOT_FOUND", {"pool": "q"})
    e = codec.ClientError.from_rpc(_Call(grpc.StatusCode.NOT_FOUND, "no pool 'q'", trailing), "rid-1")
    assert (e.code, e.message, e.reason) == (grpc.StatusCode.NOT_FOUND, "no pool 'q'", "POOL_NOT_FOUND")
    assert e.metadata == {"pool": "q", "request_id": "rid-1"} and e.request_id == "rid-1"
    # a status whose code differs from the call's cannot be read: the error keeps code and message only
    odd = codec.ClientError.from_rpc(_Call(grpc.StatusCode.INTERNAL, "boom", trailing))
    assert (odd.code, odd.message, odd.reason, odd.metadata) == (grpc.StatusCode.INTERNAL, "boom", "", {})
    bare = codec.ClientError.from_rpc(_Call(grpc.StatusCode.UNAVAILABLE, ""))
    assert (bare.message, bare.reason, bare.metadata, bare.request_id) == ("", "", {}, None)


def test_step_request_defaults_ask_for_tables_without_a_block_table():
    req = codec.step_request("p")
    assert (req.pool, req.omit_tables, req.include_block_table, req.request_id) == ("p", False, False, "")
    assert list(req.admit_cache_salts) == [] and list(req.admit_extra_keys) == []
    for f in ("free_seq_ids", "extend_seq_ids", "admit_seq_ids", "fork_parent_ids", "admit_token_ids"):
        assert not req.HasField(f)
