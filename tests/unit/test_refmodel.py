"""The reference model (tests/refmodel.py) alone, against values computed by hand from the docs.

The differential tests trust the model; these pin its reading of each documented rule.
"""

import pytest

from kvservice.contract.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from tests.refmodel import RefPool, Step


def test_copy_on_write_rule():
    # 12 tokens, page size 8: page 1 is partly filled. Parent 1 and children 2, 3 own it (r = 3).
    m = RefPool(8, [0], 32, 64)
    m.step(Step(adm=[(1, 12)]))
    m.step(Step(forks=[(1, 2), (1, 3)]))
    shared = m.s.seqs[1].pages[0][1]
    out = m.step(Step(ext=[(1, 1)]))                         # c = 1 < r = 3: the writer copies
    assert [src for src, _ in out.copies[0]] == [shared] and m.s.refs[0][shared] == 2
    out = m.step(Step(ext=[(3, 2), (2, 1)]))                 # c = r = 2: the first copies, the last writes
    assert [src for src, _ in out.copies[0]] == [shared]
    assert m.s.seqs[2].pages[0][1] == shared and m.s.seqs[3].pages[0][1] != shared
    assert out.rows[1].new_slots[0] == [(shared, 4)]
    assert m.s.refs[0][shared] == 1


@pytest.mark.parametrize(("old", "first"), [(24, 4), (23, 4), (21, 4), (20, 3), (5, 0)])
def test_window_release(old, first):
    # window 6, page size 4: growing from `old` releases the pages wholly before token old + 1 - 6
    m = RefPool(4, [0, 6], 32, 64)
    m.step(Step(adm=[(1, old)]))
    out = m.step(Step(ext=[(1, 3)]))
    assert m.s.seqs[1].first == [0, first] and out.released == first
    assert len(m.s.refs[1]) == -(-(old + 3) // 4) - first


def test_fork_copies_the_parent_before_its_extension():
    m = RefPool(4, [0, 6], 32, 64)
    m.step(Step(adm=[(1, 24)]))
    window = list(m.s.seqs[1].pages[1])
    out = m.step(Step(forks=[(1, 2)], ext=[(1, 1)]))
    assert [r.seq_id for r in out.rows] == [1, 2] and [r.num_tokens for r in out.rows] == [25, 24]
    assert m.s.seqs[2].held(1) == window and m.s.seqs[1].first == [0, 4]
    assert all(m.s.refs[1][x] == 1 for x in window[:4])      # the child's alone now, not freed


def test_prefix_hits_namespace_and_limit():
    m = RefPool(4, [0], 16, 64, prefix_caching=True)
    prompt = list(range(100, 109))                           # 9 tokens: 2 full pages
    m.step(Step(adm=[(1, 9)], token_ids=prompt))
    pages = m.s.seqs[1].pages[0]
    out = m.step(Step(adm=[(2, 8)], token_ids=prompt[:8]))   # (8 - 1) // 4 = 1 page may come from the cache
    assert out.cached_tokens == [4] and m.s.seqs[2].pages[0][0] == pages[0]
    out = m.step(Step(adm=[(3, 9)], token_ids=prompt))
    assert out.cached_tokens == [8] and m.s.seqs[3].pages[0][:2] == pages[:2]
    out = m.step(Step(adm=[(4, 9)], token_ids=prompt, salts=["other tenant"]))
    assert out.cached_tokens == [0]
    assert len(out.rows[0].new_slots[0]) == 9                # every token gets a slot mapping


def test_clean_slots_before_eviction_oldest_first():
    m = RefPool(2, [0], 6, 12, prefix_caching=True)
    m.step(Step(adm=[(1, 2)], token_ids=[1, 2]))
    m.step(Step(adm=[(2, 2)], token_ids=[3, 4]))
    a, b = m.s.seqs[1].pages[0][0], m.s.seqs[2].pages[0][0]
    m.step(Step(free=[1]))
    m.step(Step(free=[2]))                                   # cached: a (older), then b
    out = m.step(Step(adm=[(3, 8)]))                         # 4 pages: the 4 clean slots, no eviction
    assert out.evicted == [[]] and list(m.s.lru[0]) == [a, b]
    out = m.step(Step(ext=[(3, 2)]))                         # one more page: evicts a, the oldest
    assert out.evicted == [[a]] and list(m.s.lru[0]) == [b]
    with pytest.raises(ResourceExhausted):
        m.step(Step(ext=[(3, 2)], adm=[(4, 1)]))             # 2 pages, 1 free (b)
    assert m.s.refused == 1 and list(m.s.lru[0]) == [b] and m.s.seqs[3].n == 10


@pytest.mark.parametrize(("step", "error"), [
    (Step(adm=[(5, 0)]), InvalidArgument), (Step(adm=[(5, 1), (5, 1)]), InvalidArgument),
    (Step(free=[9]), NotFound), (Step(adm=[(1, 1)]), AlreadyExists), (Step(forks=[(1, 2)], free=[1]), InvalidArgument),
    (Step(ext=[(1, 62)]), InvalidArgument), (Step(adm=[(5, 40)]), ResourceExhausted),
])
def test_refused_steps_change_nothing(step, error):
    m = RefPool(4, [0], 8, 64)
    m.step(Step(adm=[(1, 3)]))
    before = (dict(m.s.seqs[1].__dict__), [dict(r) for r in m.s.refs], m.s.steps)
    with pytest.raises(error):
        m.step(step)
    assert (dict(m.s.seqs[1].__dict__), [dict(r) for r in m.s.refs], m.s.steps) == before


# ---- prefix caching on hybrid pools (ARCHITECTURE.md, "Hybrid models") -------------------------------
PROMPT = list(range(100, 121))          # 21 tokens, page size 4: 5 full pages, at most (21 - 1) // 4 = 5 cached


def _forget(m: RefPool, g: int, j: int, prompt=PROMPT) -> None:
    """Drop page j of `prompt` from group g's cache (what an eviction does to the index)."""
    del m.s.key_of[g][m.s.cache[g].pop((("", ""), tuple(prompt[:(j + 1) * 4])))[0]]


def test_hybrid_hit_takes_only_the_pages_the_window_attends():
    # windows 6 and 13: the first computed token (position 20) attends tokens 15..20 and 8..20,
    # so the groups keep pages (20 + 1 - 6) // 4 = 3.. and (20 + 1 - 13) // 4 = 2..
    m = RefPool(4, [0, 6, 13], 32, 64, prefix_caching=True)
    m.step(Step(adm=[(1, 21)], token_ids=PROMPT))
    one = m.s.seqs[1].pages
    out = m.step(Step(adm=[(2, 21)], token_ids=PROMPT))
    two = m.s.seqs[2]
    assert out.cached_tokens == [20] and two.first == [0, 3, 2]
    assert two.pages[0][:5] == one[0][:5] and two.pages[0][5] != one[0][5]
    assert two.pages[1][:3] == [None] * 3 and two.pages[1][3:5] == one[1][3:5] and two.pages[1][5] != one[1][5]
    assert two.pages[2][:2] == [None] * 2 and two.pages[2][2:5] == one[2][2:5]
    assert all(m.s.refs[1][x] == 2 for x in one[1][3:5]) and m.s.refs[1][one[1][2]] == 1
    assert [x for x, _ in out.rows[0].new_slots[1][:12]] == [None] * 12          # tokens 0..11: no page there
    assert out.rows[0].new_slots[1][12] == (one[1][3], 0)
    assert m.s.hits == [5, 2, 3] and m.stats()["prefix_cache_hits"] == 5      # the first full group's count


@pytest.mark.parametrize(("forgotten", "hit"), [((), 5), ((2,), 5), ((4,), 4), ((2, 4), 2), ((0, 2, 4), 0)])
def test_the_hit_is_the_largest_every_group_serves(forgotten, hit):
    # window 6: h = 5 needs the window group's pages 3, 4; h = 4 pages 2, 3; h = 3 pages 1, 2;
    # h = 2 pages 0, 1; h = 1 page 0. Forgetting page 2 costs nothing (h = 5 does not need it).
    m = RefPool(4, [0, 6], 32, 64, prefix_caching=True)
    m.step(Step(adm=[(1, 21)], token_ids=PROMPT))
    for j in forgotten:
        _forget(m, 1, j)
    out = m.step(Step(adm=[(2, 21)], token_ids=PROMPT))
    assert out.cached_tokens == [4 * hit]
    assert m.s.seqs[2].first[1] == max(0, (4 * hit + 1 - 6) // 4)


def test_a_window_page_is_confirmed_by_its_anchor():
    # The window group's page 4 was registered beside another full-group page than the one the full
    # group confirms now: not the same prompt state, so h drops to the largest h it does not need.
    m = RefPool(4, [0, 6], 32, 64, prefix_caching=True)
    m.step(Step(adm=[(1, 21)], token_ids=PROMPT))
    key = (("", ""), tuple(PROMPT[:20]))
    slot, anchor = m.s.cache[1][key]
    assert anchor == m.s.seqs[1].pages[0][4]
    m.s.cache[1][key] = (slot, m.s.seqs[1].pages[0][3])
    assert m.step(Step(adm=[(2, 21)], token_ids=PROMPT)).cached_tokens == [16]
    # Without a full group the parent's hash stands in, which the page's identity implies.
    m = RefPool(4, [6, 13], 32, 64, prefix_caching=True)
    m.step(Step(adm=[(1, 21)], token_ids=PROMPT))
    out = m.step(Step(adm=[(2, 21)], token_ids=PROMPT))
    assert out.cached_tokens == [20] and m.s.seqs[2].first == [3, 2] and m.s.hits == [2, 3]
    assert m.stats()["prefix_cache_hits"] == 2                  # group 0's count


def test_window_pages_are_registered_and_stay_cached_when_released():
    m = RefPool(4, [0, 6], 6, 64, prefix_caching=True)
    m.step(Step(adm=[(1, 9)], token_ids=PROMPT[:9]))              # pages 0, 1 registered in both groups
    released = m.s.seqs[1].pages[1][:2]
    assert set(m.s.key_of[1]) == set(released)
    m.step(Step(ext=[(1, 8)]))                                      # from 9 tokens: releases page 0
    m.step(Step(ext=[(1, 1)]))                                      # from 17 tokens: pages 1, 2
    assert m.s.seqs[1].first[1] == 3 and set(m.s.lru[1]) == set(released)     # page 2 was never registered
    out = m.step(Step(adm=[(2, 9)], token_ids=PROMPT[:9]))
    assert out.cached_tokens == [8] and m.s.seqs[2].pages[1][:2] == released and not m.s.lru[1]


def test_eviction_takes_leaves_first_oldest_first():
    # 8 slots, page size 4: a 3-page prompt (13 tokens: pages 0-2 registered, page 3 partial) is freed;
    # an admission needing 6 fresh pages takes the 5 clean slots and evicts one cached page: page 2,
    # the only leaf (pages 1 and 0 each have a registered page chained under them).
    m = RefPool(4, [0], 8, 64, prefix_caching=True)
    prompt = list(range(50, 63))
    m.step(Step(adm=[(1, 13)], token_ids=prompt))
    pages = list(m.s.seqs[1].pages[0])
    m.step(Step(free=[1]))
    assert m.eviction_order(0) == [pages[2], pages[1], pages[0]]
    out = m.step(Step(adm=[(2, 24)], token_ids=list(range(200, 224))))
    assert out.evicted[0] == [pages[2]]
    m.step(Step(free=[2]))
    out = m.step(Step(adm=[(3, 13)], token_ids=prompt))
    assert out.cached_tokens == [8]                          # pages 0 and 1 are still findable


def test_eviction_ties_go_to_the_lower_real_slot():
    m = RefPool(4, [0], 6, 64, prefix_caching=True)
    m.pos = lambda g, slot: -slot                            # real slots numbered the other way round
    m.step(Step(adm=[(1, 5), (2, 5)], token_ids=[*range(1, 6), *range(11, 16)]))
    a, b = m.s.seqs[1].pages[0][0], m.s.seqs[2].pages[0][0]
    m.step(Step(free=[1, 2]))                                # both leaves, released by one step
    assert m.eviction_order(0) == sorted([a, b], key=lambda x: -x)
