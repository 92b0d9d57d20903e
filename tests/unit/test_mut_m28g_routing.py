"""ScorePrefix held to a plain-Python model of the prefix caches: a pool serves the longest run of a prompt's leading
full pages (at most (n - 1) // page_size) that some admitted prompt of the same salt began with (docs/DESIGN.md:
prefix caching). Both score_prefix (fleet index, per-pool asks, injected hash functions) and score_prefix_per_pool
are checked whole: every PrefixScore field, in order, with live workers."""

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument, NotFound
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.core.hashing import page_hashes
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import (
    MAX_SCORE_TOKENS,
    PrefixScore,
    score_prefix,
    score_prefix_per_pool,
    score_prefix_reply,
)
from kvservice.manager.workers import WorkerRegistry
from kvservice.v1 import block_manager_pb2 as pb

PS = 4
SPEC = CacheSpec.uniform(1, 1, 64, page_size=PS)
CACHED = ("direct", "wrapped")          # "wrapped": an injected hash function (the per-pool path), same hashes


def _pages(p, j):
    return tuple(tuple(p[k * PS:(k + 1) * PS]) for k in range(j))


class Model:
    def __init__(self):
        self.known: dict[str, set] = {}

    def admit(self, prompt, salt):
        full = len(prompt) // PS
        s = self.known.setdefault(salt, set())
        for j in range(1, full + 1):
            s.add(_pages(prompt, j))

    def hits(self, prompt, salt):
        s = self.known.get(salt, set())
        best = 0
        for j in range(1, (len(prompt) - 1) // PS + 1):
            if _pages(prompt, j) not in s:
                break
            best = j
        return best


@pytest.fixture(scope="module")
def world():
    rng = np.random.default_rng(2028)
    m = BlockManager()
    for name in CACHED:
        m.create_pool(name, SPEC, Sizing(num_slots=4000, max_seq_len=400), prefix_caching=True,
                      model="llm-a" if name == "direct" else "llm-b")
    m.pool_and_lock("wrapped")[0].prefix.hash_fn = \
        lambda pages, col, starts, full, ns: page_hashes(pages, col, starts, full, ns)
    m.create_pool("plain", SPEC, Sizing(num_slots=64, max_seq_len=256), model="llm-a")
    now = [0.0]
    m.workers = WorkerRegistry(10.0, clock=lambda: now[0])      # an injected clock: leases lapse on demand
    m.register_worker("w-0", "direct", address="10.0.0.9:1")     # lapses below: dead workers are not listed
    now[0] = 20.0
    m.register_worker("w-2", "direct", address="10.0.0.2:1")
    m.register_worker("w-1", "direct", address="10.0.0.1:1")
    m.register_worker("w-3", "plain", address="10.0.0.3:1")
    families = [rng.integers(1, 30_000, 90) for _ in range(3)]
    models = {name: Model() for name in CACHED}
    next_id = 1
    for name in CACHED:
        pool = m.pool_and_lock(name)[0]
        for _ in range(12):
            fam = families[int(rng.integers(3))]
            prompt = np.concatenate((fam[:int(rng.integers(1, 90))], rng.integers(1, 30_000, int(rng.integers(0, 9)))))
            salt = str(rng.choice(["", "t2"]))
            with m.locked(name):
                pool.step(admit_ids=[next_id], admit_tokens=[len(prompt)], admit_token_ids=prompt, admit_salts=[salt])
            models[name].admit(prompt.tolist(), salt)
            next_id += 1
    return m, families, models


def _queries(rng, families):
    out = []
    for _ in range(40):
        fam = families[int(rng.integers(3))]
        n = int(rng.integers(1, 100))
        q = np.concatenate((fam[:n], rng.integers(1, 30_000, int(rng.integers(0, 6)))))
        if rng.random() < 0.2:
            q = q.copy()
            q[int(rng.integers(len(q)))] += 1            # a page that differs somewhere
        out.append((q.astype(np.int64), str(rng.choice(["", "t2", "never"]))))
    return out


WORKERS = {"direct": (("w-1", "10.0.0.1:1"), ("w-2", "10.0.0.2:1")), "wrapped": (), "plain": (("w-3", "10.0.0.3:1"),)}


def _want(models, q, salt, names):
    out = []
    for name in names:
        hits = models[name].hits(q.tolist(), salt) if name in models else 0
        out.append(PrefixScore(name, hits * PS, PS, name in models, WORKERS[name]))
    return out


def test_scores_equal_the_model_on_every_path(world):
    m, families, models = world
    rng = np.random.default_rng(1)
    positive = 0
    for q, salt in _queries(rng, families):
        every = sorted(["direct", "plain", "wrapped"])
        want = _want(models, q, salt, every)
        assert score_prefix(m, q, salt) == want
        assert score_prefix_per_pool(m, q, salt) == want
        named = ["wrapped", "plain", "direct"]
        want_named = _want(models, q, salt, named)
        assert score_prefix(m, q, salt, pools=named) == want_named
        assert score_prefix_per_pool(m, q, salt, pools=named) == want_named
        only_a = [s for s in want if s.pool in ("direct", "plain")]
        assert score_prefix(m, q, salt, model="llm-a") == only_a
        assert score_prefix_per_pool(m, q, salt, model="llm-a") == only_a
        positive += sum(s.cached_tokens > 0 for s in want)
    assert positive > 20


@pytest.mark.parametrize("n", [0, 1, PS - 1, PS])
def test_a_prompt_of_at_most_one_page_scores_zero_everywhere(world, n):
    m, families, _ = world
    q = families[0][:n].astype(np.int64)
    want = [PrefixScore(name, 0, PS, name != "plain", WORKERS[name]) for name in ("direct", "plain", "wrapped")]
    assert score_prefix(m, q) == want
    assert score_prefix_per_pool(m, q) == want


def test_a_prompt_that_is_not_one_dimensional_integers_is_refused(world):
    m = world[0]
    for bad in (np.zeros((2, 4), dtype=np.int64), np.zeros(8, dtype=np.float32)):
        with pytest.raises(InvalidArgument):
            score_prefix(m, bad)
        with pytest.raises(InvalidArgument):
            score_prefix_per_pool(m, bad)


def test_the_reply_encodes_every_score_and_readable_limits_the_pools(world):
    m, families, models = world
    rng = np.random.default_rng(8)
    for q, salt in _queries(rng, families)[:10]:
        for dtype in (np.int32, np.int64):
            req = pb.ScorePrefixRequest(token_ids=to_tensor(q.astype(dtype)), cache_salt=salt)
            reply = score_prefix_reply(m, req)
            assert reply.num_tokens == len(q)
            got = [(s.pool, s.cached_tokens, s.cached_pages, s.page_size, s.prefix_caching, list(s.worker_ids),
                    list(s.worker_addresses)) for s in reply.scores]
            want = [(s.pool, s.cached_tokens, s.cached_tokens // PS, PS, s.prefix_caching, [w for w, _ in s.workers],
                     [a for _, a in s.workers]) for s in _want(models, q, salt, ["direct", "plain", "wrapped"])]
            assert got == want
        readable = frozenset({"wrapped", "plain"})
        want = _want(models, q, salt, ["plain", "wrapped"])
        assert score_prefix(m, q, salt, readable=readable) == want
        assert score_prefix_per_pool(m, q, salt, readable=readable) == want
        for fn in (score_prefix, score_prefix_per_pool):
            with pytest.raises(NotFound):
                fn(m, q, salt, pools=["direct"], readable=readable)
            with pytest.raises(NotFound):
                fn(m, q, salt, pools=["nope"])


def test_prompts_up_to_the_token_limit_are_scored_and_longer_ones_refused():
    m = BlockManager()                       # no pools: the limit alone is under test
    ok = np.ones(MAX_SCORE_TOKENS, dtype=np.int32)
    assert score_prefix(m, ok) == [] and score_prefix_per_pool(m, ok) == []
    assert score_prefix_reply(m, pb.ScorePrefixRequest(token_ids=to_tensor(ok))).num_tokens == MAX_SCORE_TOKENS
    over = np.ones(MAX_SCORE_TOKENS + 1, dtype=np.int32)
    for call in (lambda: score_prefix(m, over), lambda: score_prefix_per_pool(m, over),
                 lambda: score_prefix_reply(m, pb.ScorePrefixRequest(token_ids=to_tensor(over)))):
        with pytest.raises(InvalidArgument) as e:
            call()
        assert e.value.reason == "LIMIT_EXCEEDED"
    with pytest.raises(InvalidArgument):
        score_prefix_reply(m, pb.ScorePrefixRequest())
    with pytest.raises(InvalidArgument):
        score_prefix_reply(m, pb.ScorePrefixRequest(token_ids=to_tensor(np.ones(4, dtype=np.float32))))
