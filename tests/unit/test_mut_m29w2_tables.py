"""A worker's persistent tables (kvservice.worker.tables) against the manager's own full replies: every layer's slot
mapping, CSR table and generations of a table kept current by deltas equal those of a twin manager that sends full
tables (same requests, same allocation); the tenant's byte count and quota at their exact edges; a re-plan frees
every table's bytes. The managers are real and in process (kvservice.server.stream.StreamSession)."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.server.stream import StreamSession
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.worker.tables import DeviceTables, TablePlan

PS, SLOTS, MAX_LEN = 4, 512, 64
# a full-attention layer, a sliding-window one (its own layer group and index space) and a wider full one
SPEC = CacheSpec((LayerSpec(1, 32), LayerSpec(1, 32, sliding_window=8), LayerSpec(2, 64)), PS, "per_layer")


def _manager(incarnation: int = 0) -> ManagerAPI:
    m = BlockManager()
    m.create_pool("p", SPEC, Sizing(num_slots=SLOTS, max_seq_len=MAX_LEN), incarnation=incarnation)
    return ManagerAPI(m)


class Stream:
    """One stream of a manager in process; delta=False asks for full tables every step."""

    def __init__(self, api: ManagerAPI, delta: bool, stream_id: str = "s") -> None:
        self.pool = api.manager.pool_and_lock("p")[0]
        self.api, self.session, self.delta, self.seq = api, StreamSession(stream_id), delta, 0

    def step(self, **kw) -> pb.StepReply:
        self.seq += 1
        r = pb.StepRequest(pool="p", stream_seq=self.seq, delta_tables=self.delta, delta_base=self.seq - 1,
                           accept_tokens_added=self.delta)
        for f, v in kw.items():
            getattr(r, f).CopyFrom(to_tensor(np.asarray(v, np.uint64 if f.endswith("ids") else np.int64)))
        reply = self.session.apply(self.api, r)
        reply.stream_id = self.session.stream_id
        assert not reply.HasField("error"), reply.error
        return reply


def _tables(stream: Stream, **kw) -> DeviceTables:
    plan = TablePlan(stream.pool.plan.geometry, stream.pool.max_seq_len, 16)
    return DeviceTables(plan, stream.pool.incarnation, **kw)


def _full_space(reply: pb.StepReply, space: int) -> pb.SpaceTables:
    (st,) = [t for t in reply.tables if t.index_space == space]
    return st


def test_every_layers_tables_kept_by_deltas_equal_the_managers_full_tables():
    """Random admissions, extensions and frees, stepped on two managers: the worker's copy fed the deltas of one
    gives, for every layer, the slot mapping, slot generations, CSR table and page generations the other manager
    sends in full (the layer's index space from the reply's layer -> space map), and a row bound (max_pages) that
    no row of it exceeds."""
    rng = np.random.default_rng(2929)
    incarnation = int(rng.integers(1, 2**63))                   # the same generations on both managers
    full, delta = Stream(_manager(incarnation), False), Stream(_manager(incarnation), True)
    tables = _tables(delta)
    live: dict[int, int] = {}
    next_id, checked = 1, 0
    for step in range(12):
        kw: dict[str, list[int]] = {}
        if live and step % 4 == 3:
            gone = [int(s) for s in rng.choice(sorted(live), int(rng.integers(1, len(live) + 1)), replace=False)]
            kw["free_seq_ids"] = gone
            for s in gone:
                del live[s]
        grow = [s for s in sorted(live) if live[s] < MAX_LEN - 8 and rng.random() < 0.8]
        if grow:
            kw["extend_seq_ids"] = grow
            kw["extend_num_tokens"] = [int(rng.integers(1, 8)) for _ in grow]
            for s, n in zip(grow, kw["extend_num_tokens"], strict=True):
                live[s] += n
        if len(live) < 4:
            new = list(range(next_id, next_id + int(rng.integers(1, 3))))
            next_id += len(new)
            kw["admit_seq_ids"] = new
            kw["admit_num_tokens"] = [int(rng.integers(1, 24)) for _ in new]
            live.update(zip(new, kw["admit_num_tokens"], strict=True))
        want, got = full.step(**kw), delta.step(**kw)
        if not (want.tables and len(from_tensor(want.num_tokens, "n"))):
            continue
        assert step == 0 or got.HasField("delta")                   # the copy really is kept by deltas
        tables.update("tenant", "t", got)
        spaces = list(want.layer_index_space)
        assert len(set(spaces)) == 2 and spaces[0] != spaces[1]       # the sliding layer reads another space
        for layer, space in enumerate(spaces):
            st = _full_space(want, space)
            sm, sg = tables.slot_mapping("tenant", "t", layer)
            assert np.asarray(sm).tolist() == from_tensor(st.slot_mapping, "sm").tolist(), (step, layer)
            assert np.asarray(sg).tolist() == from_tensor(st.slot_generations, "sg").tolist(), (step, layer)
            ip, idx, lpl, gens = tables.csr("tenant", "t", layer)
            assert np.asarray(ip).tolist() == from_tensor(st.indptr, "ip").tolist()
            assert np.asarray(idx).tolist() == from_tensor(st.indices, "idx").tolist()
            assert np.asarray(lpl).tolist() == from_tensor(st.last_page_len, "lpl").tolist()
            assert np.asarray(gens).tolist() == from_tensor(st.generations, "g").tolist()
            assert int(np.diff(np.asarray(ip)).max(initial=0)) <= tables.max_pages("tenant", "t", layer)
            checked += 1
    assert checked >= 3 * 8


def _load(api: ManagerAPI, tables: DeviceTables, tenant: str, table_id: str, seed: int, first_id: int,
          replace: bool = False):
    """A full reply of three sequences (ids first_id...) of random lengths (from seed) loaded as (tenant, table_id)."""
    s = Stream(api, True, f"s-{tenant}-{table_id}-{first_id}")
    lens = np.random.default_rng(seed).integers(1, MAX_LEN, 3).tolist()
    return tables.update(tenant, table_id, s.step(admit_seq_ids=[first_id, first_id + 1, first_id + 2],
                                                 admit_num_tokens=lens), replace)


def test_a_table_of_exactly_the_quota_is_held_one_byte_more_is_refused():
    """quota_bytes is the most a tenant holds: a table of exactly that many bytes is held (and the tenant's bytes
    are its bytes), with a quota one byte smaller the same reply is refused TABLE_TOO_LARGE naming both sizes,
    and nothing is held."""
    api = _manager()
    probe = Stream(api, True, "probe")
    size = _load(api, _tables(probe), "a", "t", 7, 1).nbytes
    assert size > 0
    exact = _tables(probe, quota_bytes=size)
    held = _load(api, exact, "a", "t", 7, 11)                  # the same lengths: the same size
    assert held.nbytes == size == exact.tenant_bytes("a")
    short = _tables(probe, quota_bytes=size - 1)
    with pytest.raises(ResourceExhausted) as err:
        _load(api, short, "a", "t", 7, 21)
    assert err.value.reason == "TABLE_TOO_LARGE"
    assert (err.value.metadata["table_bytes"], err.value.metadata["quota_bytes"]) == (str(size), str(size - 1))
    assert short.tenant_bytes("a") == 0


def test_a_replan_frees_every_tables_bytes_and_refuses_their_use_until_reloaded():
    """After rebind (the worker re-planned its memory) each tenant's tables hold 0 bytes, every use is refused
    STALE_TABLE naming the table, and a full reply of the new plan loads it again with its bytes counted; the
    sum of a tenant's bytes is the sum of its live tables', another tenant's not counted."""
    api = _manager()
    tables = _tables(Stream(api, True), max_tables=4)
    sizes = {tid: _load(api, tables, "a", tid, seed, 10 * seed).nbytes
             for tid, seed in (("t1", 1), ("t2", 2), ("t3", 3))}
    other = _load(api, tables, "b", "t1", 4, 40).nbytes
    assert tables.tenant_bytes("a") == sum(sizes.values()) and tables.tenant_bytes("b") == other
    tables.rebind(tables.plan, tables.incarnation)
    assert tables.tenant_bytes("a") == 0 == tables.tenant_bytes("b")
    for tid in sizes:
        for use in (tables.csr, tables.slot_mapping, tables.max_pages):
            with pytest.raises(FailedPrecondition) as err:
                use("a", tid, 2)
            assert err.value.reason == "STALE_TABLE" and err.value.metadata["table_id"] == tid
            assert f"tables {tid!r} were built for incarnation" in err.value.message
    again = _load(api, tables, "a", "t2", 2, 50, replace=True)
    assert again.nbytes == sizes["t2"] and tables.tenant_bytes("a") == sizes["t2"]
    assert tables.tenant_bytes("b") == 0


