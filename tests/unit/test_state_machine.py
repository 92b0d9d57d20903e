"""Hypothesis state machine: the pool against a plain-Python model of the allocator.

The model owns nothing NumPy: a dict of sequences -> token count and slot list
per group, and a set of free slots per group. After every step the pool must
agree with it, DESIGN.md's invariants must hold, and every failure (unknown id,
double free, duplicate, bad count, out of slots) must be a clean error that
changed nothing.
"""

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvservice.errors import AlreadyExists, InvalidArgument, KVError, NotFound, ResourceExhausted
from kvservice.geometry import CacheSpec, LayerSpec
from kvservice.invariants import assert_invariants
from kvservice.pagetable import validate_page_table
from kvservice.planner import Sizing, plan
from kvservice.pool import Pool

PAGE = 4
SLOTS = 24
MAX_LEN = 40


def cdiv(a, b):
    return -(-a // b)


class Model:
    def __init__(self, groups):
        self.seqs = {}                                   # id -> [num_tokens, [slots per group]]
        self.free = [set(range(SLOTS)) for _ in range(groups)]

    def expect(self, free_ids, ext, adm):
        """The exception class the pool must raise for this step, or None."""
        ids = [*free_ids, *(i for i, _ in ext), *(i for i, _ in adm)]
        if any(k <= 0 for _, k in ext) or any(n <= 0 for _, n in adm):
            return InvalidArgument
        if len(set(ids)) != len(ids):
            return InvalidArgument
        if any(i not in self.seqs for i in free_ids) or any(i not in self.seqs for i, _ in ext):
            return NotFound
        if any(i in self.seqs for i, _ in adm):
            return AlreadyExists
        if any(self.seqs[i][0] + k > MAX_LEN for i, k in ext) or any(n > MAX_LEN for _, n in adm):
            return InvalidArgument
        need = sum(cdiv(self.seqs[i][0] + k, PAGE) - cdiv(self.seqs[i][0], PAGE) for i, k in ext)
        need += sum(cdiv(n, PAGE) for _, n in adm)
        released = sum(cdiv(self.seqs[i][0], PAGE) for i in free_ids)
        if need > len(self.free[0]) + released:
            return ResourceExhausted
        return None


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        layers = (LayerSpec(1, 64), LayerSpec(1, 128), LayerSpec(1, 64, sliding_window=8))
        self.pool = Pool("m", plan(CacheSpec(layers, PAGE, "interleaved"), Sizing(num_slots=SLOTS,
                                                                                    max_seq_len=MAX_LEN)))
        self.model = Model(len(self.pool.allocators))
        self.next_id = 1

    def live(self):
        return sorted(self.model.seqs)

    def do_step(self, free_ids, ext, adm):
        expected = self.model.expect(free_ids, ext, adm)
        before = self.pool.sequences()
        try:
            res = self.pool.step(free_ids=np.array(free_ids, dtype=np.int64),
                                 extend_ids=np.array([i for i, _ in ext], dtype=np.int64),
                                 extend_tokens=np.array([k for _, k in ext], dtype=np.int64),
                                 admit_ids=np.array([i for i, _ in adm], dtype=np.int64),
                                 admit_tokens=np.array([n for _, n in adm], dtype=np.int64))
        except KVError as err:
            assert expected is not None and isinstance(err, expected), (expected, err)
            after = self.pool.sequences()
            assert [a.tolist() for a in after] == [b.tolist() for b in before], "a failed step changed state"
            return
        assert expected is None, f"expected {expected.__name__}"
        for i in free_ids:
            _, slots = self.model.seqs.pop(i)
            for g, s in enumerate(slots):
                self.model.free[g].update(s)
        batch = [*ext, *((i, n) for i, n in adm)]
        assert res.seq_ids.tolist() == [i for i, _ in batch]
        for i, _ in adm:
            self.model.seqs[i] = [0, [[] for _ in self.model.free]]
        for sp_tables in res.tables:
            g, space = sp_tables.space.group, sp_tables.space
            assert validate_page_table(sp_tables.table, space, PAGE).ok
            for b, (i, k) in enumerate(batch):
                old_n = self.model.seqs[i][0]
                row = sp_tables.table.row(b).astype(np.int64)
                assert ((row - space.offset) % space.scale == 0).all()
                slots = ((row - space.offset) // space.scale).tolist()
                held = self.model.seqs[i][1][g]
                assert slots[:len(held)] == held, "pages of a sequence moved"
                new = slots[len(held):]
                assert len(slots) == cdiv(old_n + k, PAGE)
                assert set(new) <= self.model.free[g], "handed out a slot the model says is owned"
                if new and space.id == min(s.space.id for s in res.tables if s.space.group == g):
                    self.model.free[g] -= set(new)
                    held.extend(new)
                # slot_mapping of the new tokens
                lo, hi = res.new_token_indptr[b], res.new_token_indptr[b + 1]
                pos = np.arange(old_n, old_n + k)
                want = (np.array(slots)[pos // PAGE] * space.scale + space.offset) * PAGE + pos % PAGE
                assert sp_tables.slot_mapping[lo:hi].tolist() == want.tolist()
        for i, k in batch:
            self.model.seqs[i][0] += k

    @rule(n=st.integers(-1, MAX_LEN + 2), count=st.integers(1, 3))
    def admit(self, n, count):
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        self.do_step([], [], [(i, n) for i in ids])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), k=st.integers(0, 12))
    def extend(self, data, k):
        ids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=4, unique=True))
        self.do_step([], [(i, k) for i in ids], [])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def free(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, max_size=3, unique=True))
        self.do_step(ids, [], [])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), n=st.integers(1, 20))
    def mixed(self, data, n):
        live = self.live()
        f = data.draw(st.lists(st.sampled_from(live), max_size=2, unique=True))
        rest = [i for i in live if i not in f]
        e = data.draw(st.lists(st.sampled_from(rest), max_size=3, unique=True)) if rest else []
        self.next_id += 1
        self.do_step(f, [(i, 1) for i in e], [(self.next_id, n)])

    @rule(seq=st.integers(10_000, 10_010))
    def unknown_ids(self, seq):
        self.do_step([seq], [], [])
        self.do_step([], [(seq, 1)], [])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def double_free_and_duplicates(self, data):
        i = data.draw(st.sampled_from(self.live()))
        self.do_step([i, i], [], [])                 # same id twice in one step
        self.do_step([], [(i, 1), (i, 1)], [])
        self.do_step([i], [], [])                    # a real free ...
        self.do_step([i], [], [])                    # ... and the double free: NotFound

    @invariant()
    def invariants_hold(self):
        assert_invariants(self.pool)
        ids, toks = self.pool.sequences()
        assert ids.tolist() == self.live()
        assert toks.tolist() == [self.model.seqs[i][0] for i in self.live()]
        for g, a in enumerate(self.pool.allocators):
            assert a.num_free == len(self.model.free[g])
            assert set(a.free_slots().tolist()) == self.model.free[g]


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
