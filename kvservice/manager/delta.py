"""Incremental page tables: what changed in a step's tables since the last reply a stream's client holds.

A StepStream client keeps, per index space, each row's pages by position within its sequence
(kvservice.contract.mirror.PageTableMirror, the shape of vLLM v1's persistent block table). Between two
replies on a stream, when no other step ran on the pool in between (``Pool.steps`` advanced by
exactly one; the pool lock is held from that check to the end of the encoding), a sequence that
is in both batches was extended by this step, and an extension changes a row in three ways only:

- pages appended after its last one (positions ``held_before .. held_after``);
- its last page replaced, when it was partly filled and shared (copy-on-write);
- pages at its front released by a sliding window (its first held position moves).

Every other row of the batch (admitted, forked, or absent from the last reply's batch) is sent
whole. So a delta is O(changed pages) plus O(B) NumPy work, and exact by construction; the
reference tests check it against full tables on every step of random op sequences.

Two sources locate the changes. Pools without sliding windows: the step's slot mappings already
hold the page of every position a new token lands in, which is every appended page and the only
page copy-on-write can replace, so the pool skips building CSR tables (``tables=False``) and only
rows sent whole are gathered (``Pool.tables_for``). Pools with sliding windows: the step's CSR
tables, whose row lengths give each row's first held position.

What the server keeps per stream (:class:`HeldTables`) is O(B): the batch, token counts, and per
layer group each row's first held position and last page. No page lists.

Every page a delta sends goes with its slot's generation (``SpaceDelta.generations``,
``replaced_generations``), read from the pool's allocators right after the step, when every page
of the batch is held by its row: the client's mirror keeps them beside the pages.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvservice.contract.geometry import IndexSpace
from kvservice.contract.wire import fill_tensor
from kvservice.core.pool import Pool, SpaceTables, StepResult
from kvservice.manager.api import add_copies, step_reply
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1.common_pb2 import INT32, INT64, UINT32

_NONE = np.zeros(0, dtype=np.int64)
_LITTLE = sys.byteorder == "little"


@dataclass(slots=True)
class HeldTables:
    """What a stream's client holds after one reply: enough to encode the next delta (no page lists).

    seq: stream_seq of that reply. pool: the Pool it came from (a weak reference: compared by identity, and a
        deleted pool is not kept alive by a session).
    pool_steps: pool.steps right after its step.
    seq_ids: uint64 [B], the reply's batch. num_tokens: int64 [B], tokens each row holds.
    first: per layer group, int64 [B]: position (0-based, within the sequence) of each row's first held page.
    last: per layer group, int64 [B]: each row's last held page in the group's first index space (-1: none).
    """

    seq: int
    pool: weakref.ref
    pool_steps: int
    seq_ids: np.ndarray
    num_tokens: np.ndarray
    first: list[np.ndarray]
    last: list[np.ndarray]

    def usable(self, pool: Pool, base: int) -> bool:
        """True if a step of `pool` about to run now can be answered relative to this reply.

        base: the request's delta_base. Call under the pool's lock, before the step.
        """
        return base == self.seq and pool is self.pool() and pool.steps == self.pool_steps


def _cdiv(a: np.ndarray, b: int) -> np.ndarray:
    return (a + (b - 1)) // b


def _carry(values: np.ndarray, src: np.ndarray, cont: np.ndarray, fill: int) -> np.ndarray:
    """int64 [B]: values[src[b]] for continued rows b, `fill` for the others."""
    out = np.full(len(src), fill, dtype=np.int64)
    out[cont] = values[src[cont]]
    return out


def _group_heads(tables: tuple[SpaceTables, ...]) -> dict[int, int]:
    """Layer group -> position in `tables` of its first index space."""
    heads: dict[int, int] = {}
    for i, st in enumerate(tables):
        heads.setdefault(st.space.group, i)
    return heads


def _gens(pool: Pool, sp: IndexSpace, pages: np.ndarray) -> np.ndarray:
    """uint32 [n]: the generation of each page (int [n], held pages of space sp) from its slot."""
    gen = pool.allocators[sp.group].generation
    if not len(pages):
        return np.zeros(0, dtype=np.uint32)
    if (sp.scale, sp.offset, sp.base) == (1, 0, 0):
        return gen.take(pages)
    return gen.take((np.asarray(pages, dtype=np.int64) - (sp.base + sp.offset)) // sp.scale)


def _spans(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ranges [starts[i], starts[i] + counts[i]), int64."""
    total = int(counts.sum())
    if not total:
        return _NONE
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)


