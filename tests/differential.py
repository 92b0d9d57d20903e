"""Differential testing of a pool against tests/refmodel.py: random op sequences, full comparison, shrinking.

A run drives one real pool (in-process `kvservice.core.pool.Pool`, or the real server
over gRPC) and the reference model through the same random Steps. After every
Step it compares everything the reply carries (batch order, token counts,
new-token indptr, every slot mapping, every index space's CSR and block table,
copy-on-write pairs, cached tokens, free count) and the pool's stats; in-process
it also compares every sequence's slots, first held page, every slot's refcount,
the free set and the LRU order of cached slots. A refused Step must raise the
same domain error class in both and change nothing.

Page generations (refmodel.Generations): every generation a reply carries (per
new token, per table entry, per copy-on-write pair) must be the model's, and
in-process every slot's generation too; pages of earlier replies are kept (a
bounded sample) and, after every op, a page must look stale to the pool's
generations (its slot's generation moved on) exactly when the model says its
slot was allocated again. `Recreate` deletes the pool and creates it again under
the same name: every later reply must carry a new incarnation, never one seen
before in the run, and the model starts afresh.

Slots: the model's slots are abstract. `Binder` keeps, per layer group, a
bijection model slot <-> real slot, established from the reply when the model
allocates, and checks it everywhere after: a real slot is bound to at most one
live model slot, a new page never takes a slot that stays owned or cached, and
the cached slots the model evicts are exactly the ones the pool reused.

Prefix caching is covered on full-only, hybrid (full + sliding groups, per_layer
and interleaved) and sliding-only pools; prompts come from a few shared prefixes
with random tails, salts and extra keys, so hits, hits cut short by a window
group's cache, and evictions all happen.

On a mismatch `shrink` removes ops (chunks, then single ops, then single list
entries inside a Step) while the run still fails, and `repro` prints the result
as code that can be pasted into a test (see `replay`).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from kvservice.contract.errors import AlreadyExists, InvalidArgument, KVError, NotFound, ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.allocator import generation_seed
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.manager import replies

from .refmodel import Generations, Outcome, RefPool, Row, Step, cdiv


class Mismatch(AssertionError):
    """The real pool and the model disagree."""


@dataclass(frozen=True)
class Kind:
    """A pool configuration the differential test covers."""

    name: str
    spec: CacheSpec
    num_slots: int
    max_seq_len: int
    prefix_caching: bool = False
    group_slots: tuple[int, ...] = ()     # slots per layer group (a sliding group smaller than a full one)

    @property
    def sizing(self) -> Sizing:
        return Sizing(num_slots=self.num_slots, max_seq_len=self.max_seq_len, group_slots=self.group_slots)


@dataclass(frozen=True)
class Recreate:
    """Delete the pool and create it again under the same name and geometry (a new incarnation)."""

    ids: tuple = ()

    def ops(self) -> int:
        return 0

    def literal(self) -> str:
        return "Recreate()"


@dataclass(frozen=True)
class Query:
    """A read of page tables (Pool.tables_for) for some ids, in-process only."""

    ids: list[int]
    block_table: bool = True

    def ops(self) -> int:
        return 0

    def literal(self) -> str:
        return f"Query({self.ids!r}, block_table={self.block_table})"


KINDS = {k.name: k for k in (
    Kind("uniform", CacheSpec((LayerSpec(2, 64),) * 2, 4, "per_layer"), 40, 64),
    Kind("sliding", CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=6), LayerSpec(1, 32),
                               LayerSpec(2, 64, sliding_window=13)), 4, "per_layer"), 36, 72),
    Kind("interleaved", CacheSpec((LayerSpec(1, 64), LayerSpec(1, 128), LayerSpec(2, 32), LayerSpec(1, 128)),
                                  8, "interleaved"), 32, 96),
    Kind("hybrid", CacheSpec((LayerSpec(1, 128, sliding_window=10), LayerSpec(1, 64), LayerSpec(2, 64),
                              LayerSpec(1, 32, sliding_window=10), LayerSpec(1, 256)), 4, "interleaved"), 40, 64),
    Kind("prefix", CacheSpec((LayerSpec(1, 64),) * 2, 4, "per_layer"), 36, 64, prefix_caching=True),
    Kind("prefix_interleaved", CacheSpec((LayerSpec(1, 64), LayerSpec(2, 128)), 3, "interleaved"), 40, 48,
         prefix_caching=True),
    # Prefix caching on hybrid pools: every group its own cache, a hit is what every group can serve.
    Kind("prefix_hybrid", CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=6), LayerSpec(1, 32),
                                     LayerSpec(2, 64, sliding_window=13)), 4, "per_layer"), 36, 72,
         prefix_caching=True),
    # group 0 slides here, so the anchoring full group is group 1
    Kind("prefix_hybrid_interleaved", CacheSpec((LayerSpec(1, 128, sliding_window=10), LayerSpec(1, 64),
                                                 LayerSpec(2, 64), LayerSpec(1, 32, sliding_window=5),
                                                 LayerSpec(1, 256)), 4, "interleaved"), 40, 64,
         prefix_caching=True),
    Kind("prefix_sliding_only", CacheSpec((LayerSpec(1, 64, sliding_window=6), LayerSpec(2, 32, sliding_window=9),
                                           LayerSpec(1, 64, sliding_window=6)), 4, "per_layer"), 32, 64,
         prefix_caching=True),
    # Groups sized to what they need (planner.py): the sliding groups hold fewer slots than the full group,
    # so a step is refused by whichever group runs out first (admission control exact per group).
    Kind("sized_hybrid", CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=6), LayerSpec(1, 32),
                                    LayerSpec(2, 64, sliding_window=13)), 4, "per_layer"), 40, 72,
         group_slots=(40, 14, 20)),
    Kind("prefix_sized_hybrid", CacheSpec((LayerSpec(1, 128, sliding_window=10), LayerSpec(1, 64), LayerSpec(2, 64),
                                           LayerSpec(1, 32, sliding_window=5), LayerSpec(1, 256)), 4, "interleaved"),
         40, 64, prefix_caching=True, group_slots=(28, 40, 22)),
    # a K-only (multi-head latent attention) layer beside K/V layers
    Kind("latent", CacheSpec((LayerSpec(1, 576, "bfloat16", k_only=True), LayerSpec(1, 64, "bfloat16"),
                              LayerSpec(1, 576, "bfloat16", 8, k_only=True)), 4, "interleaved"), 36, 64,
         group_slots=(36, 16)),
)}


def make_pool(kind: Kind) -> Pool:
    return Pool(kind.name, plan(kind.spec, kind.sizing), prefix_caching=kind.prefix_caching)


def make_model(kind: Kind) -> RefPool:
    geo = plan(kind.spec, kind.sizing).geometry
    return RefPool(kind.spec.page_size, [g.sliding_window for g in geo.groups], list(geo.group_slots),
                   kind.max_seq_len, kind.prefix_caching)


# ---- replies in one shape, whatever the transport ---------------------------------------------
@dataclass
class SpaceReply:
    id: int
    group: int
    scale: int
    offset: int
    upper_bound: int
    slot_mapping: np.ndarray
    indptr: np.ndarray | None
    indices: np.ndarray | None
    last_page_len: np.ndarray | None
    block_table: np.ndarray | None
    generations: np.ndarray | None = None         # uint32 [nnz], parallel to indices
    slot_generations: np.ndarray | None = None    # uint32 [num_new_tokens]


@dataclass
class Reply:
    seq_ids: np.ndarray
    num_tokens: np.ndarray
    new_token_indptr: np.ndarray
    spaces: list[SpaceReply]          # index-space order
    copies: list[np.ndarray]          # per group [n, 2]
    cached_tokens: np.ndarray | None
    num_free: int
    layer_index_space: list[int] | None = None
    copy_generations: list[np.ndarray] | None = None   # per group uint32 [n, 2]
    incarnation: int = 0


def _space(sp) -> SpaceReply:
    t = sp.table
    return SpaceReply(sp.space.id, sp.space.group, sp.space.scale, sp.space.offset, sp.space.upper_bound,
                      sp.slot_mapping, None if t is None else t.indptr, None if t is None else t.indices,
                      None if t is None else t.last_page_len, sp.block_table, sp.generations, sp.slot_generations)


def _arr(xs, dtype=np.int64) -> np.ndarray:
    return np.asarray(list(xs), dtype=dtype)


class InProcess:
    """Drives kvservice.core.pool.Pool directly; can read its whole state."""

    full_state = True

    def __init__(self, kind: Kind, fast: bool = True) -> None:
        self.kind, self.fast = kind, fast
        self.fast_steps = 0
        self.lean_steps = 0
        self.incarnation = 0
        self.recreate()

    def recreate(self) -> None:
        """A new pool of the same kind (the manager numbers incarnations; here a counter stands in)."""
        self.pool = make_pool(self.kind)
        self.incarnation = (self.incarnation * 6364136223846793005 + 1442695040888963407) % 2**63 or 1   # as random
        self.pool.incarnation = self.incarnation
        for a in self.pool.allocators:                            # as BlockManager.create_pool does
            a.generation[:] = generation_seed(self.incarnation)
        self.pool._fast = self.fast
        self.groups = len(self.pool.allocators)
        general = getattr(self.pool, "_decode_step", None)
        if general is not None:                  # count the decode fast path's answers

            def counted(*a):
                r = general(*a)
                self.fast_steps += r is not None
                return r

            self.pool._decode_step = counted
        lean = getattr(self.pool, "_full_group_step", None)
        if lean is not None:                     # count the one-full-group path's answers

            def counted_lean(*a):
                r = lean(*a)
                self.lean_steps += r is not None
                return r

            self.pool._full_group_step = counted_lean

    def step(self, st: Step) -> Reply:
        p = self.pool
        r = p.step(free_ids=_arr(st.free) if st.free else None,
                   extend_ids=_arr(i for i, _ in st.ext) if st.ext else None,
                   extend_tokens=_arr(k for _, k in st.ext) if st.ext else None,
                   admit_ids=_arr(i for i, _ in st.adm) if st.adm else None,
                   admit_tokens=_arr(n for _, n in st.adm) if st.adm else None,
                   tables=st.tables, block_table=st.block_table,
                   fork_parents=_arr(q for q, _ in st.forks) if st.forks else None,
                   fork_children=_arr(c for _, c in st.forks) if st.forks else None,
                   admit_token_ids=None if st.token_ids is None else _arr(st.token_ids),
                   admit_salts=st.salts, admit_extra_keys=st.keys)
        return Reply(r.seq_ids, r.num_tokens, r.new_token_indptr, [_space(sp) for sp in r.tables], list(r.copies),
                     r.cached_tokens, r.num_free_slots, copy_generations=[p.allocators[g].generation.take(c) for g, c in
                                                                         enumerate(r.copies)],
                     incarnation=p.incarnation)

    def generation(self, g: int, slot: int) -> int:
        return int(self.pool.allocators[g].generation[slot])

    def query(self, q: Query) -> list[SpaceReply]:
        return [_space(sp) for sp in self.pool.tables_for(_arr(q.ids, np.uint64), block_table=q.block_table)]

    def stats(self):
        return replies.pool_stats(self.pool)

    def snapshot(self) -> tuple:
        p = self.pool
        ids, toks = p.sequences()
        return (ids.tolist(), toks.tolist(),
                [[p.sequence_slots(i, g).tolist() for g in range(self.groups)] for i in ids.tolist()],
                [[p.first_page(i, g) for g in range(self.groups)] for i in ids.tolist()],
                [a.refcount(np.arange(a.num_slots)).tolist() for a in p.allocators],
                [a.free_slots().tolist() for a in p.allocators])


class OverGrpc:
    """Drives a pool of a real server through clients.BlockManagerClient."""

    full_state = False

    def __init__(self, client, name: str, kind: Kind | None = None) -> None:
        self.client, self.name, self.kind = client, name, kind

    def recreate(self) -> None:
        """DeletePool then CreatePool under the same name and geometry."""
        k = self.kind
        self.client.delete_pool(self.name, force=True)
        self.client.create_pool(self.name, k.spec, k.sizing, prefix_caching=k.prefix_caching)

    def step(self, st: Step) -> Reply:
        from kvservice.client.codec import ClientError

        try:
            r = self.client.step(self.name, free=st.free or None, extend=[i for i, _ in st.ext] or None,
                                 extend_tokens=[k for _, k in st.ext] or None,
                                 admit=[i for i, _ in st.adm] or None, admit_tokens=[n for _, n in st.adm] or None,
                                 tables=st.tables, block_table=st.block_table, fork=st.forks or None,
                                 admit_token_ids=st.token_ids, salts=st.salts, extra_keys=st.keys)
        except ClientError as e:
            cls = _CODE_ERRORS.get(e.code.name)
            if cls is None:
                raise Mismatch(f"server answered {e.code.name}: {e.message}") from e
            raise cls(e.message) from e
        groups = 1 + max(sp.space.group for sp in r.tables.values())
        copies = [(r.copies or {}).get(g, np.zeros((0, 2), np.int64)) for g in range(groups)]
        gens = None if r.copy_generations is None else \
            [r.copy_generations.get(g, np.zeros((0, 2), np.uint32)) for g in range(groups)]
        return Reply(r.seq_ids, r.num_tokens, r.new_token_indptr, [_space(r.tables[k]) for k in sorted(r.tables)],
                     copies, r.cached_tokens, r.num_free_slots, list(r.layer_index_space), gens, r.pool_incarnation)

    def stats(self):
        return self.client.stats(self.name)[self.name]


_CODE_ERRORS = {"INVALID_ARGUMENT": InvalidArgument, "NOT_FOUND": NotFound, "ALREADY_EXISTS": AlreadyExists,
                "RESOURCE_EXHAUSTED": ResourceExhausted}


# ---- the bijection and the comparisons --------------------------------------------------------
def _eq(what: str, got, want) -> None:
    if got != want:
        raise Mismatch(f"{what}: pool {got}, model {want}")


#: Check the slot mapping of cached tokens a sliding group does not hold (Binder.check_unheld). Off
#: until the pool stops mapping them to other rows' pages; turn it on with that fix.
CHECK_UNHELD = True


class Binder:
    """Per layer group: model slot -> real slot (kept after death: pos() answers for the prefix rule)."""

    def __init__(self, kind: Kind, model: RefPool, check_unheld: bool | None = None) -> None:
        self.unheld_checked = CHECK_UNHELD if check_unheld is None else check_unheld
        geo = plan(kind.spec, kind.sizing).geometry
        self.geo, self.model, self.ps = geo, model, kind.spec.page_size
        self.spaces = geo.index_spaces
        self.bind: list[dict[int, int]] = [{} for _ in geo.groups]
        self.gens = Generations(len(geo.groups))
        self.kept: list[tuple[int, int, int, int]] = []     # pages of earlier replies: (group, page, slot, generation)
        self.incarnations: list[int] = []                   # every incarnation replies carried, in order
        self.stale_seen = 0                                 # kept pages found stale (slot allocated again)
        model.pos = lambda g, m: self.bind[g][m]

    def reset(self) -> None:
        """The pool was created again: nothing is bound, every slot is at generation 0, a new incarnation."""
        groups = len(self.geo.groups)
        self.bind = [{} for _ in range(groups)]
        self.gens = Generations(groups)
        self.kept = []
        self.incarnations.append(0)                         # the next reply names the new one

    def base(self, space) -> int:
        return getattr(space, "base", 0)

    def page(self, space, slot: int) -> int:
        return self.base(space) + slot * space.scale + space.offset

    def real_slot(self, space, page: int, what: str) -> int:
        rel = page - self.base(space) - space.offset
        if rel % space.scale or not 0 <= rel // space.scale < self.geo.groups[space.group].num_slots:
            raise Mismatch(f"{what}: page {page} is not a page of index space {space.id}")
        return rel // space.scale

    def check_unheld(self, space, v: int, what: str) -> None:
        """A cached token before a sliding group's first kept page: the group holds no page for it.

        The docs give it no page (a cached token is neither recomputed nor appended), so its slot
        mapping may name no page of the pool: any page it named would be one that another sequence
        or the cache holds, or one of another index space. Which value the pool sends instead is not
        documented beyond that (vLLM pads with slot -1; the pool sends SKIP_SLOT, -1). The pool once sent
        other rows' slots; CHECK_UNHELD keeps this check on in every random run, and
        tests/unit/test_differential.py::test_cached_tokens_a_window_does_not_hold_name_no_page is the repro.
        """
        if self.unheld_checked and 0 <= v // self.ps < self.geo.pool_pages:
            raise Mismatch(f"{what}: slot_mapping {v} names page {v // self.ps} of the pool, but the group holds "
                           f"no page for this cached token")

    def live(self, g: int) -> set[int]:
        s = self.model.s
        return set(s.refs[g]) | set(s.lru[g])

    def check_reply(self, out: Outcome, r: Reply, st: Step | None) -> None:
        ps, G = self.ps, len(self.geo.groups)
        _eq("seq_ids", r.seq_ids.tolist(), [row.seq_id for row in out.rows])
        _eq("seq_ids dtype", r.seq_ids.dtype.name, "uint64")
        _eq("num_tokens", r.num_tokens.tolist(), [row.num_tokens for row in out.rows])
        ind = [0]
        for row in out.rows:
            ind.append(ind[-1] + row.new)
        _eq("new_token_indptr", r.new_token_indptr.tolist(), ind)
        _eq("spaces", [(s.id, s.group, s.scale, s.offset, s.upper_bound) for s in r.spaces],
            [(s.id, s.group, s.scale, s.offset, s.upper_bound) for s in self.spaces])
        self.check_incarnation(r.incarnation)
        if r.layer_index_space is not None:
            _eq("layer_index_space", r.layer_index_space, self.geo.layer_space.tolist())
        # 1. bind the step's new slots from the slot mappings, consistently over every space of the group
        tentative: list[dict[int, int]] = [{} for _ in range(G)]
        for sp, space in zip(r.spaces, self.spaces, strict=True):
            g = space.group
            sm = sp.slot_mapping
            _eq(f"space {space.id} slot_mapping dtype", sm.dtype.name, "int64")
            _eq(f"space {space.id} slot_mapping length", len(sm), ind[-1])
            sm = sm.tolist()
            pend = set(out.pending[g])
            for b, row in enumerate(out.rows):
                for t, (m, off) in enumerate(row.new_slots[g]):
                    v = sm[ind[b] + t]
                    what = f"space {space.id} row {b} (seq {row.seq_id}) new token {t}"
                    if m is None:
                        self.check_unheld(space, v, what)
                        continue
                    _eq(f"{what}: offset in page", v % ps, off)
                    real = self.real_slot(space, v // ps, what)
                    if m in pend:
                        if tentative[g].setdefault(m, real) != real:
                            raise Mismatch(f"{what}: one new page at real slots {tentative[g][m]} and {real}")
                    elif self.bind[g].get(m) != real:
                        raise Mismatch(f"{what}: slot_mapping {v} is real slot {real}, but the model's page is "
                                       f"real slot {self.bind[g].get(m)} (model slot {m})\n"
                                       f"  full slot_mapping {sm}, new_token_indptr {ind}")
        for g in range(G):
            self._bind_new(g, out, tentative[g])
        # 1b. the generation of every new token's page (0 where its group holds no page)
        for sp, space in zip(r.spaces, self.spaces, strict=True):
            g = space.group
            want = [0 if m is None else self.gens.generation(g, m) for row in out.rows for m, _ in row.new_slots[g]]
            if sp.slot_generations is None:
                raise Mismatch(f"space {space.id}: no slot_generations")
            _eq(f"space {space.id} slot_generations", sp.slot_generations.tolist(), want)
            _eq(f"space {space.id} slot_generations dtype", sp.slot_generations.dtype.name, "uint32")
        # 2. copies
        for g in range(G):
            got = r.copies[g].tolist() if g < len(r.copies) else []
            _eq(f"group {g} copies", [tuple(x) for x in got],
                [(self.bind[g][s], self.bind[g][d]) for s, d in out.copies[g]])
            if r.copy_generations is None:
                raise Mismatch("no copy generations")
            got = r.copy_generations[g].tolist() if g < len(r.copy_generations) else []
            _eq(f"group {g} copy generations", [tuple(x) for x in got],
                [(self.gens.generation(g, s), self.gens.generation(g, d)) for s, d in out.copies[g]])
        # 3. tables
        self.check_tables(out.rows, r.spaces, tables=st.tables if st else True,
                          block_table=st.block_table if st else True)
        if out.cached_tokens is None:
            _eq("cached_tokens", [] if r.cached_tokens is None else r.cached_tokens.tolist(), [])
        else:
            _eq("cached_tokens", None if r.cached_tokens is None else r.cached_tokens.tolist(), out.cached_tokens)
        _eq("num_free_slots", int(r.num_free), out.num_free)
        self.keep_pages(out.rows)

    def check_incarnation(self, inc: int) -> None:
        """Replies of one pool carry one incarnation, a re-created pool a new one never seen before; generations
        start from its seed (refmodel.Generations)."""
        if not self.incarnations or self.incarnations[-1] == 0:
            _eq("a new incarnation (never seen in this run)", inc in self.incarnations or inc == 0, False)
            if self.incarnations:
                self.incarnations[-1] = inc
            else:
                self.incarnations.append(inc)
            self.gens.seed = Generations(0, inc).seed
        else:
            _eq("pool incarnation", inc, self.incarnations[-1])

    def keep_pages(self, rows: list[Row]) -> None:
        """Keep the last page of every row (and the first) of this reply to check later whether it went stale."""
        for row in rows:
            for g, held in enumerate(row.held):
                for m in {held[0], held[-1]} if held else ():
                    self.kept.append((g, m, self.bind[g][m], self.gens.generation(g, m)))
        del self.kept[:-96]

    def check_kept(self, generation: Callable[[int, int], int]) -> None:
        """Each kept page looks stale to the pool's generations (generation(group, slot)) exactly when the model
        says its slot was allocated again since."""
        for g, m, slot, gen in self.kept:
            stale = self.gens.stale(g, m, slot)
            self.stale_seen += stale
            _eq(f"group {g} page of model slot {m} (real slot {slot}, generation {gen}) stale",
                generation(g, slot) != gen, stale)

    def _bind_new(self, g: int, out: Outcome, tentative: dict[int, int]) -> None:
        missing = [m for m in out.pending[g] if m not in tentative]
        if missing:
            raise Mismatch(f"group {g}: model slots {missing} got no new token (model error)")
        reals = list(tentative.values())
        if len(set(reals)) != len(reals):
            raise Mismatch(f"group {g}: one real slot handed out twice in a step: {sorted(reals)}")
        for m, real in tentative.items():
            self.gens.allocated(g, m, real)
        # A new page may not take a slot that stays owned or cached after this step.
        stay = {self.bind[g][m]: m for m in self.live(g) if m not in tentative}
        taken = sorted(r for r in reals if r in stay)
        if taken:
            raise Mismatch(f"group {g}: new pages took real slots {taken}, which the model says stay owned or "
                           f"cached (model slots {[stay[r] for r in taken]})")
        want_evicted = sorted(self.bind[g][e] for e in out.evicted[g])
        reused = sorted(r for r in want_evicted if r in set(reals))
        _eq(f"group {g}: cached slots evicted and reused (oldest released first)", reused, want_evicted)
        self.bind[g].update(tentative)
        # The bijection: live model slots map to distinct real slots.
        live = self.live(g)
        real = [self.bind[g][m] for m in live]
        if len(set(real)) != len(real):
            raise Mismatch(f"group {g}: two live model slots share a real slot")

    def rows_expected(self, rows: list[Row], space) -> tuple[list[int], list[int], list[int], list[list[int]]]:
        g, ps = space.group, self.ps
        indptr, indices, lpl, block = [0], [], [], []
        width = max((cdiv(row.num_tokens, ps) for row in rows), default=0)
        for row in rows:
            pages = [self.page(space, self.bind[g][m]) for m in row.held[g]]
            indices += pages
            indptr.append(len(indices))
            lpl.append(row.num_tokens - (cdiv(row.num_tokens, ps) - 1) * ps)
            block.append([-1] * row.first[g] + pages + [-1] * (width - row.first[g] - len(pages)))
        return indptr, indices, lpl, block

    def check_tables(self, rows: list[Row], spaces: list[SpaceReply], tables: bool, block_table: bool) -> None:
        for sp, space in zip(spaces, self.spaces, strict=True):
            indptr, indices, lpl, block = self.rows_expected(rows, space)
            what = f"space {space.id} (group {space.group}, scale {space.scale}, offset {space.offset})"
            if tables:
                if sp.indptr is None:
                    raise Mismatch(f"{what}: no CSR table")
                _eq(f"{what} indptr", sp.indptr.tolist(), indptr)
                _eq(f"{what} indices", sp.indices.tolist(), indices)
                _eq(f"{what} last_page_len", sp.last_page_len.tolist(), lpl)
                _eq(f"{what} dtypes", (sp.indptr.dtype.name, sp.indices.dtype.name, sp.last_page_len.dtype.name),
                    (space.index_dtype.name, space.index_dtype.name, "int32"))
                if sp.generations is None:
                    raise Mismatch(f"{what}: no generations beside the indices")
                _eq(f"{what} generations", sp.generations.tolist(),
                    [self.gens.generation(space.group, m) for row in rows for m in row.held[space.group]])
            elif sp.indptr is not None:
                raise Mismatch(f"{what}: a CSR table although tables were omitted")
            if block_table:
                if sp.block_table is None:
                    raise Mismatch(f"{what}: no block table")
                width = max((cdiv(row.num_tokens, self.ps) for row in rows), default=0)
                _eq(f"{what} block_table shape", list(sp.block_table.shape), [len(rows), width])
                _eq(f"{what} block_table", sp.block_table.tolist(), block)
                _eq(f"{what} block_table dtype", sp.block_table.dtype.name, space.index_dtype.name)
            elif sp.block_table is not None:
                raise Mismatch(f"{what}: a block table nobody asked for")

    def check_state(self, drv: InProcess) -> None:
        """The whole in-process pool against the model, through the bijection."""
        p, m = drv.pool, self.model
        ids, toks = p.sequences()
        live = m.live()
        _eq("live sequences", ids.tolist(), live)
        _eq("tokens of live sequences", toks.tolist(), [m.s.seqs[i].n for i in live])
        for g, alloc in enumerate(p.allocators):
            b = self.bind[g]
            for i in live:
                q = m.s.seqs[i]
                _eq(f"seq {i} group {g} slots", p.sequence_slots(i, g).tolist(), [b[x] for x in q.held(g)])
                _eq(f"seq {i} group {g} first page", p.first_page(i, g), q.first[g])
            num_slots = self.geo.groups[g].num_slots
            rc = [0] * num_slots
            for x, c in m.s.refs[g].items():
                rc[b[x]] = c
            _eq(f"group {g} refcounts", alloc.refcount(np.arange(num_slots)).tolist(), rc)
            if self.incarnations and self.incarnations[-1]:          # the seed is known once a reply named it
                _eq(f"group {g} slot generations", alloc.generation.tolist(),
                    [self.gens.slot(g, x) for x in range(num_slots)])
            free = alloc.free_slots().tolist()
            _eq(f"group {g} free slots", sorted(free), [x for x in range(num_slots) if rc[x] == 0])
            lru = m.s.lru[g]
            _eq(f"group {g} cached count", alloc.num_cached, len(lru))
            # The exact eviction order: leaves first, oldest release first, lower slot first.
            _eq(f"group {g} cached slots in eviction order", free[len(free) - len(lru):],
                [b[x] for x in m.eviction_order(g)])
        self.check_kept(drv.generation)

    def check_stats(self, stats) -> None:
        got = {k: int(getattr(stats, k)) for k in self.model.stats()}
        _eq("pool stats", got, self.model.stats())


# ---- random op sequences ----------------------------------------------------------------------
class Gen:
    """Random Steps (and, in-process, table reads) chosen from the model's current state."""

    def __init__(self, kind: Kind, model: RefPool, rng: random.Random, queries: bool, profile: str = "mix") -> None:
        self.kind, self.model, self.rng, self.queries = kind, model, rng, queries
        assert profile in PROFILES, profile
        self.forks_alone = profile == "forks_alone"     # never mix forks with extensions or admissions
        self.no_forks = profile == "no_forks"           # no forks at all: the pool keeps its decode fast path
        self.decode_rate = 0.2 if self.no_forks else 0.08
        self.ps = kind.spec.page_size
        self.next_id = 1
        self.decode_left = 0
        self.until_recreate = rng.randint(200, 500)
        self.last_batch: list[int] = []
        self.dead: list[int] = []
        n = kind.max_seq_len
        self.prompts = [[rng.randrange(1, 50) for _ in range(n)] for _ in range(3)]
        self.prompts.append(self.prompts[0][:2 * self.ps] + [rng.randrange(1, 50) for _ in range(n)])

    def new_id(self) -> int:
        if self.dead and self.rng.random() < 0.1:                   # reuse a freed id
            return self.dead.pop(self.rng.randrange(len(self.dead)))
        self.next_id += 1
        return self.next_id

    def n_tokens(self, big: bool = False) -> int:
        r = self.rng
        if big:
            return r.randint(self.kind.max_seq_len // 2, self.kind.max_seq_len)
        return r.choice((r.randint(1, self.ps), r.randint(1, 3 * self.ps + 1),
                         r.randint(1, self.kind.max_seq_len // 2)))

    def k_tokens(self) -> int:
        r = self.rng
        x = r.random()
        return 1 if x < 0.6 else r.randint(2, self.ps) if x < 0.85 else r.randint(self.ps + 1, 3 * self.ps)

    def room(self, i: int) -> int:
        return self.kind.max_seq_len - self.model.s.seqs[i].n

    def admissions(self, st: Step, count: int, big: bool = False) -> None:
        r = self.rng
        for _ in range(count):
            st.adm.append((self.new_id(), self.n_tokens(big)))
        if self.kind.prefix_caching and r.random() < 0.85:
            toks = []
            for _, n in st.adm:
                base = r.choice(self.prompts)
                cut = n if r.random() < 0.4 else r.randint(0, n)
                toks += base[:cut] + [r.randrange(50, 60) for _ in range(n - cut)]
            st.token_ids = toks
            if r.random() < 0.5:
                st.salts = [r.choice(("", "", "tenant")) for _ in st.adm]
            if r.random() < 0.3:
                st.keys = [r.choice(("", "lora")) for _ in st.adm]

    def next(self) -> Step | Query:
        r, m = self.rng, self.model
        live = m.live()
        if self.decode_left and self.last_batch:
            self.decode_left -= 1
            ks = [1] * len(self.last_batch) if r.random() < 0.8 else [r.randint(1, 3) for _ in self.last_batch]
            return Step(ext=list(zip(self.last_batch, ks, strict=True)), tables=r.random() < 0.9,
                        block_table=r.random() < 0.2)
        if r.random() < self.decode_rate and self.last_batch:
            self.decode_left = r.randint(2, 12)
            return self.next()
        self.until_recreate -= 1
        if self.until_recreate <= 0 and live:            # the pool deleted and created again, every ~350 ops
            self.until_recreate = r.randint(200, 500)
            self.last_batch, self.decode_left, self.dead = [], 0, []
            return Recreate()
        x = r.random()
        if x < 0.06 and self.queries and live:
            ids = r.sample(live, r.randint(1, len(live))) if r.random() < 0.9 else [*live[:1], 10**6]
            return Query(ids, block_table=r.random() < 0.7)
        if x < 0.15:
            return self.invalid(live)
        st = Step(tables=r.random() < 0.9, block_table=r.random() < 0.25)
        crowded = any(m.num_free(g) < m.slots[g] // 3 for g in range(m.groups)) or len(live) > 10
        pool = list(live)
        r.shuffle(pool)
        if pool and (crowded or r.random() < 0.3):
            st.free = [pool.pop() for _ in range(min(len(pool), r.randint(1, 3 if crowded else 1)))]
        if pool and r.random() < 0.35 and not self.no_forks:
            for _ in range(r.randint(1, 3)):
                st.forks.append((r.choice(pool), self.new_id()))
        if pool and r.random() < 0.8 and not (self.forks_alone and st.forks):
            for i in pool[:r.randint(1, min(len(pool), 5))]:
                if self.room(i) > 0:
                    st.ext.append((i, min(self.k_tokens(), self.room(i))))
        if x > 0.95 and not (self.forks_alone and st.forks):
            self.admissions(st, 1, big=True)                 # likely over capacity
        elif self.forks_alone and st.forks:
            pass
        elif r.random() < (0.8 if len(live) < 4 else 0.4):
            self.admissions(st, r.randint(1, 3))
        return st

    def invalid(self, live: list[int]) -> Step:
        r = self.rng
        st = Step()
        if live and r.random() < 0.7:
            st.ext = [(r.choice(live), 1)]
        faults = ["zero_admit", "zero_extend", "dup_admit", "unknown_free", "unknown_extend", "unknown_parent",
                  "past_max_admit"]
        if live:
            faults += ["dup_free_extend", "existing_admit", "existing_child", "parent_freed", "child_extended",
                       "past_max_extend", "negative_extend", "dup_child", "child_is_admit"]
        if self.kind.prefix_caching:
            faults += ["token_ids_short", "salts_count"]
        faults += ["salts_count_no_ids", "keys_count_no_ids"]     # counted on every pool, token ids or not
        f = r.choice(faults)
        i = r.choice(live) if live else 0
        st.ext = [e for e in st.ext if e[0] != i]
        new = self.new_id()
        if f == "zero_admit":
            st.adm = [(new, 0)]
        elif f == "zero_extend":
            st.ext.append((i, 0)) if live else st.adm.append((new, 0))
        elif f == "negative_extend":
            st.ext.append((i, -2))
        elif f == "dup_admit":
            st.adm = [(new, 3), (new, 2)]
        elif f == "unknown_free":
            st.free = [10**9 + r.randrange(10)]
        elif f == "unknown_extend":
            st.ext.append((10**9 + r.randrange(10), 1))
        elif f == "unknown_parent":
            st.forks = [(10**9 + r.randrange(10), new)]
        elif f == "past_max_admit":
            st.adm = [(new, self.kind.max_seq_len + r.randint(1, 5))]
        elif f == "dup_free_extend":
            st.free, st.ext = [i], [(i, 1)]
        elif f == "existing_admit":
            st.adm = [(i, 2)]
        elif f == "existing_child":
            st.forks = [(i, r.choice(live))]
        elif f == "parent_freed":
            st.free, st.forks = [i], [(i, new)]
        elif f == "child_extended":
            st.forks, st.ext = [(i, new)], [(new, 1)]
        elif f == "past_max_extend":
            st.ext.append((i, self.room(i) + r.randint(1, 3)))
        elif f == "dup_child":
            st.forks = [(i, new), (i, new)]
        elif f == "child_is_admit":
            st.forks, st.adm = [(i, new)], [(new, 2)]
        elif f == "token_ids_short":
            st.adm = [(new, 5)]
            st.token_ids = [1, 2, 3]
        elif f == "salts_count":
            st.adm = [(new, 5)]
            st.token_ids = [1, 2, 3, 4, 5]
            st.salts = ["a", "b"]
        elif f == "salts_count_no_ids":
            st.adm = [(new, 5), (self.new_id(), 3)]
            st.salts = ["a"]
        elif f == "keys_count_no_ids":
            st.adm = [(new, 5)]
            st.keys = ["lora-a", "lora-b", "lora-c"]
        return st

    def done(self, st: Step, out: Outcome | None) -> None:
        if out is not None:
            self.last_batch = [row.seq_id for row in out.rows]
            self.dead += st.free
        elif st.ext and [i for i, _ in st.ext] == self.last_batch:
            self.decode_left = 0


# ---- running, replaying, shrinking ------------------------------------------------------------
@dataclass
class Failure:
    kind: str
    seed: int | None
    at: int                 # index of the failing op
    message: str
    ops: list               # the ops up to and including the failing one


@dataclass
class RunStats:
    """What a run exercised (so that a test can insist that it exercised it)."""

    steps: int = 0
    ops: int = 0
    errors: int = 0
    exhausted: int = 0
    queries: int = 0
    copies: int = 0
    released: int = 0          # pages a sliding window released
    mixed: int = 0             # steps with forks and extensions or admissions together
    fast_steps: int = 0        # steps the pool answered on its decode fast path (in-process)
    lean_steps: int = 0        # steps the pool answered on its one-full-group path (Pool._full_group_step)
    hits: int = 0              # pages admissions took from the prefix caches (all groups)
    evictions: int = 0         # cached pages evicted for new ones (all groups)
    limited: int = 0           # admissions whose hit the sliding groups cut below the full chain (or the limit)
    recreated: int = 0         # pools deleted and created again (Recreate)
    stale: int = 0             # checks of an earlier reply's page that found it stale (its slot allocated again)

    def add(self, other: RunStats) -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


def _count_cache(stats: RunStats, model: RefPool) -> None:
    """Add the model's prefix-cache counters (of the pool since it was last created) to stats."""
    stats.hits += sum(model.s.hits)
    stats.evictions += sum(model.s.evictions)
    stats.limited += model.s.limited


def _apply(kind: Kind, drv, model: RefPool, binder: Binder, op, stats: RunStats) -> Outcome | None:
    if isinstance(op, Recreate):
        stats.recreated += 1
        _count_cache(stats, model)                  # what the old pool's caches did
        drv.recreate()
        model.reset()
        binder.reset()
        return None
    if isinstance(op, Query):
        stats.queries += 1
        try:
            rows = model.tables_for(op.ids)
        except KVError as err:
            try:
                drv.query(op)
            except KVError as got:
                _eq("tables_for error", type(got).__name__, type(err).__name__)
                return None
            raise Mismatch(f"tables_for({op.ids}) answered; the model says {type(err).__name__}") from None
        binder.check_tables(rows, drv.query(op), tables=True, block_table=op.block_table)
        return None
    stats.steps += 1
    stats.ops += op.ops()
    before = drv.snapshot() if drv.full_state else None
    try:
        reply, raised = drv.step(op), None
    except KVError as got:
        reply, raised = None, got
    try:
        out = model.step(op)
    except KVError as err:
        stats.errors += 1
        stats.exhausted += isinstance(err, ResourceExhausted)
        if raised is None:
            raise Mismatch(f"the step succeeded; the model says {type(err).__name__}: {err}") from None
        _eq("error class", type(raised).__name__, type(err).__name__)
        if before is not None:
            _eq("state after a refused step", drv.snapshot(), before)
        return None
    if raised is not None:
        raise Mismatch(f"the step raised {type(raised).__name__}: {raised}; the model says it succeeds")
    binder.check_reply(out, reply, op)
    stats.copies += sum(len(c) for c in out.copies)
    stats.released += out.released
    stats.mixed += bool(op.forks and (op.ext or op.adm))
    return out


def run_ops(kind: Kind, drv, ops: list, state: bool = True, check_unheld: bool | None = None) -> Failure | None:
    """Replay fixed ops against a fresh model; the first mismatch, or None (state: compare it after each op;
    check_unheld: see Binder.check_unheld, default CHECK_UNHELD)."""
    model = make_model(kind)
    binder = Binder(kind, model, check_unheld)
    stats = RunStats()
    for at, op in enumerate(ops):
        try:
            _apply(kind, drv, model, binder, op, stats)
            if state:
                if drv.full_state:
                    binder.check_state(drv)
                binder.check_stats(drv.stats())
        except Mismatch as e:
            return Failure(kind.name, None, at, str(e), ops[:at + 1])
    return None


PROFILES = ("mix", "forks_alone", "no_forks")
#: What the differential tests of this run covered, by label (printed at the end of the pytest run).
TOTALS: dict[str, RunStats] = {}


def run_random(kind: Kind, new_driver: Callable[[], object], seed: int, steps: int,
               queries: bool = True, stats_every: int = 1, profile: str = "mix",
               ) -> tuple[RunStats, Failure | None]:
    """`steps` random ops from `seed`; on a mismatch the failure with every op so far."""
    model = make_model(kind)
    binder = Binder(kind, model)
    drv = new_driver()
    gen = Gen(kind, model, random.Random(f"{kind.name}:{seed}"), queries and drv.full_state, profile)
    stats = RunStats()
    ops: list = []
    for at in range(steps):
        op = gen.next()
        ops.append(op)
        try:
            out = _apply(kind, drv, model, binder, op, stats)
            if isinstance(op, Step):
                gen.done(op, out)
            if drv.full_state:
                binder.check_state(drv)
            if at % stats_every == 0 or at == steps - 1:
                binder.check_stats(drv.stats())
        except Mismatch as e:
            return stats, Failure(kind.name, seed, at, str(e), ops)
    stats.fast_steps = getattr(drv, "fast_steps", 0)
    stats.lean_steps = getattr(drv, "lean_steps", 0)
    _count_cache(stats, model)
    stats.stale = binder.stale_seen
    return stats, None


def _keep(op: Step, keep: set[int]) -> Step:
    """op with only the entries of sequences in `keep` (and their prompts, salts and keys)."""
    adm = [j for j, (i, _) in enumerate(op.adm) if i in keep]
    out = replace(op, free=[i for i in op.free if i in keep], forks=[f for f in op.forks if f[1] in keep],
                  ext=[e for e in op.ext if e[0] in keep], adm=[op.adm[j] for j in adm])
    if op.token_ids is not None:
        starts = [sum(n for _, n in op.adm[:j]) for j in range(len(op.adm))]
        out.token_ids = [t for j in adm for t in op.token_ids[starts[j]:starts[j] + op.adm[j][1]]]
    for f in ("salts", "keys"):
        v = getattr(op, f)
        if v and len(v) == len(op.adm):
            setattr(out, f, [v[j] for j in adm])
    return out


def _related(ops: list) -> list:
    """The ops restricted to the sequences of the last op and, through forks, their ancestors."""
    last = ops[-1]
    if not isinstance(last, Step):
        keep = set(last.ids)                    # a Query's ids; none for a Recreate
    else:
        keep = {*last.free, *(i for f in last.forks for i in f), *(i for i, _ in last.ext), *(i for i, _ in last.adm)}
    for op in reversed(ops):
        if isinstance(op, Step):
            keep |= {p for p, c in op.forks if c in keep}
    out = [op if not isinstance(op, Step) else _keep(op, keep) for op in ops[:-1]]
    return [op for op in out if isinstance(op, Step) and op.ops()] + [ops[-1]]


def _candidates(op):
    """Smaller versions of one Step: one list entry removed at a time."""
    if not isinstance(op, Step):
        return
    for name in ("free", "forks", "ext", "adm"):
        xs = getattr(op, name)
        for j in range(len(xs)):
            smaller = replace(op, **{name: xs[:j] + xs[j + 1:]})
            if name == "adm" and op.token_ids is not None:
                at = sum(n for _, n in op.adm[:j])
                smaller.token_ids = op.token_ids[:at] + op.token_ids[at + op.adm[j][1]:]
                for f in ("salts", "keys"):
                    v = getattr(op, f)
                    if v and len(v) == len(op.adm):
                        setattr(smaller, f, v[:j] + v[j + 1:])
            yield smaller
    if op.block_table:
        yield replace(op, block_table=False)
    if not op.tables:
        yield replace(op, tables=True)


def signature(message: str) -> str:
    """What kind of mismatch a message reports, without the numbers (the shrinker keeps it fixed)."""
    parts = message.split(": ", 2)
    head = parts[0]
    if re.fullmatch(r"group \d+", head) and len(parts) > 1:        # a group-level check: name it
        head += ": " + " ".join(parts[1].split()[:3])
    return re.sub(r"\d+", "#", head.split(";")[0])


def shrink(kind: Kind, new_driver: Callable[[], object], failure: Failure, budget: int = 2000,
           seconds: float = 60.0) -> Failure:
    """Greedy delta debugging: drop chunks of ops, single ops, then single entries, while it still fails.

    Only failures of the same kind (`signature`) count, so the repro does not drift to another
    mismatch. Stops after `budget` replays or `seconds` (a shrink bound, not a test assertion), or after
    KV_DIFF_SHRINK_SECONDS where that is set lower: a run that only needs to know that a seed fails (a
    planted bug, a mutant) skips most of the shrinking.
    """
    seconds = min(seconds, float(os.environ.get("KV_DIFF_SHRINK_SECONDS", seconds)))
    best = failure
    tries = 0
    want = signature(failure.message)
    stop = time.monotonic() + seconds
    f = run_ops(kind, new_driver(), failure.ops, state=False)
    state = f is None or signature(f.message) != want       # the mismatch needs the state comparison

    def fails(ops):
        nonlocal tries
        tries += 1
        if time.monotonic() > stop:
            tries = budget
        f = run_ops(kind, new_driver(), ops, state)
        return f if f is not None and signature(f.message) == want else None

    ops = best.ops
    f = fails(_related(ops))            # most mismatches need only the sequences of the failing step
    if f is not None:
        best, ops = f, f.ops
    while tries < budget:
        size = len(ops), sum(op.ops() for op in ops)
        chunk = max(1, len(ops) // 2)
        while chunk >= 1 and tries < budget:
            i, changed = 0, False
            while i < len(ops) and tries < budget:
                f = fails(ops[:i] + ops[i + chunk:])
                if f is not None:
                    best, ops, changed = f, f.ops, True
                else:
                    i += chunk
            if not changed:
                chunk //= 2
        i = 0
        while i < len(ops) and tries < budget:
            for smaller in _candidates(ops[i]):
                f = fails([*ops[:i], smaller, *ops[i + 1:]])
                if f is not None:
                    best, ops = f, f.ops
                    break
            else:
                i += 1
        if (len(ops), sum(op.ops() for op in ops)) == size:
            break
    best.seed = failure.seed
    return best


def repro(failure: Failure, fast: bool | None = None) -> str:
    lines = [f"# kind {failure.kind!r}: op {failure.at} fails: {failure.message}",
             "from tests.differential import KINDS, Query, Recreate, replay  # noqa: F401",
             "from tests.refmodel import Step", "", "ops = ["]
    lines += [f"    {op.literal()}," for op in failure.ops]
    lines.append("]")
    fast_arg = "" if fast is None else f", fast={fast}"
    lines.append(f"replay(KINDS[{failure.kind!r}], ops{fast_arg})")
    return "\n".join(lines)


def replay(kind: Kind, ops: list, fast: bool = True) -> None:
    """Run a repro in-process; raises Mismatch with the message if it still fails."""
    f = run_ops(kind, InProcess(kind, fast), ops)
    if f is not None:
        raise Mismatch(f"op {f.at}: {f.message}")
