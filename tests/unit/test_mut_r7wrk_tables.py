"""DeviceTables (kvservice/worker/tables.py) refusals pinned whole, each with its exact message, reason and metadata
(docs/SECURITY.md#worker-tables): a bad table id (1-64 characters of [A-Za-z0-9_.:-]), a refused request's reply, a
reply that is no StepStream reply, a reply of another incarnation, a table of another stream, a delta with no table
to apply to, a table held from before a re-plan (used, or updated by a delta), and what an update returns
(mirror, tenant, stream, incarnation, plan, bytes). Replies come from tests/unit/test_device_tables.py's
in-process manager stream."""

from __future__ import annotations

import pytest

from kvservice.contract.errors import FailedPrecondition, InvalidArgument
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_device_tables import Stream, world  # noqa: F401  (world: the fixture)

FULL_REPLY = "(kvservice.contract.mirror.PageTableMirror.full_reply())"


def test_an_update_returns_what_the_table_is_bound_to(world):  # noqa: F811
    api, tables, inc = world
    r = Stream(api, "s7").step(admit_seq_ids=[1, 2], admit_num_tokens=[5, 30])
    held = tables.update("tenant-a", "t1", r)
    assert (held.tenant, held.stream_id, held.incarnation, held.plan) == ("tenant-a", "s7", inc, tables.plan_id)
    assert held.mirror is not None and held.mirror.batch_size == 2 and held.nbytes == tables.tenant_bytes("tenant-a")
    assert tables.plan_id == 1


@pytest.mark.parametrize("table_id", ["", "a" * 65, "t 1", "t/1", "é"])
def test_a_table_id_outside_the_alphabet_or_length_is_refused(world, table_id):  # noqa: F811
    api, tables, _ = world
    with pytest.raises(InvalidArgument) as e:
        tables.update("", table_id, Stream(api, "s").step(admit_seq_ids=[1], admit_num_tokens=[5]))
    assert e.value.message == "table_id must be 1-64 characters of [A-Za-z0-9_.:-]"


def test_every_character_of_the_alphabet_and_64_of_them_make_a_table_id(world):  # noqa: F811
    api, tables, _ = world
    r = Stream(api, "s").step(admit_seq_ids=[1], admit_num_tokens=[5])
    for tid in ("a" * 64, "AZaz09_.:-", "x"):
        assert tables.update("", tid, r).stream_id == "s"


def test_a_refused_reply_and_one_of_no_stream_are_refused(world):  # noqa: F811
    api, tables, _ = world
    good = Stream(api, "s").step(admit_seq_ids=[1], admit_num_tokens=[5])
    refused = pb.StepReply()
    refused.CopyFrom(good)
    refused.error.SetInParent()
    with pytest.raises(InvalidArgument) as e:
        tables.update("", "t", refused)
    assert e.value.message == "step is a refused request's reply: it carries no tables"
    unstreamed = pb.StepReply()
    unstreamed.CopyFrom(good)
    unstreamed.stream_seq = 0
    with pytest.raises(InvalidArgument) as e:
        tables.update("", "t", unstreamed)
    assert e.value.message == "step must be a StepStream reply (stream_seq >= 1)"


def test_a_reply_of_another_incarnation_is_refused_naming_both(world):  # noqa: F811
    api, tables, inc = world
    r = Stream(api, "s").step(admit_seq_ids=[1], admit_num_tokens=[5])
    r.pool_incarnation = inc + 5
    with pytest.raises(FailedPrecondition) as e:
        tables.update("", "t9", r)
    assert e.value.message == (f"tables 't9': this reply was made in incarnation {inc + 5} of the pool; this "
                               f"worker's memory is planned for incarnation {inc}. Take the tables of a Step of the "
                               "current pool")
    assert (e.value.reason, e.value.metadata) == ("STALE_TABLE", {"table_id": "t9", "table_incarnation":
                                                                  str(inc + 5), "pool_incarnation": str(inc)})
    r.pool_incarnation = 0                                       # a reply naming no incarnation is not checked
    assert tables.update("", "t9", r).incarnation == inc


def test_a_table_of_another_stream_is_refused_naming_both_streams(world):  # noqa: F811
    api, tables, _ = world
    tables.update("", "t", Stream(api, "s1").step(admit_seq_ids=[1], admit_num_tokens=[5]))
    with pytest.raises(FailedPrecondition) as e:
        tables.update("", "t", Stream(api, "s2").step(admit_seq_ids=[2], admit_num_tokens=[5]))
    assert e.value.message == ("tables 't' belong to stream 's1'; this reply comes from stream 's2'. Use another "
                               "table_id, or send a full reply with replace to take it over")
    assert (e.value.reason, e.value.metadata) == ("STALE_TABLE", {"table_id": "t"})


