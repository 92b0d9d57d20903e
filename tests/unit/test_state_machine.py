"""Hypothesis state machine: the pool against a plain-Python model of the allocator.

The model owns nothing NumPy: per sequence its token count and, per layer
group, the slot of each page (None once a sliding window released it); per
group a refcount dict. After every step the pool must agree with it, docs/DESIGN.md's
invariants must hold, and every failure (unknown id, double free, duplicate,
bad count, out of slots) must be a clean error that changed nothing. Forks
share slots; appends into a shared partly filled page must copy it first.
A step runs in the documented order: frees, forks (each child a copy of its
parent before this step's extensions), extensions (window release, copy-on-write,
growth), admissions. Every slot mapping, CSR row and exact last_page_len of
every step is checked, and block tables read at random must agree with the CSR.
The machine runs on an interleaved and on a per_layer spec.
"""

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvservice.contract.errors import AlreadyExists, InvalidArgument, KVError, NotFound, ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.pagetable import validate_page_table
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import assert_invariants
from kvservice.core.planner import plan
from kvservice.core.pool import Pool

PAGE = 4
SLOTS = 24
MAX_LEN = 40
WINDOW = 6
WINDOWS = (0, WINDOW)          # group 0: full attention (layers 0, 1); group 1: sliding (layer 2)


