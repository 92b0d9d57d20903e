"""A pool: one planned geometry, one slot allocator per layer group, and the sequences in it.

Sequence state lives in arrays indexed by a *row* (a dense handle the pool
assigns): ``_num_tokens[row]``, ``_held[row]`` = ceil(num_tokens / page_size),
and per layer group g the slots of the row's pages in ``_slots[g]`` (a ragged
`RowSlots`: memory proportional to the pages held) with ``_first[g][row]`` the
first page still held (pages before it fell out of a sliding window and were
released; always 0 in full-attention groups). A step over B sequences is a
fixed number of NumPy calls, not B Python calls; in the step's path they are the
C entry points (``x.nonzero()[0]``, ``x.repeat``, ``np.add.reduce(x)``: the results
of ``np.flatnonzero``, ``np.repeat``, ``x.sum()`` without their Python wrappers,
which cost a prefix-cached admission several percent of its instructions).

``step`` runs four phases, each a function you can read alone: validate the
request (`_validate`), plan every group's slot demand without changing
anything (`_plan`), carry the plan out (`_commit`), and emit the batch's slot
mappings and tables (`emit.emit_tables`). Two fast paths (fastpaths.py): `_decode_step` serves
the steady decode loop (the same batch extended again, nothing shared or
released) and `_full_group_step` a step without forks of a pool with one
full-attention layer group (validate, then plan and commit in one function);
the reference-model differential test drives both against the same model as
the general path.

Sharing: a fork's child shares its parent's slots and a prefix-cache hit shares
a cached page (refcounts). Appending into a shared, partly filled last page
copies it first: the step returns the (src, dst) slot pairs the worker copies
before the step's kernels run.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvservice.contract.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from kvservice.contract.sizing import Plan
from kvservice.core import fastpaths
from kvservice.core.allocator import SlotAllocator
from kvservice.core.cache_events import PoolEvents
from kvservice.core.emit import NO_COPIES, NO_ROWS, GroupChanges, SpaceTables, StepResult, emit_tables, grown_changes
from kvservice.core.hashing import DEFAULT_MODE, VLLM_DEFAULT_SEED, make_hash_fn
from kvservice.core.pool_state import POOL_STATE_VERSION, IdRuns, PoolState, as_array, spec_runs
from kvservice.core.prefix import Namespaces, PrefixCache, register_prompt, run_ending_at
from kvservice.core.rowslots import RowSlots, slot_table_dtype
from kvservice.core.stepplan import (
    EMPTY_I64,
    FEW,
    GroupPlan,
    Prompt,
    StepInput,
    StepPlan,
    check_distinct,
    count_in,
    cow_rows,
    distinct_counts,
    distinct_sorted,
    parse_counts,
    parse_ids,
    parse_strs,
    token_indptr,
)

__all__ = ["Pool", "SpaceTables", "StepResult"]


class Pool:
    """Named pool of slots with its sequences. Not thread-safe: the manager serialises calls."""

    def __init__(self, name: str, plan: Plan, prefix_caching: bool = False, model: str = "",
                 prefix_hash: str = DEFAULT_MODE, prefix_hash_seed: str = VLLM_DEFAULT_SEED) -> None:
        """prefix_hash: how prompt pages are hashed (hashing.HASH_MODES; ValueError for another);
        prefix_hash_seed: NONE_HASH's seed in the vllm-sha256-cbor mode."""
        self.name = name
        self.model = model                        # the model served from this pool ("" = unnamed)
        self.incarnation = 0                      # this creation of the pool (set by the manager; 0 = none yet)
        self.plan = plan
        geo = plan.geometry
        self.page_size = geo.spec.page_size
        self.max_seq_len = plan.max_seq_len
        self.allocators = [SlotAllocator(g.num_slots) for g in geo.groups]     # each group its own count
        self.windows = [g.sliding_window for g in geo.groups]
        self.layer_space: list[int] = geo.layer_space.tolist()    # layer -> index space id
        self._sliding = [g for g, w in enumerate(self.windows) if w]
        self._is_sliding = [bool(w) for w in self.windows]
        # One prefix cache per layer group (hybrid models: full and sliding groups each cache their pages).
        self.prefixes: list[PrefixCache] | None = None
        self.prefix: PrefixCache | None = None          # the first full group's cache (or group 0's)
        self._anchor_group: int | None = None           # full group whose confirmed pages anchor sliding hits
        self.prefix_hash = prefix_hash            # hashing mode of the prefix caches (part of the pool's identity)
        self.prefix_hash_seed = prefix_hash_seed
        if prefix_caching:
            ns = Namespaces()
            hash_fn = make_hash_fn(prefix_hash, ns, prefix_hash_seed)
            self.prefixes = [PrefixCache(a, self.page_size, hash_fn=hash_fn, namespaces=ns, group=g)
                             for g, a in enumerate(self.allocators)]
            full = [g for g, w in enumerate(self.windows) if not w]
            self._anchor_group = full[0] if full else None
            self.prefix = self.prefixes[full[0] if full else 0]
        self._register_order = sorted(range(len(self.allocators)), key=lambda g: bool(self.windows[g]))
        self.events = PoolEvents()                # KV events of the prefix caches (cache_events.py)
        for g, cache in enumerate(self.prefixes or ()):
            cache.sink = self.events.source(g, self.windows[g], geo.groups[g].num_slots)
        self._sharing = prefix_caching          # slots may have several owners (turned on by a fork)
        self._rows: dict[int, int] = {}          # seq_id -> row (source of truth)
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # (ids, rows) by id; None = stale
        self._last_batch: tuple[np.ndarray, np.ndarray] | None = None  # (ids, rows) of the last extend-only step
        self._fast = True                         # take the fast paths when they apply (tests turn it off)
        self._one_full_group = len(self.allocators) == 1 and not self.windows[0]
        self._free_rows: list[int] = []
        self._num_rows = 0                        # rows ever used (high-water mark)
        cap = 16
        self._num_tokens = np.zeros(cap, dtype=np.int64)   # 0 = row unused
        self._held = np.zeros(cap, dtype=np.int64)         # ceil(num_tokens / page_size), released pages included
        self._seq_ids = np.zeros(cap, dtype=np.uint64)
        self._slots = [RowSlots(slot_table_dtype(g.num_slots), cap) for g in geo.groups]
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
        ids, rows = self._index()
        return ids.copy(), self._num_tokens[rows]

    def slots_held(self, seq_ids: np.ndarray) -> np.ndarray:
        """int64 [N, num_groups]: slots each live sequence holds in each layer group (window-released excluded)."""
        rows = self._lookup(parse_ids("seq_ids", seq_ids), "seq_ids")
        held = self._held[rows]
        return np.stack([held - self._first[g][rows] for g in range(len(self.allocators))], axis=1) \
            if len(rows) else np.zeros((0, len(self.allocators)), dtype=np.int64)

    def sequence_slots(self, seq_id: int, group: int = 0) -> np.ndarray:
        """Slots a sequence holds in one group, page order (a copy; released window pages excluded)."""
        row = self._row_of(seq_id)
        r = np.array([row], dtype=np.int64)
        return self._slots[group].gather(r, self._first[group][r], self._held[r])

    def first_page(self, seq_id: int, group: int) -> int:
        """Index of the first page a sequence still holds in a group (0 unless a window released pages)."""
        return int(self._first[group][self._row_of(seq_id)])

    def tables_for(self, seq_ids: np.ndarray, block_table: bool = False) -> tuple[SpaceTables, ...]:
        """Page tables of live sequences (no slot mappings: nothing new is appended)."""
        rows = self._lookup(parse_ids("seq_ids", seq_ids), "seq_ids")
        n = self._num_tokens[rows]
        return self._emit(rows, n, n, self._held[rows], np.zeros(len(rows) + 1, dtype=np.int64), True,
                          block_table)

    def cached_prefix_pages(self, token_ids: np.ndarray, salt: str = "", extra_key: str = "") -> int:
        """Pages of a prompt an admission would take from the prefix cache now (changes nothing).

        token_ids: int64 [n] the prompt. 0 without prefix caching. The same rule as `step` (every
        layer group must be able to serve the hit), for a router choosing a replica.
        """
        if self.prefix is None or not len(token_ids):
            return 0
        n = np.array([len(token_ids)], dtype=np.int64)
        prompt = self._prompt(n, np.asarray(token_ids), [salt], [extra_key])
        if prompt is None or prompt.new_ns:          # a namespace never seen holds nothing
            return 0
        return int(self._plan_hits(prompt, 1)[0][0])

    def slot_table_bytes(self) -> int:
        """Bytes of the per-row state (slot tables and row arrays): grows with pages held, not with rows x width."""
        rows = self._num_tokens.nbytes + self._held.nbytes + self._seq_ids.nbytes + sum(f.nbytes for f in self._first)
        return rows + sum(s.nbytes() for s in self._slots)

    # ---- the step ----------------------------------------------------------------------
    def step(self, free_ids: object = None, extend_ids: object = None, extend_tokens: object = None,
             admit_ids: object = None, admit_tokens: object = None, tables: bool = True,
             block_table: bool = False, fork_parents: object = None, fork_children: object = None,
             admit_token_ids: object = None, admit_salts: object = None,
             admit_extra_keys: object = None, mappings: bool = True, count_ranges: tuple = (None, None)) -> StepResult:
        """One scheduler iteration, all or nothing: free, fork, extend, admit.

        free_ids: shape [F], uint64 (or non-negative int); live sequences to drop.
        fork_parents, fork_children: shape [K]; each child starts as a copy of its live parent as it
            was before this step, sharing its slots. A child cannot be extended in the step that creates it.
        extend_ids, extend_tokens: shape [E]; live sequences and the tokens (> 0) each gains.
        admit_ids, admit_tokens: shape [A]; new sequences and the tokens (> 0) each starts with.
        admit_token_ids: shape [sum(admit_tokens)], the admissions' token ids, for prefix caching.
        admit_salts, admit_extra_keys: A strings or none; cache pages are shared only within one pair.
        mappings: False (with tables=False): no slot mappings either (StepResult.tables is empty); what the
            step changed (StepResult.changes) is all the stream's incremental tables need.
        count_ranges: (min, max) of extend_tokens and of admit_tokens if the caller has them (None each: computed).
        Returns the batch (E extended, A admitted, K children) with slot mappings, tables,
        cached token counts and copy-on-write pairs.
        Raises InvalidArgument, NotFound, AlreadyExists or ResourceExhausted; then nothing changed.
        """
        inp = self._validate(free_ids, extend_ids, extend_tokens, admit_ids, admit_tokens, fork_parents,
                             fork_children, admit_token_ids, admit_salts, admit_extra_keys, count_ranges)
        if inp.repeat and self._fast and not (self._sharing or self._sliding):
            res = self._decode_step(inp.e_ids, inp.e_rows, inp.e_k, tables, block_table, mappings, inp.e_new)
            if res is not None:
                return res
        if self._fast and self._one_full_group and not len(inp.c_ids):
            res = self._full_group_step(inp, tables, block_table, mappings)
            if res is not None:
                return res
        plan = self._plan(inp)
        return self._commit(inp, plan, tables, block_table, mappings)

    # ---- phase 1: validate ---------------------------------------------------------------
    def _validate(self, free_ids: object, extend_ids: object, extend_tokens: object, admit_ids: object,
                  admit_tokens: object, fork_parents: object, fork_children: object, admit_token_ids: object,
                  admit_salts: object, admit_extra_keys: object, count_ranges: tuple) -> StepInput:
        f_ids = parse_ids("free_seq_ids", free_ids)
        e_ids = parse_ids("extend_seq_ids", extend_ids)
        a_ids = parse_ids("admit_seq_ids", admit_ids)
        p_ids = parse_ids("fork_parent_ids", fork_parents)
        c_ids = parse_ids("fork_child_ids", fork_children)
        e_k = parse_counts("extend_num_tokens", extend_tokens, len(e_ids), known=count_ranges[0])
        a_n = parse_counts("admit_num_tokens", admit_tokens, len(a_ids), known=count_ranges[1])
        if len(p_ids) != len(c_ids):
            raise InvalidArgument(f"fork_parent_ids has {len(p_ids)} entries, fork_child_ids {len(c_ids)}")
        extend_only = not (len(f_ids) or len(a_ids) or len(c_ids)) and len(e_ids) > 0
        e_rows = self._last_rows_if_same(e_ids) if extend_only else None
        if not (repeat := e_rows is not None):
            parts = [a for a in (f_ids, e_ids, a_ids, c_ids) if len(a)]
            if len(parts) > 1:
                check_distinct(np.concatenate(parts))
            elif parts:
                check_distinct(parts[0])
            e_rows = self._lookup(e_ids, "extend_seq_ids")
        f_rows = self._lookup(f_ids, "free_seq_ids")
        p_rows = self._lookup(p_ids, "fork_parent_ids")
        new_ids = np.concatenate((a_ids, c_ids)) if len(c_ids) else a_ids
        if len(new_ids) and (len(new_ids) > FEW or not self._rows.keys().isdisjoint(new_ids.tolist())):
            known = self._find(new_ids)[1]
            if np.logical_or.reduce(known):
                taken = new_ids[known][0]
                raise AlreadyExists(f"sequence {taken} is already in pool {self.name!r}", seq_id=taken)
        if len(p_ids) and len(f_ids) and np.isin(p_ids, f_ids).any():
            raise InvalidArgument(f"fork parent {p_ids[np.isin(p_ids, f_ids)][0]} is freed in the same step")
        e_new = self._num_tokens[e_rows] + e_k
        for name, n, ids in (("extend", e_new, e_ids), ("admit", a_n, a_ids)):
            if len(n) and (max(n.tolist()) if len(n) <= FEW else int(np.maximum.reduce(n))) > self.max_seq_len:
                j = int(np.argmax(n))
                raise InvalidArgument(
                    f"{name}: sequence {ids[j]} would hold {n[j]} tokens; pool {self.name!r} takes at most "
                    f"max_seq_len={self.max_seq_len}", seq_id=ids[j], max_seq_len=self.max_seq_len)
        prompt = self._prompt(a_n, admit_token_ids, admit_salts, admit_extra_keys)
        return StepInput(f_ids, e_ids, e_k, a_ids, a_n, p_ids, c_ids, f_rows, e_rows, p_rows, prompt, extend_only,
                         repeat, e_new)

    def _last_rows_if_same(self, e_ids: np.ndarray) -> np.ndarray | None:
        """The rows of the last extend-only step if e_ids is that batch again (checked distinct and live then)."""
        last = self._last_batch
        if last is not None and len(last[0]) == len(e_ids) and last[0].dtype == e_ids.dtype \
                and last[0].tobytes() == e_ids.tobytes():
            return last[1]
        return None

    def _prompt(self, a_n: np.ndarray, token_ids: object, salts: object, keys: object) -> Prompt | None:
        """Prefix-cache inputs of the admissions, or None when caching is off or no token ids were given."""
        a = len(a_n)
        if a:      # counted on every pool, with or without prefix caching or token ids: never ignored silently
            salt_list, key_list = parse_strs("admit_cache_salts", salts, a), parse_strs("admit_extra_keys", keys, a)
        else:
            # One salt and extra key per admission and sum(admit_tokens) token ids: with none, nothing.
            for name, values in (("admit_token_ids", token_ids), ("admit_cache_salts", salts),
                                 ("admit_extra_keys", keys)):
                if values is not None and len(np.asarray(values)):
                    raise InvalidArgument(f"{name} given for a step with no admissions; send it only with "
                                          "admit_seq_ids (one entry per admission, token ids: their sum)")
            return None
        if token_ids is None or self.prefix is None:
            if token_ids is not None and self.prefix is None and len(np.asarray(token_ids)):
                raise InvalidArgument(f"pool {self.name!r} was created without prefix caching; "
                                      "admit_token_ids are not accepted")
            return None
        tok = np.asarray(token_ids)
        if tok.ndim != 1 or tok.dtype.kind not in "iu":
            raise InvalidArgument(f"admit_token_ids must be a 1-D integer array, got shape {tok.shape} dtype "
                                  f"{tok.dtype}")
        if len(tok) != (int(a_n[0]) if a == 1 else int(np.add.reduce(a_n))):
            raise InvalidArgument(f"admit_token_ids has {len(tok)} ids; admit_num_tokens add up to {int(a_n.sum())}")
        ns, new_ns = self.prefix.namespace_ids(salt_list, key_list)
        ps = self.page_size
        full = a_n // ps
        tok = tok.astype(np.int64, copy=False)
        if a == 1:                                          # one prompt: its full pages are a view
            n = int(full[0])
            page_start = np.zeros(1, dtype=np.int64)
            row = np.zeros(n, dtype=np.int64)
            col = np.arange(n, dtype=np.int64)
            pages = tok[:n * ps].reshape(n, ps)
        else:                                               # [N, ps]: O(prompt tokens), never A x longest
            n = int(np.add.reduce(full))
            page_start = full.cumsum() - full               # first page of each prompt
            row = np.arange(a, dtype=np.int64).repeat(full)
            col = np.arange(n, dtype=np.int64) - page_start[row]
            tok_start = a_n.cumsum() - a_n
            pages = np.concatenate([tok[s:s + f * ps].reshape(f, ps)
                                    for s, f in zip(tok_start.tolist(), full.tolist(), strict=True)])
        limit = (a_n - 1) // ps                      # at least one token of each prompt is computed
        hashes = self.prefix.hash_fn(pages, col, page_start, full, ns) if n else np.zeros(0, dtype=np.uint64)
        return Prompt(pages, row, col, full, limit, ns, hashes, new_ns)

    # ---- phase 2: plan (pure) ------------------------------------------------------------
    def _plan(self, inp: StepInput) -> StepPlan:
        """Every group's slot demand and changes, computed before anything changes; ResourceExhausted if short."""
        ps = self.page_size
        e_old = self._num_tokens[inp.e_rows]
        e_new = e_old + inp.e_k
        e_held = self._held[inp.e_rows]
        e_held_new = (e_new + (ps - 1)) // ps
        a_held = (inp.a_n + (ps - 1)) // ps
        hits, cands = self._plan_hits(inp.prompt, len(inp.a_ids)) if inp.prompt is not None else (None, [])
        groups = tuple(self._plan_group(g, inp, e_old, e_held, e_held_new, a_held, hits, cands)
                       for g in range(len(self.allocators)))
        for g, gp in enumerate(groups):
            if gp.need > gp.avail:
                self._refuse(g, gp.need, gp.avail)
        return StepPlan(e_old, e_new, e_held, e_held_new, a_held, groups)

    def _refuse(self, g: int, need: int, avail: int) -> None:
        """Count and raise the refusal of a step that needs more slots of group g than it has."""
        self.refused += 1
        self.alloc_failures["out_of_slots"] = self.alloc_failures.get("out_of_slots", 0) + 1
        free_now = self.allocators[g].num_free
        raise ResourceExhausted(
            f"pool {self.name!r}: this step needs {need} slots in layer group {g} but only {avail} "
            f"are free ({free_now} free + {avail - free_now} released by this step) of "
            f"{self.allocators[g].num_slots}; free or preempt sequences, or plan a bigger pool",
            needed=need, free=avail, num_slots=self.allocators[g].num_slots, group=g)

    def _plan_hits(self, prompt: Prompt, num_admits: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Cached pages each admission takes (hits int64 [A], the same in every group) and each group's
        candidate slot per prompt page (int64 [N]).

        A hit of h pages needs, in every full-attention group, pages 0..h-1 confirmed along the parent
        chain, and in a sliding group of window w only the pages the first computed token attends:
        [first_kept(h), h). The hit is the longest h every group can serve, at most `limit`.
        """
        caches = self.prefixes
        pr = prompt
        cands: list[np.ndarray] = [EMPTY_I64] * len(caches)
        if not len(pr.pages):
            return np.zeros(num_admits, dtype=np.int64), cands
        hits = pr.limit.copy()
        for g, cache in enumerate(caches):
            if not self.windows[g]:
                h, cands[g] = cache.match(pr.pages, pr.row, pr.col, pr.limit, pr.ns, pr.hashes)
                np.minimum(hits, h, out=hits)
        if not self._sliding:
            return hits, cands
        ok_len = (pr.col + 1) <= hits[pr.row]              # h = col + 1 allowed by the full groups and limit
        anchor = self._anchor_group
        for g in self._sliding:
            cand, ok = caches[g].candidates(pr.pages, pr.row, pr.ns, pr.hashes)
            safe = np.maximum(cand, 0)
            if anchor is not None:                          # the very page the full group confirmed
                ok &= caches[g].anchor[safe] == cands[anchor]
            else:                                           # sliding groups only: the parent page's hash
                prev_h = np.zeros(len(cand), dtype=np.uint64)
                inner = (pr.col > 0).nonzero()[0]
                prev_h[inner] = pr.hashes[inner - 1]
                ok &= caches[g].parent_hash[safe] == prev_h
            needed = (pr.col + 1) - self._first_kept(g, pr.col + 1)
            ok_len &= run_ending_at(ok, pr.col) >= needed
            cands[g] = cand
        out = np.zeros(num_admits, dtype=np.int64)
        at = ok_len.nonzero()[0]
        np.maximum.at(out, pr.row[at], pr.col[at] + 1)
        return out, cands

    def _first_kept(self, g: int, tokens_pages: np.ndarray) -> np.ndarray:
        """First page a sequence needs in group g once its first h pages are cached (0 in full groups).

        tokens_pages: int64 [...] h, cached pages. The first computed token (position h * page_size)
        attends tokens from h * page_size + 1 - window on, so pages wholly before that are not needed.
        """
        w = self.windows[g]
        if not w:
            return np.zeros_like(tokens_pages)
        return np.maximum(tokens_pages * self.page_size + 1 - w, 0) // self.page_size

    def _plan_group(self, g: int, inp: StepInput, e_old: np.ndarray, e_held: np.ndarray,
                    e_held_new: np.ndarray, a_held: np.ndarray, hits_all: np.ndarray | None,
                    cands: list[np.ndarray]) -> GroupPlan:
        alloc = self.allocators[g]
        first = self._first[g]
        rs = self._slots[g]
        need = int(np.add.reduce(e_held_new - e_held)) + int(np.add.reduce(a_held))
        # Owners lost (frees, window releases) and gained (fork children) before any allocation.
        f_slots = rs.gather(inp.f_rows, first[inp.f_rows], self._held[inp.f_rows]) if len(inp.f_rows) else None
        dropped = [f_slots] if f_slots is not None else []
        new_first = None
        if self.windows[g] and len(inp.e_rows):
            lo = first[inp.e_rows]
            new_first = np.minimum(np.maximum(lo, (e_old + 1 - self.windows[g]) // self.page_size), e_held)
            dropped.append(rs.gather(inp.e_rows, lo, new_first))
        lost = EMPTY_I64
        if dropped:
            lost = np.concatenate(dropped)
            lost.sort()                               # a fresh array: sorted in place
        gained = np.sort(rs.gather(inp.p_rows, first[inp.p_rows], self._held[inp.p_rows])) \
            if len(inp.p_rows) else EMPTY_I64
        rc = alloc._refcnt

        def owners_after(slots: np.ndarray) -> np.ndarray:
            return rc[slots].astype(np.int64) - count_in(lost, slots) + count_in(gained, slots)

        freed = distinct_sorted(lost)
        freed = freed[owners_after(freed) == 0] if len(freed) else freed
        avail = alloc.num_free + len(freed)
        hits = cand = a_first = None
        if hits_all is not None:
            pr = inp.prompt
            hits, cand = hits_all, cands[g]
            a_first = self._first_kept(g, hits)
            taken = cand[(pr.col < hits[pr.row]) & (pr.col >= a_first[pr.row])]     # a fresh array
            taken.sort()
            taken = distinct_sorted(taken)
            avail -= int((owners_after(taken) == 0).sum())      # cached pages revived from the free LRU
            need -= int(np.add.reduce(hits))
        cow = None
        if (self._sharing or len(inp.p_rows)) and len(inp.e_rows):
            partial = (e_old % self.page_size != 0).nonzero()[0]
            if len(partial):
                rows = inp.e_rows[partial]
                last = rs.arena.take(rs.flat(rows, e_held[partial] - 1)).astype(np.int64)
                owners = owners_after(last)
                if np.logical_or.reduce(owners > 1):
                    cow = np.zeros(len(inp.e_rows), dtype=bool)
                    cow[partial] = cow_rows(last, owners)
                    need += int(np.add.reduce(cow))
        return GroupPlan(need, avail, new_first, cow, hits, cand, a_first, f_slots)

    # ---- phase 3: commit ---------------------------------------------------------------
    def _commit(self, inp: StepInput, plan: StepPlan, tables: bool, block_table: bool,
                mappings: bool = True) -> StepResult:
        """Carry out a plan (nothing can fail here), then emit the batch's tables."""
        ps = self.page_size
        for alloc in self.allocators:
            alloc.clock = self.steps + 1          # pages released by this step are stamped with it (eviction order)
        self._release(inp.f_rows, [gp.f_slots for gp in plan.groups])
        c_rows = self._take_rows(inp.c_ids)
        if len(c_rows):
            self._fork(inp.p_rows, c_rows)
        e_rows = inp.e_rows
        moves = {g: self._release_window(g, e_rows, plan.groups[g].new_first) for g in self._sliding}
        a_rows = self._take_rows(inp.a_ids)
        hits = plan.groups[0].hits
        for g, rs in enumerate(self._slots):
            gp = plan.groups[g]
            if gp.a_first is not None:                    # a sliding group never holds pages before the window
                self._first[g][a_rows] = gp.a_first
            rs.reserve(a_rows, self._first[g][a_rows], plan.a_held)
            if hits is not None and np.logical_or.reduce(hits):
                self._share_hits(g, a_rows, hits, gp.cand, gp.a_first, inp.prompt)
        a_lo = hits if hits is not None else np.zeros(len(a_rows), dtype=np.int64)
        grown = [self._grow(g, e_rows, plan, a_rows, a_lo, moves.get(g)) for g in range(len(self.allocators))]
        copies = tuple(c for c, _ in grown)
        rows = np.concatenate((e_rows, a_rows, c_rows)) if len(a_rows) or len(c_rows) else e_rows
        c_tokens = self._num_tokens[c_rows]
        old = np.concatenate((plan.e_old, np.zeros(len(a_rows), dtype=np.int64), c_tokens))
        new = np.concatenate((plan.e_new, inp.a_n, c_tokens))
        held_new = (new + (ps - 1)) // ps
        self._num_tokens[rows] = new
        self._held[rows] = held_new
        return self._finish(inp, rows, old, new, held_new, a_rows, hits, copies, tables, block_table,
                            tuple(ch for _, ch in grown), mappings)

    def _finish(self, inp: StepInput, rows: np.ndarray, old: np.ndarray, new: np.ndarray, held_new: np.ndarray,
                a_rows: np.ndarray, hits: np.ndarray | None, copies: tuple[np.ndarray, ...], tables: bool,
                block_table: bool, changes: tuple[GroupChanges, ...], mappings: bool = True) -> StepResult:
        """The end of a committed step (general path and fastpaths.full_group_step): register the admitted
        prompts, count the step and emit its reply for rows (int64 [B], batch order; old/new/held_new int64 [B]
        tokens before, after and pages after; hits int64 [A] or None; copies and changes per layer group;
        no slot mappings or tables when neither tables nor mappings)."""
        if inp.prompt is not None and len(a_rows):
            self._register(a_rows, inp.prompt)
        self.steps += 1
        self.admitted += len(inp.a_ids)
        self._last_batch = (inp.e_ids.copy(), inp.e_rows) if inp.extend_only else None
        tok_indptr = token_indptr(old, new)
        ps = self.page_size
        cached = hits * ps if hits is not None else (np.zeros(len(a_rows), dtype=np.int64) if len(a_rows) else None)
        spaces = self._emit(rows, old, new, held_new, tok_indptr, tables, block_table) if tables or mappings else ()
        return StepResult(self._seq_ids[rows], new, tok_indptr, spaces, self.num_free_slots, cached, copies, changes,
                          len(inp.e_rows))

    def _decode_step(self, e_ids: np.ndarray, rows: np.ndarray, k: np.ndarray, tables: bool,
                     block_table: bool, mappings: bool = True, new: np.ndarray | None = None) -> StepResult | None:
        """fastpaths.decode_step: the steady decode loop (None: the general path runs, and raises)."""
        return fastpaths.decode_step(self, e_ids, rows, k, tables, block_table, mappings, new)

    def _full_group_step(self, inp: StepInput, tables: bool, block_table: bool,
                         mappings: bool = True) -> StepResult | None:
        """fastpaths.full_group_step: one full-attention group, no forks (None: the general path plans it)."""
        return fastpaths.full_group_step(self, inp, tables, block_table, mappings)

    def _grow(self, g: int, e_rows: np.ndarray, plan: StepPlan, a_rows: np.ndarray, a_lo: np.ndarray,
              moved: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, GroupChanges]:
        """Group g: copy-on-write of the planned rows, then the new pages of extensions and admissions.

        moved: the extended rows whose first kept page the step moved, and where to (_release_window).
        Returns int64 [n, 2] (src, dst) slot pairs, in batch order, and the group's GroupChanges.
        """
        alloc = self.allocators[g]
        rs = self._slots[g]
        gp = plan.groups[g]
        copies = NO_COPIES
        cow = cow_slots = NO_ROWS
        if gp.cow is not None and np.logical_or.reduce(gp.cow):
            cow = gp.cow.nonzero()[0]
            rows = e_rows[cow]
            flat = rs.flat(rows, plan.e_held[cow] - 1)
            src = rs.arena.take(flat).astype(np.int64)
            dst = alloc.allocate(len(rows))
            rs.arena[flat] = dst
            alloc.free(src.astype(np.intp))              # other owners keep src (repeats counted)
            cow_slots = dst.astype(np.int64)
            copies = np.stack((src, cow_slots), axis=1)
        if len(a_rows):
            g_rows = np.concatenate((e_rows, a_rows))
            g_lo = np.concatenate((plan.e_held, a_lo))
            g_hi = np.concatenate((plan.e_held_new, plan.a_held))
        else:
            g_rows, g_lo, g_hi = e_rows, plan.e_held, plan.e_held_new
        nz = (g_hi > g_lo).nonzero()[0]
        counts = got = NO_ROWS
        if len(nz):
            g_rows, g_lo, g_hi = g_rows[nz], g_lo[nz], g_hi[nz]
            counts = g_hi - g_lo
            got = self._alloc_pages(g, alloc, g_rows, g_lo, g_hi, int(np.add.reduce(counts)))
        moved_rows, moved_first = moved if moved is not None else (NO_ROWS, NO_ROWS)
        return copies, grown_changes(nz, counts, got, len(e_rows), cow, cow_slots, moved_rows, moved_first)

    def _alloc_pages(self, g: int, alloc: SlotAllocator, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                     total: int) -> np.ndarray:
        """Fill columns [lo, hi) of distinct rows of group g (each hi > lo) with total = sum(hi - lo) new slots;
        returns them (row by row, columns ascending)."""
        rs = self._slots[g]
        rs.reserve(rows, self._first[g][rows], hi)
        if total == len(rows):                             # every row gains exactly one page (decode)
            flat = rs.flat(rows, lo)
        else:
            flat, _ = rs.span(rows, lo, hi)
        got = alloc.allocate(total)
        rs.arena[flat] = got
        return got

    def _release(self, rows: np.ndarray, slots: list[np.ndarray | None], distinct: bool = False) -> None:
        """Frees: every page of the rows loses an owner; the rows leave the pool. slots[g]: the rows' slots in
        group g as the plan gathered them (GroupPlan.f_slots); distinct: the plan found no slot among them twice."""
        if not len(rows):
            return
        for g, alloc in enumerate(self.allocators):
            alloc.free(slots[g].astype(np.intp, copy=False), unique=distinct or not self._sharing)
            self._slots[g].drop(rows)
            self._first[g][rows] = 0
        for seq_id in self._seq_ids[rows].tolist():
            del self._rows[seq_id]
        self._num_tokens[rows] = 0
        self._held[rows] = 0
        self._free_rows.extend(rows.tolist())
        self._sorted = None
        self._last_batch = None

    def _fork(self, p_rows: np.ndarray, c_rows: np.ndarray) -> None:
        """Each child becomes a copy of its parent (as before this step) sharing its slots."""
        self._sharing = True
        self._num_tokens[c_rows] = self._num_tokens[p_rows]
        held = self._held[p_rows]
        self._held[c_rows] = held
        for g, alloc in enumerate(self.allocators):
            first = self._first[g][p_rows]
            self._first[g][c_rows] = first
            self._slots[g].copy_rows(p_rows, c_rows, first, held)
            shared = self._slots[g].gather(p_rows, first, held)
            uniq, counts = np.unique(shared, return_counts=True)
            alloc.share(uniq, counts)

    def _release_window(self, g: int, e_rows: np.ndarray,
                        new_first: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
        """Sliding group g: the extended rows drop the pages wholly before their window. Returns the batch
        positions of the rows whose first kept page moved (int64 [M]) and where to (int64 [M]), or None."""
        if new_first is None:
            return None
        rs = self._slots[g]
        lo = self._first[g][e_rows]
        moved = (new_first != lo).nonzero()[0]
        flat, _ = rs.span(e_rows, lo, new_first)
        if len(flat):
            self.allocators[g].free(rs.arena.take(flat).astype(np.intp), unique=not self._sharing)
            rs.arena[flat] = -1
        self._first[g][e_rows] = new_first
        return moved, new_first[moved]

    def _share_hits(self, g: int, a_rows: np.ndarray, hits: np.ndarray, cand: np.ndarray, a_first: np.ndarray,
                    prompt: Prompt) -> None:
        """Admissions take their cached pages [first kept, hits) of group g, before any page is allocated."""
        rs = self._slots[g]
        mask = (prompt.col < hits[prompt.row]) & (prompt.col >= a_first[prompt.row])
        slots = cand[mask]
        uniq, counts = distinct_counts(slots)
        self.allocators[g].share(uniq, counts)
        rs.arena[rs.flat(a_rows[prompt.row[mask]], prompt.col[mask])] = slots
        self.prefixes[g].hits += len(slots)

    def _register(self, a_rows: np.ndarray, prompt: Prompt) -> None:
        """Make the admissions' full prompt pages findable by later prompts (after the step)."""
        self.prefix.add_namespaces(prompt.new_ns)
        if not len(prompt.pages):
            return
        register_prompt(self.prefixes, self._register_order, self._is_sliding, self._anchor_group, self._slots,
                        self._first, a_rows, prompt)

    # ---- rows and lookups -------------------------------------------------------------------
    def _index(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of live sequences sorted by id, rebuilt after admits and frees."""
        if self._sorted is None:
            rows = np.fromiter(self._rows.values(), dtype=np.int64, count=len(self._rows))
            keys = self._seq_ids[rows]
            order = np.argsort(keys, kind="stable")
            self._sorted = (keys[order], rows[order])
        return self._sorted

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, found) for ids, vectorised over the sorted index (a few ids: looked up in the row map, without
        rebuilding the index that every admission and free leaves stale)."""
        if len(ids) <= FEW:
            got = [self._rows.get(i, -1) for i in ids.tolist()]
            rows_few = np.array(got, dtype=np.int64)
            return np.maximum(rows_few, 0), rows_few >= 0
        keys, rows = self._index()
        if not len(keys):
            return np.zeros(len(ids), dtype=np.int64), np.zeros(len(ids), dtype=bool)
        pos = keys.searchsorted(ids)
        np.minimum(pos, len(keys) - 1, out=pos)
        return rows[pos], keys[pos] == ids

    def _lookup(self, ids: np.ndarray, field: str) -> np.ndarray:
        if not len(ids):
            return EMPTY_I64
        if len(ids) <= FEW and -1 not in (got := [self._rows.get(i, -1) for i in ids.tolist()]):
            return np.array(got, dtype=np.int64)          # a few ids, all live: the row map's answers
        rows, found = self._find(ids)
        if not np.logical_and.reduce(found):
            missing = ids[~found][0]
            raise NotFound(f"{field}: sequence {missing} is not in pool {self.name!r}", seq_id=missing)
        return rows

    def _row_of(self, seq_id: int) -> int:
        row = self._rows.get(int(seq_id))
        if row is None:
            raise NotFound(f"sequence {seq_id} is not in pool {self.name!r}", seq_id=seq_id)
        return row

    def _take_rows(self, ids: np.ndarray) -> np.ndarray:
        n = len(ids)
        if not n:
            return EMPTY_I64
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

    def _grow_rows(self, n: int) -> None:
        cap = len(self._num_tokens)
        if n <= cap:
            return
        new_cap = max(n, 2 * cap)
        pad = new_cap - cap
        self._num_tokens = np.concatenate((self._num_tokens, np.zeros(pad, dtype=np.int64)))
        self._seq_ids = np.concatenate((self._seq_ids, np.zeros(pad, dtype=np.uint64)))
        self._held = np.concatenate((self._held, np.zeros(pad, dtype=np.int64)))
        self._first = [np.concatenate((f, np.zeros(pad, dtype=np.int64))) for f in self._first]
        for s in self._slots:
            s.grow_rows(new_cap)

    # ---- phase 4: emit -----------------------------------------------------------------
    def _emit(self, rows: np.ndarray, old: np.ndarray, new: np.ndarray, held: np.ndarray, tok_indptr: np.ndarray,
              tables: bool, block_table: bool) -> tuple[SpaceTables, ...]:
        return emit_tables(self.plan.geometry.index_spaces, self.page_size, self._slots, self._first, self._is_sliding,
                           rows, old, new, held, tok_indptr, tables, block_table, self.allocators)

    # ---- durable state ---------------------------------------------------------------------------
    # A snapshot stores a pool in domain terms (sequences, the slots of their pages, free lists in hand-out
    # order, prefix-cache entries per layer group), not as this class's attributes, so that another internal
    # layout (or the next release) can read it. export_state reads, and from_state writes, exactly these
    # fields; keep both in step with any change to them (tests/unit/test_snapshot.py::
    # test_every_pool_field_is_exported_or_rebuilt lists them and fails when a field is added):
    #   Pool:          name, plan, model, incarnation, prefix_hash, prefix_hash_seed, prefixes (prefix), _sharing,
    #                  _rows, _seq_ids, _num_tokens, _held, _first, _slots (RowSlots: the slots of pages
    #                  [first, held) of each row), _free_rows,
    #                  _num_rows, steps, admitted, refused, alloc_failures, events (seq; its sources' parent
    #                  hashes and hash index are rebuilt from the caches)
    #   SlotAllocator: _stack[:_top], _top, _cached (eviction order, with release stamps), peak_used, evictions,
    #                  generation; policy: its links per registered page (prefix/<g>/linked), the rest rebuilt;
    #                  clock: the largest stamp (the pool sets it every step);
    #                  _refcnt is rebuilt from the owners (invariant 1), cacheable from the prefix caches
    #   PrefixCache (per group): by_hash (insertion order), hash, parent, parent_hash, anchor, namespace,
    #                  tokens (registered slots only), hits; the namespaces shared by the groups
    # Rebuilt, not stored (caches, scratch, constants): Pool._sorted, _last_batch, _fast, _one_full_group, page_size,
    # max_seq_len, windows, layer_space, _sliding, _is_sliding, _anchor_group, _register_order (from the plan);
    # SlotAllocator._mark, _ones, num_slots, caching, on_evict; PrefixCache.fleet (the manager attaches a
    # restored pool to its fleet index, which reads the cache again: fleet_index.py).
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
        groups, tables, stacks = [], [], []
        for g, alloc in enumerate(self.allocators):
            arrays[f"first/{g}"] = self._first[g][rows]                  # fancy indexing: copies
            rs = self._slots[g]                                           # gathered later, unlocked
            tables.append((rs.arena[:rs.used].copy(), rs.start[rows], rs.lo[rows]))
            a = alloc.export_state()
            stacks.append(a.pop("free_stack"))
            groups.append({"peak_used": a.pop("peak_used"), "evictions": a.pop("evictions")})
            arrays |= {f"{k}/{g}": v for k, v in a.items()}                 # cached, cached_stamp, generation
        prefix = None
        if self.prefixes is not None:
            for g, pc in enumerate(self.prefixes):
                arrays |= {f"prefix/{g}/{k}": v for k, v in pc.export_state().items()}
            prefix = {"hits": [int(pc.hits) for pc in self.prefixes], "namespaces": self.prefix.namespaces.items()}
        spec = geo.spec
        meta = {"version": POOL_STATE_VERSION, "name": self.name, "model": self.model,
                "incarnation": int(self.incarnation),
                "spec": {"page_size": ps, "layout": spec.layout, "layers": spec_runs(spec)},
                "num_slots": int(geo.num_slots), "group_slots": [int(n) for n in geo.group_slots],
                "max_seq_len": int(self.max_seq_len),
                "backends": list(self.plan.backends), "prefix_caching": self.prefixes is not None,
                "prefix_hash": self.prefix_hash, "prefix_hash_seed": self.prefix_hash_seed,
                "sharing": bool(self._sharing), "steps": int(self.steps),
                "admitted": int(self.admitted), "refused": int(self.refused),
                "alloc_failures": {str(k): int(v) for k, v in self.alloc_failures.items()},
                "row_capacity": len(self._num_tokens), "num_rows": int(self._num_rows),
                "events_seq": int(self.events.seq), "groups": groups, "prefix": prefix}

        def finish(runs: bool = False) -> PoolState:
            """runs: leave a free stack found to be runs as IdRuns (the snapshot encoder writes them as they are)."""
            for g, stack in enumerate(stacks):
                arrays[f"free_stack/{g}"] = stack if runs and isinstance(stack, IdRuns) else as_array(stack)
            for g, (arena, start, lo) in enumerate(tables):
                first = arrays[f"first/{g}"]
                cnt = held - first
                out = np.empty(int(cnt.sum()), dtype=np.int64)
                at = 0
                for a in range(0, len(rows), 1024):        # in pieces: other threads run in between (GIL)
                    s, f, lw, c = start[a:a + 1024], first[a:a + 1024], lo[a:a + 1024], cnt[a:a + 1024]
                    k = int(c.sum())
                    starts = c.cumsum() - c
                    flat = (s + (f - lw) - starts).repeat(c) + np.arange(k, dtype=np.int64)
                    out[at:at + k] = arena.take(flat)
                    at += k
                arrays[f"slots/{g}"] = out
            return PoolState(meta, arrays)
        return finish

    def export_state(self) -> PoolState:
        """The pool's state as PoolState (copies; the caller holds the pool's lock for a consistent cut)."""
        return self.capture_state()()

    @staticmethod
    def from_state(state: PoolState, plan: Plan) -> Pool:
        """A pool rebuilt from PoolState; plan: the pool's plan (kvservice.state.snapshot rebuilds it from meta).

        The state must have passed kvservice.core.invariants.check_pool_state (this only rebuilds it).
        """
        m, a = state.meta, state.arrays
        pool = Pool(m["name"], plan, bool(m["prefix_caching"]), str(m.get("model", "")),
                    str(m.get("prefix_hash", DEFAULT_MODE)), str(m.get("prefix_hash_seed", VLLM_DEFAULT_SEED)))
        pool.incarnation = int(m.get("incarnation", 0))
        cap = int(m["row_capacity"])
        pool._grow_rows(cap)
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
            slots = a[f"slots/{g}"]
            pool._first[g][rows] = first
            rs = pool._slots[g]
            rs.reserve(rows, first, held)
            flat, _ = rs.span(rows, first, held)
            rs.arena[flat] = slots
            alloc.restore_state(a[f"free_stack/{g}"], slots, m["groups"][g]["peak_used"], m["groups"][g]["evictions"],
                                a.get(f"generation/{g}"))               # version 2 states have none: all 0
        if pool.prefixes is not None:
            p = m["prefix"]
            pool.prefix.namespaces.restore(p["namespaces"])
            for g, pc in enumerate(pool.prefixes):
                at = f"prefix/{g}/"
                pc.restore_state({k[len(at):]: v for k, v in a.items() if k.startswith(at)}, p["hits"][g])
        for g, alloc in enumerate(pool.allocators):   # after the links: the policy orders the cached slots by them
            cached = a[f"cached/{g}"]
            stamps = a.get(f"cached_stamp/{g}")         # older snapshots: LRU order as stored
            alloc.restore_cached(cached, stamps if stamps is not None else np.arange(len(cached), dtype=np.int64))
        pool.events.seq = int(m.get("events_seq", 0))
        pool.steps, pool.admitted, pool.refused = int(m["steps"]), int(m["admitted"]), int(m["refused"])
        pool.alloc_failures = {str(k): int(v) for k, v in m["alloc_failures"].items()}
        return pool