def test_a_delta_with_no_table_to_apply_to_is_out_of_sync(world):  # noqa: F811
    api, tables, _ = world
    s = Stream(api, "s")
    s.step(admit_seq_ids=[1], admit_num_tokens=[5])              # never reaches this worker
    delta = s.step(extend_seq_ids=[1], extend_num_tokens=[1])
    assert delta.HasField("delta")
    with pytest.raises(FailedPrecondition) as e:
        tables.update("", "t4", delta)
    assert e.value.message == (f"no tables 't4' on this worker to apply a delta to; send a full reply first "
                               f"{FULL_REPLY}")
    assert (e.value.reason, e.value.metadata) == ("TABLES_OUT_OF_SYNC", {"table_id": "t4"})


def test_a_table_from_before_a_replan_is_stale_whole(world):  # noqa: F811
    """After rebind (a re-plan: plan 2, incarnation + 3): using the table, or a delta to it, is refused STALE_TABLE
    naming the incarnation and memory plan it was built for and those now served; metadata the table and both
    incarnations. A full reply of the current pool loads it again under plan 2."""
    api, tables, inc = world
    s = Stream(api, "s")
    tables.update("", "t", s.step(admit_seq_ids=[1], admit_num_tokens=[21]))
    tables.rebind(tables.plan, inc + 3)
    delta = s.step(extend_seq_ids=[1], extend_num_tokens=[1])
    delta.pool_incarnation = 0                                   # (one naming its incarnation is refused for that)
    want = (f"tables 't' were built for incarnation {inc} of the pool (memory plan 1); this worker now serves "
            f"incarnation {inc + 3} (plan 2): the pool was created again or the worker re-planned. Nothing was read "
            "or written; load them again with a full reply of the current pool (UpdateTables)")
    meta = {"table_id": "t", "table_incarnation": str(inc), "pool_incarnation": str(inc + 3)}
    for use in (lambda: tables.csr("", "t", 0), lambda: tables.max_pages("", "t", 1),
                lambda: tables.slot_mapping("", "t", 0), lambda: tables.update("", "t", delta)):
        with pytest.raises(FailedPrecondition) as e:
            use()
        assert (e.value.message, e.value.reason, e.value.metadata) == (want, "STALE_TABLE", meta)
    assert tables.tenant_bytes("") == 0


def test_one_table_over_the_quota_is_refused_with_the_whole_message(world):  # noqa: F811
    from kvservice.contract.errors import ResourceExhausted
    from kvservice.worker.tables import DeviceTables

    api, tables, inc = world
    small = DeviceTables(tables.plan, inc, quota_bytes=64)
    with pytest.raises(ResourceExhausted) as e:
        small.update("a", "t1", Stream(api, "s").step(admit_seq_ids=[1, 2], admit_num_tokens=[20, 40]))
    size = int(e.value.metadata["table_bytes"])
    assert e.value.message == (f"tables 't1' would take {size} bytes, more than this worker's quota of 64 bytes per "
                               "tenant (kvworker serve --table-quota-bytes)")
    assert (e.value.reason, e.value.metadata) == ("TABLE_TOO_LARGE", {"table_bytes": str(size), "quota_bytes": "64"})


def test_the_table_just_updated_is_never_the_one_dropped(world):  # noqa: F811
    """_evict drops the tenant's least recently updated tables past max_tables, never the one just updated: with
    max_tables 0 every update keeps only its own table."""
    from kvservice.contract.errors import NotFound
    from kvservice.worker.tables import DeviceTables

    api, tables, inc = world
    none = DeviceTables(tables.plan, inc, max_tables=0)
    s = Stream(api, "s")
    none.update("a", "t1", s.step(admit_seq_ids=[1], admit_num_tokens=[5]))
    assert none.csr("a", "t1", 0)[2].tolist() == [5]                      # last_page_len of its one row
    none.update("a", "t2", Stream(api, "s2").step(admit_seq_ids=[2], admit_num_tokens=[9]))
    assert none.csr("a", "t2", 0)[2].tolist() == [9]
    with pytest.raises(NotFound):
        none.csr("a", "t1", 0)


