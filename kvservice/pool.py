"""A pool: one planned geometry, one slot allocator per layer group, and the sequences in it.

Sequence state lives in arrays indexed by a *row* (a dense handle the pool
assigns): ``_num_tokens[row]``, ``_held[row]`` = ceil(num_tokens / page_size)
and, per group, ``_slots[g][row, j]`` = the slot holding page j, with
``_first[g][row]`` the first page still held (pages before it fell out of a
sliding window and were released; always 0 in full-attention groups). A step
over B sequences is a fixed number of NumPy calls, not B Python calls; only
forks and copy-on-write touch rows one by one.

Sharing: a fork's child shares its parent's slots and a prefix-cache hit shares
a cached page (refcounts). Appending into a shared, partly filled last page
copies it first: the step returns the (src, dst) slot pairs the worker copies
before the step's kernels run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .allocator import SlotAllocator
from .errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from .geometry import IndexSpace
from .pagetable import PageTable
from .planner import Plan
from .prefix import PrefixCache

_EMPTY_IDS = np.zeros(0, dtype=np.uint64)
_EMPTY_COUNTS = np.zeros(0, dtype=np.int64)
_NO_COPIES = np.zeros((0, 2), dtype=np.int64)


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
    """Outcome of one step for the scheduled batch (extended, then admitted, then forked sequences).

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
    cached_tokens: np.ndarray | None = None          # int64 [A]: tokens of each admission found in the cache
    copies: tuple[np.ndarray, ...] = ()              # per group: int64 [n, 2] (src_slot, dst_slot) to copy first


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


def _strs(name: str, values: object, n: int) -> list[str]:
    vals = [] if values is None else [str(v) for v in values]  # type: ignore[attr-defined]
    if not vals:
        return [""] * n
    if len(vals) != n:
        raise InvalidArgument(f"{name} has {len(vals)} entries for {n} admissions; give one per admission or none")
    return vals


