"""kvservice.client.codec: the bytes a StepRequest carries (INT32 where the values fit, never a value changed)."""

import numpy as np
import pytest

from kvservice.client import codec
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import from_tensor
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb


@pytest.mark.parametrize(("ids", "wire"), [([1, 2, 3], cpb.INT32), ([0, 2**31 - 1], cpb.INT32),
                                           ([1, 2**31], cpb.UINT64), ([5, 2**40, 2**64 - 1], cpb.UINT64)])
def test_ids_go_as_int32_only_when_every_one_fits(ids, wire):
    req = codec.step_request("p", extend=ids, extend_tokens=1, admit=ids, admit_tokens=[7] * len(ids))
    for field in (req.extend_seq_ids, req.admit_seq_ids):
        assert field.dtype == wire
        assert from_tensor(field, "ids").astype(np.uint64).tolist() == ids      # no id changed on the way
    assert req.extend_num_tokens.dtype == req.admit_num_tokens.dtype == cpb.INT32
    assert from_tensor(req.admit_num_tokens, "counts").tolist() == [7] * len(ids)


def test_counts_that_do_not_fit_or_are_not_positive_keep_int64():
    assert codec.step_request("p", extend=[1, 2], extend_tokens=[1, 2**31]).extend_num_tokens.dtype == cpb.INT64
    req = codec.step_request("p", extend=[1, 2], extend_tokens=[3, -1])     # the manager says why it is refused
    assert req.extend_num_tokens.dtype == cpb.INT64
    assert from_tensor(req.extend_num_tokens, "counts").tolist() == [3, -1]


def test_a_large_sequence_id_survives_a_step_through_the_manager():
    api = ManagerAPI(BlockManager())
    api.CreatePool(codec.create_pool_request("p", CacheSpec.uniform(2, 1, 64, "float16", 16),
                                             Sizing(num_slots=64, max_seq_len=256)))
    big = [3, 2**31 + 5, 2**63 + 9]
    codec.parse_step(api.Step(codec.step_request("p", admit=big, admit_tokens=[4, 5, 6])))
    res = codec.parse_step(api.Step(codec.step_request("p", extend=big, extend_tokens=1)))
    assert res.seq_ids.tolist() == big and res.num_tokens.tolist() == [5, 6, 7]


def test_a_configured_pools_incarnation_is_pinned_across_versions():
    """A creation without an incarnation (a configured pool) gets one derived from the request's bytes; a journal
    written by one version is replayed by the next, so the derivation is part of the state format. The request's
    bytes are written here by hand (field 1, length-delimited: 0x0a, 8, "llama-8b"), and the value is pinned."""
    from kvservice.manager.api import derived_incarnation

    r = pb.CreatePoolRequest(name="llama-8b")
    assert r.SerializeToString(deterministic=True) == b"\x0a\x08llama-8b"
    assert derived_incarnation(r) == 763879215519169790                   # blake2b-64 of those bytes, LE, >> 1
    assert derived_incarnation(pb.CreatePoolRequest(name="llama-8c")) not in (0, 763879215519169790)


def test_parse_step_keeps_each_index_spaces_fields_and_names_a_malformed_tensor():
    """An interleaved pool's index spaces have scale > 1 and offsets > 0: the parsed spaces carry the reply's own
    fields, and a damaged tensor is named by its field."""
    from kvservice.contract.errors import InvalidArgument

    api = ManagerAPI(BlockManager())
    api.CreatePool(codec.create_pool_request("p", CacheSpec.uniform(3, 1, 64, "float16", 16, layout="interleaved"),
                                             Sizing(num_slots=64, max_seq_len=256)))
    reply = api.Step(codec.step_request("p", admit=[1, 2], admit_tokens=[20, 40]))
    res = codec.parse_step(reply)
    assert len(reply.tables) == 3
    for st in reply.tables:
        sp = res.tables[st.index_space].space
        assert (sp.id, sp.group, sp.scale, sp.offset, sp.upper_bound, sp.base) == \
            (st.index_space, st.group, st.scale, st.offset, st.upper_bound, st.base)
    assert sorted({(st.scale, st.offset) for st in reply.tables}) == [(3, 0), (3, 1), (3, 2)]
    for field in ("seq_ids", "num_tokens", "new_token_indptr"):     # each named as the reply's field is spelt
        bad = pb.StepReply()
        bad.CopyFrom(reply)
        getattr(bad, field).data = getattr(reply, field).data[:-1]
        with pytest.raises(InvalidArgument, match=rf"^{field}: \d+ bytes is not a whole number"):
            codec.parse_step(bad)


@pytest.mark.parametrize(("tokens", "wire"), [
    ([], cpb.INT32), ([-(2**31), 0, 2**31 - 1], cpb.INT32), ([3, 2**31], cpb.INT64), ([-(2**31) - 1, 5], cpb.INT64)])
def test_score_request_sends_int32_exactly_when_every_token_id_fits(tokens, wire):
    """The documented rule (BlockManagerClient.score_prefix): token ids go as INT32 when every one fits in a signed
    32-bit integer, else INT64; the values arrive unchanged either way."""
    rng = np.random.default_rng(11)
    ids = tokens + (rng.integers(1, 50_000, 5).tolist() if tokens else [])
    req = codec.score_request(ids, salt="s", extra_key="k", pools=("a", "b"), model="m")
    assert req.token_ids.dtype == wire
    assert from_tensor(req.token_ids, "token_ids").astype(np.int64).tolist() == ids
    assert (req.cache_salt, req.extra_key, list(req.pools), req.model) == ("s", "k", ["a", "b"], "m")


def test_validate_request_carries_the_table_and_the_report_cap():
    """validate_request puts the CSR arrays and max_reports (default 100, the most violations to list) on the wire."""
    from kvservice.contract.pagetable import PageTable

    rng = np.random.default_rng(59)
    indices = rng.integers(1, 1000, 5).astype(np.int32)
    table = PageTable(np.array([0, 2, 5], np.int32), indices, np.array([3, 1], np.int32))
    cap = int(rng.integers(2, 50))
    req = codec.validate_request("p", 3, table, max_reports=cap)
    assert (req.pool, req.layer, req.max_reports) == ("p", 3, cap)
    assert from_tensor(req.indices, "indices").tolist() == indices.tolist()
    assert from_tensor(req.indptr, "indptr").tolist() == [0, 2, 5]
    assert from_tensor(req.last_page_len, "last_page_len").tolist() == [3, 1]
    assert codec.validate_request("p", 0, table).max_reports == 100


def test_parse_copies_names_the_field_it_refuses():
    """A copy's pairs of a float dtype are refused naming "pairs" (wire.py: from_tensor names its field)."""
    from kvservice.contract.errors import InvalidArgument
    from kvservice.contract.wire import to_tensor

    reply = pb.StepReply()
    reply.copies.add(group=0, pairs=to_tensor(np.array([[4, 9]], np.int64)))
    copies, gens = codec.parse_copies(reply)
    assert {g: a.tolist() for g, a in copies.items()} == {0: [[4, 9]]} and gens is None
    reply.copies[0].pairs.CopyFrom(to_tensor(np.array([4.0, 9.0], np.float32)))
    with pytest.raises(InvalidArgument, match=r"^pairs: dtype FLOAT32 not allowed here"):
        codec.parse_copies(reply)
