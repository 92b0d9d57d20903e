"""PageTableMirror: a stream's page tables kept current by incremental StepStream replies.

Per index space: a table ``[B, width]`` of page indices by position in each sequence (row b = row b of
the last reply's batch), ``-1`` where a position is not held (past the last page, or released by a
sliding window): vLLM v1's persistent block table, and the padded block table a full reply carries. The
FlashInfer CSR and the slot mappings are gathered from it on request.

A full reply (no ``delta``) replaces everything; an incremental one (``StepReply.delta``, block_manager
.proto's TableDelta) applies to the reply whose ``stream_seq`` is its base: rows carried over (or sent
whole), front pages released, one last page replaced (copy-on-write), pages appended; O(B + changed
pages), outputs O(entries). ``xp``: NumPy on the host, CuPy for a device-side copy (the worker's
persistent tables): only the delta crosses to the device. Page generations live in a uint32 table of
the same shape, written with the pages; a reply without them (an older manager) leaves the mirror
without any until a full reply brings them (``has_generations``; outputs None).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from kvservice.contract.errors import KVError
from kvservice.contract.geometry import MAX_COUNT, IndexSpace
from kvservice.contract.pagetable import PageTable
from kvservice.contract.wire import fill_tensor, from_tensor
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1.common_pb2 import INT32, INT64, UINT32


class MirrorError(Exception):
    """A reply that does not apply to what the mirror holds (wrong base, inconsistent sizes)."""


def _cdiv(a: Any, b: int) -> Any:
    return (a + (b - 1)) // b


class _Space:
    """One index space: table [B, width] (index dtype, -1 = not held), first: int64 [B] first held position,
    gens: uint32 [B, width] the generation of each held page (None: the mirror holds no generations)."""

    __slots__ = ("first", "gens", "info", "table")

    def __init__(self, info: IndexSpace, table: Any, first: Any, gens: Any = None) -> None:
        self.info = info
        self.table = table
        self.first = first
        self.gens = gens


class PageTableMirror:
    """The tables of the last reply applied, by index space.

    page_size: tokens per page of the pool. xp: numpy (default) or cupy.
    max_entries: most table cells (B x longest row, per index space) a reply may make it hold; a reply
        asking for more is refused (MirrorError), so a hostile one cannot claim gigabytes.
    max_width: most pages a row may hold (None: any); tables never grow wider (a worker's bound).
    seq: stream_seq of the last reply applied; 0 = holds nothing (the next request must ask for
        full tables: delta_base 0). A delta on another base changes nothing; any other reply that does
        not apply leaves the mirror holding nothing.
    """

    def __init__(self, page_size: int, xp: ModuleType = np, max_entries: int = 1 << 26,
                 max_width: int | None = None) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self.xp = xp
        self.max_entries = max_entries
        self.max_width = max_width
        self.seq = 0
        self.seq_ids = np.zeros(0, dtype=np.uint64)      # uint64 [B] (host)
        self.num_tokens = xp.zeros(0, dtype=np.int64)    # int64 [B]
        self.new_token_indptr = xp.zeros(1, dtype=np.int64)   # int64 [B + 1]
        self._held = xp.zeros(0, dtype=np.int64)          # int64 [B]: ceil(num_tokens / page_size)
        self.spaces: dict[int, _Space] = {}
        self._steps: tuple[int, Any] | None = None        # (tokens_added, its new_token_indptr), reused (read-only)

    def invalidate(self) -> None:
        """Forget the tables (the next reply must be a full one)."""
        self.seq = 0
        self.spaces = {}

    @property
    def has_generations(self) -> bool:
        """True if every page held has its generation (every reply applied since the last full one sent them)."""
        return bool(self.spaces) and all(s.gens is not None for s in self.spaces.values())

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    # ---- applying replies ----------------------------------------------------------------------
    def apply(self, reply: pb.StepReply) -> None:
        """Apply one reply: full tables replace the state, a delta updates it. MirrorError if it does not apply."""
        if reply.HasField("error"):
            return                                   # a refused request changed nothing
        d = reply.delta
        if reply.HasField("delta") and (not self.seq or d.base_seq != self.seq):
            raise MirrorError(f"this delta applies to the reply of request {d.base_seq}; the mirror holds "
                              f"{self.seq or 'nothing'} (ask for full tables: delta_base 0)")     # nothing changed
        try:
            if reply.HasField("delta"):
                self._apply_delta(reply)
            else:
                self._load_full(reply)
        except MirrorError:
            self.invalidate()
            raise
        except (IndexError, ValueError, TypeError, OverflowError, KVError) as err:
            self.invalidate()                        # inconsistent sizes or rows: nothing half-applied is kept
            raise MirrorError(f"the reply does not fit the tables it names ({getattr(err, 'message', err)})") \
                from None

    def _check_size(self, b: int, width: int) -> None:
        if b * width > self.max_entries or (self.max_width is not None and width > self.max_width):
            raise MirrorError(f"the reply would make a table of {b} rows x {width} pages, over this mirror's "
                              f"{self.max_entries} entries or {self.max_width} pages per row")

    def _widen(self, table: Any, width: int, fill: int = -1) -> Any:
        """table with at least `width` columns (doubling, up to max_width), new columns `fill`."""
        return _widen(self.xp, table, width, fill, self.max_width)

    def _arr(self, t: Any, name: str) -> Any:
        return from_tensor(t, name) if self.xp is np else self.xp.asarray(from_tensor(t, name))

    def _load_full(self, reply: pb.StepReply) -> None:
        xp, ps = self.xp, self.page_size
        self.seq_ids = from_tensor(reply.seq_ids, "seq_ids").astype(np.uint64, copy=False)
        num = self._arr(reply.num_tokens, "num_tokens")
        self.num_tokens, self.new_token_indptr = num, self._arr(reply.new_token_indptr, "new_token_indptr")
        if any(not st.HasField("indptr") for st in reply.tables) or not reply.tables:
            self.invalidate()                        # no CSR tables in this reply: nothing to hold
            return
        held = _cdiv(num, ps)
        b = len(num)
        spaces = {}
        with_gens = all(st.HasField("generations") for st in reply.tables)
        for st in reply.tables:
            indptr = self._arr(st.indptr, "indptr").astype(np.int64)
            indices = self._arr(st.indices, "indices")
            cnt = indptr[1:] - indptr[:-1]
            first = held - cnt
            width = int(held.max()) if b else 0
            self._check_size(b, width)
            if len(indptr) != b + 1 or int(indptr[0]) != 0 or int(indptr[-1]) != len(indices) or \
                    (b and (int(cnt.min()) < 0 or int(first.min()) < 0)):
                raise MirrorError(f"index space {st.index_space}: indptr does not describe {b} rows of "
                                  f"{len(indices)} pages within their sequences")
            table = xp.full((b, max(width, 1)), -1, dtype=indices.dtype)
            cells = _spans(xp, xp.arange(b, dtype=np.int64) * table.shape[1] + first, cnt)
            table.ravel()[cells] = indices
            gens = None
            if with_gens:
                values = self._gen_arr(st.generations, "generations", len(indices), st.index_space)
                gens = xp.zeros(table.shape, dtype=np.uint32)
                gens.ravel()[cells] = values
            spaces[st.index_space] = _Space(IndexSpace(st.index_space, st.group, st.scale, st.offset, st.upper_bound,
                                                       (), st.base), table, first, gens)
        self.spaces = spaces
        self._held = held
        self.seq = reply.stream_seq

    def _gen_arr(self, t: Any, name: str, n: int, space: int) -> Any:
        """A generations Tensor: uint32 [n] (n: the pages it goes with), on the mirror's device."""
        a = from_tensor(t, name)
        if a.dtype != np.uint32 or a.ndim != 1 or len(a) != n:
            raise MirrorError(f"index space {space}: {name} must be UINT32 [{n}] (one per page), got "
                              f"{a.dtype} {list(a.shape)}")
        return a if self.xp is np else self.xp.asarray(a)

    def _apply_delta(self, reply: pb.StepReply) -> None:
        d = reply.delta
        if d.tokens_added:
            num_n, tok = self._uniform(reply)
        else:
            num_n = self._arr(reply.num_tokens, "num_tokens")
            tok = self._arr(reply.new_token_indptr, "new_token_indptr")
        b = len(num_n)
        if len(tok) != b + 1:
            raise MirrorError(f"new_token_indptr has {len(tok)} entries for {b} rows")
        if not d.HasField("base_rows") and not d.groups and self._append_only(reply, num_n, tok):
            return
        src, cont, held_p, seq_ids = self._delta_rows(reply, b)
        held_n = _cdiv(num_n, self.page_size)
        width_n = int(held_n.max()) if b else 0
        self._check_size(b, width_n)
        if b and int(num_n.min()) <= 0:
            raise MirrorError("every row holds at least one token")
        groups = {gd.group: gd for gd in d.groups}
        if len(reply.tables) != len(self.spaces):
            raise MirrorError(f"delta has {len(reply.tables)} index spaces; the mirror holds {len(self.spaces)}")
        plans: dict[int, tuple] = {}                   # group -> its plan
        updated: dict[int, tuple] = {}                 # index space -> (table, first, generations)
        keep_gens = self.has_generations and all(st.delta.HasField("generations") for st in reply.tables)
        for st in reply.tables:
            space = self.spaces.get(st.index_space)
            if space is None:
                raise MirrorError(f"delta names index space {st.index_space}; the mirror holds {sorted(self.spaces)}")
            g = space.info.group
            plan = plans.get(g)
            if plan is None:
                plan = plans[g] = self._plan(groups.get(g), src, cont, space.first, held_p, held_n)
            table, gens = self._space_after(st, space, plan, src, cont, b, width_n, keep_gens)
            updated[st.index_space] = (table, plan[0], gens)
        for sid, (table, first_n, gens) in updated.items():
            self.spaces[sid].table, self.spaces[sid].first, self.spaces[sid].gens = table, first_n, gens
        self.seq_ids, self.num_tokens, self.new_token_indptr, self._held = seq_ids, num_n, tok, held_n
        self.seq = reply.stream_seq

    def _delta_rows(self, reply: pb.StepReply, b: int) -> tuple[Any, Any, Any, Any]:
        """(src int64 [B]: base row of each row, -1 new; cont: src >= 0; held_p: pages held before; seq_ids) or for a
        same-batch delta (every row continued) src = cont = None."""
        d = reply.delta
        if not d.HasField("base_rows"):                   # the same batch, every row continued
            if b != self.batch_size or len(reply.seq_ids.data):
                raise MirrorError(f"a same-batch delta has {b} rows; the mirror holds {self.batch_size}")
            return None, None, self._held, self.seq_ids
        src = self._arr(d.base_rows, "base_rows").astype(np.int64)
        seq_ids = from_tensor(reply.seq_ids, "seq_ids").astype(np.uint64, copy=False)
        if len(src) != b or len(seq_ids) != b or (b and int(src.max()) >= self.batch_size):
            raise MirrorError(f"delta rows ({len(src)} base rows, {len(seq_ids)} ids, {b} counts) do not fit a "
                              f"base batch of {self.batch_size}")
        cont = src >= 0
        return src, cont, _cdiv(self._carry(self.num_tokens, src, cont, 0), self.page_size), seq_ids

    def _space_after(self, st: pb.SpaceTables, space: _Space, plan: tuple, src: Any, cont: Any, b: int,
                     width_n: int, keep_gens: bool) -> tuple[Any, Any]:
        """(table [B, width], generations [B, width] or None) of one index space after the delta: base rows carried
        over (a same-batch delta: widened in place), released pages cleared, replaced and new pages written."""
        _, released, replaced, writes = plan
        old, old_gens = space.table, space.gens if keep_gens else None
        gens = None
        if src is None:
            table = old if old.shape[1] >= width_n else self._widen(old, width_n)
            if old_gens is not None:
                gens = old_gens if old_gens.shape[1] >= width_n else self._widen(old_gens, width_n, 0)
        else:
            table = self.xp.full((b, max(width_n, old.shape[1], 1)), -1, dtype=old.dtype)
            gens = self.xp.zeros(table.shape, dtype=np.uint32) if old_gens is not None else None
            rows = self.xp.flatnonzero(cont)
            if len(rows):
                table[rows, :old.shape[1]] = old[src[rows]]
                if gens is not None:
                    gens[rows, :old.shape[1]] = old_gens[src[rows]]
        w = table.shape[1]
        flat = table.ravel()
        gflat = gens.ravel() if gens is not None else None
        if released is not None:
            flat[released[0] * w + released[1]] = -1
        if replaced is not None:
            values = self._arr(st.delta.replaced, "replaced")
            if len(values) != len(replaced[0]):
                raise MirrorError(f"index space {st.index_space}: {len(values)} replaced pages for "
                                  f"{len(replaced[0])} rows")
            at = replaced[0] * w + replaced[1]
            flat[at] = values
            if gflat is not None:
                gflat[at] = self._gen_arr(st.delta.replaced_generations, "replaced_generations", len(values),
                                          st.index_space)
        pages = self._arr(st.delta.pages, "pages")
        if pages.dtype != table.dtype:
            raise MirrorError(f"index space {st.index_space}: pages are {pages.dtype}, the space's index dtype "
                              f"is {table.dtype}")
        if len(pages) != len(writes[0]):
            raise MirrorError(f"index space {st.index_space}: delta has {len(pages)} pages, the batch adds "
                              f"{len(writes[0])}")
        if gflat is not None:
            page_gens = self._gen_arr(st.delta.generations, "generations", len(pages), st.index_space)
        if len(pages):
            at = writes[0] * w + writes[1]
            flat[at] = pages
            if gflat is not None:
                gflat[at] = page_gens
        return table, gens

    def _uniform(self, reply: pb.StepReply) -> tuple[Any, Any]:
        """num_tokens and new_token_indptr of a delta with tokens_added: the base batch, each row + tokens_added."""
        t = reply.delta.tokens_added
        if reply.delta.HasField("base_rows") or reply.HasField("num_tokens") or reply.HasField("new_token_indptr"):
            raise MirrorError("a delta with tokens_added covers the base batch alone; it carries no base_rows, "
                              "num_tokens or new_token_indptr")
        if t > MAX_COUNT:
            raise MirrorError(f"tokens_added {t} is more than a sequence can gain in a step ({MAX_COUNT})")
        b = self.batch_size
        if self.xp is not np:                        # device arrays cannot be made read-only: a fresh one each time
            return self.num_tokens + t, self.xp.arange(b + 1, dtype=np.int64) * t
        steps = self._steps
        if steps is None or steps[0] != t or len(steps[1]) != b + 1:
            indptr = np.arange(b + 1, dtype=np.int64) * t
            indptr.flags.writeable = False           # shared by the results of a steady loop, as replies' arrays are
            steps = self._steps = (t, indptr)
        return self.num_tokens + t, steps[1]

    def _append_only(self, reply: pb.StepReply, num_n: Any, tok: Any) -> bool:
        """A steady decode delta (same batch, at most one page gained per row, nothing released or replaced)
        in a handful of array calls; False (nothing changed) when the delta is not one."""
        xp, ps = self.xp, self.page_size
        if len(num_n) != self.batch_size or len(reply.seq_ids.data) or len(reply.tables) != len(self.spaces):
            return False
        held_n = (num_n + (ps - 1)) // ps
        count = held_n - self._held
        rows = xp.flatnonzero(count)
        if len(rows) and (int(held_n.max()) * len(num_n) > self.max_entries
                          or (self.max_width is not None and int(held_n.max()) > self.max_width)):
            return False                              # the general path refuses it
        if len(rows) and (int(count.max()) != 1 or int(count.min()) < 0):    # every row gains 0 or 1 page
            return False
        cols = self._held[rows]
        width = int(cols.max()) + 1 if len(rows) else 0
        spaces = []
        for st in reply.tables:
            space = self.spaces.get(st.index_space)
            pages = st.delta.pages
            if space is None or len(pages.data) != len(rows) * space.table.itemsize or \
                    pages.dtype != (INT32 if space.table.itemsize == 4 else INT64):
                return False
            spaces.append((space, pages, st.delta.generations))
        keep_gens = _gens_fit(reply, len(rows)) if self.has_generations else False
        if keep_gens is None:
            return False                              # malformed generations: the general path names them
        for space, pages, gens in spaces:
            table = space.table if space.table.shape[1] >= width else self._widen(space.table, width)
            g = None
            if keep_gens:
                g = space.gens if space.gens.shape[1] >= width else self._widen(space.gens, width, 0)
            if len(rows):
                table[rows, cols] = self._arr(pages, "pages")
                if g is not None:
                    g[rows, cols] = self._arr(gens, "generations")
            space.table, space.gens = table, g
        self.num_tokens, self.new_token_indptr, self._held = num_n, tok, held_n
        self.seq = reply.stream_seq
        return True

    def _carry(self, values: Any, src: Any, cont: Any, fill: int) -> Any:
        out = self.xp.full(len(src), fill, dtype=np.int64)
        rows = self.xp.flatnonzero(cont)
        out[rows] = values[src[rows]]
        return out

    def _plan(self, gd: pb.GroupDelta | None, src: Any, cont: Any, first_old: Any, held_p: Any,
              held_n: Any) -> tuple:
        """Per layer group: (first positions int64 [B], released (rows, cols) or None, replaced (rows, cols) or
        None, appended (rows, cols)) of one delta; every space of the group applies the same positions."""
        xp = self.xp
        first_p = first_old if src is None else self._carry(first_old, src, cont, 0)
        first_n, released, replaced = first_p, None, None
        moved = gd is not None and gd.HasField("first_rows")
        if moved:
            fr = self._arr(gd.first_rows, "first_rows").astype(np.int64)
            first_n = first_p.copy()
            first_n[fr] = self._arr(gd.first_pages, "first_pages")
            gone = xp.maximum(first_n - first_p, 0) if cont is None else \
                xp.where(cont, xp.maximum(first_n - first_p, 0), 0)
            if int(gone.sum()):
                released = (xp.repeat(xp.arange(len(gone), dtype=np.int64), gone), _spans(xp, first_p, gone))
        if gd is not None and gd.HasField("replaced_rows"):
            rr = self._arr(gd.replaced_rows, "replaced_rows").astype(np.int64)
            replaced = (rr, held_p[rr] - 1)
        if cont is None and not moved:
            lo = held_p
        else:
            lo = xp.maximum(held_p, first_n) if cont is None else xp.where(cont, xp.maximum(held_p, first_n), first_n)
        count = held_n - lo
        if not len(count) or int(count.max()) <= 1:       # decode: at most one new page per row
            rows = xp.flatnonzero(count)
            writes = (rows, lo[rows])
        else:
            writes = (xp.repeat(xp.arange(len(count), dtype=np.int64), count), _spans(xp, lo, count))
        return first_n, released, replaced, writes

    # ---- outputs ------------------------------------------------------------------------------
    def _space(self, space_id: int) -> _Space:
        if not self.seq:
            raise MirrorError("the mirror holds no tables (apply a reply with tables first)")
        try:
            return self.spaces[space_id]
        except KeyError:
            raise MirrorError(f"no index space {space_id}; spaces: {sorted(self.spaces)}") from None

    def page_table(self, space_id: int) -> PageTable:
        """FlashInfer CSR of the batch in one space.

        Returns indptr [B + 1] and indices [nnz] in the space's index dtype, last_page_len int32 [B].
        """
        s = self._space(space_id)
        cnt, cells = self._held_cells(s)
        indptr = self.xp.zeros(len(cnt) + 1, dtype=np.int64)
        self.xp.cumsum(cnt, out=indptr[1:])
        return PageTable(indptr.astype(s.table.dtype), s.table.ravel().take(cells),
                         (self.num_tokens - (self._held - 1) * self.page_size).astype(np.int32))

    def generations(self, space_id: int) -> Any:
        """uint32 [nnz]: the generation of each page of page_table(space_id).indices; None without generations."""
        s = self._space(space_id)
        return None if s.gens is None else s.gens.ravel().take(self._held_cells(s)[1])

    def _held_cells(self, s: _Space) -> tuple[Any, Any]:
        """(pages each row holds in s, int64 [B]; their cells in s's [B, width] tables, row by row)."""
        cnt = self._held - s.first
        return cnt, _spans(self.xp, self.xp.arange(len(cnt), dtype=np.int64) * s.table.shape[1] + s.first, cnt)

    def _new_token_cells(self, s: _Space) -> tuple[Any, Any]:
        """(cell of each new token's page in s's [B, width] tables, its position in its sequence), batch order."""
        xp, ps = self.xp, self.page_size
        tok, num = self.new_token_indptr, self.num_tokens
        k = tok[1:] - tok[:-1]
        total = int(tok[-1])
        b = len(num)
        if total == b and (not b or bool((k == 1).all())):
            rows, pos = xp.arange(b, dtype=np.int64), num - 1
        else:
            rows = xp.repeat(xp.arange(b, dtype=np.int64), k)
            pos = _spans(xp, num - k, k)
        return rows * s.table.shape[1] + pos // ps, pos

    def slot_mapping(self, space_id: int) -> Any:
        """int64 [num_new_tokens]: page_index * page_size + offset_in_page of each new token; -1: page not held."""
        ps = self.page_size
        s = self._space(space_id)
        cells, pos = self._new_token_cells(s)
        pages = s.table.ravel().take(cells).astype(np.int64)
        return self.xp.where(pages >= 0, pages * ps + pos % ps, -1)

    def slot_generations(self, space_id: int) -> Any:
        """uint32 [num_new_tokens], parallel to slot_mapping: each new token's page generation (0: -1); None without."""
        s = self._space(space_id)
        if s.gens is None:
            return None
        cells, _ = self._new_token_cells(s)
        return self.xp.where(s.table.ravel().take(cells) >= 0, s.gens.ravel().take(cells), 0).astype(np.uint32)

    def num_pages(self, space_id: int) -> int:
        """Page table entries of the batch in one space (nnz of its CSR)."""
        s = self._space(space_id)
        return int((self._held - s.first).sum())

    def full_reply(self) -> pb.StepReply:
        """A full StepReply of what the mirror holds (batch and every space's tables; stream_seq = seq), e.g. to
        bring a worker's persistent copy (UpdateTables) back in step."""
        if not self.seq:
            raise MirrorError("the mirror holds no tables")
        reply = pb.StepReply(stream_seq=self.seq)
        fill_tensor(reply.seq_ids, self.seq_ids)
        fill_tensor(reply.num_tokens, _host(self.num_tokens))
        fill_tensor(reply.new_token_indptr, _host(self.new_token_indptr))
        for sid, s in sorted(self.spaces.items()):
            i = s.info
            out = reply.tables.add(index_space=sid, group=i.group, scale=i.scale, offset=i.offset,
                                   upper_bound=i.upper_bound, base=i.base)
            t = self.page_table(sid)
            fill_tensor(out.slot_mapping, _host(self.slot_mapping(sid)))
            fill_tensor(out.indptr, _host(t.indptr))
            fill_tensor(out.indices, _host(t.indices))
            fill_tensor(out.last_page_len, _host(t.last_page_len))
            if s.gens is not None:
                fill_tensor(out.generations, _host(self.generations(sid)))
                fill_tensor(out.slot_generations, _host(self.slot_generations(sid)))
        return reply

    def block_table(self, space_id: int) -> Any:
        """[B, max pages held] page indices by position, -1 where not held (the full reply's block table)."""
        s = self._space(space_id)
        width = int(self._held.max()) if len(self._held) else 0
        return s.table[:, :width].copy()


def _gens_fit(reply: pb.StepReply, n: int) -> bool | None:
    """Whether every space of a steady decode delta sends the generations of its n pages (False: none sent, the
    mirror then holds none; None: malformed ones)."""
    sent = [st.delta.HasField("generations") for st in reply.tables]
    if not all(sent):
        return None if any(sent) else False
    ok = all(st.delta.generations.dtype == UINT32 and len(st.delta.generations.data) == 4 * n for st in reply.tables)
    return True if ok else None


def _host(a: Any) -> np.ndarray:
    """A NumPy array of a NumPy or CuPy one."""
    return np.asarray(a.get() if hasattr(a, "get") else a)


def _spans(xp: ModuleType, starts: Any, counts: Any) -> Any:
    """Concatenation of the ranges [starts[i], starts[i] + counts[i]), int64."""
    total = int(counts.sum()) if len(counts) else 0
    if not total:
        return xp.zeros(0, dtype=np.int64)
    offsets = xp.cumsum(counts) - counts
    return xp.repeat(starts - offsets, counts) + xp.arange(total, dtype=np.int64)


def _widen(xp: ModuleType, table: Any, width: int, fill: int = -1, cap: int | None = None) -> Any:
    """table with at least `width` columns (doubling, but not past cap unless width is), new columns `fill`."""
    new_w = max(width, 2 * table.shape[1] if cap is None else min(2 * table.shape[1], cap))
    out = xp.full((table.shape[0], new_w), fill, dtype=table.dtype)
    out[:, :table.shape[1]] = table
    return out
