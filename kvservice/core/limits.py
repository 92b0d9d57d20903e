"""What a Step costs, bounded from its request and the pool before anything changes.

Two checks run before `Pool.step` (see `ManagerAPI.Step`):

- `check_step_counts`: every token count is at most the pool's max_seq_len, and the step's
  page demand is summed in Python integers whenever an int64 sum could wrap. After it, no sum
  the pool computes in int64 can overflow (with or without the server's --max-step-* caps).
- `step_reply_bound`: an upper bound on the bytes of the StepReply, from how many rows, new
  tokens and held pages the step will have. The adapter refuses a step whose bound is over the
  server's message limit (RESOURCE_EXHAUSTED, reason REPLY_TOO_LARGE), so a Step is never applied
  and then lost to gRPC's "Sent message larger than max".

The reply of one index space holds ``slot_mapping`` and ``slot_generations`` (8 + 4 bytes per new
token), and unless tables are omitted ``indptr`` ([B + 1]), ``indices`` and ``generations`` (one entry
each per page held, after sliding windows released theirs) and ``last_page_len`` ([B], int32), plus
``block_table`` ([B, widest row]) when asked; index entries are 4 or 8 bytes (the space's index dtype),
generations 4. The batch part holds ``seq_ids``, ``num_tokens`` and ``new_token_indptr`` (8 bytes each
per row), the cached token counts of admissions and at most one copy-on-write pair (2 x 8 bytes of
slots, 2 x 4 of generations) per extended row and group.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.contract.sizing import Plan

#: Protobuf framing of one Tensor (dtype, a 2-D shape, the data's tag and length, the field's own
#: tag and length) is at most 11 + 23 + 11 + 11 bytes; counted as 64.
TENSOR_FRAMING = 64
#: Framing of one SpaceTables message: five Tensors' allowance (with each part's own, ten for its seven Tensors)
#: and six integer fields of at most 11 bytes.
SPACE_FRAMING = 5 * TENSOR_FRAMING + 6 * 11 + 11
#: Bytes of one page generation (UINT32) on the wire.
GENERATION_BYTES = 4
#: Everything else of a StepReply that does not grow with the batch (integers, future fields).
REPLY_SLACK = 1024
#: Sums of int64 values stay exact while count x largest value is below this.
_SAFE_SUM = 2**62


@dataclass(frozen=True, slots=True)
class ReplyModel:
    """What the size of a pool's StepReply depends on, from its plan (built once per pool).

    index_bytes[g]: sum over the index spaces of layer group g of their index itemsize (4 or 8) plus the
        GENERATION_BYTES each space sends beside every index.
    windows[g]: sliding window of group g, tokens (0 = full attention).
    """

    num_spaces: int
    index_bytes: tuple[int, ...]
    windows: tuple[int, ...]
    num_layers: int
    page_size: int
    max_pages: int

    @classmethod
    @functools.lru_cache(maxsize=256)      # keyed by plans (hashable, frozen): at most 256 kept
    def of(cls, plan: Plan) -> ReplyModel:
        """The model of a plan (cached: the hot path asks once per Step)."""
        geo = plan.geometry
        index_bytes = [0] * len(geo.groups)
        for s in geo.index_spaces:
            index_bytes[s.group] += s.index_dtype.itemsize + GENERATION_BYTES
        return cls(len(geo.index_spaces), tuple(index_bytes), tuple(g.sliding_window for g in geo.groups),
                   len(geo.layers), plan.page_size, plan.max_pages_per_seq)


@dataclass(frozen=True, slots=True)
class StepShape:
    """How big a step's batch is after it runs: what the reply's size depends on.

    rows: B, the scheduled batch (extended, admitted, forked children).
    extended: E, rows that were extended (each may need one copy-on-write pair per group).
    admitted: A, rows admitted (each gets a cached-token count).
    new_tokens: T, tokens appended by the step (one slot-mapping entry each per index space).
    pages: per layer group, pages the batch's rows hold after the step (table entries), at most.
    widest: pages of the longest row after the step, at most (block table width).
    """

    rows: int
    extended: int
    admitted: int
    new_tokens: int
    pages: tuple[int, ...]
    widest: int


@dataclass(frozen=True, slots=True)
class ReplyBound:
    """Bytes of a StepReply, at most, by part."""

    slot_mappings: int
    tables: int
    block_tables: int
    rest: int

    @property
    def total(self) -> int:
        return self.slot_mappings + self.tables + self.block_tables + self.rest


def step_reply_bound(model: ReplyModel, shape: StepShape, tables: bool, block_table: bool) -> ReplyBound:
    """Upper bound on the serialized StepReply of a step of `shape` in a pool of `model`."""
    b, spaces, groups = shape.rows, model.num_spaces, len(model.index_bytes)
    mappings = spaces * ((8 + GENERATION_BYTES) * shape.new_tokens + TENSOR_FRAMING)
    table_bytes = block_bytes = 0
    if tables:
        table_bytes = sum(isz * (b + 1 + pages) for isz, pages in zip(model.index_bytes, shape.pages, strict=True))
        table_bytes += spaces * (4 * b + 3 * TENSOR_FRAMING)
    if block_table:
        block_bytes = (sum(model.index_bytes) - GENERATION_BYTES * spaces) * b * shape.widest + spaces * TENSOR_FRAMING
    rest = (REPLY_SLACK + spaces * SPACE_FRAMING + 10 * model.num_layers + 8 * (3 * b + 1) + 8 * shape.admitted
            + groups * ((16 + 2 * GENERATION_BYTES) * shape.extended + 2 * TENSOR_FRAMING + 11) + 4 * TENSOR_FRAMING)
    return ReplyBound(mappings, table_bytes, block_bytes, rest)


@functools.lru_cache(maxsize=1024)
def extend_bound(model: ReplyModel, tables: bool, block_table: bool) -> tuple[int, int, int]:
    """(c0, ce, cs): step_reply_bound(...).total of an extend-only step (E rows extended by S tokens in all, every
    row at max_pages: the bound from the request alone) is c0 + ce * E + cs * S.

    step_reply_bound is affine in E and S for that shape (rows = extended = E, no admissions, E x max_pages
    table entries per layer group, rows max_pages wide), so three evaluations give it exactly;
    tests/unit/test_limits.py checks the two against each other on random steps and pools.
    """
    def total(e: int, t: int) -> int:
        shape = StepShape(e, e, 0, t, (e * model.max_pages,) * len(model.index_bytes), model.max_pages)
        return step_reply_bound(model, shape, tables, block_table).total
    c0 = total(0, 0)
    return c0, total(1, 0) - c0, total(0, 1) - c0


def exact_sum(a: np.ndarray) -> int:
    """Sum of a non-negative integer array, exact even where an int64 sum would wrap."""
    if not len(a):
        return 0
    top = int(a.max())
    if top * len(a) < _SAFE_SUM:
        return int(a.sum(dtype=np.int64))
    return sum(a.tolist())


def check_step_counts(pool: str, max_seq_len: int, num_slots: int, page_size: int,
                      counts: Sequence[tuple[str, np.ndarray | None]],
                      summaries: Sequence[tuple[int, int, int] | None] | None = None,
                      ) -> list[tuple[int, int, int] | None]:
    """Refuse token counts that could overflow the pool's int64 arithmetic; returns (min, max, exact sum)
    of each array (None for an absent, empty or malformed one; the sum is 0 when an entry is < 0).

    counts: (field name, 1-D integer array or None) for extend_num_tokens and admit_num_tokens.
    summaries: their (min, max, exact sum) already computed (kvservice.manager.step_input), or None.
    Counts <= 0 and wrong lengths are left to the pool (its messages name the sequence).
    Raises InvalidArgument for a count over max_seq_len (no sequence can take it). With counts
    bounded so, only a batch so long that count x pages per count reaches 2^62 could wrap the
    pool's sums of pages: such a step is summed here exactly and refused (ResourceExhausted) when
    even the pages it needs at the least exceed the pool's slots; otherwise its sums cannot wrap.
    """
    least_pages, risky, out = 0, False, []
    for i, (name, a) in enumerate(counts):
        summary = summaries[i] if summaries is not None else count_summary(a)
        out.append(summary)
        if summary is None:
            continue                                  # the pool names the shape or dtype
        top = summary[1]
        if top > max_seq_len:
            j = int(np.argmax(a))
            raise InvalidArgument(f"{name}[{j}] = {top} tokens: pool {pool!r} takes at most max_seq_len="
                                  f"{max_seq_len} tokens per sequence", reason="OVER_MAX_SEQ_LEN", value=top,
                                  max_seq_len=max_seq_len)
        if (top // page_size + 2) * len(a) >= _SAFE_SUM:
            risky = True
            least_pages += exact_sum(np.maximum(a, 0) // page_size)   # k tokens take >= floor(k / ps) pages
    if risky and least_pages > num_slots:
        raise ResourceExhausted(f"pool {pool!r}: this step needs at least {least_pages} slots, the pool has "
                                f"{num_slots}; split the step", needed=least_pages, num_slots=num_slots)
    return out


def count_summary(a: np.ndarray | None) -> tuple[int, int, int] | None:
    """(min, max, exact sum) of a 1-D integer count array, the sum 0 when an entry is < 0; None if absent,
    empty or not 1-D integers."""
    if a is None or not a.size or a.ndim != 1 or a.dtype.kind not in "iu":
        return None
    n = len(a)
    if n > 1:
        raw = a.tobytes()
        w = a.itemsize
        if raw == raw[:w] * n:                        # every count the same (a decode step): no reductions
            v = int(a[0])
            return v, v, v * n if v >= 0 else 0
    low, top = int(np.minimum.reduce(a)), int(np.maximum.reduce(a))
    total = 0
    if low >= 0:
        if top * len(a) < 1 << (8 * a.dtype.itemsize - 1):
            total = int(np.add.reduce(a))             # exact in the array's own dtype: no cast
        elif top * len(a) < _SAFE_SUM:
            total = int(np.add.reduce(a, dtype=np.int64))
        else:
            total = sum(a.tolist())
    return low, top, total


def pages_after(page_size: int, max_pages: int, windows: Sequence[int], e_old: np.ndarray | None,
                e_k: np.ndarray, a_n: np.ndarray, c_tokens: np.ndarray | None, num_children: int,
                live_tokens: int | None) -> tuple[tuple[int, ...], int]:
    """Per-group table entries of the batch after a step, at most, and the widest row, at most.

    e_old, e_k: int64 [E], tokens each extended row holds before the step and gains;
        e_old None = unknown: the bound then takes each extended row at max_pages, or, given live_tokens
        (the tokens of all the pool's sequences), at most those tokens' pages.
    a_n: int64 [A], tokens of each admission. c_tokens: int64 [K], tokens of each fork child
        (its parent's), None = unknown (max_pages each). windows[g]: sliding window of group g (0 = full).
    """
    ps = page_size
    a_pages = -(-a_n // ps)
    admitted = exact_sum(a_pages)
    widest = int(a_pages.max()) if len(a_pages) else 0
    if e_old is None:
        # Sum over distinct live rows of ceil((old + k) / ps) <= (sum(old) + sum(k)) / ps + E.
        extended = len(e_k) * max_pages
        if live_tokens is not None:
            extended = min(extended, (live_tokens + exact_sum(e_k)) // ps + len(e_k))
        children = num_children * max_pages
        widest = max_pages if len(e_k) or num_children else widest
        return tuple(extended + admitted + children for _ in windows), widest
    e_new = e_old + e_k
    e_pages = -(-e_new // ps)
    c_pages = -(-c_tokens // ps) if c_tokens is not None else np.full(num_children, max_pages, dtype=np.int64)
    widest = max(widest, int(e_pages.max()) if len(e_pages) else 0, int(c_pages.max()) if len(c_pages) else 0)
    out = []
    for w in windows:
        kept = e_pages
        if w:   # a sliding group keeps pages from (old + 1 - w) // ps on (docs/DESIGN.md: window release)
            kept = e_pages - np.minimum(np.maximum(e_old + 1 - w, 0) // ps, -(-e_old // ps))
        out.append(exact_sum(kept) + admitted + exact_sum(c_pages))
    return tuple(out), widest
