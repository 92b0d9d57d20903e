"""score_prefix_reply (the ScorePrefix RPC) checked whole: every request field reaches the scores (cache_salt and
extra_key: pages are shared only within one (salt, extra key) namespace; pools: those named, in that order, each
once; model: with no pools named, only the pools created for it; readable: only the caller's pools), every reply
field (num_tokens, and per pool: cached_tokens, cached_pages, page_size, prefix_caching, the live workers' ids and
addresses by id), for a fleet-index member, a pool with an injected hash function (asked one by one) and a pool
without a cache; and the refusals' exact messages, reasons and metadata (block_manager.proto's ScorePrefix).
Oracle: a plain-Python model of the caches (a pool serves the longest run of a prompt's leading full pages, at
most (n - 1) // page_size, that a prompt admitted in the same namespace began with; docs/DESIGN.md), the Model
of test_mut_m28g_routing.py keyed by (cache_salt, extra_key)."""

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument, NotFound
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.core.hashing import page_hashes
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import MAX_SCORE_TOKENS, score_prefix, score_prefix_reply
from kvservice.manager.workers import WorkerRegistry
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from tests.unit.test_mut_m28g_routing import PS, Model

SPACES = [("", ""), ("t1", ""), ("", "lora-7"), ("t1", "lora-7")]
MODEL_OF = {"idx": "llm-a", "own": "llm-b", "none": "llm-a"}       # idx: a fleet member; own: its own hash function
LIVE = {"idx": [("w-1", "10.1.0.1:9"), ("w-4", "10.1.0.4:9")], "own": [], "none": [("w-2", "10.1.0.2:9")]}


@pytest.fixture(scope="module")
def world():
    rng = np.random.default_rng(7073)
    m = BlockManager()
    now = [0.0]
    m.workers = WorkerRegistry(10.0, clock=lambda: now[0])
    spec = CacheSpec.uniform(1, 1, 64, page_size=PS)
    for name, model in MODEL_OF.items():
        m.create_pool(name, spec, Sizing(num_slots=2000, max_seq_len=400), prefix_caching=name != "none",
                      model=model)
    m.pool_and_lock("own")[0].prefix.hash_fn = lambda *a: page_hashes(*a)     # not the default: asked itself
    m.register_worker("w-3", "idx", address="10.1.0.3:9")                      # its lease lapses: not listed
    now[0] = 30.0
    for name, workers in LIVE.items():
        for wid, address in workers:
            m.register_worker(wid, name, address=address)
    families = [rng.integers(1, 30_000, 80) for _ in range(3)]
    admitted = {name: Model() for name in MODEL_OF}      # the prompts admitted in each pool, by (salt, key)
    next_id = 1
    for name in ("idx", "own"):
        pool = m.pool_and_lock(name)[0]
        for i in range(12):
            fam = families[i % 3]
            p = np.concatenate((fam[:int(rng.integers(PS, 80))], rng.integers(1, 30_000, int(rng.integers(0, 5)))))
            space = SPACES[i % len(SPACES)]
            with m.locked(name):
                pool.step(admit_ids=[next_id], admit_tokens=[len(p)], admit_token_ids=p, admit_salts=[space[0]],
                          admit_extra_keys=[space[1]])
            admitted[name].admit(p.tolist(), space)
            next_id += 1
    return m, families, admitted


def _score_rows(reply):
    return [(s.pool, s.cached_tokens, s.cached_pages, s.page_size, s.prefix_caching, list(s.worker_ids),
             list(s.worker_addresses)) for s in reply.scores]


def _want_rows(admitted, q, space, names):
    return [(n, admitted[n].hits(q.tolist(), space) * PS, admitted[n].hits(q.tolist(), space), PS, n != "none",
             [w for w, _ in LIVE[n]], [a for _, a in LIVE[n]]) for n in names]