def test_only_stream_replies_are_taken():
    """stream_seq 1 is the first reply of a stream and is taken; 0 (a plain Step's reply) is refused."""
    stream = Stream(_manager(), True)
    tables = _tables(stream)
    first = stream.step(admit_seq_ids=[5], admit_num_tokens=[9])
    assert first.stream_seq == 1
    assert tables.update("a", "t", first).mirror.seq == 1
    first.stream_seq = 0
    with pytest.raises(InvalidArgument, match="stream_seq >= 1"):
        tables.update("a", "u", first)


def test_each_tenant_keeps_its_most_recently_updated_tables_within_count_and_quota():
    """Random loads of random sizes by two tenants, against a plain model of the documented rule: after each
    update the tenant's least recently updated tables (never the one just updated) are dropped while it holds more
    than max_tables tables or more than quota_bytes bytes; the other tenant is untouched. After every update the
    tables held (usable or NotFound) and each tenant's bytes are the model's."""
    from collections import OrderedDict

    from kvservice.contract.errors import NotFound

    rng = np.random.default_rng(4242)
    api = _manager()
    probe = _load(api, _tables(Stream(api, True, "probe")), "x", "t", 3, 1).nbytes
    max_tables, quota = 3, int(2.5 * probe)
    tables = _tables(Stream(api, True, "probe2"), max_tables=max_tables, quota_bytes=quota)
    model: dict[str, OrderedDict[str, int]] = {"a": OrderedDict(), "b": OrderedDict()}
    next_id, evicted = 100, 0
    for _ in range(30):
        tenant, tid = str(rng.choice(["a", "b"])), f"t{int(rng.integers(0, 6))}"
        rows = int(rng.integers(1, 4))
        s = Stream(api, True, f"s{next_id}")
        reply = s.step(admit_seq_ids=list(range(next_id, next_id + rows)),
                       admit_num_tokens=rng.integers(1, MAX_LEN, rows).tolist())
        next_id += rows
        nbytes = tables.update(tenant, tid, reply, replace=True).nbytes      # each fits the quota alone
        s.step(free_seq_ids=list(range(next_id - rows, next_id)))      # the manager's slots back, the copy kept
        mine = model[tenant]
        mine[tid] = nbytes
        mine.move_to_end(tid)
        while len(mine) > max_tables or sum(mine.values()) > quota:
            oldest = next(k for k in mine if k != tid)
            del mine[oldest]
            evicted += 1
        for who, held in model.items():
            assert tables.tenant_bytes(who) == sum(held.values())
            for t in (f"t{i}" for i in range(6)):
                if t in held:
                    assert np.asarray(tables.csr(who, t, 0)[0]).shape[0] >= 2
                else:
                    with pytest.raises(NotFound):
                        tables.csr(who, t, 0)
    assert evicted >= 5