class Pool:
    """Named pool of slots with its sequences. Not thread-safe: the manager serialises calls."""

    def __init__(self, name: str, plan: Plan, prefix_caching: bool = False) -> None:
        self.name = name
        self.plan = plan
        geo = plan.geometry
        self.page_size = geo.spec.page_size
        self.max_seq_len = plan.max_seq_len
        self.allocators = [SlotAllocator(geo.num_slots) for _ in geo.groups]
        self.windows = [g.sliding_window for g in geo.groups]
        self.layer_space: list[int] = geo.layer_space.tolist()    # layer -> index space id
        self._sliding = [g for g, w in enumerate(self.windows) if w]
        if prefix_caching and self._sliding:
            raise InvalidArgument("prefix caching with sliding-window layer groups is not supported; create the "
                                  "pool without enable_prefix_caching or without sliding layers")
        self.prefix = PrefixCache(self.allocators[0], self.page_size) if prefix_caching else None
        self._sharing = prefix_caching          # slots may have several owners
        self._rows: dict[int, int] = {}          # seq_id -> row (source of truth)
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # (ids, rows) by id; None = stale
        self._last_batch: tuple[np.ndarray, np.ndarray] | None = None  # (ids, rows) of the last extend-only step
        self._fast = True                         # take _decode_step when it applies (tests turn it off)
        self._free_rows: list[int] = []
        self._num_rows = 0                        # rows ever used (high-water mark)
        cap, width = 16, 4
        self._num_tokens = np.zeros(cap, dtype=np.int64)   # 0 = row unused
        self._held = np.zeros(cap, dtype=np.int64)         # ceil(num_tokens / page_size): pages, released included
        self._arange = np.arange(1024, dtype=np.int64)
        self._seq_ids = np.zeros(cap, dtype=np.uint64)
        # Slot values fit the index dtype of a scale-1 space, so per_layer tables need no conversion.
        self._slot_dtype = np.dtype(np.int32 if geo.num_slots <= 2**31 - 1 else np.int64)
        self._slots = [np.full((cap, width), -1, dtype=self._slot_dtype) for _ in geo.groups]
        self._first = [np.zeros(cap, dtype=np.int64) for _ in geo.groups]
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
        """Slots a sequence holds in one group, page order (a copy; released window pages excluded)."""
        row = self._rows.get(int(seq_id))
        if row is None:
            raise NotFound(f"sequence {seq_id} is not in pool {self.name!r}", seq_id=seq_id)
        return self._slots[group][row, self._first[group][row]:self._held[row]].copy()

    def first_page(self, seq_id: int, group: int) -> int:
        """Index of the first page a sequence still holds in a group (0 unless a window released pages)."""
        row = self._rows.get(int(seq_id))
        if row is None:
            raise NotFound(f"sequence {seq_id} is not in pool {self.name!r}", seq_id=seq_id)
        return int(self._first[group][row])

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
             block_table: bool = False, fork_parents: object = None, fork_children: object = None,
             admit_token_ids: object = None, admit_salts: object = None,
             admit_extra_keys: object = None) -> StepResult:
        """One scheduler iteration, all or nothing: free, fork, extend, admit.

        free_ids: shape [F], uint64 (or non-negative int); live sequences to drop.
        fork_parents, fork_children: shape [K]; each child starts as a copy of its live parent,
            sharing its slots. A child cannot be extended in the step that creates it.
        extend_ids, extend_tokens: shape [E]; live sequences and the tokens (> 0) each gains.
        admit_ids, admit_tokens: shape [A]; new sequences and the tokens (> 0) each starts with.
        admit_token_ids: shape [sum(admit_tokens)], the admissions' token ids, for prefix caching.
        admit_salts, admit_extra_keys: A strings or none; cache pages are shared only within one pair.
        Returns the batch (E extended, A admitted, K children) with slot mappings, tables,
        cached token counts and copy-on-write pairs.
        Raises InvalidArgument, NotFound, AlreadyExists or ResourceExhausted; then nothing changed.
        """
        f_ids = _ids("free_seq_ids", free_ids)
        e_ids = _ids("extend_seq_ids", extend_ids)
        a_ids = _ids("admit_seq_ids", admit_ids)
        p_ids = _ids("fork_parent_ids", fork_parents)
        c_ids = _ids("fork_child_ids", fork_children)
        e_k = _counts("extend_num_tokens", extend_tokens, len(e_ids))
        a_n = _counts("admit_num_tokens", admit_tokens, len(a_ids))
        if len(p_ids) != len(c_ids):
            raise InvalidArgument(f"fork_parent_ids has {len(p_ids)} entries, fork_child_ids {len(c_ids)}")
        parts = [a for a in (f_ids, e_ids, a_ids, c_ids) if len(a)]
        all_ids = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else f_ids
        last = self._last_batch
        same_batch = (len(parts) == 1 and parts[0] is e_ids and last is not None and len(last[0]) == len(e_ids)
                      and np.array_equal(last[0], e_ids))
        if len(all_ids) > 1 and not same_batch:
            srt = np.sort(all_ids)
            dup = srt[1:] == srt[:-1]
            if dup.any():
                raise InvalidArgument(
                    f"sequence {srt[1:][dup][0]} appears more than once in one step; each sequence may be "
                    "freed, extended, admitted or created by a fork once per step", seq_id=srt[1:][dup][0])
        if same_batch and self._fast and not (self._sharing or self._sliding or admit_token_ids is not None):
            res = self._decode_step(last[1], e_k, tables, block_table)  # type: ignore[index]
            if res is not None:
                return res
        f_rows = self._lookup(f_ids, "free_seq_ids")
        # A decode loop extends the same batch step after step: its ids were checked (distinct, live)
        # and looked up last time, and no admission or free has happened since.
        e_rows = last[1] if same_batch else self._lookup(e_ids, "extend_seq_ids")  # type: ignore[index]
        p_rows = self._lookup(p_ids, "fork_parent_ids")
        new_ids = np.concatenate((a_ids, c_ids)) if len(c_ids) else a_ids
        if len(new_ids):
            known = self._find(new_ids)[1]
            if known.any():
                taken = new_ids[known][0]
                raise AlreadyExists(f"sequence {taken} is already in pool {self.name!r}", seq_id=taken)
        if len(p_ids) and len(f_ids) and np.isin(p_ids, f_ids).any():
            raise InvalidArgument(f"fork parent {p_ids[np.isin(p_ids, f_ids)][0]} is freed in the same step")
        ps = self.page_size
        e_old = self._num_tokens[e_rows]
        e_new = e_old + e_k
        for name, n, ids in (("extend", e_new, e_ids), ("admit", a_n, a_ids)):
            if len(n) and int(n.max()) > self.max_seq_len:
                j = int(np.argmax(n))
                raise InvalidArgument(
                    f"{name}: sequence {ids[j]} would hold {n[j]} tokens; pool {self.name!r} takes at most "
                    f"max_seq_len={self.max_seq_len}", seq_id=ids[j], max_seq_len=self.max_seq_len)
        prompt = self._prompt_pages(a_n, admit_token_ids, admit_salts, admit_extra_keys)
        e_held = self._held[e_rows]
        e_held_new = (e_new + (ps - 1)) // ps
        a_held = (a_n + (ps - 1)) // ps
        # ---- slot demand per group, computed exactly before anything changes ------------
        if self._sharing or self._sliding or len(f_rows) or len(p_rows) or prompt is not None:
            plans = [self._plan_group(g, alloc, f_rows, p_rows, e_rows, e_old, e_held, e_held_new, a_held, prompt)
                     for g, alloc in enumerate(self.allocators)]
        else:                                   # nothing is released or shared: every group needs the same
            need = int((e_held_new - e_held).sum()) + (int(a_held.sum()) if len(a_held) else 0)
            plans = [(need, alloc.num_free, None, None, None) for alloc in self.allocators]
        for g, (need, avail, *_rest) in enumerate(plans):
            if need > avail:
                self.refused += 1
                self.alloc_failures["out_of_slots"] = self.alloc_failures.get("out_of_slots", 0) + 1
                free_now = self.allocators[g].num_free
                raise ResourceExhausted(
                    f"pool {self.name!r}: this step needs {need} slots in layer group {g} but only {avail} are "
                    f"free ({free_now} free + {avail - free_now} released by this step) of {self.plan.num_slots}; "
                    "free or preempt sequences, or plan a bigger pool",
                    needed=need, free=avail, num_slots=self.plan.num_slots, group=g)
        # ---- nothing can fail past this line --------------------------------------
        self._release(f_rows)
        for g in self._sliding:
            self._release_window(g, e_rows, plans[g][2])
        c_rows = self._take_rows(c_ids) if len(c_ids) else _EMPTY_COUNTS
        if len(c_rows):
            self._fork(p_rows, c_rows)
        a_rows = self._take_rows(a_ids) if len(a_ids) else _EMPTY_COUNTS
        hits = plans[0][3] if prompt is not None else None
        if hits is not None and len(a_rows):
            self._share_hits(a_rows, hits, plans[0][4])
        # New pages: extensions from their held count, admissions after their prefix hits.
        if len(a_rows):
            g_rows = np.concatenate((e_rows, a_rows))
            a_lo = hits if hits is not None else np.zeros(len(a_rows), dtype=np.int64)
            g_lo, g_hi = np.concatenate((e_held, a_lo)), np.concatenate((e_held_new, a_held))
        else:
            g_rows, g_lo, g_hi = e_rows, e_held, e_held_new
        if len(g_rows):
            self._ensure_width(int(g_hi.max()))
        g_need = g_hi - g_lo
        g_total = int(g_need.sum())
        copies = [self._grow(g, alloc, g_rows, g_lo, g_need, g_total, e_rows, e_old, e_held)
                  for g, alloc in enumerate(self.allocators)]
        rows = np.concatenate((e_rows, a_rows, c_rows)) if len(a_rows) or len(c_rows) else e_rows
        old = np.concatenate((e_old, np.zeros(len(a_rows), dtype=np.int64), self._num_tokens[c_rows])) \
            if len(rows) > len(e_rows) else e_old
        new = np.concatenate((e_new, a_n, self._num_tokens[c_rows])) if len(rows) > len(e_rows) else e_new
        held_new = (new + (ps - 1)) // ps if len(rows) > len(e_rows) else e_held_new
        self._num_tokens[rows] = new
        self._held[rows] = held_new
        if prompt is not None and len(a_rows):
            self._register(a_rows, a_n, prompt)
        self.steps += 1
        self.admitted += len(a_ids)
        self._last_batch = (e_ids.copy(), e_rows) if len(parts) == 1 and parts[0] is e_ids else None
        tok_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(new - old, out=tok_indptr[1:])
        cached = hits * ps if hits is not None else (np.zeros(len(a_ids), dtype=np.int64) if len(a_ids) else None)
        return StepResult(self._seq_ids[rows], new, tok_indptr,
                          self._emit(rows, old, new, held_new, tok_indptr, tables, block_table),
                          self.num_free_slots, cached, tuple(copies))

    def _decode_step(self, rows: np.ndarray, k: np.ndarray, tables: bool, block_table: bool) -> StepResult | None:
        """The hot path: the last step's batch grows again, nothing freed, admitted or shared.

        Same result as the general path, with fewer NumPy calls. Returns None (the
        general path then runs, and raises) if the step would fail.
        """
        ps = self.page_size
        old = self._num_tokens[rows]
        new = old + k
        if int(new.max()) > self.max_seq_len:
            return None
        held_old = self._held[rows]
        held_new = (new + (ps - 1)) // ps
        need = held_new - held_old
        total = int(need.sum())
        if total > self.num_free_slots:
            return None
        if total:
            self._ensure_width(int(held_new.max()))
            for g, alloc in enumerate(self.allocators):
                self._grow(g, alloc, rows, held_old, need, total, _EMPTY_COUNTS, _EMPTY_COUNTS, _EMPTY_COUNTS)
        self._num_tokens[rows] = new
        self._held[rows] = held_new
        self.steps += 1
        b = len(rows)
        if int(k.sum()) == b:
            tok_indptr = self._iota(b + 1).copy()
        else:
            tok_indptr = np.zeros(b + 1, dtype=np.int64)
            np.cumsum(k, out=tok_indptr[1:])
        return StepResult(self._seq_ids[rows], new, tok_indptr,
                          self._emit(rows, old, new, held_new, tok_indptr, tables, block_table),
                          self.num_free_slots, None, tuple(_NO_COPIES for _ in self.allocators))

    # ---- step pieces -------------------------------------------------------------------
    def _prompt_pages(self, a_n: np.ndarray, token_ids: object, salts: object,
                      keys: object) -> tuple | None:
        """Prefix-cache inputs of the admissions, or None when caching is off or no tokens were given.

        Returns (pages int64 [A, P, ps], full int64 [A], limit int64 [A], ns int64 [A], hashes uint64 [A, P],
        new namespaces): full = full pages of each prompt, limit = pages it may take from the cache.
        """
        a = len(a_n)
        if token_ids is None or self.prefix is None or not a:
            if token_ids is not None and self.prefix is None and len(np.asarray(token_ids)):
                raise InvalidArgument(f"pool {self.name!r} was created without prefix caching; "
                                      "admit_token_ids are not accepted")
            return None
        tok = np.asarray(token_ids)
        if tok.ndim != 1 or tok.dtype.kind not in "iu":
            raise InvalidArgument(f"admit_token_ids must be a 1-D integer array, got shape {tok.shape} dtype "
                                  f"{tok.dtype}")
        if len(tok) != int(a_n.sum()):
            raise InvalidArgument(f"admit_token_ids has {len(tok)} ids; admit_num_tokens add up to {int(a_n.sum())}")
        ns, new_ns = self.prefix.namespace_ids(_strs("admit_cache_salts", salts, a),
                                               _strs("admit_extra_keys", keys, a))
        ps = self.page_size
        full = a_n // ps
        p = int(full.max())
        starts = np.cumsum(a_n) - a_n
        col = np.arange(p * ps)
        idx = np.minimum(starts[:, None] + col[None, :], len(tok) - 1)
        pages = tok.astype(np.int64)[idx].reshape(a, p, ps)
        limit = (a_n - 1) // ps                      # at least one token of each prompt is computed
        hashes = self.prefix.hash_fn(pages, ns) if p else np.zeros((a, 0), dtype=np.uint64)
        return pages, full, limit, ns, hashes, new_ns

    def _plan_group(self, g: int, alloc: SlotAllocator, f_rows: np.ndarray, p_rows: np.ndarray, e_rows: np.ndarray,
                    e_old: np.ndarray, e_held: np.ndarray, e_held_new: np.ndarray, a_held: np.ndarray,
                    prompt: tuple | None) -> tuple:
        """(slots needed, slots available, new window starts, prefix hits, copy-on-write count) of group g."""
        ps = self.page_size
        first = self._first[g]
        released: list[np.ndarray] = []
        if len(f_rows):
            released.append(self._row_slots(g, f_rows, first[f_rows], self._held[f_rows]))
        new_first = None
        if self.windows[g] and len(e_rows):
            lo = first[e_rows]
            new_first = np.minimum(np.maximum(lo, (e_old + 1 - self.windows[g]) // ps), e_held)
            released.append(self._row_slots(g, e_rows, lo, new_first))
        dropped = np.concatenate(released) if released else np.zeros(0, dtype=np.int64)
        rc = alloc._refcnt
        if self._sharing and len(dropped):
            uniq, counts = np.unique(dropped, return_counts=True)
            freed = uniq[rc[uniq] == counts]
        else:
            freed = dropped
        avail = alloc.num_free + len(freed)
        need = int((e_held_new - e_held).sum())
        hits = None
        if prompt is not None and g == 0:
            pages, full, limit, ns, hashes, _ = prompt
            hits, cand = self.prefix.match(pages, limit, ns, hashes) if pages.shape[1] else (
                np.zeros(len(full), dtype=np.int64), np.zeros((len(full), 0), dtype=np.int64))
            hit_slots = cand[np.arange(cand.shape[1]) < hits[:, None]]
            revived = np.unique(hit_slots)
            revived = revived[(rc[revived] == 0) | np.isin(revived, freed)]
            avail -= len(revived)
            need += int((a_held - hits).sum())
            prompt_hit = (hits, cand)
        else:
            need += int(a_held.sum())
            prompt_hit = None
        if (self._sharing or len(p_rows)) and len(e_rows):
            # Owners after this step's frees, window releases and forks, before its copies.
            delta = np.zeros(alloc.num_slots, dtype=np.int64)
            np.subtract.at(delta, dropped, 1)
            if len(p_rows):
                np.add.at(delta, self._row_slots(g, p_rows, first[p_rows], self._held[p_rows]), 1)
            need += self._count_cow(g, e_rows, e_old, e_held, delta)
        return need, avail, new_first, hits, prompt_hit

    def _count_cow(self, g: int, e_rows: np.ndarray, e_old: np.ndarray, e_held: np.ndarray,
                   delta: np.ndarray) -> int:
        """Copies needed: extended rows whose partly filled last page other live sequences also hold.

        delta: int64 [num_slots], change of each slot's owners before the copies (frees, forks).
        Of c extending owners of a slot with r owners, all c copy if r > c, else all but the last.
        """
        partial = (e_old % self.page_size) != 0
        if not partial.any():
            return 0
        rows, held = e_rows[partial], e_held[partial]
        last = self._slots[g][rows, held - 1].astype(np.int64)
        rc = self.allocators[g]._refcnt[last] + delta[last]
        shared = rc > 1
        if not shared.any():
            return 0
        uniq, c = np.unique(last[shared], return_counts=True)
        r = self.allocators[g]._refcnt[uniq] + delta[uniq]
        return int((c - (r == c)).sum())

    def _row_slots(self, g: int, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Slots in columns [lo, hi) of each row of group g, concatenated (int64)."""
        cnt = np.maximum(hi - lo, 0)
        total = int(cnt.sum())
        if not total:
            return np.zeros(0, dtype=np.int64)
        width = self._slots[g].shape[1]
        starts = np.cumsum(cnt) - cnt
        flat = np.repeat(rows * width + lo - starts, cnt) + self._iota(total)
        return self._slots[g].ravel().take(flat).astype(np.int64)

    def _release_window(self, g: int, e_rows: np.ndarray, new_first: np.ndarray | None) -> None:
        if new_first is None:
            return
        lo = self._first[g][e_rows]
        dropped = self._row_slots(g, e_rows, lo, new_first)
        if len(dropped):
            self.allocators[g].free(dropped, unique=not self._sharing)
            width = self._slots[g].shape[1]
            cnt = new_first - lo
            starts = np.cumsum(cnt) - cnt
            flat = np.repeat(e_rows * width + lo - starts, cnt) + self._iota(int(cnt.sum()))
            self._slots[g].ravel()[flat] = -1
        self._first[g][e_rows] = new_first

    def _fork(self, p_rows: np.ndarray, c_rows: np.ndarray) -> None:
        self._sharing = True
        self._num_tokens[c_rows] = self._num_tokens[p_rows]
        self._held[c_rows] = self._held[p_rows]
        self._ensure_width(int(self._held[p_rows].max()))
        for g, alloc in enumerate(self.allocators):
            self._slots[g][c_rows] = self._slots[g][p_rows]
            self._first[g][c_rows] = self._first[g][p_rows]
            shared = self._row_slots(g, p_rows, self._first[g][p_rows], self._held[p_rows])
            uniq, counts = np.unique(shared, return_counts=True)
            alloc.share(uniq, counts)

    def _share_hits(self, a_rows: np.ndarray, hits: np.ndarray, prompt_hit: tuple) -> None:
        _, cand = prompt_hit
        if not hits.any():
            return
        self._ensure_width(int(hits.max()))
        mask = np.arange(cand.shape[1]) < hits[:, None]
        slots = cand[mask]
        uniq, counts = np.unique(slots, return_counts=True)
        self.allocators[0].share(uniq, counts)
        rows = np.repeat(a_rows, hits)
        cols = np.nonzero(mask)[1]
        self._slots[0][rows, cols] = slots
        self.prefix.hits += len(slots)

    def _grow(self, g: int, alloc: SlotAllocator, rows: np.ndarray, lo: np.ndarray, need: np.ndarray, total: int,
              e_rows: np.ndarray, e_old: np.ndarray, e_held: np.ndarray) -> np.ndarray:
        """Copy-on-write, then `need` new pages from column `lo` of each row. Returns the (src, dst) copies."""
        copies = _NO_COPIES
        if self._sharing and len(e_rows):      # (a fork earlier in this step turned sharing on)
            copies = self._copy_on_write(g, alloc, e_rows, e_old, e_held)
        if total:
            if total <= len(rows) and int(need.max()) == 1:     # decode: at most one new page per row
                nz = np.flatnonzero(need)
                rep_rows, cols = rows[nz], lo[nz]
            else:
                starts = np.cumsum(need) - need
                rep_rows = np.repeat(rows, need)
                cols = np.repeat(lo - starts, need) + self._iota(total)
            self._slots[g][rep_rows, cols] = alloc.allocate(total)
        return copies

    def _copy_on_write(self, g: int, alloc: SlotAllocator, e_rows: np.ndarray, e_old: np.ndarray,
                       e_held: np.ndarray) -> np.ndarray:
        partial = np.flatnonzero((e_old % self.page_size) != 0)
        slots = self._slots[g]
        # Only rows whose partly filled last page has other owners now can need a copy; the loop
        # (sequential, since one copy can leave the last owner alone) runs over those alone.
        last = slots[e_rows[partial], e_held[partial] - 1]
        partial = partial[alloc._refcnt[last] > 1]
        pairs = []
        for i in partial.tolist():
            row, col = int(e_rows[i]), int(e_held[i]) - 1
            src = int(slots[row, col])
            if alloc._refcnt[src] > 1:
                dst = int(alloc.allocate(1)[0])
                slots[row, col] = dst
                alloc.free(np.array([src], dtype=np.intp), unique=True)
                pairs.append((src, dst))
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    def _register(self, a_rows: np.ndarray, a_n: np.ndarray, prompt: tuple) -> None:
        pages, full, _, ns, hashes, new_ns = prompt
        self.prefix.add_namespaces(new_ns)
        p = pages.shape[1]
        if not p:
            return
        mask = np.arange(p) < full[:, None]
        slots = self._slots[0][a_rows[:, None], np.arange(p)[None, :]].astype(np.int64)
        parents = np.concatenate((np.full((len(a_rows), 1), -1, dtype=np.int64), slots[:, :-1]), axis=1)
        self.prefix.register(slots[mask], parents[mask], np.broadcast_to(ns[:, None], mask.shape)[mask],
                             pages[mask], hashes[mask])

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
        self._last_batch = None
        return out

    def _release(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        held = self._held[rows]
        for g, alloc in enumerate(self.allocators):
            alloc.free(self._row_slots(g, rows, self._first[g][rows], held), unique=not self._sharing)
            self._first[g][rows] = 0
        for seq_id in self._seq_ids[rows].tolist():
            del self._rows[seq_id]
        self._num_tokens[rows] = 0
        self._held[rows] = 0
        self._free_rows.extend(rows.tolist())
        self._sorted = None
        self._last_batch = None

    def _grow_rows(self, n: int) -> None:
        cap = len(self._num_tokens)
        if n <= cap:
            return
        new_cap = max(n, 2 * cap)
        self._num_tokens = np.concatenate((self._num_tokens, np.zeros(new_cap - cap, dtype=np.int64)))
        self._seq_ids = np.concatenate((self._seq_ids, np.zeros(new_cap - cap, dtype=np.uint64)))
        self._held = np.concatenate((self._held, np.zeros(new_cap - cap, dtype=np.int64)))
        self._first = [np.concatenate((f, np.zeros(new_cap - cap, dtype=np.int64))) for f in self._first]
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
            last = (new - (held - 1) * ps).astype(np.int32)
        if block_table:
            bt_width = int(held.max()) if b else 0
            pad = np.arange(bt_width) >= held[:, None]
        out = []
        gathered: dict[int, tuple] = {}
        for space in self.plan.geometry.index_spaces:
            g = space.group
            if g not in gathered:
                flat_slots = self._slots[g].ravel()
                indptr = idx = sub = None
                if tables:
                    # Row r's held pages are columns [first, held) of its table row: one flat gather.
                    first = self._first[g][rows] if self.windows[g] else None
                    cnt = held - first if first is not None else held
                    indptr = np.zeros(b + 1, dtype=np.int64)
                    np.cumsum(cnt, out=indptr[1:])
                    base = rows * width - indptr[:-1]
                    flat = np.repeat(base + first if first is not None else base, cnt)
                    flat += self._iota(int(indptr[-1]))
                    idx = flat_slots.take(flat)
                if block_table:
                    sub = self._slots[g][rows, :bt_width]
                gathered[g] = (flat_slots.take(tok_flat).astype(np.int64), indptr, idx, sub)
            tok_slots, indptr, idx, sub = gathered[g]
            if space.scale == 1 and space.offset == 0:
                mapping = tok_slots * ps + off_in_page
            else:
                mapping = (tok_slots * space.scale + space.offset) * ps + off_in_page
            table = PageTable(indptr.astype(space.index_dtype), space.page_indices(idx), last) if tables else None
            bt = None
            if block_table:
                bt = space.page_indices(sub).copy()
                bt[pad | (sub < 0)] = -1
            out.append(SpaceTables(space, mapping, table, bt))
        return tuple(out)

    # =====================================================================================================
    # State export / import (snapshots). Used only by kvservice/snapshot.py and the journal.
    #
    # A snapshot stores a pool in domain terms (sequences, the slots of their pages, free lists in hand-out
    # order, prefix-cache entries), not as this class's attributes, so that another internal layout (or the
    # next release) can read it. export_state reads, and from_state writes, exactly these fields; keep both
    # in step with any change to them (tests/unit/test_snapshot.py::test_every_pool_field_is_exported lists
    # them and fails when a field is added):
    #   Pool:          name, plan, prefix, _sharing, _rows, _seq_ids, _num_tokens, _held, _first, _slots,
    #                  _free_rows, _num_rows, steps, admitted, refused, alloc_failures
    #   SlotAllocator: _stack[:_top], _top, _cached (LRU order), peak_used, evictions;
    #                  _refcnt is rebuilt from the owners (invariant 1), cacheable from the prefix cache
    #   PrefixCache:   by_hash (insertion order), hash, parent, namespace, tokens (registered slots only),
    #                  _namespaces, hits
    # Rebuilt, not stored (caches, scratch, constants): Pool._sorted, _last_batch, _arange, _fast,
    # page_size, max_seq_len, windows, layer_space, _sliding, _slot_dtype (from the plan);
    # SlotAllocator._mark, _ones, num_slots, caching, on_evict.
    # Slot-table cells outside a sequence's held pages, the stack above _top and the tokens of slots no
    # longer registered hold stale values that nothing reads; they come back as -1 / 0.
    # =====================================================================================================
    def capture_state(self) -> Callable[[], PoolState]:
        """Copy what export_state needs and return the function that builds the PoolState from the copies.

        Call it under the pool's lock: it only copies (memcpy-speed), so the lock is held briefly; the
        returned function gathers the slot lists later, without any lock (what a snapshot does).
        """
        geo = self.plan.geometry
        ps = self.page_size
        rows = np.sort(np.fromiter(self._rows.values(), dtype=np.int64, count=len(self._rows)))
        held = self._held[rows]
        arrays: dict[str, np.ndarray] = {
            "seq_ids": self._seq_ids[rows], "rows": rows, "num_tokens": self._num_tokens[rows],
            "free_rows": np.asarray(self._free_rows, dtype=np.int64)}
        width = self._slots[0].shape[1]
        groups, tables, stacks = [], [], []
        for g, alloc in enumerate(self.allocators):
            arrays[f"first/{g}"] = self._first[g][rows]                  # fancy indexing: copies
            tables.append(self._slots[g].copy())                        # gathered into CSR later, unlocked
            stacks.append(_copy_ids(alloc._stack[:alloc._top]))
            arrays[f"cached/{g}"] = np.fromiter(alloc._cached, dtype=np.int64, count=len(alloc._cached))
            groups.append({"peak_used": int(alloc.peak_used), "evictions": int(alloc.evictions)})
        prefix = None
        if self.prefix is not None:
            pc = self.prefix
            slots = np.fromiter(pc.by_hash.values(), dtype=np.int64, count=len(pc.by_hash))
            arrays["prefix/hash"] = np.fromiter(pc.by_hash.keys(), dtype=np.uint64, count=len(pc.by_hash))
            arrays["prefix/slot"] = slots
            arrays["prefix/parent"] = pc.parent[slots].copy()
            arrays["prefix/namespace"] = pc.namespace[slots].copy()
            arrays["prefix/tokens"] = pc.tokens[slots].copy()
            prefix = {"hits": int(pc.hits), "namespaces": [[s, k, int(i)] for (s, k), i in pc._namespaces.items()]}
        spec = geo.spec
        meta = {"version": POOL_STATE_VERSION, "name": self.name,
                "spec": {"page_size": ps, "layout": spec.layout, "layers": _spec_runs(spec)},
                "num_slots": int(geo.num_slots), "max_seq_len": int(self.max_seq_len),
                "backends": list(self.plan.backends), "prefix_caching": self.prefix is not None,
                "sharing": bool(self._sharing), "steps": int(self.steps),
                "admitted": int(self.admitted), "refused": int(self.refused),
                "alloc_failures": {str(k): int(v) for k, v in self.alloc_failures.items()},
                "row_capacity": len(self._num_tokens), "page_capacity": int(width), "num_rows": int(self._num_rows),
                "groups": groups, "prefix": prefix}

        def finish(runs: bool = False) -> PoolState:
            """runs: leave a free stack found to be runs as IdRuns (the snapshot encoder writes them as they are)."""
            for g, stack in enumerate(stacks):
                arrays[f"free_stack/{g}"] = stack if runs and isinstance(stack, IdRuns) else _as_array(stack)
            for g, table in enumerate(tables):
                first = arrays[f"first/{g}"]
                cnt = held - first
                out = np.empty(int(cnt.sum()), dtype=np.int64)
                flat_table, at = table.ravel(), 0
                for lo in range(0, len(rows), 1024):     # in pieces: other threads run in between (GIL)
                    r, f, c = rows[lo:lo + 1024], first[lo:lo + 1024], cnt[lo:lo + 1024]
                    k = int(c.sum())
                    starts = np.cumsum(c) - c
                    flat = np.repeat(r * width + f - starts, c) + np.arange(k, dtype=np.int64)
                    out[at:at + k] = flat_table.take(flat)
                    at += k
                arrays[f"slots/{g}"] = out
            return PoolState(meta, arrays)
        return finish

    def export_state(self) -> PoolState:
        """The pool's state as PoolState (copies; the caller holds the pool's lock for a consistent cut)."""
        return self.capture_state()()

    @staticmethod
    def from_state(state: PoolState, plan: Plan) -> Pool:
        """A pool rebuilt from PoolState; plan: the pool's plan (kvservice.snapshot rebuilds it from meta).

        The state must have passed kvservice.snapshot.check_pool_state (this only rebuilds it).
        """
        from collections import OrderedDict

        m, a = state.meta, state.arrays
        pool = Pool(m["name"], plan, bool(m["prefix_caching"]))
        cap, width = int(m["row_capacity"]), int(m["page_capacity"])
        pool._num_tokens = np.zeros(cap, dtype=np.int64)
        pool._held = np.zeros(cap, dtype=np.int64)
        pool._seq_ids = np.zeros(cap, dtype=np.uint64)
        pool._first = [np.zeros(cap, dtype=np.int64) for _ in pool.allocators]
        pool._slots = [np.full((cap, width), -1, dtype=pool._slot_dtype) for _ in pool.allocators]
        ps = pool.page_size
        rows, n = a["rows"], a["num_tokens"]
        held = (n + (ps - 1)) // ps
        pool._seq_ids[rows] = a["seq_ids"]
        pool._num_tokens[rows] = n
        pool._held[rows] = held
        pool._rows = dict(zip(a["seq_ids"].tolist(), rows.tolist(), strict=True))
        pool._free_rows = a["free_rows"].tolist()
        pool._num_rows = int(m["num_rows"])
        pool._sharing = bool(m["sharing"])
        for g, alloc in enumerate(pool.allocators):
            first = a[f"first/{g}"]
            cnt = held - first
            starts = np.cumsum(cnt) - cnt
            flat = np.repeat(rows * width + first - starts, cnt) + np.arange(int(cnt.sum()), dtype=np.int64)
            slots = a[f"slots/{g}"]
            pool._first[g][rows] = first
            pool._slots[g].ravel()[flat] = slots
            stack = a[f"free_stack/{g}"]
            alloc._stack[:len(stack)] = stack
            alloc._top = len(stack)
            alloc._refcnt[:] = np.bincount(slots, minlength=alloc.num_slots).astype(np.int32)
            alloc._cached = OrderedDict.fromkeys(a[f"cached/{g}"].tolist())
            alloc.peak_used = int(m["groups"][g]["peak_used"])
            alloc.evictions = int(m["groups"][g]["evictions"])
        if pool.prefix is not None:
            pc, p = pool.prefix, m["prefix"]
            slots = a["prefix/slot"]
            pc.by_hash = dict(zip(a["prefix/hash"].tolist(), slots.tolist(), strict=True))
            pc.hash[slots] = a["prefix/hash"]
            pc.parent[slots] = a["prefix/parent"]
            pc.namespace[slots] = a["prefix/namespace"]
            pc.tokens[slots] = a["prefix/tokens"]
            pc._namespaces = {(s, k): int(i) for s, k, i in p["namespaces"]}
            pc.hits = int(p["hits"])
            pool.allocators[0].cacheable[slots] = True
        pool.steps, pool.admitted, pool.refused = int(m["steps"]), int(m["admitted"]), int(m["refused"])
        pool.alloc_failures = {str(k): int(v) for k, v in m["alloc_failures"].items()}
        return pool


from collections.abc import Callable  # noqa: E402  (state export section: kept out of the module's imports)

POOL_STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class PoolState:
    """A pool as plain data: JSON-able ``meta`` and named 1-D/2-D NumPy ``arrays`` (copies, never views).

    meta: version, name, spec {page_size, layout, layers: [[kv_heads, head_dim, dtype, sliding_window,
      count], ...]}, num_slots, max_seq_len, backends, prefix_caching, sharing, steps, admitted, refused,
      alloc_failures {reason: count}, row_capacity, page_capacity, num_rows,
      groups [{peak_used, evictions}], prefix {hits, namespaces: [[salt, extra_key, id], ...]} or None.
    arrays (N live sequences in row order, G layer groups, E prefix-cache entries):
      seq_ids uint64 [N]; rows int64 [N]; num_tokens int64 [N] (tokens, > 0); free_rows int64 [R]
        (reuse order: the last is taken first);
      first/<g> int64 [N]: first page still held in group g (0 unless a sliding window released pages);
      slots/<g> int64 [sum over sequences of held - first]: the slots of pages [first, held) of each
        sequence, sequences concatenated (held = ceil(num_tokens / page_size));
      free_stack/<g> int64 [F]: free slots holding nothing, bottom to top (the top is handed out first);
      cached/<g> int64 [C]: free slots holding a cached page, least recently released first;
      prefix/hash uint64 [E], prefix/slot, prefix/parent, prefix/namespace int64 [E] (by_hash order),
      prefix/tokens int64 [E, page_size].
    """

    meta: dict
    arrays: dict


def _spec_runs(spec: object) -> list[list]:
    runs: list[list] = []
    for la in spec.layers:                                            # type: ignore[attr-defined]
        row = [la.kv_heads, la.head_dim, la.dtype, la.sliding_window]
        if runs and runs[-1][:4] == row:
            runs[-1][4] += 1
        else:
            runs.append([*row, 1])
    return runs


@dataclass(frozen=True, slots=True)
class IdRuns:
    """A 1-D int64 array of n ids stored as runs of consecutive descending ids.

    starts: int64 [R], the index where each run begins (starts[0] == 0); tops: int64 [R], the run's first
    id plus its start index (element i of run k is tops[k] - i); n: elements in all.
    """

    starts: np.ndarray
    tops: np.ndarray
    n: int

    def array(self) -> np.ndarray:
        lengths = np.diff(np.append(self.starts, self.n))
        return np.repeat(self.tops, lengths) - np.arange(self.n, dtype=np.int64)


def _as_array(a: np.ndarray | IdRuns) -> np.ndarray:
    return a.array() if isinstance(a, IdRuns) else a


def _copy_ids(a: np.ndarray) -> np.ndarray | IdRuns:
    """A 1-D id array kept for later: IdRuns, or an int64 copy.

    A free stack is mostly runs of consecutive descending ids (all of it, in an idle pool): those
    are found by a scan in 1 M-element chunks, without allocating a copy of the whole array, so the
    caller's lock is held for a read of it only. Otherwise it is a plain copy.
    """
    n, chunk = len(a), 1 << 20
    breaks, found = [np.zeros(1, dtype=np.int64)], 0
    if n > chunk:
        for lo in range(0, n - 1, chunk):
            b = np.flatnonzero(np.diff(a[lo:min(n, lo + chunk + 1)]) != -1) + (lo + 1)
            found += len(b)
            if found > n // 64:
                break
            breaks.append(b)
        else:
            starts = np.concatenate(breaks)
            return IdRuns(starts, a[starts].astype(np.int64) + starts, n)
    return a.astype(np.int64)
