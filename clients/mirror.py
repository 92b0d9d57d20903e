"""PageTableMirror: a stream's page tables kept current by incremental StepStream replies.

Per index space the mirror holds a 2-D table ``[B, width]`` of page indices by position within
each sequence (row b = row b of the last reply's batch), ``-1`` where a position is not held:
past the row's last page, or before its first held page (released by a sliding window). That is
vLLM v1's persistent block table, and exactly the padded block table a full reply carries; the
FlashInfer CSR and the slot mappings are gathered from it on request.

A full reply (no ``delta``) replaces everything; an incremental one (``StepReply.delta``, see
block_manager.proto's TableDelta) applies to the reply whose ``stream_seq`` equals its base:
rows are carried over (or sent whole), front pages released, one last page replaced
(copy-on-write), pages appended. Each costs O(B + changed pages); outputs cost O(entries).

``xp`` is the array module: NumPy on the host, CuPy for a device-side copy (the worker's
persistent table uses this class with CuPy). Only the delta crosses to the device.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from kvservice.geometry import IndexSpace
from kvservice.pagetable import PageTable
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.wire import from_tensor


class MirrorError(Exception):
    """A reply that does not apply to what the mirror holds (wrong base, inconsistent sizes)."""


def _cdiv(a: Any, b: int) -> Any:
    return (a + (b - 1)) // b


class _Space:
    """One index space: table [B, width] (index dtype, -1 = not held) and first: int64 [B] first held position."""

    __slots__ = ("first", "info", "table")

    def __init__(self, info: IndexSpace, table: Any, first: Any) -> None:
        self.info = info
        self.table = table
        self.first = first


class PageTableMirror:
    """The tables of the last reply applied, by index space.

    page_size: tokens per page of the pool. xp: numpy (default) or cupy.
    seq: stream_seq of the last reply applied; 0 = holds nothing (the next request must ask for
        full tables: delta_base 0).
    """

    def __init__(self, page_size: int, xp: ModuleType = np) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self.xp = xp
        self.seq = 0
        self.seq_ids = np.zeros(0, dtype=np.uint64)      # uint64 [B] (host)
        self.num_tokens = xp.zeros(0, dtype=np.int64)    # int64 [B]
        self.new_token_indptr = xp.zeros(1, dtype=np.int64)   # int64 [B + 1]
        self.spaces: dict[int, _Space] = {}

    def invalidate(self) -> None:
        """Forget the tables (the next reply must be a full one)."""
        self.seq = 0
        self.spaces = {}

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    # ---- applying replies ----------------------------------------------------------------------
    def apply(self, reply: pb.StepReply) -> None:
        """Apply one reply: full tables replace the state, a delta updates it. MirrorError if it does not apply."""
        if reply.HasField("error"):
            return                                   # a refused request changed nothing
        if reply.HasField("delta"):
            self._apply_delta(reply)
        else:
            self._load_full(reply)

    def _arr(self, t: Any, name: str) -> Any:
        a = from_tensor(t, name)
        return a if self.xp is np else self.xp.asarray(a)

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
        for st in reply.tables:
            indptr = self._arr(st.indptr, "indptr").astype(np.int64)
            indices = self._arr(st.indices, "indices")
            cnt = indptr[1:] - indptr[:-1]
            first = held - cnt
            width = int(held.max()) if b else 0
            table = xp.full((b, max(width, 1)), -1, dtype=indices.dtype)
            table.ravel()[_spans(xp, xp.arange(b, dtype=np.int64) * table.shape[1] + first, cnt)] = indices
            spaces[st.index_space] = _Space(IndexSpace(st.index_space, st.group, st.scale, st.offset, st.upper_bound,
                                                       ()), table, first)
        self.spaces = spaces
        self.seq = reply.stream_seq

    def _apply_delta(self, reply: pb.StepReply) -> None:
        xp, ps = self.xp, self.page_size
        d = reply.delta
        if not self.seq or d.base_seq != self.seq:
            raise MirrorError(f"this delta applies to the reply of request {d.base_seq}; the mirror holds "
                              f"{self.seq or 'nothing'} (ask for full tables: delta_base 0)")
        num_n = self._arr(reply.num_tokens, "num_tokens")
        tok = self._arr(reply.new_token_indptr, "new_token_indptr")
        b = len(num_n)
        same = not d.HasField("base_rows")
        if same:
            if b != self.batch_size or len(reply.seq_ids.data):
                raise MirrorError(f"a same-batch delta has {b} rows; the mirror holds {self.batch_size}")
            src = None
            cont = xp.ones(b, dtype=bool)
            num_p = self.num_tokens
            seq_ids = self.seq_ids
        else:
            src = self._arr(d.base_rows, "base_rows").astype(np.int64)
            seq_ids = from_tensor(reply.seq_ids, "seq_ids").astype(np.uint64, copy=False)
            if len(src) != b or len(seq_ids) != b or (b and int(src.max()) >= self.batch_size):
                raise MirrorError(f"delta rows ({len(src)} base rows, {len(seq_ids)} ids, {b} counts) do not fit a "
                                  f"base batch of {self.batch_size}")
            cont = src >= 0
            srcc = xp.where(cont, src, 0)
            num_p = xp.where(cont, self.num_tokens[srcc] if self.batch_size else 0, 0)
        held_p = _cdiv(num_p, ps)
        held_n = _cdiv(num_n, ps)
        groups = {gd.group: gd for gd in d.groups}
        by_id = {st.index_space: st for st in reply.tables}
        if set(by_id) != set(self.spaces):
            raise MirrorError(f"delta names index spaces {sorted(by_id)}; the mirror holds {sorted(self.spaces)}")
        width_n = int(held_n.max()) if b else 0
        for sid, space in self.spaces.items():
            st = by_id[sid]
            gd = groups.get(space.info.group)
            old, old_first = space.table, space.first
            if same:
                first_p = old_first
                table = old if old.shape[1] >= width_n else _widen(xp, old, width_n)
            else:
                first_p = xp.where(cont, old_first[srcc] if self.batch_size else 0, 0)
                table = xp.full((b, max(width_n, old.shape[1], 1)), -1, dtype=old.dtype)
                rows = xp.flatnonzero(cont)
                if len(rows):
                    table[rows, :old.shape[1]] = old[src[rows]]
            first_n = first_p.copy()
            if gd is not None and gd.HasField("first_rows"):
                first_n[self._arr(gd.first_rows, "first_rows").astype(np.int64)] = \
                    self._arr(gd.first_pages, "first_pages")
            w = table.shape[1]
            flat = table.ravel()
            rows_b = xp.arange(b, dtype=np.int64) * w
            released = xp.where(cont, xp.maximum(first_n - first_p, 0), 0)
            if int(released.sum()):
                flat[_spans(xp, rows_b + first_p, released)] = -1
            if gd is not None and gd.HasField("replaced_rows"):
                rr = self._arr(gd.replaced_rows, "replaced_rows").astype(np.int64)
                flat[rows_b[rr] + held_p[rr] - 1] = self._arr(st.delta.replaced, "replaced")
            lo = xp.where(cont, xp.maximum(held_p, first_n), first_n)
            count = held_n - lo
            pages = self._arr(st.delta.pages, "pages")
            if int(count.sum()) != len(pages):
                raise MirrorError(f"index space {sid}: delta has {len(pages)} pages, the batch adds {int(count.sum())}")
            if len(pages):
                flat[_spans(xp, rows_b + lo, count)] = pages
            space.table, space.first = table, first_n
        self.seq_ids, self.num_tokens, self.new_token_indptr = seq_ids, num_n, tok
        self.seq = reply.stream_seq

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
        xp, ps = self.xp, self.page_size
        s = self._space(space_id)
        held = _cdiv(self.num_tokens, ps)
        cnt = held - s.first
        indptr = xp.zeros(len(cnt) + 1, dtype=np.int64)
        xp.cumsum(cnt, out=indptr[1:])
        w = s.table.shape[1]
        idx = s.table.ravel().take(_spans(xp, xp.arange(len(cnt), dtype=np.int64) * w + s.first, cnt))
        return PageTable(indptr.astype(s.table.dtype), idx, (self.num_tokens - (held - 1) * ps).astype(np.int32))

    def slot_mapping(self, space_id: int) -> Any:
        """int64 [num_new_tokens]: page_index * page_size + offset_in_page of each new token, batch order."""
        xp, ps = self.xp, self.page_size
        s = self._space(space_id)
        tok, num = self.new_token_indptr, self.num_tokens
        k = tok[1:] - tok[:-1]
        total = int(tok[-1])
        b = len(num)
        if total == b and (not b or bool((k == 1).all())):
            rows, pos = xp.arange(b, dtype=np.int64), num - 1
        else:
            rows = xp.repeat(xp.arange(b, dtype=np.int64), k)
            pos = _spans(xp, num - k, k)
        pages = s.table.ravel().take(rows * s.table.shape[1] + pos // ps).astype(np.int64)
        return pages * ps + pos % ps

    def block_table(self, space_id: int) -> Any:
        """[B, max pages held] page indices by position, -1 where not held (the full reply's block table)."""
        s = self._space(space_id)
        width = int(_cdiv(self.num_tokens, self.page_size).max()) if len(self.num_tokens) else 0
        return s.table[:, :width].copy()


def _spans(xp: ModuleType, starts: Any, counts: Any) -> Any:
    """Concatenation of the ranges [starts[i], starts[i] + counts[i]), int64."""
    total = int(counts.sum()) if len(counts) else 0
    if not total:
        return xp.zeros(0, dtype=np.int64)
    offsets = xp.cumsum(counts) - counts
    return xp.repeat(starts - offsets, counts) + xp.arange(total, dtype=np.int64)


def _widen(xp: ModuleType, table: Any, width: int) -> Any:
    """table with at least `width` columns (doubling), new columns -1."""
    new_w = max(width, 2 * table.shape[1])
    out = xp.full((table.shape[0], new_w), -1, dtype=table.dtype)
    out[:, :table.shape[1]] = table
    return out
