"""A deliberately plain reference model of a pool: dicts, lists and ints, no NumPy, no fast paths.

Written from DESIGN.md and docs/ARCHITECTURE.md (never from kvservice/pool.py,
allocator.py or prefix.py) so that a differential test can hold the real pool
to the documented semantics:

- One Step, all or nothing: frees first, then forks (each child a copy of its
  parent as it was before this step's extensions), then extensions (window
  release, copy-on-write, growth), then admissions; new full prompt pages are
  registered in the prefix cache after the step.
- Batch order of a reply: extended sequences, then admitted ones, then fork
  children, each in request order.
- Copy-on-write: of c extending owners of a partly filled last page with r
  owners, all c copy when r > c, otherwise the last one in batch order writes in
  place. Copies are listed in batch order.
- Sliding window w: a sequence growing from `old` tokens releases every page
  wholly before token `old + 1 - w`.
- Prefix caching (group 0 only, full attention): an admission with token ids
  takes page j from the cache when a cached page holds the same namespace
  (salt, extra key) and the same token prefix (tokens[:(j+1)*page_size]), and
  its recorded parent slot is the slot accepted for page j - 1; hits form a
  prefix of the prompt and cover at most (n - 1) // page_size pages. A page
  whose last owner leaves goes to an LRU; an allocation uses a clean free slot
  while one is left and only then evicts the oldest cached page. The docs fix
  no order among pages released by the same step, so the model keeps them as
  one generation and asks `choose` which of a generation's pages the pool
  evicted when it evicts only some of them.
- Block tables: row b, column j is page j of the sequence (absolute page
  position), -1 where a sliding window released it and past the row's end; as
  wide as the longest row (ceil(n / page_size) of the longest sequence).

Slots here are abstract ids: which physical slot the allocator picks is its
choice. Every page allocated by a step gets a fresh id (listed in
`Outcome.pending`); the caller binds ids to real slots and checks that exactly
the evicted cached slots (`Outcome.evicted`) were reused. `pos(g, slot)`, set by
the caller, answers which physical slot an id was bound to; the prefix cache's
parent-slot rule is about physical slots, so it compares through it.
`choose(g, candidates)` (also the caller's) picks the one page of the oldest
generation of cached pages that the pool evicted; by default the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvservice.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Step:
    """One Step request in plain lists (what the differential test replays and shrinks).

    token_ids: the admissions' token ids concatenated (None: no prefix caching for this step).
    salts, keys: one string per admission, or None (= "" for each).
    """

    free: list[int] = field(default_factory=list)
    forks: list[tuple[int, int]] = field(default_factory=list)
    ext: list[tuple[int, int]] = field(default_factory=list)
    adm: list[tuple[int, int]] = field(default_factory=list)
    token_ids: list[int] | None = None
    salts: list[str] | None = None
    keys: list[str] | None = None
    tables: bool = True
    block_table: bool = False

    def ops(self) -> int:
        """Elementary operations in this step (each free, fork, extension and admission)."""
        return len(self.free) + len(self.forks) + len(self.ext) + len(self.adm)

    def literal(self) -> str:
        parts = [f"{k}={v!r}" for k, v in (("free", self.free), ("forks", self.forks), ("ext", self.ext),
                                           ("adm", self.adm)) if v]
        for k in ("token_ids", "salts", "keys"):
            if getattr(self, k) is not None:
                parts.append(f"{k}={getattr(self, k)!r}")
        if not self.tables:
            parts.append("tables=False")
        if self.block_table:
            parts.append("block_table=True")
        return f"Step({', '.join(parts)})"


@dataclass
class Seq:
    n: int
    first: list[int]                  # per group: first page still held
    pages: list[list[int | None]]     # per group: slot of every page; None once released

    def held(self, g: int) -> list[int]:
        return self.pages[g][self.first[g]:]

    def copy(self) -> Seq:
        return Seq(self.n, list(self.first), [list(p) for p in self.pages])


@dataclass
class Row:
    """One row of the batch: the sequence, its tokens after the step and the new tokens' places."""

    seq_id: int
    num_tokens: int
    new: int
    held: list[list[int]]                          # per group: held slots (from the first held page)
    first: list[int]                               # per group: position of the first held page
    new_slots: list[list[tuple[int, int]]]         # per group: (slot, offset in page) per new token


