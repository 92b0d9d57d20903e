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

``step`` runs four phases, each a function you can read alone, in a module of
its own (a base class of Pool): validate the request (`_validate`,
pool_validate.py), plan every group's slot demand without changing anything
(`_plan`, pool_plan.py), carry the plan out (`_commit`, pool_commit.py), and
emit the batch's slot mappings and tables (`emit.emit_tables`, through
pool_rows.py, which also maps sequence ids to rows); pool_codec.py turns a
pool into plain data and back. Two fast paths (fastpaths.py): `_decode_step` serves
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

import numpy as np

from kvservice.contract.sizing import Plan
from kvservice.core.allocator import SlotAllocator
from kvservice.core.cache_events import PoolEvents
from kvservice.core.emit import SpaceTables, StepResult
from kvservice.core.hashing import DEFAULT_MODE, VLLM_DEFAULT_SEED, make_hash_fn
from kvservice.core.pool_codec import PoolCodec
from kvservice.core.pool_commit import CommitPhase
from kvservice.core.pool_plan import PlanPhase
from kvservice.core.pool_rows import RowIndex
from kvservice.core.pool_validate import ValidatePhase
from kvservice.core.prefix import Namespaces, PrefixCache
from kvservice.core.rowslots import RowSlots, slot_table_dtype
from kvservice.core.stepplan import parse_ids

__all__ = ["Pool", "SpaceTables", "StepResult"]


class Pool(ValidatePhase, PlanPhase, CommitPhase, RowIndex, PoolCodec):
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