def cdiv(a, b):
    return -(-a // b)


class Seq:
    def __init__(self, n=0, pages=None, first=None):
        self.n = n
        self.pages = pages or [[] for _ in WINDOWS]     # per group: slot per page, None = released
        self.first = first or [0 for _ in WINDOWS]

    def held(self, g):
        return self.pages[g][self.first[g]:]

    def clone(self):
        return Seq(self.n, [list(p) for p in self.pages], list(self.first))


class Model:
    def __init__(self):
        self.seqs: dict[int, Seq] = {}
        self.rc = [dict.fromkeys(range(SLOTS), 0) for _ in WINDOWS]

    def free_count(self, g):
        return sum(1 for v in self.rc[g].values() if v == 0)

    def new_first(self, s, g, old):
        w = WINDOWS[g]
        if not w:
            return s.first[g]
        return min(max(s.first[g], (old + 1 - w) // PAGE), cdiv(old, PAGE))

    def expect(self, free_ids, forks, ext, adm):
        """The exception class the pool must raise for this step, or None."""
        ids = [*free_ids, *(c for _, c in forks), *(i for i, _ in ext), *(i for i, _ in adm)]
        if any(k <= 0 for _, k in ext) or any(n <= 0 for _, n in adm):
            return InvalidArgument
        if len(set(ids)) != len(ids):
            return InvalidArgument
        if any(i not in self.seqs for i in free_ids) or any(i not in self.seqs for i, _ in ext) \
                or any(p not in self.seqs for p, _ in forks):
            return NotFound
        if any(i in self.seqs for i, _ in adm) or any(c in self.seqs for _, c in forks):
            return AlreadyExists
        if any(p in free_ids for p, _ in forks):
            return InvalidArgument
        if any(self.seqs[i].n + k > MAX_LEN for i, k in ext) or any(n > MAX_LEN for _, n in adm):
            return InvalidArgument
        for g in range(len(WINDOWS)):
            dropped = [x for i in free_ids for x in self.seqs[i].held(g)]
            for i, _ in ext:
                s = self.seqs[i]
                dropped += s.pages[g][s.first[g]:self.new_first(s, g, s.n)]
            counts = {x: dropped.count(x) for x in set(dropped)}
            # children (forked before the extensions' window release) keep what their parents release
            forked = [x for p, _ in forks for x in self.seqs[p].held(g)]
            freed = [x for x, c in counts.items() if self.rc[g][x] + forked.count(x) == c]
            need = sum(cdiv(self.seqs[i].n + k, PAGE) - cdiv(self.seqs[i].n, PAGE) for i, k in ext)
            need += sum(cdiv(n, PAGE) for _, n in adm)
            extenders = {}
            for i, _ in ext:
                s = self.seqs[i]
                if s.n % PAGE:
                    last = s.pages[g][-1]
                    extenders[last] = extenders.get(last, 0) + 1
            for slot, c in extenders.items():
                r = self.rc[g][slot] - counts.get(slot, 0) + forked.count(slot)
                need += c - (1 if r == c else 0)
            if need > self.free_count(g) + len(freed):
                return ResourceExhausted
        return None


class PoolMachine(RuleBasedStateMachine):
    LAYOUT = "interleaved"

    def __init__(self):
        super().__init__()
        layers = (LayerSpec(1, 64), LayerSpec(1, 128), LayerSpec(1, 64, sliding_window=WINDOW))
        self.pool = Pool("m", plan(CacheSpec(layers, PAGE, self.LAYOUT), Sizing(num_slots=SLOTS,
                                                                                  max_seq_len=MAX_LEN)))
        self.model = Model()
        self.next_id = 1

    def live(self):
        return sorted(self.model.seqs)

    def decref(self, g, slot):
        assert self.model.rc[g][slot] > 0
        self.model.rc[g][slot] -= 1

    def do_step(self, free_ids=(), ext=(), adm=(), forks=()):
        free_ids, ext, adm, forks = list(free_ids), list(ext), list(adm), list(forks)
        expected = self.model.expect(free_ids, forks, ext, adm)
        before = self.pool.sequences()
        arr = lambda xs: np.array(list(xs), dtype=np.int64)  # noqa: E731
        try:
            res = self.pool.step(free_ids=arr(free_ids), extend_ids=arr(i for i, _ in ext),
                                 extend_tokens=arr(k for _, k in ext), admit_ids=arr(i for i, _ in adm),
                                 admit_tokens=arr(n for _, n in adm), fork_parents=arr(p for p, _ in forks),
                                 fork_children=arr(c for _, c in forks))
        except KVError as err:
            assert expected is not None and isinstance(err, expected), (expected, err)
            after = self.pool.sequences()
            assert [a.tolist() for a in after] == [b.tolist() for b in before], "a failed step changed state"
            return
        assert expected is None, f"expected {expected.__name__}"
        m = self.model
        # 1. frees, 2. forks (copies of the parents before this step's extensions), 3. window releases
        for i in free_ids:
            s = m.seqs.pop(i)
            for g in range(len(WINDOWS)):
                for x in s.held(g):
                    self.decref(g, x)
        for p, c in forks:
            m.seqs[c] = m.seqs[p].clone()
            for g in range(len(WINDOWS)):
                for x in m.seqs[c].held(g):
                    m.rc[g][x] += 1
        for i, _ in ext:
            s = m.seqs[i]
            for g in range(len(WINDOWS)):
                nf = m.new_first(s, g, s.n)
                for j in range(s.first[g], nf):
                    self.decref(g, s.pages[g][j])
                    s.pages[g][j] = None
                s.first[g] = nf
        for i, _ in adm:
            m.seqs[i] = Seq()
        batch = [*ext, *adm, *((c, 0) for _, c in forks)]
        assert res.seq_ids.tolist() == [i for i, _ in batch]
        # 4. copy-on-write, in batch order: a partly filled last page with other owners is copied.
        for g in range(len(WINDOWS)):
            want = []
            for i, _ in ext:
                s = m.seqs[i]
                if s.n % PAGE and m.rc[g][s.pages[g][-1]] > 1:
                    src = s.pages[g][-1]
                    want.append(src)
                    self.decref(g, src)
                    s.pages[g][-1] = ("copy", src)       # filled in from the reply below
            got = res.copies[g].tolist() if len(res.copies) else []
            assert [src for src, _ in got] == want, (g, got, want)
            dsts = iter(dst for _, dst in got)
            for i, _ in ext:
                s = m.seqs[i]
                if s.pages[g] and isinstance(s.pages[g][-1], tuple):
                    dst = next(dsts)
                    assert m.rc[g][dst] == 0, "copied into a slot that is in use"
                    m.rc[g][dst] = 1
                    s.pages[g][-1] = dst
        # 5. growth: new pages come from free slots; tables and slot mappings match the model.
        for sp in res.tables:
            g, space = sp.space.group, sp.space
            assert validate_page_table(sp.table, space, PAGE).ok
            first_space = space.id == min(t.space.id for t in res.tables if t.space.group == g)
            for b, (i, k) in enumerate(batch):
                s = m.seqs[i]
                row = sp.table.row(b).astype(np.int64)
                assert ((row - space.base - space.offset) % space.scale == 0).all()
                slots = ((row - space.base - space.offset) // space.scale).tolist()
                held = s.held(g)
                assert slots[:len(held)] == held, "pages of a sequence moved"
                new = slots[len(held):]
                assert s.first[g] + len(slots) == cdiv(s.n + k, PAGE)
                n = s.n + k
                assert sp.table.last_page_len[b] == n - (cdiv(n, PAGE) - 1) * PAGE
                if first_space:
                    for x in new:
                        assert m.rc[g][x] == 0, "handed out a slot the model says is owned"
                        m.rc[g][x] = 1
                    s.pages[g].extend(new)
                lo, hi = res.new_token_indptr[b], res.new_token_indptr[b + 1]
                pos = np.arange(s.n, s.n + k)
                pages = [s.pages[g][p] for p in (pos // PAGE).tolist()] if first_space else \
                    [(slots[p - s.first[g]]) for p in (pos // PAGE).tolist()]
                want = (np.array(pages, dtype=np.int64) * space.scale + space.base + space.offset) * PAGE + pos % PAGE
                assert sp.slot_mapping[lo:hi].tolist() == want.tolist()
        for i, k in batch:
            m.seqs[i].n += k

    @rule(n=st.integers(-1, MAX_LEN + 2), count=st.integers(1, 3))
    def admit(self, n, count):
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        self.do_step(adm=[(i, n) for i in ids])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), k=st.integers(0, 9))
    def extend(self, data, k):
        ids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=4, unique=True))
        self.do_step(ext=[(i, k) for i in ids])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def free(self, data):
        self.do_step(free_ids=data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=3,
                                                 unique=True)))

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), n_children=st.integers(1, 3), extend_parent=st.booleans())
    def fork(self, data, n_children, extend_parent):
        parent = data.draw(st.sampled_from(self.live()))
        kids = list(range(self.next_id, self.next_id + n_children))
        self.next_id += n_children
        self.do_step(forks=[(parent, c) for c in kids], ext=[(parent, 1)] if extend_parent else [])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), n=st.integers(1, 20))
    def mixed(self, data, n):
        live = self.live()
        f = data.draw(st.lists(st.sampled_from(live), max_size=2, unique=True))
        rest = [i for i in live if i not in f]
        e = data.draw(st.lists(st.sampled_from(rest), max_size=4, unique=True)) if rest else []
        self.next_id += 1
        self.do_step(free_ids=f, ext=[(i, 1) for i in e], adm=[(self.next_id, n)])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), n=st.integers(1, 12))
    def fork_mix(self, data, n):
        """Frees, forks, extensions by 1 and by chunks and an admission, all in one step."""
        live = self.live()
        f = data.draw(st.lists(st.sampled_from(live), max_size=2, unique=True))
        rest = [i for i in live if i not in f]
        parents = data.draw(st.lists(st.sampled_from(rest), max_size=3)) if rest else []
        kids = list(range(self.next_id, self.next_id + len(parents)))
        self.next_id += len(parents) + 1
        e = data.draw(st.lists(st.sampled_from(rest), max_size=4, unique=True)) if rest else []
        ks = data.draw(st.lists(st.sampled_from((1, 1, 2, 3, PAGE, PAGE + 1)), min_size=len(e), max_size=len(e)))
        self.do_step(free_ids=f, ext=list(zip(e, ks, strict=True)), adm=[(self.next_id, n)],
                     forks=list(zip(parents, kids, strict=True)))

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def read_tables(self, data):
        """Block tables of a random batch: column j is page j (-1 once released), the CSR row is the held part."""
        ids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=6))
        tables = self.pool.tables_for(np.array(ids, dtype=np.uint64), block_table=True)
        for sp in tables:
            g, space = sp.space.group, sp.space
            width = max(cdiv(self.model.seqs[i].n, PAGE) for i in ids)
            assert sp.block_table.shape == (len(ids), width)
            for b, i in enumerate(ids):
                s = self.model.seqs[i]
                row = sp.table.row(b).tolist()
                want = [getattr(space, "base", 0) + x * space.scale + space.offset for x in s.held(g)]
                assert row == want
                assert sp.block_table[b].tolist() == [-1] * s.first[g] + row + [-1] * (width - s.first[g] - len(row))
                assert sp.table.last_page_len[b] == s.n - (cdiv(s.n, PAGE) - 1) * PAGE

    @rule(seq=st.integers(10_000, 10_010))
    def unknown_ids(self, seq):
        self.do_step(free_ids=[seq])
        self.do_step(ext=[(seq, 1)])
        self.do_step(forks=[(seq, seq + 100)])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def double_free_and_duplicates(self, data):
        i = data.draw(st.sampled_from(self.live()))
        self.do_step(free_ids=[i, i])                 # same id twice in one step
        self.do_step(ext=[(i, 1), (i, 1)])
        self.do_step(forks=[(i, self.next_id)], free_ids=[i])   # parent freed in the same step
        self.do_step(free_ids=[i])                    # a real free ...
        self.do_step(free_ids=[i])                    # ... and the double free: NotFound

    @invariant()
    def invariants_hold(self):
        assert_invariants(self.pool)
        ids, toks = self.pool.sequences()
        assert ids.tolist() == self.live()
        assert toks.tolist() == [self.model.seqs[i].n for i in self.live()]
        for g, a in enumerate(self.pool.allocators):
            assert set(a.free_slots().tolist()) == {x for x, v in self.model.rc[g].items() if v == 0}
            assert a.refcount(np.arange(SLOTS)).tolist() == [self.model.rc[g][x] for x in range(SLOTS)]
            for i in self.live():
                assert self.pool.sequence_slots(i, g).tolist() == self.model.seqs[i].held(g)


class PerLayerMachine(PoolMachine):
    LAYOUT = "per_layer"


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow], report_multiple_bugs=False)
TestPerLayerMachine = PerLayerMachine.TestCase
TestPerLayerMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow], report_multiple_bugs=False)