def held_from_full(seq: int, pool: Pool, res: StepResult) -> HeldTables:
    """The state of a client that received full CSR tables of `res` (under the pool lock, after the step)."""
    ps = pool.page_size
    held_n = _cdiv(res.num_tokens, ps)
    first, last = [], []
    for _, i in sorted(_group_heads(res.tables).items()):
        t = res.tables[i].table
        assert t is not None, "held_from_full needs a result with CSR tables"
        indptr = t.indptr.astype(np.int64)
        cnt = np.diff(indptr)
        first.append(held_n - cnt)
        last.append(np.where(cnt > 0, t.indices[np.maximum(indptr[1:] - 1, 0)] if len(t.indices) else -1, -1)
                    .astype(np.int64))
    return HeldTables(seq, weakref.ref(pool), pool.steps, res.seq_ids, res.num_tokens, first, last)


def match_rows(held: HeldTables, res: StepResult) -> np.ndarray | None:
    """Row of the held batch each row of res continues (-1: sent whole), or None if res's batch is the held one.

    A row continues only if its token count grew by exactly its new tokens (> 0). Returns int64 [B].
    """
    ids, n_new = res.seq_ids, res.num_tokens
    k = np.diff(res.new_token_indptr)
    if len(ids) == len(held.seq_ids) and np.array_equal(ids, held.seq_ids):
        if len(ids) and (k > 0).all() and np.array_equal(held.num_tokens + k, n_new):
            return None
        src = np.arange(len(ids), dtype=np.int64)
    else:
        order = np.argsort(held.seq_ids, kind="stable")
        keys = held.seq_ids[order]
        pos = np.minimum(np.searchsorted(keys, ids), max(len(keys) - 1, 0))
        src = np.where((keys[pos] == ids) if len(keys) else np.zeros(len(ids), dtype=bool), order[pos] if len(keys)
                       else 0, -1).astype(np.int64)
    ok = (src >= 0) & (k > 0)
    ok[ok] &= held.num_tokens[src[ok]] + k[ok] == n_new[ok]
    return np.where(ok, src, -1)