@pytest.mark.parametrize("slack", [0, -1])
def test_tables_that_fill_the_quota_exactly_are_all_held(slack):
    """Two tables whose bytes add up to exactly the tenant's quota are both held; with a quota one byte smaller the
    older one is dropped when the second is loaded (the second is held: it fits alone)."""
    api = _manager()
    probe = _tables(Stream(api, True, "probe"))
    s1, s2 = _load(api, probe, "x", "p1", 5, 1).nbytes, _load(api, probe, "x", "p2", 6, 4).nbytes
    tables = _tables(Stream(api, True, "probe2"), quota_bytes=s1 + s2 + slack)
    assert _load(api, tables, "a", "t1", 5, 11).nbytes == s1
    assert _load(api, tables, "a", "t2", 6, 14).nbytes == s2
    assert tables.tenant_bytes("a") == (s1 + s2 if slack == 0 else s2)
    assert len(tables.csr("a", "t2", 1)[0]) == 4
    if slack == 0:
        assert len(tables.csr("a", "t1", 1)[0]) == 4
    else:
        from kvservice.contract.errors import NotFound
        with pytest.raises(NotFound):
            tables.csr("a", "t1", 1)


def test_a_delta_that_grows_a_table_past_the_quota_drops_it():
    """A table held at exactly the quota; a delta admitting another sequence would make it bigger: refused
    TABLE_TOO_LARGE, and the table is gone (what it held was already replaced), so the next use is NotFound and
    the tenant holds 0 bytes."""
    api = _manager()
    s = Stream(api, True, "grow")
    probe = _tables(Stream(api, True, "probe"))
    size = _load(api, probe, "x", "p", 11, 100).nbytes
    tables = _tables(s, quota_bytes=size)
    lens = np.random.default_rng(11).integers(1, MAX_LEN, 3).tolist()
    assert tables.update("a", "t", s.step(admit_seq_ids=[1, 2, 3], admit_num_tokens=lens)).nbytes == size
    grow = s.step(admit_seq_ids=[4, 5, 6, 7], admit_num_tokens=[MAX_LEN] * 4)
    assert grow.HasField("delta")
    with pytest.raises(ResourceExhausted) as err:
        tables.update("a", "t", grow)
    assert err.value.reason == "TABLE_TOO_LARGE" and int(err.value.metadata["table_bytes"]) > size
    from kvservice.contract.errors import NotFound
    with pytest.raises(NotFound):
        tables.csr("a", "t", 0)
    assert tables.tenant_bytes("a") == 0
