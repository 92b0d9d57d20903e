"""Incremental page tables: a step's changes (StepResult.changes), encoded relative to the last reply a stream's
client holds.

A StepStream client keeps, per index space, each row's pages by position within its sequence
(kvservice.contract.mirror.PageTableMirror, the shape of vLLM v1's persistent block table). Between two
replies on a stream, when no other step ran on the pool in between (``Pool.steps`` advanced by
exactly one; the pool lock is held from that check to the end of the encoding), a sequence that
is in both batches was extended by this step, and an extension changes a row in three ways only,
which the pool reports per layer group from the step's plan (core.emit.GroupChanges):

- pages appended after its last one (positions ``held_before .. held_after``);
- its last page replaced, when it was partly filled and shared (copy-on-write);
- pages at its front released by a sliding window (its first held position moves).

Every other row of the batch (admitted, forked, or absent from the last reply's batch) is sent
whole, gathered from the pool (``Pool.tables_for``). Nothing is diffed: a delta is O(changed pages)
plus O(B) NumPy work, exact by construction, and the step itself builds no slot mappings or tables
for it (``Pool.step(tables=False, mappings=False)``). The same changes give full tables (the pool's
emission, for a client that holds nothing) and no tables (omit_tables); tests/unit/test_delta_mirror.py
checks the mirror against full tables, and the changes against a diff of full tables, on every step of
random op sequences.

What the server keeps per stream (:class:`HeldTables`) is O(B): the batch and its token counts. No
page lists.

Every page a delta sends goes with its slot's generation (``SpaceDelta.generations``,
``replaced_generations``), read from the pool's allocators right after the step, when every page
of the batch is held by its row: the client's mirror keeps them beside the pages.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvservice.contract.wire import fill_tensor
from kvservice.core.emit import GroupChanges
from kvservice.core.pool import Pool, SpaceTables, StepResult
from kvservice.manager.replies import add_copies, step_reply
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
    """

    seq: int
    pool: weakref.ref
    pool_steps: int
    seq_ids: np.ndarray
    num_tokens: np.ndarray

    def usable(self, pool: Pool, base: int) -> bool:
        """True if a step of `pool` about to run now can be answered relative to this reply.

        base: the request's delta_base. Call under the pool's lock, before the step.
        """
        return base == self.seq and pool is self.pool() and pool.steps == self.pool_steps


class TablesHolder(Protocol):
    """Whoever keeps what a stream's client holds between replies (server/stream.py's StreamSession)."""

    held: HeldTables | None


