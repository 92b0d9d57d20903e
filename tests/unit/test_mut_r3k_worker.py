"""kvservice/worker: kernel_api.check_array on objects that are only half an array, and tables.TablePlan.check's
refusals of a reply, each asserted with its whole message, written out by hand (the field, the dtype the space
needs, and why a reply without generations is refused), and the delta's page count at its exact limit."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import ResourceExhausted
from kvservice.contract.wire import to_tensor
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.worker import kernel_api as api
from tests.unit.test_mut_m29w2_tableplan import MAX_ROWS, _full, _plan, _refused
from tests.unit.test_mut_m29w2_tables import Stream, _manager

UPGRADE = "(a reply without page generations comes from a manager older than this worker: upgrade it)"


class _ShapeOnly:
    shape = (4,)


class _DtypeOnly:
    dtype = np.dtype(np.int64)


@pytest.mark.parametrize("obj, type_name", [
    (_ShapeOnly(), "_ShapeOnly"), (_DtypeOnly(), "_DtypeOnly"), (memoryview(bytearray(32)), "memoryview"),
    ((4,), "tuple"), (None, "NoneType")])
def test_check_array_refuses_anything_without_both_shape_and_dtype_as_a_type_error(obj, type_name):
    """An array needs a shape and a dtype: an object with only one of them (a memoryview has a shape, no dtype)
    is refused with the same TypeError as a list, naming its type, never an AttributeError."""
    with pytest.raises(TypeError) as ei:
        api.check_array("slot_mapping", obj, (4,), np.int64, "[n]")
    assert str(ei.value) == f"slot_mapping: expected an array [n], got {type_name}"


def test_check_array_takes_dtype_names_and_checks_a_scalars_shape():
    """The dtype may be given as a name; a NumPy scalar has a shape, () (0 dimensions), refused as a shape."""
    api.check_array("x", np.zeros(3, np.float16), (None,), "float16", "[n]")
    with pytest.raises(ValueError) as ei:
        api.check_array("x", np.int64(3), (None,), np.int64, "[n]")
    assert str(ei.value) == "x: expected shape [n] = (None,), got ()"
    with pytest.raises(TypeError) as ei:
        api.check_array("x", np.zeros(3, np.float32), (3,), "float16", "[n]")
    assert str(ei.value) == "x: expected dtype float16, got float32"


def _changed(reply: pb.StepReply, fn) -> pb.StepReply:
    r = pb.StepReply()
    r.CopyFrom(reply)
    fn(r)
    return r


def _delta():
    """A plan and a delta reply over 2 rows whose first delta table names at least 2 pages."""
    s, _ = _full(2, [3, 5])
    delta = s.step(extend_seq_ids=[1, 2], extend_num_tokens=[6, 9])
    assert delta.HasField("delta")
    i = next(i for i, t in enumerate(delta.tables) if len(t.delta.pages.data) >= 8)
    return _plan(s), delta, i


def test_a_delta_of_the_wrong_dtypes_is_refused_with_the_whole_message():
    """pages / replaced must be the space's index dtype (INT32 here) and their generations UINT32: a wrong dtype
    of either names the field and says why (an older manager)."""
    plan, delta, i = _delta()
    sp = delta.tables[i].index_space
    for name, gname in (("pages", "generations"), ("replaced", "replaced_generations")):
        want = f"step.tables[{sp}].delta.{name} must be INT32 with UINT32 generations {UPGRADE}"
        d = delta.tables[i].delta
        n = len(getattr(d, name).data) // 4
        wide = np.frombuffer(getattr(d, name).data, np.int32).astype(np.int64)
        assert _refused(plan, _changed(delta, lambda r, g=gname, n=n: getattr(r.tables[i].delta, g).CopyFrom(
            to_tensor(np.ones(n, np.int32)))), 2) == want
        assert _refused(plan, _changed(delta, lambda r, name=name, wide=wide: getattr(r.tables[i].delta, name)
                                       .CopyFrom(to_tensor(wide))), 2) == want


def test_a_delta_of_exactly_max_rows_times_max_pages_pages_is_taken():
    """The most pages a delta may name in one space is max_rows x max_pages (valid pages, one generation each)."""
    plan, delta, i = _delta()
    pages = np.frombuffer(delta.tables[i].delta.pages.data, np.int32)
    full = np.resize(pages, MAX_ROWS * plan.max_pages)
    plan.check(_changed(delta, lambda r: (r.tables[i].delta.pages.CopyFrom(to_tensor(full)),
                                          r.tables[i].delta.generations.CopyFrom(
                                              to_tensor(np.ones(len(full), np.uint32))))), 2)
    plan.check(_changed(delta, lambda r: (r.tables[i].delta.pages.CopyFrom(to_tensor(pages[:0].copy())),
                                          r.tables[i].delta.generations.CopyFrom(
                                              to_tensor(np.ones(0, np.uint32))))), 2)


def test_a_full_reply_is_refused_with_each_whole_message():
    s, full = _full(MAX_ROWS, [64] * MAX_ROWS)
    plan = _plan(s)
    sp = full.tables[0].index_space
    space_map = plan.geometry.layer_space.tolist()
    assert _refused(plan, _changed(full, lambda r: r.tables[0].generations.CopyFrom(
        to_tensor(np.frombuffer(full.tables[0].generations.data, np.uint32).astype(np.int32))))) == (
        f"step.tables[{sp}]: indptr INT32/INT64, indices INT32 (the space's index dtype), last_page_len INT32 and "
        f"generations UINT32 are required {UPGRADE}")
    nnz = len(full.tables[0].indices.data) // 4
    assert _refused(plan, _changed(full, lambda r: r.tables[0].generations.CopyFrom(
        to_tensor(np.ones(nnz - 1, np.uint32))))) == (
        f"step.tables[{sp}]: {nnz} page indices and {nnz - 1} generations for {MAX_ROWS} rows of at most "
        f"{plan.max_pages} pages")
    bad_map = [space_map[0]] * len(space_map)
    assert _refused(plan, _changed(full, lambda r: (r.ClearField("layer_index_space"),
                                                    r.layer_index_space.extend(bad_map)))) == (
        f"step.layer_index_space {bad_map} is not this pool's layer -> index space map {space_map}: a reply of "
        "another pool or plan")
    named = [t.index_space for t in full.tables]
    assert _refused(plan, _changed(full, lambda r: r.tables.append(r.tables[0]))) == (
        f"step.tables name index spaces {[*named, named[0]]}; this pool has {sorted(named)} (each once)")
    st = full.tables[1]
    want = (st.group, st.scale, st.offset, st.upper_bound, st.base)
    got = (st.group, st.scale, st.offset + 1, st.upper_bound, st.base)
    assert _refused(plan, _changed(full, lambda r: setattr(r.tables[1], "offset", st.offset + 1))) == (
        f"step.tables[{st.index_space}]: (group, scale, offset, upper_bound, base) {got}, this pool's index space "
        f"{st.index_space} is {want}: a reply of another pool or plan")


def test_a_delta_adding_tokens_is_sized_by_the_rows_held():
    """A delta adding tokens names no num_tokens: its rows are the table's held rows, checked against max_rows."""
    s = Stream(_manager(), True)
    s.step(admit_seq_ids=[1, 2], admit_num_tokens=[3, 5])
    delta = s.step(extend_seq_ids=[1, 2], extend_num_tokens=[1, 1])
    assert delta.HasField("delta") and delta.delta.tokens_added == 1
    _plan(s).check(delta, MAX_ROWS)
    assert _refused(_plan(s), delta, MAX_ROWS + 1, kind=ResourceExhausted) == (
        f"step has {MAX_ROWS + 1} rows; a table on this worker holds at most {MAX_ROWS} (kvworker serve "
        f"--max-table-rows, or the pool's {s.pool.plan.geometry.num_slots} slots)")