def encode_delta(pool: Pool, res: StepResult, held: HeldTables, seq: int, same_batch: bool = False,
                 derive: bool = False) -> tuple[pb.StepReply, HeldTables]:
    """The incremental reply of step result `res` relative to `held`, and what the client holds after it.

    res: the step's result, with CSR tables (required if the pool has sliding windows) or without.
    seq: the request's stream_seq. Call under the pool lock, right after the step, with
    held.usable(pool, base) checked before it (rows sent whole are gathered from the pool).
    same_batch: the caller knows the batch is held's, same order, each row +k (the same extend-only
    request as the one that made held, with no step between): the decode path skips comparing them.
    derive: the client derives counts from tokens_added (StepRequest.accept_tokens_added): a uniform
    extend of the base batch then leaves num_tokens and new_token_indptr out.
    """
    fast = _decode_delta(pool, res, held, seq, same_batch, derive)
    if fast is not None:
        return fast
    ps = pool.page_size
    src = match_rows(held, res)
    b = len(res.seq_ids)
    same = src is None
    if same:
        src = np.arange(b, dtype=np.int64)
    cont = src >= 0
    tok = res.new_token_indptr
    num_n = res.num_tokens
    held_n = _cdiv(num_n, ps)
    num_p = _carry(held.num_tokens, src, cont, 0)
    held_p = _cdiv(num_p, ps)
    heads = _group_heads(res.tables)
    csr = res.tables[0].table is not None if res.tables else True
    # ---- per group: first held positions (CSR source only: no sliding windows otherwise) ----------
    firsts: dict[int, np.ndarray] = {}
    for g, i in heads.items():
        if csr:
            t = res.tables[i].table
            firsts[g] = held_n - np.diff(t.indptr.astype(np.int64))
            cont &= firsts[g] >= _carry(held.first[g], src, cont, 0)     # a window never moves back
        else:
            firsts[g] = np.zeros(b, dtype=np.int64)
    if not cont.all():
        same = False
    whole_rows = np.flatnonzero(~cont)
    whole = pool.tables_for(res.seq_ids[whole_rows]) if not csr and len(whole_rows) else None
    reply = _step_reply_base(pool, res, seq, held.seq, same, np.where(cont, src, -1), derive)
    new_first, new_last = [], []
    for g in sorted(heads):
        spaces = [i for i, st in enumerate(res.tables) if st.space.group == g]
        first_n = firsts[g]
        first_p = _carry(held.first[g], src, cont, 0)
        last_p = _carry(held.last[g], src, cont, -1)
        lo = np.where(cont, np.maximum(held_p, first_n), first_n)       # first position sent
        count = held_n - lo
        gd = pb.GroupDelta(group=g)
        moved = np.flatnonzero(first_n != first_p)
        if len(moved):
            fill_tensor(gd.first_rows, moved.astype(np.int32))
            fill_tensor(gd.first_pages, first_n[moved])
        if csr:
            head = res.tables[heads[g]].table
            indptr = head.indptr.astype(np.int64)
            # The base's last page, where it is still held: its position in this step's CSR rows.
            at = indptr[:-1] + held_p - 1 - first_n
            check = np.flatnonzero(cont & (held_p - 1 >= first_n))
            replaced = check[head.indices[at[check]] != last_p[check]] if len(check) else _NONE
            pos = _spans(indptr[:-1] + lo - first_n, count)
            rep_pos = at[replaced]
            values = [(res.tables[i].table.indices.take(pos), res.tables[i].table.indices.take(rep_pos))
                      for i in spaces]
            cnt = np.diff(indptr)
            last_n = np.where(cnt > 0, head.indices.take(np.maximum(indptr[1:] - 1, 0)) if len(head.indices)
                              else -1, -1).astype(np.int64)
        else:
            values, replaced, last_n = _from_slot_mappings(res, spaces, heads[g], whole, cont, whole_rows, tok,
                                                           num_p, held_p, held_n, last_p, count, ps)
        if len(replaced):
            fill_tensor(gd.replaced_rows, replaced.astype(np.int32))
        if len(moved) or len(replaced):
            reply.delta.groups.append(gd)
        for i, (pages, rep) in zip(spaces, values, strict=True):
            st = res.tables[i]
            sp = st.space
            out = reply.tables.add(index_space=sp.id, group=sp.group, scale=sp.scale, offset=sp.offset,
                                   upper_bound=sp.upper_bound, base=sp.base)
            fill_tensor(out.delta.pages, pages.astype(sp.index_dtype, copy=False))
            fill_tensor(out.delta.replaced, rep.astype(sp.index_dtype, copy=False))
            fill_tensor(out.delta.generations, _gens(pool, sp, pages))
            fill_tensor(out.delta.replaced_generations, _gens(pool, sp, rep))
        new_first.append(first_n)
        new_last.append(last_n)
    return reply, HeldTables(seq, held.pool, pool.steps, res.seq_ids, num_n, new_first, new_last)


