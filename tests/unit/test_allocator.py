"""SlotAllocator against a plain-Python model (a set of free slots and a dict of refcounts)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.core.allocator import SlotAllocator


def test_allocate_free_roundtrip_values():
    a = SlotAllocator(8)
    s = a.allocate(3)
    assert sorted(s.tolist()) == [0, 1, 2] and a.num_free == 5 and a.peak_used == 3
    assert a.refcount(s).tolist() == [1, 1, 1]
    a.free(s[:2])
    assert a.num_free == 7 and a.refcount(s).tolist() == [0, 0, 1]
    a.check()


def test_exhaustion_says_needed_and_free_and_changes_nothing():
    a = SlotAllocator(4)
    a.allocate(3)
    with pytest.raises(ResourceExhausted, match="needed 2 slots, 1 free"):
        a.allocate(2)
    assert a.num_free == 1
    a.check()


@pytest.mark.parametrize("bad", [[5], [-1], [0, 0, 0]])
def test_bad_frees_are_errors_not_negative_refcounts(bad):
    a = SlotAllocator(5)
    a.allocate(2)            # slots 0, 1 held once
    before = a.refcount(np.arange(5)).tolist()
    with pytest.raises(InvalidArgument):
        a.free(np.array(bad))
    assert a.refcount(np.arange(5)).tolist() == before
    a.check()


def test_double_free():
    a = SlotAllocator(5)
    s = a.allocate(2)
    a.free(s)
    with pytest.raises(InvalidArgument, match="double free of slot"):
        a.free(s)
    assert a.num_free == 5


def test_shared_slots_need_one_free_per_owner():
    a = SlotAllocator(5)
    s = a.allocate(1)
    a._refcnt[s] += 1              # a second owner (sharing arrives with prefix caching)
    a.free(np.concatenate([s, s]))
    assert a.num_free == 5
    a.check()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40))
def test_against_python_model(ops):
    a = SlotAllocator(16)
    free, held = set(range(16)), []
    for is_alloc, n in ops:
        if is_alloc:
            if n > len(free):
                with pytest.raises(ResourceExhausted):
                    a.allocate(n)
                continue
            got = a.allocate(n).tolist()
            assert set(got) <= free and len(set(got)) == n
            free -= set(got)
            held.extend(got)
        else:
            take, held = held[:n], held[n:]
            a.free(np.array(take, dtype=np.int64))
            free |= set(take)
        assert a.num_free == len(free) and set(a.free_slots().tolist()) == free
        a.check()


class LRUModel:
    """SlotAllocator's contract with prefix caching, in lists: a LIFO free stack and an LRU of cached slots.

    Slots freed by one call enter the stack (or the LRU) together; the contract fixes no order among
    them, so both are kept as lists of groups (oldest / bottom first) and allocation may take any
    members of the group it only partly empties.
    """

    def __init__(self, n):
        self.refs = dict.fromkeys(range(n), 0)
        self.stack = [set(range(n))]          # bottom .. top
        self.lru = []                         # least recently released first
        self.cacheable = set()
        self.evictions = 0
        self.peak = 0

    def free_count(self):
        return sum(map(len, self.stack)) + sum(map(len, self.lru))

    def take(self, groups, n, got, what):
        """Remove n slots from the end (stack: top) of groups: whole groups first; check `got` took them."""
        taken = []
        while n:
            g = groups[-1] if what == "stack" else groups[0]
            if len(g) <= n:
                part = set(g)
                groups.remove(g)
            else:
                part = g & got
                assert len(part) == n, f"{what}: took {sorted(part)} of the group {sorted(g)}, wanted {n}"
                if what == "lru":
                    assert part == set(sorted(g)[:n]), f"evicted {sorted(part)} of {sorted(g)}: lower slots first"
                g -= part
            taken.append(part)
            n -= len(part)
        return taken

    def allocate(self, n, got, evicted):
        from_stack = min(n, sum(map(len, self.stack)))
        taken = self.take(self.stack, from_stack, set(got), "stack")
        old = self.take(self.lru, n - from_stack, set(got), "lru")
        # exactly these slots, evictions reported oldest first
        assert sorted(got) == sorted(set().union(*taken, *old))
        at = 0
        for part in old:
            assert evicted[at:at + len(part)] == sorted(part), (evicted, old)   # lower slot first within a release
            at += len(part)
        assert at == len(evicted)
        self.evictions += len(evicted)
        self.cacheable -= set(evicted)
        for s in got:
            self.refs[s] = 1
        self.peak = max(self.peak, sum(1 for v in self.refs.values() if v))

    def free(self, slots):
        released = []
        for s in slots:
            self.refs[s] -= 1
            if self.refs[s] == 0:
                released.append(s)
        to_lru = {s for s in released if s in self.cacheable}
        if to_lru:
            self.lru.append(to_lru)
        if set(released) - to_lru:
            self.stack.append(set(released) - to_lru)

    def share(self, slots):
        for s in slots:
            if self.refs[s] == 0:
                for g in self.lru:
                    g.discard(s)
            self.refs[s] += 1
        self.lru = [g for g in self.lru if g]
        self.peak = max(self.peak, sum(1 for v in self.refs.values() if v))


N_SLOTS = 10


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "free_cached", "share", "mark"]),
                          st.integers(0, 8),
                          st.lists(st.integers(0, 40), max_size=6), st.booleans()), max_size=50))
def test_lru_order_against_a_model(ops):
    a = SlotAllocator(N_SLOTS)
    a.caching = True
    evicted = []
    a.on_evict = lambda slots: evicted.extend(slots.tolist())
    m = LRUModel(N_SLOTS)
    for op, n, picks, unique in ops:
        a.clock += 1                      # as a pool does every step: each op's releases get their own stamp
        held = sorted(s for s, r in m.refs.items() if r)
        cached = sorted(set().union(*m.lru)) if m.lru else []
        if op == "alloc":
            if n > m.free_count():
                with pytest.raises(ResourceExhausted):
                    a.allocate(n)
                continue
            evicted.clear()
            got = a.allocate(n).tolist()
            assert len(set(got)) == n
            m.allocate(n, got, list(evicted))
        elif op == "free_cached" and held:
            # pages registered by the prefix cache, then released by their owner (one call)
            slots = sorted({held[p % len(held)] for p in picks})
            a.cacheable[slots] = True
            m.cacheable |= set(slots)
            a.free(np.array(slots, dtype=np.intp), unique=True)
            m.free(slots)
        elif op == "free" and held:
            slots = sorted({held[p % len(held)] for p in picks}) if unique else [held[p % len(held)] for p in picks]
            if any(slots.count(s) > m.refs[s] for s in slots):
                with pytest.raises(InvalidArgument, match="double free"):
                    a.free(np.array(slots, dtype=np.intp))
                continue
            a.free(np.array(slots, dtype=np.intp), unique=unique)
            m.free(slots)
        elif op == "share" and (held or cached):
            pool = held + cached
            slots = sorted({pool[p % len(pool)] for p in picks})
            a.share(np.array(slots, dtype=np.intp))
            m.share(slots)
        elif op == "mark" and held:
            # the prefix cache registers pages of owned slots
            slots = {held[p % len(held)] for p in picks}
            a.cacheable[list(slots)] = True
            m.cacheable |= slots
        # free_slots(): the stack bottom to top (each group in any order), then the cached slots oldest release
        # first, lower slot first among those released together (no page depends on another here)
        free = a.free_slots().tolist()
        want = [g for g in m.stack if g]
        got, at = [], 0
        for g in want:
            got.append(set(free[at:at + len(g)]))
            at += len(g)
        assert at + sum(map(len, m.lru)) == len(free) and got == want
        assert free[at:] == [s for g in m.lru for s in sorted(g)]
        assert a.num_free == m.free_count() and a.num_cached == sum(map(len, m.lru))
        assert a.refcount(np.arange(N_SLOTS)).tolist() == [m.refs[s] for s in range(N_SLOTS)]
        assert a.evictions == m.evictions and a.peak_used == m.peak
        assert {s for s in range(N_SLOTS) if a.cacheable[s]} == m.cacheable
        a.check()


# Error contract: each refusal names the numbers and the reason a person (or a client) acts on.

def test_negative_allocation_names_the_count_and_changes_nothing():
    a = SlotAllocator(6)
    a.allocate(2)
    with pytest.raises(InvalidArgument, match=r"cannot allocate a negative number of slots \(-3\)"):
        a.allocate(-3)
    assert a.num_free == 4
    a.check()


def test_double_free_carries_the_reason_and_the_slot():
    rng = np.random.default_rng(31)
    a = SlotAllocator(9)
    s = a.allocate(5)
    victim = int(rng.choice(s))
    a.free(np.array([victim]))
    with pytest.raises(InvalidArgument, match=f"double free of slot {victim}: it is already free") as e:
        a.free(s)                        # unique ids, one of them already free
    assert e.value.reason == "DOUBLE_FREE" and e.value.metadata == {"slot": str(victim)}
    with pytest.raises(InvalidArgument, match=f"double free of slot {victim}: freed more often") as e:
        a.free(np.array([victim, victim]))
    assert e.value.reason == "DOUBLE_FREE" and e.value.metadata == {"slot": str(victim)}
    assert a.num_free == 5 and a.refcount(s).tolist() == [0 if x == victim else 1 for x in s.tolist()]


def test_sharing_a_plain_free_slot_names_it():
    a = SlotAllocator(7)
    held = a.allocate(3)
    free_slot = int(a.free_slots()[-1])
    with pytest.raises(InvalidArgument, match=f"slot {free_slot} is free and holds no cached page; it cannot "
                                              "be shared") as e:
        a.share(np.array([held[0], free_slot]))
    assert e.value.metadata == {"slot": str(free_slot)}
    assert a.refcount(held).tolist() == [1, 1, 1] and a.num_free == 4


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda a, used: a._cached.__setitem__(int(a._stack[0]), 0),
     "a slot is free twice (stack and cache, or twice in one)"),
    (lambda a, used: a._refcnt.__setitem__(int(a.free_slots()[0]), 1), "a free slot has owners"),
    (lambda a, used: a._refcnt.__setitem__(used, -1), "negative refcount"),
    (lambda a, used: a._refcnt.__setitem__(used, 0), "free count != slots with refcount 0"),
    (lambda a, used: a.cacheable.__setitem__(int(a._stack[0]), True),
     "a slot on the plain free stack is marked cacheable"),
    (lambda a, used: a.cacheable.__setitem__(next(iter(a._cached)), False),
     "a cached free slot is not marked cacheable"),
])
def test_check_names_the_broken_invariant(corrupt, message):
    a = SlotAllocator(8)
    a.caching = True
    s = a.allocate(5)
    a.cacheable[s[:2]] = True
    a.free(s[:4])                        # two slots to the LRU, two to the stack, one still used
    assert a.num_cached == 2 and a.num_used == 1
    a.check()
    corrupt(a, int(s[4]))
    with pytest.raises(AssertionError) as e:
        a.check()
    assert str(e.value) == message           # the whole text: a person reads it when a soak fails


def test_exhaustion_metadata_says_needed_and_free():
    a = SlotAllocator(6)
    a.allocate(4)
    with pytest.raises(ResourceExhausted) as e:
        a.allocate(5)
    assert e.value.metadata == {"needed": "5", "free": "2"}


def test_free_takes_int32_ids_and_names_the_first_bad_id():
    rng = np.random.default_rng(9)
    a = SlotAllocator(10)
    s = a.allocate(5)
    a.free(s[:3].astype(np.int32))                     # any integer dtype of ids, not only intp
    assert a.num_free == 8 and a.refcount(s).tolist() == [0, 0, 0, 1, 1]
    bad = int(rng.integers(10, 99))
    with pytest.raises(InvalidArgument) as e:
        a.free(np.array([0, s[3], bad, -4]))           # a valid 0 first: the message names the bad id
    assert e.value.message == f"slot {bad} does not exist (num_slots=10)"
    assert a.num_free == 8
    a.check()


@pytest.mark.parametrize("n", [0, -3])
def test_an_allocator_without_slots_is_refused_with_the_count(n):
    with pytest.raises(InvalidArgument) as e:
        SlotAllocator(n)
    assert e.value.message == f"num_slots must be > 0, got {n}"
    assert SlotAllocator(1).num_free == 1                  # one slot is an allocator


def test_refcounts_are_int32_owner_counts():
    a = SlotAllocator(6)
    s = a.allocate(3)
    a.share(s[[0, 2]], np.array([1, 2]))
    rc = a.refcount(s)
    assert rc.dtype == np.int32 and rc.tolist() == [2, 1, 3]
