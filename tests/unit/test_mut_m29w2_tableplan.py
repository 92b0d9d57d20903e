"""What a worker table of one pool may be (kvservice.worker.tables.TablePlan): its sizes hand-computed from the module's
documented layout, and check() taking real replies of an in-process manager at their exact limits and refusing,
by field, each one changed past a limit (rows, token counts, page counts, generations, dtypes, index spaces, pages
off the space). Then the ids a table may have, and the incarnation a reply must come from."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvservice.contract.wire import to_tensor
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.worker.tables import DeviceTables, TablePlan
from tests.unit.test_mut_m29w2_tables import PS, Stream, _manager

MAX_ROWS = 4


def _plan(stream: Stream, max_rows: int = MAX_ROWS) -> TablePlan:
    return TablePlan(stream.pool.plan.geometry, stream.pool.max_seq_len, max_rows)


def test_the_plans_sizes_follow_the_documented_layout():
    """max_seq_len 64 with page size 4: 16 pages per row. Two int32 index spaces: a cell is 2 x (4 + 4) bytes;
    a row holds 16 cells, 32 bytes of per-row arrays and 8 per space; one update may also build an int64 cell
    index of max_rows x max_pages; the default tenant quota is 4 tables."""
    plan = _plan(Stream(_manager(), True), 3)
    assert PS == 4 and plan.max_seq_len == 64 and len(plan.geometry.index_spaces) == 2
    assert all(s.index_dtype.itemsize == 4 for s in plan.geometry.index_spaces)
    assert (plan.page_size, plan.max_pages, plan.cell_bytes) == (4, 16, 16)
    held = 3 * (16 * 16 + 32 + 2 * 8)
    assert plan.held_bytes == held and plan.max_table_bytes == held + 8 * 3 * 16
    assert DeviceTables(plan).quota_bytes == 4 * held
    odd = TablePlan(plan.geometry, 61, 1)                  # a last page partly used still takes a cell
    assert odd.max_pages == 16 and TablePlan(plan.geometry, 60, 1).max_pages == 15


def _full(rows: int, lens: list[int] | None = None) -> tuple[Stream, pb.StepReply]:
    s = Stream(_manager(), True)
    lens = lens or [int(n) for n in np.random.default_rng(rows).integers(1, 64, rows)]
    return s, s.step(admit_seq_ids=list(range(1, rows + 1)), admit_num_tokens=lens)


def test_check_takes_replies_at_the_limits():
    """max_rows rows of max_seq_len tokens each (every page cell used), an int64 indptr, and a delta adding exactly
    max_seq_len tokens: all pass."""
    s, full = _full(MAX_ROWS, [64] * MAX_ROWS)
    plan = _plan(s)
    plan.check(full, 0)
    assert all(len(st.indices.data) == 4 * MAX_ROWS * plan.max_pages for st in full.tables)
    wide = pb.StepReply()
    wide.CopyFrom(full)
    wide.tables[0].indptr.CopyFrom(to_tensor(np.array([0, 16, 32, 48, 64], np.int64)))
    plan.check(wide, 0)
    s2, first = _full(2, [3, 5])
    delta = s2.step(extend_seq_ids=[1], extend_num_tokens=[2])
    assert delta.HasField("delta")
    delta.delta.tokens_added = 64
    _plan(s2).check(delta, 2)
    plan.check(first, 0)


def _refused(plan: TablePlan, reply: pb.StepReply, held: int = 0, kind: type = InvalidArgument) -> str:
    with pytest.raises(kind) as err:
        plan.check(reply, held)
    return err.value.message


def test_check_refuses_each_field_past_its_limit_by_name():
    s, full = _full(MAX_ROWS, [64] * MAX_ROWS)
    plan = _plan(s)

    def changed(fn) -> pb.StepReply:
        r = pb.StepReply()
        r.CopyFrom(full)
        fn(r)
        return r

    big = _plan(s, MAX_ROWS - 1)
    with pytest.raises(ResourceExhausted) as err:
        big.check(full, 0)
    assert err.value.reason == "TABLE_TOO_LARGE" and err.value.metadata == {"rows": "4", "max_rows": "3"}
    assert _refused(plan, changed(lambda r: r.num_tokens.CopyFrom(to_tensor(np.array([64, 64, 0, 64], np.int64))))) \
        == "step.num_tokens must be [B] counts in [1, 64] (the pool's max_seq_len)"
    assert "counts in [1, 64]" in _refused(plan, changed(
        lambda r: r.num_tokens.CopyFrom(to_tensor(np.array([64, 65, 64, 64], np.int64)))))
    assert _refused(plan, changed(lambda r: r.num_tokens.CopyFrom(to_tensor(np.full(4, 64, np.int32))))) == \
        "step.num_tokens must be INT64 [B]"
    assert "is not this pool's layer -> index space map" in _refused(plan, changed(
        lambda r: r.layer_index_space.__setitem__(1, r.layer_index_space[0])))
    assert "name index spaces" in _refused(plan, changed(lambda r: r.tables.append(r.tables[0])))
    for f in ("group", "scale", "offset", "upper_bound", "base"):
        msg = _refused(plan, changed(lambda r, f=f: setattr(r.tables[1], f, getattr(r.tables[1], f) + 1)))
        assert "(group, scale, offset, upper_bound, base)" in msg and "a reply of another pool or plan" in msg
    sp = full.tables[0].index_space
    extra = np.frombuffer(full.tables[0].indices.data, np.int32)
    more = np.concatenate([extra, extra[:1]])
    assert f"step.tables[{sp}]: {len(more)} page indices" in _refused(plan, changed(lambda r: (
        r.tables[0].indices.CopyFrom(to_tensor(more)),
        r.tables[0].generations.CopyFrom(to_tensor(np.ones(len(more), np.uint32))))))
    for n in (len(extra) - 1, len(extra) + 1):
        assert f"{len(extra)} page indices and {n} generations" in _refused(plan, changed(
            lambda r, n=n: r.tables[0].generations.CopyFrom(to_tensor(np.ones(n, np.uint32)))))
    for field, dtype in (("generations", np.int32), ("indices", np.int64), ("last_page_len", np.int64),
                         ("indptr", np.uint32)):
        msg = _refused(plan, changed(lambda r, field=field, dtype=dtype: getattr(r.tables[0], field).CopyFrom(
            to_tensor(np.frombuffer(getattr(full.tables[0], field).data, np.uint32 if field == "generations"
                                    else np.int32).astype(dtype)))))
        assert msg.startswith(f"step.tables[{sp}]: indptr INT32/INT64, indices INT32"), (field, msg)
    space = plan.geometry.index_spaces[sp]
    for i, bad in ((0, space.upper_bound), (len(extra) - 1, space.base - 1)):
        pages = extra.copy()
        pages[i] = bad
        assert _refused(plan, changed(lambda r, p=pages: r.tables[0].indices.CopyFrom(to_tensor(p)))) == \
            f"step.tables[{sp}].indices[{i}] = {bad} is not a page of index space {sp} ([{space.base}, " \
            f"{space.upper_bound}), base + {space.offset} + k * {space.scale})"


def test_check_refuses_a_delta_past_its_limits_by_name():
    s, _ = _full(2, [3, 5])
    plan = _plan(s)
    delta = s.step(extend_seq_ids=[1, 2], extend_num_tokens=[6, 9])
    assert delta.HasField("delta")

    def changed(fn) -> pb.StepReply:
        r = pb.StepReply()
        r.CopyFrom(delta)
        fn(r)
        return r

    assert _refused(plan, changed(lambda r: setattr(r.delta, "tokens_added", 65)), 2) == \
        "step.delta.tokens_added 65 is more than a sequence of this pool holds (max_seq_len 64)"
    st = next(t for t in delta.tables if len(t.delta.pages.data) >= 8)
    i = list(delta.tables).index(st)
    where = f"step.tables[{st.index_space}].delta"
    pages = np.frombuffer(st.delta.pages.data, np.int32)
    assert len(pages) >= 2
    for name, gname in (("pages", "generations"), ("replaced", "replaced_generations")):
        n = len(getattr(st.delta, name).data) // 4
        msg = _refused(plan, changed(lambda r, g=gname, n=n: getattr(r.tables[i].delta, g).CopyFrom(
            to_tensor(np.ones(n + 1, np.uint32)))), 2)
        assert msg == f"{where}.{name}: {n} pages and {n + 1} generations"
        msg = _refused(plan, changed(lambda r, g=gname, n=n: getattr(r.tables[i].delta, g).CopyFrom(
            to_tensor(np.ones(n, np.int32)))), 2)
        assert msg.startswith(f"{where}.{name} must be INT32 with UINT32 generations")
    too_many = np.resize(pages, MAX_ROWS * plan.max_pages + 1)
    assert _refused(plan, changed(lambda r: (
        r.tables[i].delta.pages.CopyFrom(to_tensor(too_many)),
        r.tables[i].delta.generations.CopyFrom(to_tensor(np.ones(len(too_many), np.uint32))))), 2) == \
        f"{where}.pages: {len(too_many)} pages and {len(too_many)} generations"
    space = plan.geometry.index_spaces[st.index_space]
    bad = pages.copy()
    bad[1] = space.upper_bound + 7
    assert _refused(plan, changed(lambda r: r.tables[i].delta.pages.CopyFrom(to_tensor(bad))), 2).startswith(
        f"{where}.pages[1] = {space.upper_bound + 7} is not a page of index space {st.index_space}")
    one = pages[:1].copy()
    one[0] = space.upper_bound
    assert _refused(plan, changed(lambda r: (
        r.tables[i].delta.pages.CopyFrom(to_tensor(one)),
        r.tables[i].delta.generations.CopyFrom(to_tensor(np.ones(1, np.uint32))))), 2).startswith(
        f"{where}.pages[0] = {space.upper_bound} is not a page")


def test_table_ids_and_incarnations():
    """A table id is 1 to 64 of [A-Za-z0-9_.:-]; a reply of another incarnation of the pool is STALE_TABLE naming
    both (one that names none, from a manager that predates incarnations, is taken)."""
    s, full = _full(2, [7, 9])
    tables = DeviceTables(_plan(s), s.pool.incarnation)
    for ok in ("a", "A-z_0.9:x", "x" * 64):
        assert tables.update("t", ok, full, replace=True).mirror.batch_size == 2
    for bad in ("", "x" * 65, "a b", "a/b", "é"):
        with pytest.raises(InvalidArgument, match=r"table_id must be 1-64 characters"):
            tables.update("t", bad, full)
    other = pb.StepReply()
    other.CopyFrom(full)
    other.pool_incarnation = s.pool.incarnation + 1
    with pytest.raises(FailedPrecondition) as err:
        tables.update("t", "new", other)
    assert err.value.reason == "STALE_TABLE"
    assert err.value.metadata == {"table_id": "new", "table_incarnation": str(s.pool.incarnation + 1),
                                  "pool_incarnation": str(s.pool.incarnation)}
    with pytest.raises(NotFound):
        tables.csr("t", "new", 0)
    other.pool_incarnation = 0
    assert tables.update("t", "new", other).incarnation == s.pool.incarnation