def test_token_counts_of_one_and_a_delta_without_tokens_added_sized_by_num_tokens():
    """num_tokens entries may be 1 to max_seq_len, ends included; a delta that does not say tokens_added is sized
    by its num_tokens, not by the rows held (more than max_rows here)."""
    s, full = _full(MAX_ROWS, [64] * MAX_ROWS)
    plan = _plan(s)
    plan.check(_changed(full, lambda r: r.num_tokens.CopyFrom(to_tensor(np.array([1, 64, 1, 64], np.int64)))), 0)
    plan2, delta, _ = _delta()                          # rows gaining 6 and 9 tokens: no tokens_added
    assert delta.delta.tokens_added == 0 and len(delta.num_tokens.data) == 2 * 8
    plan2.check(delta, MAX_ROWS + 1)

def test_a_layer_map_of_another_pool_is_named_by_its_first_16_layers():
    """A 20-layer pool: the refusal quotes the first 16 entries of both maps, before anything else is read."""
    from kvservice.contract.geometry import CacheSpec, Geometry
    from kvservice.worker.tables import TablePlan

    geo = Geometry(CacheSpec.uniform(20, 1, 64, page_size=4), 8)
    reply = pb.StepReply()
    reply.layer_index_space.extend([1] * 20)
    assert _refused(TablePlan(geo, 32, 4), reply) == (
        f"step.layer_index_space {[1] * 16} is not this pool's layer -> index space map {[0] * 16}: a reply of "
        "another pool or plan")