def _spans(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ranges [starts[i], starts[i] + counts[i]), int64."""
    total = int(counts.sum())
    if not total:
        return _NONE
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)


def held_from_full(seq: int, pool: Pool, res: StepResult) -> HeldTables:
    """The state of a client that received full tables of `res` (under the pool lock, after the step)."""
    return HeldTables(seq, weakref.ref(pool), pool.steps, res.seq_ids, res.num_tokens)


def match_rows(held: HeldTables, res: StepResult) -> np.ndarray | None:
    """Row of the held batch each row of res continues (-1: sent whole), or None if res's batch is the held one.

    Only an extended row (the first res.num_extended) continues, and only if its token count grew by exactly
    its new tokens (> 0). Returns int64 [B].
    """
    ids, n_new = res.seq_ids, res.num_tokens
    k = np.diff(res.new_token_indptr)
    if len(ids) == len(held.seq_ids) and np.array_equal(ids, held.seq_ids):
        if len(ids) and res.num_extended == len(ids) and (k > 0).all() and np.array_equal(held.num_tokens + k, n_new):
            return None
        src = np.arange(len(ids), dtype=np.int64)
    else:
        order = np.argsort(held.seq_ids, kind="stable")
        keys = held.seq_ids[order]
        pos = np.minimum(np.searchsorted(keys, ids), max(len(keys) - 1, 0))
        src = np.where((keys[pos] == ids) if len(keys) else np.zeros(len(ids), dtype=bool), order[pos] if len(keys)
                       else 0, -1).astype(np.int64)
    ok = (src >= 0) & (k > 0)
    ok[res.num_extended:] = False
    ok[ok] &= held.num_tokens[src[ok]] + k[ok] == n_new[ok]
    return np.where(ok, src, -1)


def encode_delta(pool: Pool, res: StepResult, held: HeldTables, seq: int,
                 derive: bool = False) -> tuple[pb.StepReply, HeldTables]:
    """The incremental reply of step result `res` relative to `held`, and what the client holds after it.

    res: the step's result with its changes (Pool.step(tables=False, mappings=False) suffices).
    seq: the request's stream_seq. Call under the pool lock, right after the step, with
    held.usable(pool, base) checked before it (rows sent whole are gathered from the pool).
    derive: the client derives counts from tokens_added (StepRequest.accept_tokens_added): a uniform
    extend of the base batch then leaves num_tokens and new_token_indptr out.
    """
    after = HeldTables(seq, held.pool, pool.steps, res.seq_ids, res.num_tokens)
    if res.repeat and int(res.new_token_indptr[-1]) == len(res.seq_ids):
        # The pool's last step's batch again, which held.usable makes held's: one token per row.
        fast = _decode_delta(pool, res, held.seq, seq, derive)
        if fast is not None:
            return fast, after
    src = match_rows(held, res)
    ps = pool.page_size
    b = len(res.seq_ids)
    same = src is None
    if same:
        src = np.arange(b, dtype=np.int64)
    cont = src >= 0
    num_n = res.num_tokens
    held_n = (num_n + (ps - 1)) // ps
    held_p = (num_n - np.diff(res.new_token_indptr) + (ps - 1)) // ps     # a continued row's pages before the step
    whole_rows = (~cont).nonzero()[0]
    whole = pool.tables_for(res.seq_ids[whole_rows]) if len(whole_rows) else None
    reply = _step_reply_base(pool, res, seq, held.seq, same, np.where(cont, src, -1), derive)
    spaces = pool.plan.geometry.index_spaces
    for g, ch in enumerate(res.changes):
        group = [i for i, sp in enumerate(spaces) if sp.group == g]
        _encode_group(reply, pool, g, group, ch, cont, whole_rows, whole, held_n, held_p)
    return reply, after


def _encode_group(reply: pb.StepReply, pool: Pool, g: int, group: list[int], ch: GroupChanges, cont: np.ndarray,
                  whole_rows: np.ndarray, whole: tuple[SpaceTables, ...] | None, held_n: np.ndarray,
                  held_p: np.ndarray) -> None:
    """Layer group g's part of a delta: its GroupDelta (first pages moved, last pages replaced) and one
    SpaceDelta per index space of the group (`group`: their positions in the pool's index spaces).

    cont: bool [B] rows continued from the held batch; whole_rows: int64 [W] the others, whose tables
    `whole` (Pool.tables_for of those rows) holds; held_n / held_p: int64 [B] pages after / before the step.
    """
    b = len(cont)
    gen = pool.allocators[g].generation
    grown_ok = cont[ch.grown]                               # grown rows the client holds (the others: whole)
    c_rows, c_counts, c_slots = ch.grown, ch.counts, ch.slots
    if not grown_ok.all():
        c_rows, c_counts, c_slots = ch.grown[grown_ok], ch.counts[grown_ok], ch.slots[grown_ok.repeat(ch.counts)]
    count = np.zeros(b, dtype=np.int64)
    count[c_rows] = c_counts
    first_n = np.zeros(b, dtype=np.int64)                   # first kept page after the step, where it moved
    moved = np.zeros(b, dtype=bool)
    if len(ch.moved):
        m_ok = cont[ch.moved]
        first_n[ch.moved[m_ok]] = ch.moved_first[m_ok]
        moved[ch.moved[m_ok]] = True
    w_cnt = _NONE
    if whole is not None:
        w_ip = whole[group[0]].table.indptr.astype(np.int64)
        w_cnt = np.diff(w_ip)
        count[whole_rows] = w_cnt
        first_n[whole_rows] = held_n[whole_rows] - w_cnt
        moved[whole_rows] = first_n[whole_rows] != 0
    # A continued row's replaced last page: copy-on-write of position held_p - 1, while it is still held.
    r_ok = cont[ch.cow] & (held_p[ch.cow] - 1 >= first_n[ch.cow])
    replaced, r_slots = ch.cow[r_ok], ch.cow_slots[r_ok]
    m_rows = moved.nonzero()[0]
    if len(m_rows) or len(replaced):
        gd = reply.delta.groups.add(group=g)
        if len(m_rows):
            fill_tensor(gd.first_rows, m_rows.astype(np.int32))
            fill_tensor(gd.first_pages, first_n[m_rows])
        if len(replaced):
            fill_tensor(gd.replaced_rows, replaced.astype(np.int32))
    offsets = np.cumsum(count) - count
    c_dst = _spans(offsets[c_rows], c_counts)
    w_dst = _spans(offsets[whole_rows], w_cnt) if whole is not None else _NONE
    total = int(np.add.reduce(count))
    c_gen, r_gen = gen.take(c_slots), gen.take(r_slots)
    spaces = pool.plan.geometry.index_spaces
    for i in group:
        sp = spaces[i]
        pages = np.empty(total, dtype=sp.index_dtype)
        gens = np.empty(total, dtype=np.uint32)
        pages[c_dst] = sp.page_indices(c_slots)
        gens[c_dst] = c_gen
        if len(w_dst):
            pages[w_dst] = whole[i].table.indices
            gens[w_dst] = whole[i].generations
        out = reply.tables.add(index_space=sp.id, group=sp.group, scale=sp.scale, offset=sp.offset,
                               upper_bound=sp.upper_bound, base=sp.base)
        fill_tensor(out.delta.pages, pages)
        fill_tensor(out.delta.replaced, sp.page_indices(r_slots))
        fill_tensor(out.delta.generations, gens)
        fill_tensor(out.delta.replaced_generations, r_gen)


def _decode_delta(pool: Pool, res: StepResult, base: int, seq: int, derive: bool) -> pb.StepReply | None:
    """encode_delta of a steady decode step (the held batch again, one new token per row, nothing replaced or
    moved), in a fixed handful of NumPy calls; None when the step is not one."""
    changes = res.changes
    for ch in changes:
        if len(ch.cow) or len(ch.moved):
            return None
    reply = pb.StepReply(layer_index_space=pool.layer_space, num_free_slots=res.num_free_slots, stream_seq=seq)
    _counts(reply, res, derive)
    add_copies(reply, pool, res)
    reply.delta.base_seq = base
    gens = [pool.allocators[g].generation.take(ch.slots) for g, ch in enumerate(changes)]
    for sp in pool.plan.geometry.index_spaces:
        g = sp.group
        pages = sp.page_indices(changes[g].slots)
        out = reply.tables.add(index_space=sp.id, group=g, scale=sp.scale, offset=sp.offset,
                               upper_bound=sp.upper_bound, base=sp.base)
        code = INT32 if sp.index_dtype.itemsize == 4 else INT64
        _put(out.delta.pages, code, pages)
        _put(out.delta.replaced, code, pages[:0])
        _put(out.delta.generations, UINT32, gens[g])
        _put(out.delta.replaced_generations, UINT32, gens[g][:0])
    return reply


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
