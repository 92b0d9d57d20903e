"""Persistent page tables on the worker's device, kept current by the manager's StepStream replies.

A scheduler that receives incremental tables (kvservice.client.stream.StepStream with deltas) forwards
each reply to the workers (UpdateTables); each worker applies it to its own PageTableMirror
whose arrays live where the kernels run (CuPy on a GPU, NumPy on the CPU backend). A decode
step then ships only the delta to the device, and AppendKV / DecodeAttention name the copy
(``table_id``) instead of carrying slot mappings and CSR tables: the shape of vLLM v1's
persistent block table. The kernels still check every page index they read (docs/DESIGN.md), and
every page's generation (the mirror keeps the generations the manager sent beside the pages).

A table is bound to what it was made for (docs/SECURITY.md#worker-tables):

- its **tenant**, the name of the token that loaded it: ids live in one namespace per tenant, so
  another tenant's ``t1`` is another table, and nothing about it (not even that it exists) shows;
- its **stream** (StepReply.stream_id): a reply of another stream never updates it (STALE_TABLE),
  unless the caller asks to replace it with a full reply;
- the **pool incarnation and memory plan** it was built in: after the pool was created again (or the
  worker re-planned its memory) any use is refused STALE_TABLE, naming both incarnations, before
  the kernels touch memory; a full reply of the current incarnation loads it afresh.

Every reply is checked against the pool's plan before anything is allocated (:class:`TablePlan`):
index spaces, dtypes, row counts, token counts and page values, like a Step. A table holds at most
``max_rows`` rows of at most ``max_pages_per_seq`` pages per index space (:attr:`TablePlan.held_bytes`;
one update allocates at most :attr:`TablePlan.max_table_bytes`, the pool's table size), and a tenant at
most ``max_tables`` tables and ``quota_bytes`` bytes (default 4 x held_bytes): past them its least
recently updated tables are dropped.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvservice.contract.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvservice.contract.geometry import Geometry
from kvservice.contract.mirror import MirrorError, PageTableMirror
from kvservice.contract.pagetable import page_reasons
from kvservice.contract.wire import from_tensor
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb

_TABLE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
#: Rows one table may hold at most by default (vLLM's max_num_seqs is 256 to 1024); kvworker --max-table-rows.
MAX_TABLE_ROWS = 1024
#: Tables one tenant may hold by default (least recently updated dropped past it); kvworker --max-tables.
MAX_TABLES = 8
#: Bytes per row besides the page cells: seq_ids, num_tokens, new_token_indptr, held, and per space first.
_ROW_BYTES = 32
_INDEX_CODE = {4: cpb.INT32, 8: cpb.INT64}


@dataclass(frozen=True, slots=True)
class TablePlan:
    """What a table of one pool may be: its index spaces and the sizes that bound it.

    geometry: the pool's (layer -> index space); max_seq_len: tokens per sequence the pool accepts;
    max_rows: rows per table (min of the worker's --max-table-rows and the pool's slots: without
    sharing, every row holds a slot of each layer group).
    """

    geometry: Geometry
    max_seq_len: int
    max_rows: int

    @property
    def page_size(self) -> int:
        return self.geometry.spec.page_size

    @property
    def max_pages(self) -> int:
        """Pages per row per index space, at most: ceil(max_seq_len / page_size)."""
        return -(-self.max_seq_len // self.page_size)

    @property
    def cell_bytes(self) -> int:
        """Bytes of one (row, page position) over every index space: the page index and its generation."""
        return sum(s.index_dtype.itemsize + 4 for s in self.geometry.index_spaces)

    @property
    def held_bytes(self) -> int:
        """What one table can hold at most: max_rows x max_pages cells per space, and its per-row arrays."""
        spaces = len(self.geometry.index_spaces)
        return self.max_rows * (self.max_pages * self.cell_bytes + _ROW_BYTES + 8 * spaces)

    @property
    def max_table_bytes(self) -> int:
        """The pool's table size: the most one UpdateTables may allocate, the table it builds (held_bytes) and the
        int64 cell index it builds it with (one index space at a time)."""
        return self.held_bytes + 8 * self.max_rows * self.max_pages

    def check(self, reply: pb.StepReply, held_rows: int) -> None:
        """InvalidArgument (naming the field) or ResourceExhausted for a reply this pool cannot have sent;
        reads sizes and small arrays only, allocates nothing in proportion to what the reply claims.

        held_rows: rows of the table a delta applies to (its base batch).
        """
        geo = self.geometry
        if reply.layer_index_space and list(reply.layer_index_space) != geo.layer_space.tolist():
            raise InvalidArgument(f"step.layer_index_space {list(reply.layer_index_space)[:16]} is not this pool's "
                                  f"layer -> index space map {geo.layer_space.tolist()[:16]}: a reply of another "
                                  "pool or plan")
        spaces = {s.id: s for s in geo.index_spaces}
        named = [st.index_space for st in reply.tables]
        if sorted(named) != sorted(spaces):
            raise InvalidArgument(f"step.tables name index spaces {named}; this pool has {sorted(spaces)} (each once)")
        delta = reply.HasField("delta")
        rows = self._rows(reply, delta, held_rows)
        if rows > self.max_rows:
            raise ResourceExhausted(f"step has {rows} rows; a table on this worker holds at most {self.max_rows} "
                                    f"(kvworker serve --max-table-rows, or the pool's {geo.num_slots} slots)",
                                    reason="TABLE_TOO_LARGE", rows=rows, max_rows=self.max_rows)
        for st in reply.tables:
            sp = spaces[st.index_space]
            want = (sp.group, sp.scale, sp.offset, sp.upper_bound, sp.base)
            got = (st.group, st.scale, st.offset, st.upper_bound, st.base)
            if got != want:
                raise InvalidArgument(f"step.tables[{sp.id}]: (group, scale, offset, upper_bound, base) {got}, this "
                                      f"pool's index space {sp.id} is {want}: a reply of another pool or plan")
            code = _INDEX_CODE[sp.index_dtype.itemsize]
            if delta:
                self._check_delta(st, sp, code)
            else:
                self._check_full(st, sp, code, rows)

    def _rows(self, reply: pb.StepReply, delta: bool, held_rows: int) -> int:
        """Rows of the batch after the reply, from its arrays' byte lengths; checks its token counts."""
        if delta and reply.delta.tokens_added:
            if reply.delta.tokens_added > self.max_seq_len:
                raise InvalidArgument(f"step.delta.tokens_added {reply.delta.tokens_added} is more than a sequence "
                                      f"of this pool holds (max_seq_len {self.max_seq_len})")
            return held_rows
        num = reply.num_tokens
        if num.dtype != cpb.INT64:
            raise InvalidArgument("step.num_tokens must be INT64 [B]")
        rows = len(num.data) // 8
        if rows <= self.max_rows:
            n = from_tensor(num, "step.num_tokens")
            if n.ndim != 1 or (len(n) and (int(n.min()) < 1 or int(n.max()) > self.max_seq_len)):
                raise InvalidArgument(f"step.num_tokens must be [B] counts in [1, {self.max_seq_len}] (the pool's "
                                      "max_seq_len)")
        return rows

    def _check_full(self, st: pb.SpaceTables, sp: Any, code: int, rows: int) -> None:
        where = f"step.tables[{sp.id}]"
        if st.indptr.dtype not in (cpb.INT32, cpb.INT64) or st.indices.dtype != code or \
                st.last_page_len.dtype != cpb.INT32 or st.generations.dtype != cpb.UINT32:
            raise InvalidArgument(f"{where}: indptr INT32/INT64, indices {cpb.DType.Name(code)} (the space's index "
                                  "dtype), last_page_len INT32 and generations UINT32 are required (a reply without "
                                  "page generations comes from a manager older than this worker: upgrade it)")
        nnz = len(st.indices.data) // sp.index_dtype.itemsize
        if nnz > rows * self.max_pages or len(st.generations.data) != 4 * nnz:
            raise InvalidArgument(f"{where}: {nnz} page indices and {len(st.generations.data) // 4} generations "
                                  f"for {rows} rows of at most {self.max_pages} pages")
        self._check_pages(from_tensor(st.indices, f"{where}.indices"), sp, f"{where}.indices")

    def _check_delta(self, st: pb.SpaceTables, sp: Any, code: int) -> None:
        where = f"step.tables[{sp.id}].delta"
        d = st.delta
        for name in ("pages", "replaced"):
            t, g = getattr(d, name), getattr(d, "generations" if name == "pages" else "replaced_generations")
            if t.dtype != code or g.dtype != cpb.UINT32:
                raise InvalidArgument(f"{where}.{name} must be {cpb.DType.Name(code)} with UINT32 generations "
                                      "(a reply without page generations comes from a manager older than this "
                                      "worker: upgrade it)")
            n = len(t.data) // sp.index_dtype.itemsize
            if n > self.max_rows * self.max_pages or len(g.data) != 4 * n:
                raise InvalidArgument(f"{where}.{name}: {n} pages and {len(g.data) // 4} generations")
            self._check_pages(from_tensor(t, f"{where}.{name}"), sp, f"{where}.{name}")

    def _check_pages(self, pages: np.ndarray, sp: Any, where: str) -> None:
        if not len(pages):
            return
        bad = np.flatnonzero(page_reasons(pages, base=sp.base, upper_bound=sp.upper_bound, scale=sp.scale,
                                          offset=sp.offset, pool_pages=self.geometry.pool_pages))
        if len(bad):
            raise InvalidArgument(f"{where}[{int(bad[0])}] = {int(pages[bad[0]])} is not a page of index space "
                                  f"{sp.id} ([{sp.base}, {sp.upper_bound}), base + {sp.offset} + k * {sp.scale})")