def _decode_delta(pool: Pool, res: StepResult, held: HeldTables, seq: int, same_batch: bool,
                  derive: bool) -> tuple[pb.StepReply, HeldTables] | None:
    """encode_delta of a steady decode step (same batch, one new token per row, one group without a window),
    in a fixed handful of NumPy calls; None when the step is not one."""
    if res.opened is not None:
        return _opened_delta(pool, res, held, seq, derive)
    ids, b = res.seq_ids, len(res.seq_ids)
    if (len(res.tables) == 0 or res.tables[0].table is not None or len(held.first) != 1 or b != len(held.seq_ids)
            or int(res.new_token_indptr[-1]) != b):
        return None
    if not same_batch and not (np.array_equal(ids, held.seq_ids)
                               and np.array_equal(held.num_tokens + 1, res.num_tokens)):
        return None
    ps = pool.page_size
    partial = held.num_tokens % ps != 0          # the new token lands in the row's last page
    page = res.tables[0].slot_mapping // ps      # the page each row's new token is in (head space)
    opened = np.flatnonzero(~partial)            # rows whose new token opened a page
    replaced = np.flatnonzero(partial & (page != held.last[0]))      # copy-on-write moved the last page
    reply = pb.StepReply(layer_index_space=pool.layer_space, num_free_slots=res.num_free_slots, stream_seq=seq)
    _counts(reply, res, derive)
    add_copies(reply, pool, res)
    reply.delta.base_seq = held.seq
    if len(replaced):
        gd = reply.delta.groups.add(group=0)
        fill_tensor(gd.replaced_rows, replaced.astype(np.int32))
    for i, st in enumerate(res.tables):
        sp = st.space
        pg = page if i == 0 else st.slot_mapping // ps
        out = reply.tables.add(index_space=sp.id, group=sp.group, scale=sp.scale, offset=sp.offset,
                               upper_bound=sp.upper_bound, base=sp.base)
        code = INT32 if sp.index_dtype.itemsize == 4 else INT64
        pages, rep = pg.take(opened), pg.take(replaced)
        _put(out.delta.pages, code, pages.astype(sp.index_dtype))
        _put(out.delta.replaced, code, rep.astype(sp.index_dtype))
        _put(out.delta.generations, UINT32, _gens(pool, sp, pages))
        _put(out.delta.replaced_generations, UINT32, _gens(pool, sp, rep))
    return reply, HeldTables(seq, held.pool, pool.steps, ids, res.num_tokens, held.first, [page])


def _opened_delta(pool: Pool, res: StepResult, held: HeldTables, seq: int,
                  derive: bool) -> tuple[pb.StepReply, HeldTables]:
    """_decode_delta of a step that reported the pages it opened (StepResult.opened: Pool.step's steady decode
    path asked for no slot mappings), which is all the delta holds: no page can be replaced without sharing.

    Pool.step gives `opened` only for the pool's last batch again, one token per row, one layer group: with
    held.usable checked before the step, that batch is held's (same rows, same order), each row + 1.
    """
    rows, slots = res.opened                                # type: ignore[misc]
    if len(held.first) != 1 or len(res.seq_ids) != len(held.seq_ids):
        raise AssertionError("a steady decode step continues the held batch of one layer group")
    reply = pb.StepReply(layer_index_space=pool.layer_space, num_free_slots=res.num_free_slots, stream_seq=seq)
    _counts(reply, res, derive)
    reply.delta.base_seq = held.seq
    last = held.last[0]
    gens = [pool.allocators[g].generation.take(s) for g, s in enumerate(slots)]
    for i, sp in enumerate(pool.plan.geometry.index_spaces):
        pages = sp.page_indices(slots[sp.group])
        if i == 0:                                          # the group's first space: the rows' last pages
            last = last.copy()
            last[rows] = pages
        out = reply.tables.add(index_space=sp.id, group=sp.group, scale=sp.scale, offset=sp.offset,
                               upper_bound=sp.upper_bound, base=sp.base)
        code = INT32 if sp.index_dtype.itemsize == 4 else INT64
        _put(out.delta.pages, code, pages)
        _put(out.delta.replaced, code, pages[:0])
        _put(out.delta.generations, UINT32, gens[sp.group])
        _put(out.delta.replaced_generations, UINT32, gens[sp.group][:0])
    return reply, HeldTables(seq, held.pool, pool.steps, res.seq_ids, res.num_tokens, held.first, [last])