def test_every_request_field_reaches_the_scores_and_every_reply_field_is_filled(world):
    m, families, admitted = world
    rng = np.random.default_rng(7074)
    hits = set()
    for i in range(30):
        fam = families[int(rng.integers(3))]
        q = np.concatenate((fam[:int(rng.integers(1, 80))], rng.integers(1, 30_000, int(rng.integers(0, 4)))))
        space = SPACES[i % len(SPACES)]
        dtype = (np.int32, np.int64)[i % 2]
        base = dict(token_ids=to_tensor(q.astype(dtype)), cache_salt=space[0], extra_key=space[1])
        every = _want_rows(admitted, q, space, ["idx", "none", "own"])
        hits.update((r[0], space) for r in every if r[1])
        reply = score_prefix_reply(m, pb.ScorePrefixRequest(**base))
        assert (reply.num_tokens, _score_rows(reply)) == (len(q), every)
        named = ["own", "none", "idx", "own"]                                   # in this order, each once
        reply = score_prefix_reply(m, pb.ScorePrefixRequest(pools=named, model="llm-a", **base))
        assert _score_rows(reply) == _want_rows(admitted, q, space, ["own", "none", "idx"])
        for model in ("llm-a", "llm-b"):
            reply = score_prefix_reply(m, pb.ScorePrefixRequest(model=model, **base))
            assert _score_rows(reply) == [r for r in every if MODEL_OF[r[0]] == model]
        mine = frozenset({"own", "none"})
        reply = score_prefix_reply(m, pb.ScorePrefixRequest(**base), mine)
        assert _score_rows(reply) == [r for r in every if r[0] in mine]
        with pytest.raises(NotFound) as e:
            score_prefix_reply(m, pb.ScorePrefixRequest(pools=["idx"], **base), mine)
        assert (e.value.message, e.value.metadata) == ("pool 'idx' does not exist", {"pool": "idx"})
    assert {(n, s) for n in ("idx", "own") for s in SPACES[1:]} <= hits      # every salted or keyed space served


def test_refusals_name_the_field_the_limit_and_the_shape(world):
    m = world[0]

    def refused(request=None, tokens=None):
        with pytest.raises(InvalidArgument) as e:
            if request is not None:
                score_prefix_reply(m, request)
            else:
                score_prefix(m, tokens)
        return e.value.message, e.value.reason, e.value.metadata

    assert refused(pb.ScorePrefixRequest(pools=["idx"])) == \
        ("token_ids is required: the prompt's token ids, INT32 or INT64", "INVALID_ARGUMENT", {})
    assert refused(pb.ScorePrefixRequest(token_ids=cpb.Tensor(dtype=cpb.FLOAT32, data=b"\0" * 8))) == \
        ("token_ids must be INT32 or INT64", "INVALID_ARGUMENT", {})
    over = ("token_ids has 1048577 tokens; ScorePrefix takes at most 1048576", "LIMIT_EXCEEDED",
            {"limit": "1048576"})
    assert MAX_SCORE_TOKENS == 1048576
    for code, size in ((cpb.INT32, 4), (cpb.INT64, 8)):
        big = cpb.Tensor(dtype=code, data=b"\1" + b"\0" * (size * (MAX_SCORE_TOKENS + 1) - 1))
        assert refused(pb.ScorePrefixRequest(token_ids=big)) == over
    assert refused(tokens=np.ones(MAX_SCORE_TOKENS + 1, dtype=np.int64)) == over
    square = cpb.Tensor(dtype=cpb.INT64, shape=[2, 3], data=b"\0" * 48)
    assert refused(pb.ScorePrefixRequest(token_ids=square)) == \
        ("token_ids must be 1-D, got shape [2, 3]", "INVALID_ARGUMENT", {})
    assert refused(tokens=np.zeros((2, 4), dtype=np.int64)) == \
        ("token_ids must be a 1-D integer array, got shape (2, 4) dtype int64", "INVALID_ARGUMENT", {})
    assert refused(tokens=np.zeros(8, dtype=np.float32)) == \
        ("token_ids must be a 1-D integer array, got shape (8,) dtype float32", "INVALID_ARGUMENT", {})