@dataclass
class Outcome:
    rows: list[Row]
    copies: list[list[tuple[int, int]]]            # per group: (src, dst) in batch order
    cached_tokens: list[int] | None                # per admission (None if the step admits nothing)
    pending: list[list[int]]                       # per group: ids of slots allocated by this step
    evicted: list[list[int]]                       # per group: cached slots this step took for new pages
    num_free: int
    released: int = 0                              # pages sliding windows released (all groups)


class _State:
    """Everything a step changes; copied before a step so that a refused step changes nothing."""

    def __init__(self, groups: int) -> None:
        self.seqs: dict[int, Seq] = {}
        self.refs: list[dict[int, int]] = [{} for _ in range(groups)]     # owned slot -> owners
        self.lru: list[dict[int, int]] = [{} for _ in range(groups)]      # cached free slot -> generation
        self.cache: dict[tuple, tuple[int, int | None]] = {}              # (ns, tokens) -> (slot, parent)
        self.key_of: dict[int, tuple] = {}                                # registered slot -> its key
        self.steps = self.admitted = self.refused = self.hits = self.evictions = 0
        self.peak = 0
        self.generation = 0

    def copy(self) -> _State:
        s = _State(0)
        s.seqs = {i: q.copy() for i, q in self.seqs.items()}
        s.refs = [dict(r) for r in self.refs]
        s.lru = [dict(x) for x in self.lru]
        s.cache = dict(self.cache)
        s.key_of = dict(self.key_of)
        s.steps, s.admitted, s.refused, s.hits, s.evictions = \
            self.steps, self.admitted, self.refused, self.hits, self.evictions
        s.peak = self.peak
        s.generation = self.generation
        return s