def _counts(reply: pb.StepReply, res: StepResult, derive: bool) -> None:
    """A steady decode delta's counts (every row + 1): tokens_added if the client derives them, else the arrays."""
    if derive:
        reply.delta.tokens_added = 1
    else:
        _put(reply.num_tokens, INT64, res.num_tokens)
        _put(reply.new_token_indptr, INT64, res.new_token_indptr)


def _put(t: Any, code: int, a: np.ndarray) -> None:
    """fill_tensor for an int32/int64/uint32 array of a known wire dtype (the decode path's few arrays)."""
    t.dtype = code
    t.data = a.tobytes() if _LITTLE else a.astype(a.dtype.newbyteorder("<")).tobytes()


def _from_slot_mappings(res: StepResult, spaces: list[int], head: int, whole: tuple[SpaceTables, ...] | None,
                        cont: np.ndarray, whole_rows: np.ndarray, tok: np.ndarray, num_p: np.ndarray,
                        held_p: np.ndarray, held_n: np.ndarray, last_p: np.ndarray, count: np.ndarray,
                        ps: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """Appended and replaced pages of one group (no sliding window) from slot mappings and whole-row tables.

    Returns ([(pages, replaced values)] per space of the group, replaced rows int64 [R], last pages int64 [B]).
    """
    b = len(cont)
    crow = np.flatnonzero(cont)
    # Every page a continued row gains holds new tokens: the first one in position c = held_p + j is
    # token tok[b] + c * ps - num_p[b] of the step (c >= held_p, so c * ps >= num_p).
    c_tok = np.repeat(tok[crow] + held_p[crow] * ps - num_p[crow], count[crow]) \
        + ps * _spans(np.zeros(len(crow), dtype=np.int64), count[crow])
    # Copy-on-write can only have moved a continued row's last page, and only if it was partly filled:
    # then the row's first new token lands in it.
    partial = crow[num_p[crow] % ps != 0]
    head_sm = res.tables[head].slot_mapping
    first_tok_page = head_sm.take(tok[partial]) // ps
    replaced = partial[first_tok_page != last_p[partial]]
    # Output offsets: pages in batch order, continued rows then whole rows scattered into place.
    offsets = np.cumsum(count) - count
    c_dst = _spans(offsets[crow], count[crow])
    w_dst = _spans(offsets[whole_rows], count[whole_rows])
    total = int(count.sum())
    values = []
    for i in spaces:
        sm = res.tables[i].slot_mapping
        pages = np.empty(total, dtype=np.int64)
        if len(c_dst):
            pages[c_dst] = sm.take(c_tok) // ps
        if len(w_dst):
            assert whole is not None and whole[i].table is not None, "rows sent whole need their tables"
            pages[w_dst] = whole[i].table.indices
        values.append((pages, sm.take(tok[replaced]) // ps))
    last_n = np.full(b, -1, dtype=np.int64)
    if len(crow):
        last_n[crow] = head_sm.take(tok[crow + 1] - 1) // ps
    if len(whole_rows):
        t = whole[head].table
        ip = t.indptr.astype(np.int64)
        has = np.diff(ip) > 0
        last_n[whole_rows[has]] = t.indices.take(ip[1:][has] - 1)
    return values, replaced, last_n


def _step_reply_base(pool: Pool, res: StepResult, seq: int, base: int, same: bool, src: np.ndarray,
                     derive: bool) -> pb.StepReply:
    reply = step_reply(pool, res, tables=False)
    reply.stream_seq = seq
    reply.delta.base_seq = base
    if same:
        reply.ClearField("seq_ids")
        k = np.diff(res.new_token_indptr)
        if derive and len(k) and int(k.min()) == int(k.max()):      # a uniform extend: counts follow from the base's
            reply.ClearField("num_tokens")
            reply.ClearField("new_token_indptr")
            reply.delta.tokens_added = int(k[0])
    else:
        fill_tensor(reply.delta.base_rows, src.astype(np.int32))
    return reply
