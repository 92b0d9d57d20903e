"""A worker's persistent tables (kvservice.worker.tables) in-process: bound to tenant, stream, incarnation and plan;
checked against the pool's plan before anything is allocated; bounded per tenant. Replies come from a real
in-process manager stream (kvservice.server.stream.StreamSession)."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.server.stream import StreamRegistry, StreamSession, scoped_request_id
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.worker.tables import DeviceTables, TablePlan

SPEC = CacheSpec.uniform(2, 1, 32, "float32", 16)


class Stream:
    """A manager stream in-process: step(...) returns the StepReply a scheduler would forward."""

    def __init__(self, api: ManagerAPI, stream_id: str, pool: str = "p") -> None:
        self.api, self.session, self.pool, self.seq = api, StreamSession(stream_id), pool, 0

    def step(self, **kw) -> pb.StepReply:
        self.seq += 1
        r = pb.StepRequest(pool=self.pool, stream_seq=self.seq, delta_tables=True, delta_base=self.seq - 1,
                           accept_tokens_added=True)
        for f, v in kw.items():
            getattr(r, f).CopyFrom(to_tensor(np.asarray(v, np.uint64 if f.endswith("ids") else np.int64)))
        reply = self.session.apply(self.api, r)
        reply.stream_id = self.session.stream_id
        return reply


@pytest.fixture
def world():
    m = BlockManager()
    pool = m.create_pool("p", SPEC, Sizing(num_slots=32, max_seq_len=256))
    api = ManagerAPI(m)
    plan = TablePlan(pool.plan.geometry, pool.max_seq_len, 32)
    return api, DeviceTables(plan, pool.incarnation, max_tables=2), pool.incarnation


def test_tables_of_two_tenants_never_meet(world):
    api, tables, _ = world
    a, b = Stream(api, "s"), Stream(api, "s")
    tables.update("ta", "t1", a.step(admit_seq_ids=[1], admit_num_tokens=[20]))
    tables.update("tb", "t1", b.step(admit_seq_ids=[2], admit_num_tokens=[40]))
    assert tables.csr("ta", "t1", 0)[1].tolist() != tables.csr("tb", "t1", 0)[1].tolist()
    assert len(tables.csr("tb", "t1", 0)[1]) == 3 and len(tables.csr("ta", "t1", 0)[1]) == 2
    with pytest.raises(NotFound):
        tables.csr("tc", "t1", 0)


def test_a_table_belongs_to_its_stream_until_replaced(world):
    api, tables, _ = world
    s1, s2 = Stream(api, "s1"), Stream(api, "s2")
    tables.update("", "t", s1.step(admit_seq_ids=[1], admit_num_tokens=[5]))
    other = s2.step(admit_seq_ids=[2], admit_num_tokens=[5])
    with pytest.raises(FailedPrecondition) as exc:
        tables.update("", "t", other)
    assert exc.value.reason == "STALE_TABLE" and "belong to stream 's1'" in exc.value.message
    assert tables.update("", "t", other, replace=True).stream_id == "s2"
    with pytest.raises(FailedPrecondition):                      # a delta of the old stream: refused
        tables.update("", "t", s1.step(extend_seq_ids=[1], extend_num_tokens=[1]))


def test_a_replan_makes_every_table_stale_until_reloaded(world):
    api, tables, inc = world
    s = Stream(api, "s")
    tables.update("", "t", s.step(admit_seq_ids=[1], admit_num_tokens=[5]))
    plan = tables.plan
    tables.rebind(plan, inc + 1)
    for use in (lambda: tables.csr("", "t", 0), lambda: tables.slot_mapping("", "t", 1)):
        with pytest.raises(FailedPrecondition) as exc:
            use()
        assert exc.value.reason == "STALE_TABLE"
        assert exc.value.metadata == {"table_id": "t", "table_incarnation": str(inc),
                                      "pool_incarnation": str(inc + 1)}
    with pytest.raises(FailedPrecondition) as exc:                # a reply of the old incarnation
        tables.update("", "t", s.step(extend_seq_ids=[1], extend_num_tokens=[1]))
    assert exc.value.reason == "STALE_TABLE"
    api2 = BlockManager()                                         # the pool created again: a full reply loads it
    pool2 = api2.create_pool("p", SPEC, Sizing(num_slots=32, max_seq_len=256), incarnation=inc + 1)
    s2 = Stream(ManagerAPI(api2), "s")
    tables.update("", "t", s2.step(admit_seq_ids=[1], admit_num_tokens=[5]))
    assert tables.csr("", "t", 0)[3].tolist() == [int(pool2.allocators[0].generation[0])]


def test_replies_are_checked_against_the_plan_before_anything_is_allocated(world):
    api, tables, _ = world
    s = Stream(api, "s")
    good = s.step(admit_seq_ids=[1, 2], admit_num_tokens=[5, 30])
    tables.update("", "t", good)
    before = tables.csr("", "t", 0)[1].tolist()

    def bad(change, what):
        r = pb.StepReply()
        r.CopyFrom(good)
        change(r)
        with pytest.raises((InvalidArgument, ResourceExhausted)) as exc:
            tables.update("", "t", r)
        assert what in exc.value.message, exc.value.message
        assert tables.csr("", "t", 0)[1].tolist() == before

    bad(lambda r: setattr(r.tables[0], "upper_bound", 64), "another pool or plan")
    bad(lambda r: r.tables[0].ClearField("generations"), "generations UINT32")
    bad(lambda r: r.tables.add().CopyFrom(r.tables[0]), "each once")
    bad(lambda r: r.num_tokens.CopyFrom(to_tensor(np.array([5, 300], np.int64))), "max_seq_len")
    bad(lambda r: r.tables[0].indices.CopyFrom(to_tensor(np.array([0, 1, 32], np.int32))), "not a page")
    bad(lambda r: r.num_tokens.CopyFrom(to_tensor(np.ones(33, np.int64))), "at most 32")


def test_a_tenant_past_its_quota_loses_its_oldest_table_only(world):
    api, tables, _ = world
    s = Stream(api, "s")
    r = s.step(admit_seq_ids=[1], admit_num_tokens=[5])
    for t in ("t1", "t2", "t3"):
        tables.update("a", t, r)
    tables.update("b", "t1", r)
    with pytest.raises(NotFound):
        tables.csr("a", "t1", 0)                                  # max_tables = 2: a's oldest went
    assert tables.csr("b", "t1", 0) is not None                   # another tenant's table never does
    assert tables.tenant_bytes("a") <= tables.quota_bytes


def test_streams_and_request_ids_are_per_tenant():
    reg = StreamRegistry()
    assert reg.session("s", "a") is not reg.session("s", "b") and reg.session("s", "a") is reg.session("s", "a")
    assert scoped_request_id("", "x") == "x"
    assert len({scoped_request_id("a/b", "c"), scoped_request_id("a", "b/c"), scoped_request_id("", "a/b/c")}) == 3


def test_a_held_table_counts_at_least_the_bytes_of_its_page_tables(world):
    """A tenant's bytes (what its quota bounds) include every space's page table: at least rows x width x 4 bytes
    per space, read from the csr the worker serves."""
    api, tables, _ = world
    s = Stream(api, "s")
    held = tables.update("a", "t1", s.step(admit_seq_ids=[1, 2, 3], admit_num_tokens=[20, 40, 60]))
    pages = sum(len(tables.csr("a", "t1", layer)[1]) for layer in range(len(SPEC.layers)))
    assert held.nbytes == tables.tenant_bytes("a") >= 4 * pages > 0
    tables.update("a", "t2", Stream(api, "s2").step(admit_seq_ids=[9], admit_num_tokens=[30]))
    assert tables.tenant_bytes("a") > held.nbytes                # a second table adds its own


def test_a_full_reply_whose_generations_do_not_match_its_pages_is_refused(world):
    api, tables, _ = world
    r = Stream(api, "s").step(admit_seq_ids=[1, 2], admit_num_tokens=[20, 40])
    assert len(r.tables) and all(len(st.generations.data) == len(st.indices.data) for st in r.tables)   # 4 B each
    r.tables[0].generations.data = r.tables[0].generations.data[:-4]                  # one generation short
    with pytest.raises(InvalidArgument, match=r"step.tables\[0\]: 5 page indices and 4 generations"):
        tables.update("a", "t1", r)
    with pytest.raises(NotFound):
        tables.csr("a", "t1", 0)                                                      # nothing was kept


def test_a_delta_the_table_cannot_take_is_refused_by_name(world):
    """A delta built on a reply this table never got (one forwarded elsewhere) is TABLES_OUT_OF_SYNC, naming the
    table; the worker then wants a full reply."""
    api, tables, _ = world
    s = Stream(api, "s")
    tables.update("a", "t1", s.step(admit_seq_ids=[1, 2], admit_num_tokens=[20, 40]))
    s.step(extend_seq_ids=[1], extend_num_tokens=[30])                 # never reaches this worker
    with pytest.raises(FailedPrecondition) as e:
        tables.update("a", "t1", s.step(extend_seq_ids=[2], extend_num_tokens=[1]))
    assert e.value.reason == "TABLES_OUT_OF_SYNC" and e.value.metadata == {"table_id": "t1"}
    assert "tables 't1'" in e.value.message and "send a full reply" in e.value.message


def test_one_table_over_the_quota_is_refused_naming_its_size_and_the_flag(world):
    """A single table bigger than the tenant quota: RESOURCE_EXHAUSTED TABLE_TOO_LARGE whose message gives the
    table's bytes, the quota and the option that sets it (kvworker serve --table-quota-bytes); nothing is kept."""
    api, _, incarnation = world
    pool = api.manager.pool_and_lock("p")[0]
    small = DeviceTables(TablePlan(pool.plan.geometry, pool.max_seq_len, 32), incarnation, quota_bytes=64)
    r = Stream(api, "s").step(admit_seq_ids=[1, 2, 3], admit_num_tokens=[20, 40, 60])
    with pytest.raises(ResourceExhausted) as exc:
        small.update("a", "t1", r)
    size = int(exc.value.metadata["table_bytes"])
    assert exc.value.reason == "TABLE_TOO_LARGE" and size > 64 and int(exc.value.metadata["quota_bytes"]) == 64
    assert f"tables 't1' would take {size} bytes" in exc.value.message
    assert "quota of 64 bytes" in exc.value.message and "--table-quota-bytes" in exc.value.message
    with pytest.raises(NotFound):
        small.csr("a", "t1", 0)
    assert small.tenant_bytes("a") == 0