class RefPool:
    """The model. windows[g] is group g's sliding window (0 = full attention)."""

    def __init__(self, page_size: int, windows: list[int] | tuple[int, ...], num_slots: int, max_seq_len: int,
                 prefix_caching: bool = False) -> None:
        self.ps = page_size
        self.windows = list(windows)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.prefix_caching = prefix_caching
        self.s = _State(len(self.windows))
        self._next_slot = 0
        self.pos = lambda g, slot: slot          # physical slot of an id; the differential test sets it
        self.choose = lambda g, candidates: candidates[0]

    # ---- read-only views -----------------------------------------------------------------
    @property
    def groups(self) -> int:
        return len(self.windows)

    def clean(self, g: int, s: _State | None = None) -> int:
        s = s or self.s
        return self.num_slots - len(s.refs[g]) - len(s.lru[g])

    def num_free(self, g: int) -> int:
        return self.num_slots - len(self.s.refs[g])

    def live(self) -> list[int]:
        return sorted(self.s.seqs)

    def stats(self) -> dict[str, int]:
        s = self.s
        return {"steps": s.steps, "admitted": s.admitted, "refused": s.refused,
                "num_sequences": len(s.seqs), "num_tokens": sum(q.n for q in s.seqs.values()),
                "num_free_slots": min(self.num_free(g) for g in range(self.groups)),
                "peak_used_slots": s.peak, "prefix_cache_hits": s.hits,
                "prefix_cache_evictions": s.evictions, "cached_slots": len(s.lru[0]) if self.prefix_caching else 0}

    def row(self, seq_id: int, new: int = 0) -> Row:
        q = self.s.seqs[seq_id]
        return Row(seq_id, q.n, new, [q.held(g) for g in range(self.groups)], list(q.first),
                   [[] for _ in range(self.groups)])

    def tables_for(self, seq_ids: list[int]) -> list[Row]:
        for i in seq_ids:
            if i not in self.s.seqs:
                raise NotFound(f"sequence {i} is not in the pool")
        return [self.row(i) for i in seq_ids]

    # ---- the step ------------------------------------------------------------------------
    def step(self, st: Step) -> Outcome:
        """Apply one step; raise the domain error the pool must raise (and change nothing but `refused`)."""
        self._validate(st)
        trial = self.s.copy()
        trial.generation += 1
        try:
            out = self._apply(trial, st)
        except ResourceExhausted:
            self.s.refused += 1
            raise
        trial.steps += 1
        trial.admitted += len(st.adm)
        trial.peak = max(trial.peak, *(len(r) for r in trial.refs))
        self.s = trial
        return out

    def _validate(self, st: Step) -> None:
        seqs = self.s.seqs
        a_ids = [i for i, _ in st.adm]
        if any(k <= 0 for _, k in st.ext) or any(n <= 0 for _, n in st.adm):
            raise InvalidArgument("token counts must be > 0")
        if st.token_ids is not None and not self.prefix_caching:
            raise InvalidArgument("admit_token_ids need a pool created with prefix caching")
        if st.token_ids is not None and len(st.token_ids) != sum(n for _, n in st.adm):
            raise InvalidArgument("admit_token_ids must hold sum(admit_tokens) ids")
        for name, v in (("salts", st.salts), ("keys", st.keys)):
            if v is not None and len(v) not in (0, len(st.adm)):
                raise InvalidArgument(f"{name}: one per admission")
        ids = [*st.free, *(c for _, c in st.forks), *(i for i, _ in st.ext), *a_ids]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a sequence appears more than once")
        if any(i not in seqs for i in st.free) or any(i not in seqs for i, _ in st.ext) \
                or any(p not in seqs for p, _ in st.forks):
            raise NotFound("unknown sequence")
        if any(i in seqs for i in a_ids) or any(c in seqs for _, c in st.forks):
            raise AlreadyExists("sequence already live")
        if any(p in st.free for p, _ in st.forks):
            raise InvalidArgument("fork parent freed in the same step")
        if any(seqs[i].n + k > self.max_seq_len for i, k in st.ext) or any(n > self.max_seq_len for _, n in st.adm):
            raise InvalidArgument("past max_seq_len")

    def _new_slot(self, s: _State, g: int, pending: list[int], evicted: list[int]) -> int:
        if self.clean(g, s) == 0:
            if not s.lru[g]:
                raise ResourceExhausted(f"group {g}: no free slot")
            oldest = min(s.lru[g].values())
            candidates = [x for x, gen in s.lru[g].items() if gen == oldest]
            victim = candidates[0] if len(candidates) == 1 else self.choose(g, candidates)
            del s.lru[g][victim]
            key = s.key_of.pop(victim)
            del s.cache[key]
            s.evictions += 1
            evicted.append(victim)
        slot = self._next_slot
        self._next_slot += 1
        s.refs[g][slot] = 1
        pending.append(slot)
        return slot

    def _drop(self, s: _State, g: int, slot: int) -> None:
        s.refs[g][slot] -= 1
        if s.refs[g][slot] == 0:
            del s.refs[g][slot]
            if slot in s.key_of:
                s.lru[g][slot] = s.generation      # a registered page stays cached

    def _share(self, s: _State, g: int, slot: int) -> None:
        if slot in s.lru[g]:
            del s.lru[g][slot]               # revived from the cache
        s.refs[g][slot] = s.refs[g].get(slot, 0) + 1

    def _apply(self, s: _State, st: Step) -> Outcome:
        ps, G = self.ps, self.groups
        pending: list[list[int]] = [[] for _ in range(G)]
        evicted: list[list[int]] = [[] for _ in range(G)]
        # 1. frees
        for i in st.free:
            q = s.seqs.pop(i)
            for g in range(G):
                for x in q.held(g):
                    self._drop(s, g, x)
        # 2. forks: a copy of the parent as it is now (before this step's extensions)
        for p, c in st.forks:
            q = s.seqs[p].copy()
            s.seqs[c] = q
            for g in range(G):
                for x in q.held(g):
                    self._share(s, g, x)
        # 3. prefix-cache hits of the admissions, decided before any page is allocated
        prompts = self._prompts(st)
        hit_slots: list[list[int]] = []
        for (_, n), prompt in zip(st.adm, prompts, strict=True):
            got: list[int] = []
            if prompt is not None:
                ns, toks = prompt
                parent = None
                for j in range((n - 1) // ps):
                    entry = s.cache.get((ns, tuple(toks[:(j + 1) * ps])))
                    if entry is None:
                        break
                    slot, reg_parent = entry
                    if (reg_parent is None) != (parent is None) or \
                            (parent is not None and self.pos(0, reg_parent) != self.pos(0, parent)):
                        break
                    self._share(s, 0, slot)
                    got.append(slot)
                    parent = slot
                s.hits += len(got)
            hit_slots.append(got)
        # 4. extensions: window release, copy-on-write, growth (per group)
        olds = {i: s.seqs[i].n for i, _ in st.ext}
        copies: list[list[tuple[int, int]]] = [[] for _ in range(G)]
        released = 0
        for g in range(G):
            w = self.windows[g]
            if w:
                for i, _ in st.ext:
                    q = s.seqs[i]
                    new_first = max(q.first[g], (olds[i] + 1 - w) // ps)
                    for j in range(q.first[g], new_first):
                        self._drop(s, g, q.pages[g][j])
                        q.pages[g][j] = None
                        released += 1
                    q.first[g] = new_first
            # owners of each partly filled last page among the extending sequences, batch order
            writers: dict[int, list[int]] = {}
            for i, _ in st.ext:
                q = s.seqs[i]
                if q.n % ps:
                    writers.setdefault(q.pages[g][-1], []).append(i)
            copying = set()
            for slot, who in writers.items():
                r, c = s.refs[g][slot], len(who)
                copying.update(who if r > c else who[:-1])
            for i, _ in st.ext:
                if i in copying:
                    q = s.seqs[i]
                    src = q.pages[g][-1]
                    dst = self._new_slot(s, g, pending[g], evicted[g])
                    self._drop(s, g, src)
                    q.pages[g][-1] = dst
                    copies[g].append((src, dst))
            for i, k in st.ext:
                q = s.seqs[i]
                for _ in range(cdiv(olds[i] + k, ps) - cdiv(olds[i], ps)):
                    q.pages[g].append(self._new_slot(s, g, pending[g], evicted[g]))
        for i, k in st.ext:
            s.seqs[i].n += k
        # 5. admissions
        for (i, n), hits in zip(st.adm, hit_slots, strict=True):
            q = Seq(n, [0] * G, [[] for _ in range(G)])
            for g in range(G):
                q.pages[g] = list(hits) if g == 0 else []
                while len(q.pages[g]) < cdiv(n, ps):
                    q.pages[g].append(self._new_slot(s, g, pending[g], evicted[g]))
            s.seqs[i] = q
        # 6. registration of the admissions' new full prompt pages
        for (i, n), prompt, hits in zip(st.adm, prompts, hit_slots, strict=True):
            if prompt is None:
                continue
            ns, toks = prompt
            pages = s.seqs[i].pages[0]
            for j in range(len(hits), n // ps):
                key = (ns, tuple(toks[:(j + 1) * ps]))
                if key not in s.cache:
                    s.cache[key] = (pages[j], pages[j - 1] if j else None)
                    s.key_of[pages[j]] = key
        # the reply
        rows = [self._emit(s, i, olds[i], k) for i, k in st.ext]
        rows += [self._emit(s, i, 0, n) for i, n in st.adm]
        rows += [self._emit(s, c, s.seqs[c].n, 0) for _, c in st.forks]
        cached = [len(h) * ps for h in hit_slots] if st.adm else None
        num_free = min(self.num_slots - len(s.refs[g]) for g in range(G))
        return Outcome(rows, copies, cached, pending, evicted, num_free, released)

    def _prompts(self, st: Step) -> list[tuple[tuple[str, str], list[int]] | None]:
        if not self.prefix_caching or st.token_ids is None:
            return [None] * len(st.adm)
        out, at = [], 0
        for a, (_, n) in enumerate(st.adm):
            salt = st.salts[a] if st.salts else ""
            key = st.keys[a] if st.keys else ""
            out.append(((salt, key), st.token_ids[at:at + n]))
            at += n
        return out

    def _emit(self, s: _State, seq_id: int, old: int, k: int) -> Row:
        q = s.seqs[seq_id]
        ps = self.ps
        new_slots = [[(q.pages[g][t // ps], t % ps) for t in range(old, old + k)] for g in range(self.groups)]
        return Row(seq_id, q.n, k, [q.held(g) for g in range(self.groups)], list(q.first), new_slots)
