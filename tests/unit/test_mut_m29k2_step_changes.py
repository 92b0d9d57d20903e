"""What a Step reports it changed (StepResult.changes, copies) against the pool's pages read before and after it.

GroupChanges' contract (kvservice/core/emit.py): for the extended rows at the front of the batch, `grown` the
positions of rows that gained pages, `counts` how many, `slots` their slots row after row (pages [held before,
held after)); `cow` the rows whose partly filled, shared last page was copied and `cow_slots` the slot now
holding it; `moved` the rows whose first kept page moved and `moved_first` that page now. The oracle here reads
each sequence's slots and first page (Pool.sequence_slots / first_page) before and after every Step of random
op mixes on every path: the decode repeat path, the one-full-group fast path and the general path.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import ResourceExhausted
from kvservice.core.invariants import assert_invariants
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from tests.differential import KINDS, replay
from tests.refmodel import Step


def _pages(pool: Pool, s: int) -> list[tuple[int, list[int]]]:
    return [(pool.first_page(s, g), pool.sequence_slots(s, g).tolist()) for g in range(len(pool.allocators))]


def _check(pool: Pool, kw: dict):
    ps = pool.page_size
    e_ids = [int(x) for x in kw.get("extend_ids", [])]
    e_k = [int(x) for x in kw.get("extend_tokens", [])]
    tokens = dict(zip(*(x.tolist() for x in pool.sequences()), strict=True))
    before = {s: _pages(pool, s) for s in e_ids}
    owners: list[dict[int, int]] = [{} for _ in pool.allocators]       # slot -> live sequences holding it
    for s in tokens:
        for g, (_, slots) in enumerate(_pages(pool, s)):
            for x in slots:
                owners[g][x] = owners[g].get(x, 0) + 1
    try:
        res = pool.step(**kw)
    except ResourceExhausted:
        return None
    assert res.num_extended == len(e_ids) and res.seq_ids[:len(e_ids)].tolist() == e_ids
    for g in range(len(pool.allocators)):
        grown, counts, slots, cow, cow_slots, moved, moved_first, copies = [], [], [], [], [], [], [], []
        for i, (s, k) in enumerate(zip(e_ids, e_k, strict=True)):
            old = tokens[s]
            h0, h1 = -(-old // ps), -(-(old + k) // ps)
            f0, s0 = before[s][g]
            f1, s1 = _pages(pool, s)[g]
            assert len(s1) == h1 - f1
            if h1 > h0:
                grown.append(i)
                counts.append(h1 - h0)
                slots += s1[h0 - f1:]
            if old % ps and h0 - 1 >= f1 and s0[h0 - 1 - f0] != s1[h0 - 1 - f1]:
                assert owners[g][s0[h0 - 1 - f0]] > 1, "copy-on-write of a page no other sequence held"
                cow.append(i)
                cow_slots.append(s1[h0 - 1 - f1])
                copies.append([s0[h0 - 1 - f0], s1[h0 - 1 - f1]])
            if f1 != f0:
                moved.append(i)
                moved_first.append(f1)
            assert s1[max(f0, f1) - f1:min(h0, h1) - f1 - (1 if i in cow else 0)] == \
                s0[max(f0, f1) - f0:min(h0, h1) - f0 - (1 if i in cow else 0)]   # kept pages never move
        ch = res.changes[g]
        got = [ch.grown.tolist(), ch.counts.tolist(), ch.slots.tolist(), ch.cow.tolist(), ch.cow_slots.tolist(),
               ch.moved.tolist(), ch.moved_first.tolist()]
        assert got == [grown, counts, slots, cow, cow_slots, moved, moved_first], (g, kw)
        cp = res.copies[g] if len(res.copies) > g else np.zeros((0, 2), dtype=np.int64)
        assert sorted(cp.tolist()) == sorted(copies), (g, kw)
    return res


def _ops(rng: np.random.Generator, max_len: int, ps: int, prefix: bool, live: dict[int, int], forks: bool = True):
    """Random steps; live: seq id -> tokens, kept up to date by the caller after every step."""
    base = rng.integers(1, 500, max_len)
    nid = 1
    for _ in range(240):
        r = rng.random()
        kw: dict = {}
        if forks and r < 0.15 and 0 < len(live) <= 4:
            par = [int(x) for x in rng.choice(list(live), min(len(live), int(rng.integers(1, 4))), replace=False)]
            kids = list(range(nid, nid + len(par)))
            nid += len(par)
            yield {"fork_parents": par, "fork_children": kids}
            continue
        cand = [s for s, n in live.items() if n < max_len]
        if r < 0.55 and cand and len(live) <= 5:                    # a decode batch, maybe repeated
            batch = [int(x) for x in rng.choice(cand, min(len(cand), int(rng.integers(1, 12))), replace=False)]
            for _ in range(int(rng.integers(1, 4))):
                batch = [s for s in batch if live[s] < max_len]
                if not batch:
                    break
                yield {"extend_ids": batch, "extend_tokens": [1] * len(batch)}
            continue
        free = [int(x) for x in rng.choice(list(live), min(len(live), int(rng.integers(0, 3))), replace=False)] \
            if live and rng.random() < 0.7 else []
        if len(live) > 4:                                              # keep the small pools from filling up
            free = sorted(set(free) | {max(live, key=live.get)})
        ext = [s for s in cand if s not in free and rng.random() < 0.4]
        ks = [int(rng.integers(1, min(3 * ps, max_len - live[s]) + 1)) for s in ext]
        adm = list(range(nid, nid + int(rng.integers(0, 3))))
        nid += len(adm)
        an = [int(rng.integers(1, max_len // 3)) for _ in adm]
        if free:
            kw["free_ids"] = free
        if ext:
            kw |= {"extend_ids": ext, "extend_tokens": ks}
        if adm:
            kw |= {"admit_ids": adm, "admit_tokens": an}
            if prefix:
                kw["admit_token_ids"] = np.concatenate([base[:n] if j % 2 else rng.integers(1, 500, n)
                                                        for j, n in enumerate(an)])
        if kw:
            yield kw


CASES = [("uniform", True, True), ("uniform", True, False), ("uniform", False, True), ("interleaved", True, False),
         ("interleaved", False, True), ("sliding", True, True), ("hybrid", True, True), ("hybrid", False, True),
         ("prefix", True, True), ("prefix", True, False), ("prefix_hybrid", True, True),
         ("prefix_hybrid", False, True), ("prefix_sliding_only", True, True), ("sized_hybrid", True, True),
         ("latent", True, True)]


@pytest.mark.parametrize("kind, fast, forks", CASES)
def test_reported_changes_and_copies_are_what_happened_to_the_pages(kind, fast, forks):
    k = KINDS[kind]
    pool = Pool(k.name, plan(k.spec, k.sizing), prefix_caching=k.prefix_caching)
    pool._fast = fast
    rng = np.random.default_rng(sum(map(ord, kind)))
    live: dict[int, int] = {}
    done = grew = cows = moves = repeats = 0
    for kw in _ops(rng, k.max_seq_len, k.spec.page_size, k.prefix_caching, live, forks):
        res = _check(pool, kw)
        if res is not None:
            done += 1
            grew += sum(len(c.grown) for c in res.changes)
            cows += sum(len(c.cow) for c in res.changes)
            moves += sum(len(c.moved) for c in res.changes)
            repeats += res.repeat
        live.clear()
        live.update(zip(*(x.tolist() for x in pool.sequences()), strict=True))
    assert done > 250 and grew > 200
    assert cows > 0 if forks else cows == 0      # forks of partly filled pages, then extended
    assert moves > 0 if pool._sliding else moves == 0
    if fast and not forks and not k.prefix_caching:
        assert repeats > 20                      # the decode fast path answered
    assert_invariants(pool)


def _as_step(kw: dict) -> Step:
    def ids(key: str) -> list[int]:
        return [int(x) for x in kw.get(key, [])]
    ext = list(zip(ids("extend_ids"), ids("extend_tokens"), strict=True))
    adm = list(zip(ids("admit_ids"), ids("admit_tokens"), strict=True))
    forks = list(zip(ids("fork_parents"), ids("fork_children"), strict=True))
    tok = [int(x) for x in kw["admit_token_ids"]] if "admit_token_ids" in kw else None
    return Step(free=ids("free_ids"), forks=forks, ext=ext, adm=adm, token_ids=tok)


@pytest.mark.parametrize("kind, fast, forks", [("uniform", True, True), ("uniform", True, False),
                                               ("prefix_hybrid", True, True), ("sized_hybrid", False, True)])
def test_the_same_op_streams_match_the_reference_model(kind, fast, forks):
    k = KINDS[kind]
    pool = Pool(k.name, plan(k.spec, k.sizing), prefix_caching=k.prefix_caching)
    live: dict[int, int] = {}
    steps = []
    for kw in _ops(np.random.default_rng(sum(map(ord, kind))), k.max_seq_len, k.spec.page_size, k.prefix_caching,
                   live, forks):
        try:
            pool.step(**kw)
        except ResourceExhausted:
            pass
        steps.append(_as_step(kw))
        live.clear()
        live.update(zip(*(x.tolist() for x in pool.sequences()), strict=True))
    replay(k, steps, fast=fast)