def test_a_stale_table_error_names_both_incarnations_and_the_rpc_that_reloads_it(world):
    """The refusal tells the caller what to do: its last words name the worker service's method that loads
    tables (UpdateTables, as the worker proto spells it), and the incarnations are the held and the served."""
    from kvservice.v1 import worker_pb2 as wpb

    api, tables, inc = world
    tables.update("", "t", Stream(api, "s").step(admit_seq_ids=[1], admit_num_tokens=[21]))
    tables.rebind(tables.plan, inc + 3)
    with pytest.raises(FailedPrecondition) as exc:
        tables.csr("", "t", 1)
    msg = exc.value.message
    assert msg.startswith(f"tables 't' were built for incarnation {inc} of the pool") and \
        f"this worker now serves incarnation {inc + 3}" in msg, msg
    rpc = msg[msg.rindex("(") + 1:-1]
    assert msg.endswith(f"a full reply of the current pool ({rpc})") and \
        rpc in wpb.DESCRIPTOR.services_by_name["Worker"].methods_by_name, msg


def test_a_held_tables_bytes_are_every_array_its_mirror_holds(world):
    """HeldTable.nbytes (what the tenant quota bounds) is the sum over every array the mirror holds: its own
    per-sequence arrays and each index space's (found by walking the objects, not by a list of names)."""
    api, tables, _ = world
    rng = np.random.default_rng(41)
    held = tables.update("a", "t1", Stream(api, "s").step(admit_seq_ids=[1, 2, 3, 4],
                                                          admit_num_tokens=rng.integers(1, 60, 4).tolist()))
    mirror = held.mirror

    def arrays(obj) -> list[np.ndarray]:
        values = vars(obj).values() if hasattr(obj, "__dict__") else [getattr(obj, n) for n in obj.__slots__]
        return [v for v in values if isinstance(v, np.ndarray)]

    own = arrays(mirror)
    assert len(own) >= 4 and all(a.nbytes for a in own)
    want = sum(a.nbytes for a in own) + sum(a.nbytes for s in mirror.spaces.values() for a in arrays(s))
    assert held.nbytes == want == tables.tenant_bytes("a")