def test_a_full_reply_that_does_not_load_leaves_the_table_as_it_was(world):  # noqa: F811
    """A full reply of the table's stream that passes the plan's checks but does not fit together (its indptr does
    not describe the pages it carries) is refused TABLES_OUT_OF_SYNC, and the table keeps what it held (module
    docstring: a refused reply leaves the table as it was, only a delta that did not fit drops it)."""
    import numpy as np

    from kvservice.contract.wire import to_tensor

    api, tables, _ = world
    s = Stream(api, "s")
    tables.update("", "t", s.step(admit_seq_ids=[1, 2], admit_num_tokens=[5, 30]))
    before = [a.tolist() for a in tables.csr("", "t", 0)]
    bad = Stream(api, "s").step(admit_seq_ids=[3], admit_num_tokens=[9])
    for st in bad.tables:
        st.indptr.CopyFrom(to_tensor(np.array([0, 0], np.int32)))
    with pytest.raises(FailedPrecondition) as e:
        tables.update("", "t", bad)
    assert e.value.reason == "TABLES_OUT_OF_SYNC" and e.value.metadata == {"table_id": "t"}
    assert [a.tolist() for a in tables.csr("", "t", 0)] == before


def test_a_row_never_grows_past_the_plans_pages_per_sequence(world):  # noqa: F811
    """A table holds at most max_pages pages per row (ceil(max_seq_len / page_size)): here a plan of 32 tokens (2
    pages of 16). A decode delta adding 20 tokens to a row of 20 (tokens_added within max_seq_len, so the plan lets
    it through) would make 3 pages: refused TABLES_OUT_OF_SYNC naming the limits (32 rows x 2 pages = 64 entries, 2
    pages per row), and the table, which no longer matches its stream, is dropped."""
    from kvservice.contract.errors import NotFound
    from kvservice.worker.tables import DeviceTables, TablePlan

    api, tables, inc = world
    short = DeviceTables(TablePlan(tables.plan.geometry, 32, 32), inc)
    s = Stream(api, "s")
    short.update("", "t", s.step(admit_seq_ids=[1], admit_num_tokens=[20]))
    grow = s.step(extend_seq_ids=[1], extend_num_tokens=[20])
    assert grow.delta.tokens_added == 20
    with pytest.raises(FailedPrecondition) as e:
        short.update("", "t", grow)
    assert e.value.message == ("tables 't': the reply would make a table of 1 rows x 3 pages, over this mirror's 64 "
                               f"entries or 2 pages per row; send a full reply {FULL_REPLY}")
    assert (e.value.reason, e.value.metadata) == ("TABLES_OUT_OF_SYNC", {"table_id": "t"})
    with pytest.raises(NotFound):
        short.csr("", "t", 0)


def test_a_tables_arrays_live_on_the_tables_array_module(world):  # noqa: F811
    """DeviceTables(xp=...): each table's mirror keeps its arrays with that module (CuPy on a GPU worker), not
    NumPy's by default. A stand-in module that hands NumPy's functions out stands for CuPy here."""
    import numpy as np

    from kvservice.worker.tables import DeviceTables

    class Module:
        def __getattr__(self, name):
            return getattr(np, name)

    xp = Module()
    api, tables, inc = world
    dev = DeviceTables(tables.plan, inc, xp=xp)
    held = dev.update("", "t", Stream(api, "s").step(admit_seq_ids=[1, 2], admit_num_tokens=[5, 30]))
    assert dev.xp is xp and held.mirror.xp is xp


def test_page_bytes_that_are_no_whole_number_of_indices_are_refused_naming_the_field(world):  # noqa: F811
    """A full reply's indices, or a delta's pages, with a stray byte (the counts of pages and generations still
    agree) are refused by the tensor decoder, naming the reply's field."""
    api, tables, _ = world
    s = Stream(api, "s")
    full = s.step(admit_seq_ids=[1], admit_num_tokens=[5])
    good = pb.StepReply()
    good.CopyFrom(full)
    full.tables[0].indices.data += b"\x00"
    with pytest.raises(InvalidArgument) as e:
        tables.update("", "t", full)
    assert e.value.message == "step.tables[0].indices: 5 bytes is not a whole number of 4-byte items"
    tables.update("", "t", good)
    delta = s.step(extend_seq_ids=[1], extend_num_tokens=[20])
    (st,) = [st for st in delta.tables if len(st.delta.pages.data)]
    st.delta.pages.data += b"\x00"
    with pytest.raises(InvalidArgument) as e:
        tables.update("", "t", delta)
    assert e.value.message == (f"step.tables[{st.index_space}].delta.pages: 5 bytes is not a whole number of 4-byte "
                               "items")
