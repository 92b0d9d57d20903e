"""A pool: one planned geometry, one slot allocator per layer group, and the sequences in it.

Sequence state lives in arrays indexed by a *row* (a dense handle the pool
assigns): ``_num_tokens[row]`` and, per group, ``_slots[g][row, j]`` = the slot
holding page j of the sequence. A step over B sequences is a fixed number of
NumPy calls, not B Python calls. Only the seq_id -> row lookup is a dict.

Invariant kept here: a live sequence of n tokens holds exactly ceil(n /
page_size) slots in every group, in ``_slots[g][row, :ceil(n / page_size)]``.
(Sliding-window release comes with the prefix-caching work; until then sliding
groups hold every page, like full groups.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .allocator import SlotAllocator
from .errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from .geometry import IndexSpace
from .pagetable import PageTable
from .planner import Plan

_EMPTY_IDS = np.zeros(0, dtype=np.uint64)
_EMPTY_COUNTS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class SpaceTables:
    """What the kernels of one index space need for a step.

    slot_mapping: shape [num_new_tokens], int64; page_index * page_size + offset_in_page
        for each new token, rows in batch order.
    table: CSR page table of the batch (None if tables were omitted).
    block_table: shape [B, max_pages], index dtype of the space, padded with -1 (None unless asked).
    """

    space: IndexSpace
    slot_mapping: np.ndarray
    table: PageTable | None
    block_table: np.ndarray | None


@dataclass(frozen=True, slots=True)
class StepResult:
    """Outcome of one step for the scheduled batch (extended sequences, then admitted ones).

    seq_ids: shape [B], uint64.
    num_tokens: shape [B], int64; tokens each sequence holds after the step.
    new_token_indptr: shape [B + 1], int64; row b's new tokens are [indptr[b], indptr[b+1]).
    tables: one entry per index space of the pool, in index-space order.
    num_free_slots: free slots after the step (fewest over the groups).
    """

    seq_ids: np.ndarray
    num_tokens: np.ndarray
    new_token_indptr: np.ndarray
    tables: tuple[SpaceTables, ...]
    num_free_slots: int


def _ids(name: str, a: object) -> np.ndarray:
    if a is None:
        return _EMPTY_IDS
    arr = np.asarray(a)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if arr.dtype.kind == "i" and len(arr) and arr.min() < 0:
        raise InvalidArgument(f"{name} holds a negative sequence id ({arr.min()})")
    return arr.astype(np.uint64, copy=False)


def _counts(name: str, a: object, n: int) -> np.ndarray:
    if a is None:
        a = _EMPTY_COUNTS
    arr = np.asarray(a)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if len(arr) != n:
        raise InvalidArgument(f"{name} has {len(arr)} entries for {n} sequence ids")
    arr = arr.astype(np.int64, copy=False)
    if n and arr.min() <= 0:
        raise InvalidArgument(f"{name} must be > 0 tokens per sequence, got {arr.min()}")
    return arr


class Pool:
    """Named pool of slots with its sequences. Not thread-safe: the manager serialises calls."""

    def __init__(self, name: str, plan: Plan) -> None:
        self.name = name
        self.plan = plan
        geo = plan.geometry
        self.page_size = geo.spec.page_size
        self.max_seq_len = plan.max_seq_len
        self.allocators = [SlotAllocator(geo.num_slots) for _ in geo.groups]
        self._rows: dict[int, int] = {}          # seq_id -> row (source of truth)
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # (ids, rows) by id; None = stale
        self._free_rows: list[int] = []
        self._num_rows = 0                        # rows ever used (high-water mark)
        cap, width = 16, 4
        self._num_tokens = np.zeros(cap, dtype=np.int64)   # 0 = row unused
        self._held = np.zeros(cap, dtype=np.int64)         # ceil(num_tokens / page_size): slots per group
        self._arange = np.arange(1024, dtype=np.int64)
        self._seq_ids = np.zeros(cap, dtype=np.uint64)
        # Slot values fit the index dtype of a scale-1 space, so per_layer tables need no conversion.
        self._slot_dtype = np.dtype(np.int32 if geo.num_slots <= 2**31 - 1 else np.int64)
        self._slots = [np.full((cap, width), -1, dtype=self._slot_dtype) for _ in geo.groups]
        self.steps = 0
        self.admitted = 0
        self.refused = 0
        self.alloc_failures: dict[str, int] = {}

    # ---- read side -------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(self._rows)

    @property
    def num_free_slots(self) -> int:
        return min(a.num_free for a in self.allocators)

    @property
    def peak_used_slots(self) -> int:
        return max(a.peak_used for a in self.allocators)

    @property
    def num_tokens_total(self) -> int:
        return int(self._num_tokens.sum())

    def sequences(self) -> tuple[np.ndarray, np.ndarray]:
        """(seq_ids uint64 [N], num_tokens int64 [N]) of live sequences, sorted by id."""
        rows = np.fromiter(self._rows.values(), dtype=np.int64, count=len(self._rows))
        ids = self._seq_ids[rows]
        order = np.argsort(ids, kind="stable")
        return ids[order], self._num_tokens[rows[order]]

    def sequence_slots(self, seq_id: int, group: int = 0) -> np.ndarray:
        """Slots held by a sequence in one group, page order (a copy)."""
        row = self._rows.get(int(seq_id))
        if row is None:
            raise NotFound(f"sequence {seq_id} is not in pool {self.name!r}", seq_id=seq_id)
        held = -(-int(self._num_tokens[row]) // self.page_size)
        return self._slots[group][row, :held].copy()

    def tables_for(self, seq_ids: np.ndarray, block_table: bool = False) -> tuple[SpaceTables, ...]:
        """Page tables of live sequences (no slot mappings: nothing new is appended)."""
        ids = _ids("seq_ids", seq_ids)
        rows = self._lookup(ids, "seq_ids")
        n = self._num_tokens[rows]
        return self._emit(rows, n, n, self._held[rows], np.zeros(len(rows) + 1, dtype=np.int64), True,
                          block_table)

    # ---- the step ----------------------------------------------------------------------
    def step(self, free_ids: object = None, extend_ids: object = None, extend_tokens: object = None,
             admit_ids: object = None, admit_tokens: object = None, tables: bool = True,
             block_table: bool = False) -> StepResult:
        """One scheduler iteration: free, then extend, then admit; all or nothing.

        free_ids: shape [F], uint64 (or non-negative int); live sequences to drop.
        extend_ids, extend_tokens: shape [E]; live sequences and the tokens (> 0) each gains.
        admit_ids, admit_tokens: shape [A]; new sequences and the tokens (> 0) each starts with.
        Returns the scheduled batch (E extended, then A admitted) with slot mappings and tables.
        Raises InvalidArgument, NotFound, AlreadyExists or ResourceExhausted; then nothing changed.
        """
        f_ids = _ids("free_seq_ids", free_ids)
        e_ids = _ids("extend_seq_ids", extend_ids)
        a_ids = _ids("admit_seq_ids", admit_ids)
        e_k = _counts("extend_num_tokens", extend_tokens, len(e_ids))
        a_n = _counts("admit_num_tokens", admit_tokens, len(a_ids))
        parts = [a for a in (f_ids, e_ids, a_ids) if len(a)]
        all_ids = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else f_ids
        if len(all_ids) > 1:
            srt = np.sort(all_ids)
            dup = srt[1:] == srt[:-1]
            if dup.any():
                raise InvalidArgument(
                    f"sequence {srt[1:][dup][0]} appears more than once in one step; each sequence may be "
                    "freed, extended or admitted once per step", seq_id=srt[1:][dup][0])
        f_rows = self._lookup(f_ids, "free_seq_ids")
        e_rows = self._lookup(e_ids, "extend_seq_ids")
        if len(a_ids):
            known = self._find(a_ids)[1]
            if known.any():
                taken = a_ids[known][0]
                raise AlreadyExists(f"sequence {taken} is already in pool {self.name!r}", seq_id=taken)
        ps = self.page_size
        e_old = self._num_tokens[e_rows]
        e_new = e_old + e_k
        for name, n, ids in (("extend", e_new, e_ids), ("admit", a_n, a_ids)):
            if len(n) and n.max() > self.max_seq_len:
                j = int(np.argmax(n))
                raise InvalidArgument(
                    f"{name}: sequence {ids[j]} would hold {n[j]} tokens; pool {self.name!r} takes at most "
                    f"max_seq_len={self.max_seq_len}", seq_id=ids[j], max_seq_len=self.max_seq_len)
        if len(a_ids):
            old = np.concatenate((e_old, np.zeros(len(a_ids), dtype=np.int64)))
            new = np.concatenate((e_new, a_n))
            held_old = np.concatenate((self._held[e_rows], np.zeros(len(a_ids), dtype=np.int64)))
        else:
            old, new, held_old = e_old, e_new, self._held[e_rows]
        held_new = (new + (ps - 1)) // ps
        need = held_new - held_old
        needed = int(need.sum())
        released = int(self._held[f_rows].sum()) if len(f_rows) else 0
        free_now = self.num_free_slots
        if needed > free_now + released:
            self.refused += 1
            self.alloc_failures["out_of_slots"] = self.alloc_failures.get("out_of_slots", 0) + 1
            raise ResourceExhausted(
                f"pool {self.name!r}: this step needs {needed} slots per layer group but only "
                f"{free_now + released} are free ({free_now} free + {released} released by this step's "
                f"frees) of {self.plan.num_slots}; free or preempt sequences, or plan a bigger pool",
                needed=needed, free=free_now + released, num_slots=self.plan.num_slots)
        # ---- nothing can fail past this line --------------------------------------
        self._release(f_rows)
        rows = np.concatenate((e_rows, self._take_rows(a_ids))) if len(a_ids) else e_rows
        self._num_tokens[rows] = new
        self._held[rows] = held_new
        if len(rows):
            self._ensure_width(int(held_new.max()))
        if needed:
            starts = np.cumsum(need) - need
            rep_rows = np.repeat(rows, need)
            cols = np.repeat(held_old - starts, need) + self._iota(needed)
            for alloc, slots in zip(self.allocators, self._slots, strict=True):
                slots[rep_rows, cols] = alloc.allocate(needed)
        self.steps += 1
        self.admitted += len(a_ids)
        tok_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(new - old, out=tok_indptr[1:])
        return StepResult(self._seq_ids[rows], new, tok_indptr,
                          self._emit(rows, old, new, held_new, tok_indptr, tables, block_table), self.num_free_slots)

    # ---- helpers -------------------------------------------------------------------
    def _iota(self, n: int) -> np.ndarray:
        """arange(n) as int64, from a cached buffer (read-only use)."""
        if len(self._arange) < n:
            self._arange = np.arange(max(n, 2 * len(self._arange)), dtype=np.int64)
        return self._arange[:n]

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, found) for ids, vectorised over a sorted index rebuilt after admits and frees."""
        if self._sorted is None:
            rows = np.fromiter(self._rows.values(), dtype=np.int64, count=len(self._rows))
            keys = self._seq_ids[rows]
            order = np.argsort(keys)
            self._sorted = (keys[order], rows[order])
        keys, rows = self._sorted
        if not len(keys):
            return np.zeros(len(ids), dtype=np.int64), np.zeros(len(ids), dtype=bool)
        pos = np.searchsorted(keys, ids)
        np.minimum(pos, len(keys) - 1, out=pos)
        return rows[pos], keys[pos] == ids

    def _lookup(self, ids: np.ndarray, field: str) -> np.ndarray:
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        rows, found = self._find(ids)
        if not found.all():
            missing = ids[~found][0]
            raise NotFound(f"{field}: sequence {missing} is not in pool {self.name!r}", seq_id=missing)
        return rows

    def _take_rows(self, ids: np.ndarray) -> np.ndarray:
        n = len(ids)
        if not n:
            return np.zeros(0, dtype=np.int64)
        reuse = min(n, len(self._free_rows))
        rows = [self._free_rows.pop() for _ in range(reuse)]
        fresh = n - reuse
        if fresh:
            self._grow_rows(self._num_rows + fresh)
            rows.extend(range(self._num_rows, self._num_rows + fresh))
            self._num_rows += fresh
        out = np.array(rows, dtype=np.int64)
        self._seq_ids[out] = ids
        self._rows.update(zip(ids.tolist(), rows, strict=True))
        self._sorted = None
        return out

    def _release(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        held = self._held[rows]
        mask = np.arange(int(held.max())) < held[:, None]
        for alloc, slots in zip(self.allocators, self._slots, strict=True):
            alloc.free(slots[rows, :mask.shape[1]][mask], unique=True)
        for seq_id in self._seq_ids[rows].tolist():
            del self._rows[seq_id]
        self._num_tokens[rows] = 0
        self._held[rows] = 0
        self._free_rows.extend(rows.tolist())
        self._sorted = None

    def _grow_rows(self, n: int) -> None:
        cap = len(self._num_tokens)
        if n <= cap:
            return
        new_cap = max(n, 2 * cap)
        self._num_tokens = np.concatenate((self._num_tokens, np.zeros(new_cap - cap, dtype=np.int64)))
        self._seq_ids = np.concatenate((self._seq_ids, np.zeros(new_cap - cap, dtype=np.uint64)))
        self._held = np.concatenate((self._held, np.zeros(new_cap - cap, dtype=np.int64)))
        self._slots = [np.concatenate((s, np.full((new_cap - cap, s.shape[1]), -1, dtype=s.dtype)))
                       for s in self._slots]

    def _ensure_width(self, pages: int) -> None:
        width = self._slots[0].shape[1]
        if pages <= width:
            return
        new_w = min(max(pages, 2 * width), self.plan.max_pages_per_seq)
        self._slots = [np.concatenate((s, np.full((s.shape[0], new_w - width), -1, dtype=s.dtype)), axis=1)
                       for s in self._slots]

    def _emit(self, rows: np.ndarray, old: np.ndarray, new: np.ndarray, held: np.ndarray, tok_indptr: np.ndarray,
              tables: bool, block_table: bool) -> tuple[SpaceTables, ...]:
        """Slot mappings of the new tokens and the tables of `rows`, for every index space."""
        ps = self.page_size
        b = len(rows)
        width = self._slots[0].shape[1]
        t = int(tok_indptr[-1])
        if t == b:                                   # decode: one new token per row
            tok_rows, pos = rows, old
        else:
            k = new - old
            tok_rows = np.repeat(rows, k)
            pos = np.repeat(old - tok_indptr[:-1], k) + self._iota(t)
        page_of_tok, off_in_page = np.divmod(pos, ps)
        tok_flat = tok_rows * width + page_of_tok              # into _slots[g].ravel()
        if tables:
            indptr = np.zeros(b + 1, dtype=np.int64)
            np.cumsum(held, out=indptr[1:])
            # Row r's pages sit at the start of its table row: gather them flat, no mask.
            flat = np.repeat(rows * width - indptr[:-1], held)
            flat += self._iota(int(indptr[-1]))
            last = (new - (held - 1) * ps).astype(np.int32)
        if block_table:
            bt_width = int(held.max()) if b else 0
            pad = np.arange(bt_width) >= held[:, None]
        out = []
        gathered: dict[int, tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] = {}
        for space in self.plan.geometry.index_spaces:
            g = space.group
            if g not in gathered:
                flat_slots = self._slots[g].ravel()
                gathered[g] = (flat_slots.take(tok_flat).astype(np.int64),
                               flat_slots.take(flat) if tables else None,
                               self._slots[g][rows, :bt_width] if block_table else None)
            tok_slots, idx, sub = gathered[g]
            if space.scale == 1 and space.offset == 0:
                mapping = tok_slots * ps + off_in_page
            else:
                mapping = (tok_slots * space.scale + space.offset) * ps + off_in_page
            table = PageTable(indptr.astype(space.index_dtype), space.page_indices(idx), last) if tables else None
            bt = None
            if block_table:
                bt = space.page_indices(sub).copy()
                bt[pad] = -1
            out.append(SpaceTables(space, mapping, table, bt))
        return tuple(out)
