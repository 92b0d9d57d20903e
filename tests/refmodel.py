"""A deliberately plain reference model of a pool: dicts, lists and ints, no NumPy, no fast paths.

Written from docs/DESIGN.md and docs/ARCHITECTURE.md (never from kvservice/core/pool.py,
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
- Prefix caching, every layer group its own cache over its own slots. A page's
  identity is (namespace, every token up to the page's end): equal identities
  are equal chained hashes (barring collisions, which the real pool cannot
  produce without an injected hash function), so the caches are dicts keyed by
  identity. A hit of h pages (h <= (n - 1) // page_size) needs, in the full
  group, pages 0..h-1 confirmed along the parent chain (a cached page of that
  identity whose recorded parent slot is the slot confirmed for page j - 1); in
  a sliding group of window w, pages [(h * page_size + 1 - w) // page_size, h)
  (none below 0), each a cached page of that identity whose *anchor* (the slot
  the first full group held for the same page when it was registered) is the
  very page the full group just confirmed; in a pool of sliding groups only the
  parent's chained hash stands in for the anchor, which identity equality
  already implies. The hit is the largest h every group can serve. The
  admission then holds in a sliding group no page before that first kept page,
  takes [first, h) from the group's cache and allocates the rest; in the full
  group it takes 0..h-1. cached_tokens = h * page_size. After the step each
  group registers the admission's full prompt pages it holds whose identity it
  does not cache yet. A page whose last owner leaves (a free, a window release)
  stays cached while registered, stamped with the step that released it; an
  allocation uses a clean free slot while one is left and only then evicts a
  cached page (docs/ARCHITECTURE.md, "Eviction order"): a *leaf* (no registered
  page was registered under it as its parent page, with that parent registered
  at the time), the one released longest ago, the lower real slot first among
  those released by the same step. Evicting a page unlinks it from its parent
  (which may become a leaf). Only when no cached free page is a leaf (a sliding
  group whose dependants are still in use) is the oldest inner page evicted by
  the same order, and the pages registered under it stop counting as its
  dependants.
- An admitted token whose page a sliding group does not hold (a cached token
  before the group's first kept page) has no slot in that group: its
  `new_slots` entry is (None, offset).
- Stats: a pool gives one number each for prefix_cache_hits (pages served from
  the cache), prefix_cache_evictions and cached_slots, all three of one layer
  group's cache: the first full-attention group (group 0 in a pool of sliding
  groups only), as the PoolStats comments say; per-group hit counts are metrics.
- Block tables: row b, column j is page j of the sequence (absolute page
  position), -1 where a sliding window released it and past the row's end; as
  wide as the longest row (ceil(n / page_size) of the longest sequence).

- Page generations (docs/ARCHITECTURE.md "Page generations"): a slot's
  generation counts the pages it has held, that is its allocations (a new page,
  a copy-on-write target, a page taken after evicting a cached one), from the
  pool's seed: the k-th allocation of a slot hands out ((seed + k - 1) mod
  (2^32 - 1)) + 1 (so never 0), seed = the incarnation's low 32 bits XOR its high
  32 bits. A fork or a prefix-cache hit adds an owner to a page and leaves the
  generation alone. Every page a reply names carries the generation its slot had
  when the page was allocated, and a page held from an earlier reply is stale
  exactly when its slot has been allocated again since. A pool created again
  starts from its new incarnation's seed. `Generations` below.

Slots here are abstract ids: which physical slot the allocator picks is its
choice. Every page allocated by a step gets a fresh id (listed in
`Outcome.pending`); the caller binds ids to real slots and checks that exactly
the evicted cached slots (`Outcome.evicted`) were reused. `pos(g, slot)`, set by
the caller, answers which physical slot an id was bound to; the prefix cache's
parent-slot and anchor rules, and the eviction order's ties, are about physical
slots, so they compare through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvservice.contract.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted


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
    new_slots: list[list[tuple[int | None, int]]]  # per group: (slot or None, offset in page) per new token


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
        # per group: identity (ns, tokens up to the page's end) -> (slot, parent slot in a full group,
        # anchor slot of the first full group in a sliding one, None for page 0 or without a full group)
        self.cache: list[dict[tuple, tuple[int, int | None]]] = [{} for _ in range(groups)]
        self.key_of: list[dict[int, tuple]] = [{} for _ in range(groups)]     # registered slot -> its identity
        self.under: list[dict[int, int]] = [{} for _ in range(groups)]       # registered slot -> the parent page
        #                                                                      it depends on (eviction order)
        self.hits = [0] * groups            # per group: pages admissions took from its cache
        self.evictions = [0] * groups       # per group: cached pages evicted for new ones
        self.limited = 0                    # hits the sliding groups cut below the full chain (or the limit)
        self.steps = self.admitted = self.refused = 0
        self.peak = 0
        self.generation = 0

    def copy(self) -> _State:
        s = _State(0)
        s.seqs = {i: q.copy() for i, q in self.seqs.items()}
        s.refs = [dict(r) for r in self.refs]
        s.lru = [dict(x) for x in self.lru]
        s.cache = [dict(c) for c in self.cache]
        s.key_of = [dict(k) for k in self.key_of]
        s.under = [dict(u) for u in self.under]
        s.hits, s.evictions = list(self.hits), list(self.evictions)
        s.steps, s.admitted, s.refused, s.limited = self.steps, self.admitted, self.refused, self.limited
        s.peak = self.peak
        s.generation = self.generation
        return s


class Generations:
    """Page generations in plain dicts, from the rule in the module docstring: per layer group, physical slot ->
    allocations so far, and page (the model's abstract slot id) -> the generation it was allocated with.
    The caller says which physical slot each new page took (`allocated`), since only it knows."""

    def __init__(self, groups: int, incarnation: int = 0) -> None:
        self.seed = (incarnation ^ (incarnation >> 32)) & 0xFFFFFFFF
        self.count: list[dict[int, int]] = [{} for _ in range(groups)]    # physical slot -> allocations
        self.of: list[dict[int, int]] = [{} for _ in range(groups)]       # page -> its generation

    def _value(self, k: int) -> int:
        return self.seed if k == 0 else (self.seed + k - 1) % (2**32 - 1) + 1

    def allocated(self, g: int, page: int, slot: int) -> None:
        self.count[g][slot] = self.count[g].get(slot, 0) + 1
        self.of[g][page] = self._value(self.count[g][slot])

    def generation(self, g: int, page: int) -> int:
        """The generation a reply sends with `page`."""
        return self.of[g][page]

    def slot(self, g: int, slot: int) -> int:
        """A physical slot's generation now (the seed: never allocated)."""
        return self._value(self.count[g].get(slot, 0))

    def stale(self, g: int, page: int, slot: int) -> bool:
        """True once `slot`, which held `page`, holds a newer page: a table naming `page` must not be read."""
        return self.slot(g, slot) != self.of[g][page]


class RefPool:
    """The model. windows[g] is group g's sliding window (0 = full attention).

    num_slots: slots of every group, or of each group (the plan sizes each layer group on its own:
    a sliding group may hold fewer than a full one). A step any group cannot serve is refused.
    """

    def __init__(self, page_size: int, windows: list[int] | tuple[int, ...], num_slots: int | list[int],
                 max_seq_len: int, prefix_caching: bool = False) -> None:
        self.ps = page_size
        self.windows = list(windows)
        self.slots = list(num_slots) if isinstance(num_slots, list | tuple) else [num_slots] * len(self.windows)
        assert len(self.slots) == len(self.windows), "one slot count per layer group"
        self.num_slots = max(self.slots)
        self.max_seq_len = max_seq_len
        self.prefix_caching = prefix_caching
        self.s = _State(len(self.windows))
        full = [g for g, w in enumerate(self.windows) if not w]
        self.anchor = full[0] if full else None     # the first full group (its pages anchor sliding hits)
        self._stat_group = 0 if self.anchor is None else self.anchor   # the group PoolStats describes
        self._next_slot = 0
        self.pos = lambda g, slot: slot          # physical slot of an id; the differential test sets it

    def reset(self) -> None:
        """The pool was deleted and created again: no sequences, nothing cached, every counter at 0. Abstract slot
        ids keep counting (a page of the old pool is never a page of the new one)."""
        self.s = _State(len(self.windows))

    # ---- read-only views -----------------------------------------------------------------
    @property
    def groups(self) -> int:
        return len(self.windows)

    def clean(self, g: int, s: _State | None = None) -> int:
        s = s or self.s
        return self.slots[g] - len(s.refs[g]) - len(s.lru[g])

    def eviction_order(self, g: int, s: _State | None = None) -> list[int]:
        """The cached free pages of group g in the order allocations would evict them from now on."""
        s = s or self.s
        lru, under = dict(s.lru[g]), dict(s.under[g])
        out = []
        while lru:
            victim = self._victim(g, lru, under)
            self._unlink(under, victim)
            del lru[victim]
            out.append(victim)
        return out

    def _victim(self, g: int, lru: dict[int, int], under: dict[int, int]) -> int:
        """Of the cached free pages (slot -> step released), the one evicted next: leaves first, oldest, lower slot."""
        inner = set(under.values())
        leaves = [x for x in lru if x not in inner]
        return min(leaves or list(lru), key=lambda x: (lru[x], self.pos(g, x)))

    @staticmethod
    def _unlink(under: dict[int, int], victim: int) -> None:
        """The victim's page is gone: it no longer depends on its parent, and nothing depends on it."""
        under.pop(victim, None)
        for child in [c for c, p in under.items() if p == victim]:
            del under[child]

    def num_free(self, g: int) -> int:
        return self.slots[g] - len(self.s.refs[g])

    def live(self) -> list[int]:
        return sorted(self.s.seqs)

    def stats(self) -> dict[str, int]:
        s = self.s
        return {"steps": s.steps, "admitted": s.admitted, "refused": s.refused,
                "num_sequences": len(s.seqs), "num_tokens": sum(q.n for q in s.seqs.values()),
                "num_free_slots": min(self.num_free(g) for g in range(self.groups)),
                "peak_used_slots": s.peak,
                "prefix_cache_hits": s.hits[self._stat_group] if self.prefix_caching else 0,
                "prefix_cache_evictions": s.evictions[self._stat_group] if self.prefix_caching else 0,
                "cached_slots": len(s.lru[self._stat_group]) if self.prefix_caching else 0}

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
            victim = self._victim(g, s.lru[g], s.under[g])
            self._unlink(s.under[g], victim)
            del s.lru[g][victim]
            key = s.key_of[g].pop(victim)
            del s.cache[g][key]
            s.evictions[g] += 1
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
            if slot in s.key_of[g]:
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
        # 3. prefix-cache hits of the admissions, decided (and pinned) before any page is allocated
        prompts = self._prompts(st)
        hit_slots: list[list[list[int | None]]] = []        # per admission, per group: page -> slot (None: not held)
        hit_pages: list[int] = []                           # per admission: h
        for (_, n), prompt in zip(st.adm, prompts, strict=True):
            h, taken = self._lookup(s, n, prompt) if prompt is not None else (0, [[] for _ in range(G)])
            hit_pages.append(h)
            for g in range(G):
                for x in taken[g]:
                    if x is not None:
                        self._share(s, g, x)
                        s.hits[g] += 1
            hit_slots.append(taken)
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
        for (i, n), taken in zip(st.adm, hit_slots, strict=True):
            q = Seq(n, [0] * G, [[] for _ in range(G)])
            for g in range(G):
                q.pages[g] = list(taken[g])
                q.first[g] = sum(x is None for x in taken[g])      # a sliding group: its first kept page
                while len(q.pages[g]) < cdiv(n, ps):
                    q.pages[g].append(self._new_slot(s, g, pending[g], evicted[g]))
            s.seqs[i] = q
        # 6. registration of the admissions' full prompt pages, in every group that holds them
        for (i, n), prompt in zip(st.adm, prompts, strict=True):
            if prompt is None:
                continue
            ns, toks = prompt
            q = s.seqs[i]
            for g in range(G):
                for j in range(q.first[g], n // ps):
                    key = (ns, tuple(toks[:(j + 1) * ps]))
                    if key in s.cache[g]:
                        continue                  # this identity is cached already (here: this very page)
                    if not self.windows[g]:
                        link = q.pages[g][j - 1] if j else None
                    else:
                        link = q.pages[self.anchor][j] if self.anchor is not None else None
                    s.cache[g][key] = (q.pages[g][j], link)
                    s.key_of[g][q.pages[g][j]] = key
                    parent = q.pages[g][j - 1] if j > q.first[g] else None     # this group's page j - 1
                    if parent is not None and parent in s.key_of[g]:
                        s.under[g][q.pages[g][j]] = parent
        # the reply
        rows = [self._emit(s, i, olds[i], k) for i, k in st.ext]
        rows += [self._emit(s, i, 0, n) for i, n in st.adm]
        rows += [self._emit(s, c, s.seqs[c].n, 0) for _, c in st.forks]
        cached = [h * ps for h in hit_pages] if st.adm else None
        num_free = min(self.slots[g] - len(s.refs[g]) for g in range(G))
        return Outcome(rows, copies, cached, pending, evicted, num_free, released)

    def _lookup(self, s: _State, n: int, prompt: tuple[tuple[str, str], list[int]]
                ) -> tuple[int, list[list[int | None]]]:
        """An admission's hit h and, per group, the slots of its pages [0, h) (None below a window's first page)."""
        ps, (ns, toks) = self.ps, prompt
        limit = (n - 1) // ps

        def key(j: int) -> tuple:
            return ns, tuple(toks[:(j + 1) * ps])

        # full groups: the longest chain of pages confirmed by identity and parent slot
        chain: dict[int, list[int]] = {}
        bound = limit
        for g, w in enumerate(self.windows):
            if w:
                continue
            got: list[int] = []
            while len(got) < limit:
                entry = s.cache[g].get(key(len(got)))
                if entry is None:
                    break
                slot, parent = entry
                want = got[-1] if got else None
                if (parent is None) != (want is None) or \
                        (want is not None and self.pos(g, parent) != self.pos(g, want)):
                    break
                got.append(slot)
            chain[g] = got
            bound = min(bound, len(got))

        def first(g: int, h: int) -> int:
            return max(0, (h * ps + 1 - self.windows[g]) // ps)

        def serves(g: int, h: int) -> bool:
            for j in range(first(g, h), h):
                entry = s.cache[g].get(key(j))
                if entry is None:
                    return False
                if self.anchor is not None and \
                        self.pos(self.anchor, entry[1]) != self.pos(self.anchor, chain[self.anchor][j]):
                    return False
            return True

        h = bound
        while h and not all(serves(g, h) for g, w in enumerate(self.windows) if w):
            h -= 1
        s.limited += h < bound
        taken: list[list[int | None]] = []
        for g, w in enumerate(self.windows):
            if not w:
                taken.append(list(chain[g][:h]))
            else:
                lo = first(g, h)
                taken.append([None] * lo + [s.cache[g][key(j)][0] for j in range(lo, h)])
        return h, taken

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