@dataclass(slots=True)
class HeldTable:
    """One table and what it is bound to (the module docstring)."""

    mirror: PageTableMirror | None      # None once its incarnation or plan is gone (the memory is freed)
    tenant: str
    stream_id: str
    incarnation: int
    plan: int
    nbytes: int = 0


def _nbytes(m: PageTableMirror) -> int:
    """Device bytes a mirror holds."""
    out = sum(a.nbytes for a in (m.num_tokens, m.new_token_indptr, m._held)) + m.seq_ids.nbytes
    for s in m.spaces.values():
        out += s.table.nbytes + s.first.nbytes + (s.gens.nbytes if s.gens is not None else 0)
    return int(out)


class DeviceTables:
    """(tenant, table_id) -> HeldTable on the device, bound to this worker's pool incarnation and memory plan.

    plan: the pool's TablePlan; incarnation: the pool incarnation the worker's memory is planned for;
    xp: numpy or cupy; max_tables / quota_bytes: per tenant (least recently updated dropped past them).
    """

    def __init__(self, plan: TablePlan, incarnation: int = 0, xp: Any = np, max_tables: int = MAX_TABLES,
                 quota_bytes: int = 0) -> None:
        self.xp = xp
        self.max_tables = max_tables
        self.quota_bytes = quota_bytes or 4 * plan.held_bytes
        self._tables: OrderedDict[tuple[str, str], HeldTable] = OrderedDict()
        self._lock = threading.Lock()
        self.plan_id = 0
        self.rebind(plan, incarnation)

    def rebind(self, plan: TablePlan, incarnation: int) -> None:
        """The worker's memory is now planned for `incarnation` with `plan`: every table held is stale (its memory
        freed; a use is refused STALE_TABLE) until a full reply of the current pool loads it again."""
        with self._lock:
            self.plan_id += 1
            self.plan, self.incarnation = plan, incarnation
            for t in self._tables.values():
                t.mirror, t.nbytes = None, 0

    @property
    def layer_space(self) -> list[int]:
        return self.plan.geometry.layer_space.tolist()

    def tenant_bytes(self, tenant: str) -> int:
        with self._lock:
            return sum(t.nbytes for (who, _), t in self._tables.items() if who == tenant)

    # ---- updates ------------------------------------------------------------------------------
    def update(self, tenant: str, table_id: str, reply: pb.StepReply, replace: bool = False) -> HeldTable:
        """Apply one StepStream reply to the tenant's table `table_id` (created by a full reply).

        Raises InvalidArgument for a bad id, a reply with neither tables nor a delta, or one this pool
        cannot have sent; ResourceExhausted (TABLE_TOO_LARGE) past the pool's table size; FailedPrecondition
        STALE_TABLE for a reply of another incarnation or stream (see the module docstring),
        TABLES_OUT_OF_SYNC for a delta the copy cannot take. A refused reply leaves the table as it was,
        except a delta that did not fit what it held, which drops the table.
        """
        if not _TABLE_ID.match(table_id):
            raise InvalidArgument("table_id must be 1-64 characters of [A-Za-z0-9_.:-]")
        if reply.HasField("error"):
            raise InvalidArgument("step is a refused request's reply: it carries no tables")
        if reply.stream_seq < 1:
            raise InvalidArgument("step must be a StepStream reply (stream_seq >= 1)")
        key = (tenant, table_id)
        with self._lock:
            delta = reply.HasField("delta")
            held = self._bound(key, reply, replace)
            mirror = held.mirror if delta and held is not None else None
            self.plan.check(reply, mirror.batch_size if mirror is not None else 0)     # before anything is allocated
            mirror = self._apply(key, reply, mirror)
            out = HeldTable(mirror, tenant, reply.stream_id, self.incarnation, self.plan_id, _nbytes(mirror))
            if out.nbytes > self.quota_bytes:
                if delta:
                    self._tables.pop(key, None)
                raise ResourceExhausted(f"tables {table_id!r} would take {out.nbytes} bytes, more than this worker's "
                                        f"quota of {self.quota_bytes} bytes per tenant (kvworker serve "
                                        "--table-quota-bytes)", reason="TABLE_TOO_LARGE", table_bytes=out.nbytes,
                                        quota_bytes=self.quota_bytes)
            self._tables[key] = out
            self._tables.move_to_end(key)
            self._evict(tenant, key)
            return out

    def _bound(self, key: tuple[str, str], reply: pb.StepReply, replace: bool) -> HeldTable | None:
        """The table a reply may update (None: none yet), or FailedPrecondition: a reply of another incarnation
        or stream, or a delta with no live table to apply to (under the lock)."""
        table_id = key[1]
        if reply.pool_incarnation and self.incarnation and reply.pool_incarnation != self.incarnation:
            raise FailedPrecondition(
                f"tables {table_id!r}: this reply was made in incarnation {reply.pool_incarnation} of the pool; "
                f"this worker's memory is planned for incarnation {self.incarnation}. Take the tables of a Step of "
                "the current pool", reason="STALE_TABLE", table_id=table_id,
                table_incarnation=reply.pool_incarnation, pool_incarnation=self.incarnation)
        held = self._tables.get(key)
        delta = reply.HasField("delta")
        if held is not None and held.stream_id != reply.stream_id and (delta or not replace):
            raise FailedPrecondition(
                f"tables {table_id!r} belong to stream {held.stream_id!r}; this reply comes from stream "
                f"{reply.stream_id!r}. Use another table_id, or send a full reply with replace to take it over",
                reason="STALE_TABLE", table_id=table_id)
        if delta and (held is None or held.mirror is None or held.plan != self.plan_id):
            if held is not None:
                raise self._stale(table_id, held)
            raise FailedPrecondition(f"no tables {table_id!r} on this worker to apply a delta to; send a full "
                                     "reply first (kvservice.contract.mirror.PageTableMirror.full_reply())",
                                     reason="TABLES_OUT_OF_SYNC", table_id=table_id)
        return held

    def _apply(self, key: tuple[str, str], reply: pb.StepReply, mirror: PageTableMirror | None) -> PageTableMirror:
        """Apply a checked reply to the live table's mirror (a delta) or a new one (a full reply); under the lock.
        A delta that does not fit drops the table; nothing else changes what is held."""
        delta = mirror is not None
        plan = self.plan
        if mirror is None:
            mirror = PageTableMirror(plan.page_size, self.xp, max_entries=plan.max_rows * plan.max_pages,
                                     max_width=plan.max_pages)
        try:
            mirror.apply(reply)
        except MirrorError as err:
            if delta and not mirror.seq:
                self._tables.pop(key, None)           # what it held is gone (see PageTableMirror.apply)
            raise FailedPrecondition(f"tables {key[1]!r}: {err}; send a full reply "
                                     "(kvservice.contract.mirror.PageTableMirror.full_reply())",
                                     reason="TABLES_OUT_OF_SYNC", table_id=key[1]) from None
        if not mirror.seq:
            raise InvalidArgument("step carries no page tables (a reply to omit_tables): nothing to hold")
        if not mirror.has_generations:
            if delta:
                self._tables.pop(key, None)
            raise InvalidArgument("step carries no page generations (a manager older than this worker: upgrade it)")
        return mirror

    def _evict(self, tenant: str, keep: tuple[str, str]) -> None:
        """Drop the tenant's least recently updated tables past max_tables or quota_bytes (never `keep`)."""
        mine = [k for k in self._tables if k[0] == tenant]
        total = sum(self._tables[k].nbytes for k in mine)
        for k in mine:
            if k == keep or (len(mine) <= self.max_tables and total <= self.quota_bytes):
                continue
            total -= self._tables.pop(k).nbytes
            mine = [m for m in mine if m != k]

    # ---- uses ---------------------------------------------------------------------------------
    def _stale(self, table_id: str, held: HeldTable) -> FailedPrecondition:
        return FailedPrecondition(
            f"tables {table_id!r} were built for incarnation {held.incarnation} of the pool (memory plan "
            f"{held.plan}); this worker now serves incarnation {self.incarnation} (plan {self.plan_id}): the pool "
            "was created again or the worker re-planned. Nothing was read or written; load them again with a full "
            "reply of the current pool (UpdateTables)", reason="STALE_TABLE", table_id=table_id,
            table_incarnation=held.incarnation, pool_incarnation=self.incarnation)

    def _mirror(self, tenant: str, table_id: str, layer: int) -> tuple[PageTableMirror, int]:
        with self._lock:
            held = self._tables.get((tenant, table_id))
            if held is None:
                raise NotFound(f"no tables {table_id!r} on this worker (UpdateTables creates them)",
                               table_id=table_id)
            if held.mirror is None or held.plan != self.plan_id or held.incarnation != self.incarnation:
                raise self._stale(table_id, held)
            return held.mirror, self.layer_space[layer]

    def csr(self, tenant: str, table_id: str, layer: int) -> tuple[Any, Any, Any, Any]:
        """(indptr int32 [B + 1], indices int32 [nnz], last_page_len int32 [B], generations uint32 [nnz]) of a
        layer, on the device."""
        mirror, space = self._mirror(tenant, table_id, layer)
        t = mirror.page_table(space)
        if t.indices.dtype != np.int32:
            raise FailedPrecondition(f"layer {layer}'s index space needs int64 page indices; the kernels take int32")
        return t.indptr.astype(np.int32), t.indices, t.last_page_len, mirror.generations(space)

    def max_pages(self, tenant: str, table_id: str, layer: int) -> int:
        """A bound on the pages of any row of ``csr(tenant, table_id, layer)``, known on the host: the width of
        the copy's table (decode plans its splits with it instead of reading indptr back from the device)."""
        mirror, space = self._mirror(tenant, table_id, layer)
        return int(mirror.spaces[space].table.shape[1])

    def slot_mapping(self, tenant: str, table_id: str, layer: int) -> tuple[Any, Any]:
        """(int64 [n] slot mapping, uint32 [n] generations) of the copy's last step in a layer's index space."""
        mirror, space = self._mirror(tenant, table_id, layer)
        return mirror.slot_mapping(space), mirror.slot_generations(space)
