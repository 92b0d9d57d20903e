"""Hypothesis state machine for prefix caching: hits, LRU eviction, tenants, forks and forced hash collisions.

The model records what each slot holds (the token chain of the page written
into it). Whatever the cache does, a sequence's page must hold that sequence's
own prefix: a hit may never alias another prompt or tenant, even when every
hash collides. Every token of an admission (cached or not) gets a slot mapping
into its own page. Forks share a sequence's pages, alone or in the step of an
admission; appending into a shared partly filled page copies it first. Pool
invariants (refcounts, free/cached accounting, cache index) are checked after
every step.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import assert_invariants
from kvservice.core.planner import plan
from kvservice.core.pool import Pool

PS = 2
SLOTS = 12
PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [7, 7, 1, 2, 3, 4]]


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.collide = False
        self.pool = Pool("p", plan(CacheSpec.uniform(1, 1, 64, page_size=PS),
                                   Sizing(num_slots=SLOTS, max_seq_len=SLOTS * PS)), prefix_caching=True)
        self.content: dict[int, tuple] = {}        # slot -> (tenant, token chain) written into it
        self.seqs: dict[int, tuple[str, list[int]]] = {}
        self.next_id = 1

    @rule(collide=st.booleans())
    def set_hash(self, collide):
        if collide:       # every page hashes to its index: all prompts collide
            self.pool.prefix.hash_fn = lambda pages, col, *_: (col + 1).astype(np.uint64)

    @rule(p=st.sampled_from(range(len(PREFIXES))), cut=st.integers(1, 6), tail=st.lists(st.integers(0, 3),
          max_size=3), tenant=st.sampled_from(["a", "b"]))
    def admit(self, p, cut, tail, tenant):
        toks = PREFIXES[p][:cut] + tail
        sid = self.next_id
        self.next_id += 1
        try:
            r = self.pool.step(admit_ids=[sid], admit_tokens=[len(toks)], admit_token_ids=np.array(toks),
                               admit_salts=[tenant])
        except ResourceExhausted:
            return
        slots = self.pool.sequence_slots(sid).tolist()
        hits = int(r.cached_tokens[0]) // PS
        assert hits <= (len(toks) - 1) // PS
        self.check_admission(r, 0, slots, len(toks))
        for j, s in enumerate(slots):
            chain = (tenant, tuple(toks[:(j + 1) * PS]))
            if j < hits:
                assert self.content.get(s) == chain, f"hit on slot {s} holding {self.content.get(s)}, want {chain}"
            else:
                self.content[s] = chain if (j + 1) * PS <= len(toks) else ("partial", sid, j)
        self.seqs[sid] = (tenant, toks)

    def check_admission(self, r, b, slots, n):
        """Row b of the reply: an admission of n tokens whose pages are `slots`."""
        (sp,) = r.tables
        lo, hi = r.new_token_indptr[b], r.new_token_indptr[b + 1]
        assert hi - lo == n
        assert sp.slot_mapping[lo:hi].tolist() == [slots[t // PS] * PS + t % PS for t in range(n)]
        assert sp.table.row(b).tolist() == slots
        assert sp.table.last_page_len[b] == n - (-(-n // PS) - 1) * PS

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data, n):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        kids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        r = self.pool.step(fork_parents=[parent] * n, fork_children=kids)
        want = self.pool.sequence_slots(parent).tolist()
        assert r.seq_ids.tolist() == kids and r.new_token_indptr.tolist() == [0] * (n + 1)
        for b, c in enumerate(kids):
            assert self.pool.sequence_slots(c).tolist() == want == r.tables[0].table.row(b).tolist()
            tenant, toks = self.seqs[parent]
            self.seqs[c] = (tenant, list(toks))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), p=st.sampled_from(range(len(PREFIXES))), cut=st.integers(1, 6),
          tenant=st.sampled_from(["a", "b"]))
    def fork_and_admit(self, data, p, cut, tenant):
        """A fork and a (possibly cached) admission in one step: each row maps to its own pages."""
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child, sid = self.next_id, self.next_id + 1
        self.next_id += 2
        toks = PREFIXES[p][:cut]
        try:
            r = self.pool.step(fork_parents=[parent], fork_children=[child], admit_ids=[sid],
                               admit_tokens=[len(toks)], admit_token_ids=np.array(toks), admit_salts=[tenant])
        except ResourceExhausted:
            return
        assert r.seq_ids.tolist() == [sid, child]
        slots = self.pool.sequence_slots(sid).tolist()
        hits = int(r.cached_tokens[0]) // PS
        self.check_admission(r, 0, slots, len(toks))
        for j, s in enumerate(slots):
            chain = (tenant, tuple(toks[:(j + 1) * PS]))
            if j < hits:
                assert self.content.get(s) == chain
            else:
                self.content[s] = chain if (j + 1) * PS <= len(toks) else ("partial", sid, j)
        assert r.tables[0].table.row(1).tolist() == self.pool.sequence_slots(parent).tolist()
        self.seqs[sid] = (tenant, toks)
        self.seqs[child] = (self.seqs[parent][0], list(self.seqs[parent][1]))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.pool.step(free_ids=[sid])
        del self.seqs[sid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def extend(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        _tenant, toks = self.seqs[sid]
        if len(toks) >= SLOTS * PS:                       # at max_seq_len: refused, and nothing changes
            before = self.pool.sequence_slots(sid).tolist()
            with pytest.raises(InvalidArgument, match=f"would hold {len(toks) + 1} tokens; pool 'p' takes at most "
                                                      f"max_seq_len={SLOTS * PS}"):
                self.pool.step(extend_ids=[sid], extend_tokens=[1])
            assert self.pool.sequence_slots(sid).tolist() == before
            return
        try:
            r = self.pool.step(extend_ids=[sid], extend_tokens=[1])
        except ResourceExhausted:
            return
        toks.append(-1)                                   # a generated token (not hashed)
        slots = self.pool.sequence_slots(sid).tolist()
        if len(toks) % PS == 1:                          # a fresh page was allocated
            self.content[slots[-1]] = ("generated", sid, len(slots) - 1)
        for src, dst in r.copies[0].tolist():             # a shared partly filled page was copied
            assert dst == slots[-1] and src != dst
            self.content[dst] = ("copy", sid, len(slots) - 1)
        assert r.tables[0].slot_mapping.tolist() == [slots[-1] * PS + (len(toks) - 1) % PS]

    @invariant()
    def consistent(self):
        assert_invariants(self.pool)
        for sid, (tenant, toks) in self.seqs.items():
            for j, s in enumerate(self.pool.sequence_slots(sid).tolist()):
                c = self.content.get(s)
                if c and c[0] in ("a", "b"):             # a hashed prompt page: must be this prompt's own
                    assert c == (tenant, tuple(toks[:(j + 1) * PS])), (sid, j, c)


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow], report_multiple_bugs=False)
