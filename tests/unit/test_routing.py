"""ScorePrefix: per pool, exactly the tokens an admission would find cached now; nothing changes; errors."""

import copy

import numpy as np
import pytest

from kvservice.client.codec import score_request, step_request
from kvservice.contract.errors import InvalidArgument, NotFound, ResourceExhausted
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.prefix import prompt_hashes
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import MAX_SCORE_TOKENS, chained_hashes, score_prefix
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from tests.kv_workload import PS, Workload, pool_step_args


@pytest.mark.parametrize(("pages", "ps", "ns"), [(1, 4, 0), (7, 4, 3), (300, 16, 1), (2, 1, 0)])
def test_chained_hashes_equal_the_steps_hashes(pages, ps, ns):
    rng = np.random.default_rng(pages)
    tok = rng.integers(-(2**40), 2**40, (pages, ps))           # negative and huge ids too
    ref = prompt_hashes(tok, ns)
    assert np.array_equal(chained_hashes(tok, ns), ref)


def busy_manager(num_pools=3, steps=60, seed=0):
    """Pools with prefix caches filled (and evicted) by the random workload; one pool without a cache."""
    m = BlockManager()
    spec = CacheSpec.uniform(1, 1, 64, page_size=PS)
    rng = np.random.default_rng(seed)
    w = Workload(rng)
    for i in range(num_pools):
        m.create_pool(f"p{i}", spec, Sizing(num_slots=48 + 16 * i, max_seq_len=192), prefix_caching=True,
                      model="m-even" if i % 2 == 0 else "m-odd")
        pool = m.pool_and_lock(f"p{i}")[0]
        wi = Workload(np.random.default_rng(seed + i))
        wi.families = w.families                                  # the same prompt families everywhere
        for _ in range(steps):
            kw = wi.step()
            try:
                pool.step(**pool_step_args(kw))
            except ResourceExhausted:
                kw = wi.step(pressure=True)
                pool.step(**pool_step_args(kw))
            wi.applied(kw)
    m.create_pool("plain", spec, Sizing(num_slots=16, max_seq_len=64))
    return m, w


def admit_now(m, pool, prompt, salt):
    """What a Step admitting the prompt would report, run on a copy (the real pool is not touched). When the
    copy has too few free slots for the admission, the Step's own matcher (PrefixCache.match) answers."""
    clone = copy.deepcopy(m.pool_and_lock(pool)[0])
    try:
        r = clone.step(admit_ids=[10**12], admit_tokens=[len(prompt)], admit_token_ids=prompt, admit_salts=[salt])
        return int(r.cached_tokens[0])
    except ResourceExhausted:
        pass
    cache, full = clone.prefix, len(prompt) // PS
    ids, new = cache.namespace_ids([salt], [""])
    if new or not full:
        return 0
    pages = np.asarray(prompt[:full * PS], dtype=np.int64).reshape(full, PS)
    hits, _ = cache.match(pages, np.zeros(full, dtype=np.int64), np.arange(full), np.array([(len(prompt) - 1) // PS]),
                          ids, prompt_hashes(pages, int(ids[0]), cache.hash_fn))
    return int(hits[0]) * PS


def test_scores_equal_what_an_admission_would_get_and_change_nothing():
    m, w = busy_manager()
    before = state_tree(m)
    nonzero = 0
    for k in range(40):
        prompt = w.prompt() if k % 4 else w.families[k % 4][:int(w.rng.integers(1, 120))]
        salt = "" if k % 3 else "tenant-b"
        scores = score_prefix(m, prompt, salt)
        assert [s.pool for s in scores] == ["p0", "p1", "p2", "plain"]
        for s in scores[:3]:
            assert s.cached_tokens == admit_now(m, s.pool, prompt, salt), (k, s)
            nonzero += s.cached_tokens > 0
        assert scores[3].cached_tokens == 0 and not scores[3].prefix_caching
    assert nonzero > 20                                          # the workload left plenty cached
    assert state_tree(m) == before                               # no LRU touch, no namespace, nothing


def test_pool_selection_by_name_and_model():
    m, w = busy_manager()
    prompt = w.families[0][:100]
    assert [s.pool for s in score_prefix(m, prompt, pools=["p2", "p0", "p2"])] == ["p2", "p0"]
    assert [s.pool for s in score_prefix(m, prompt, model="m-even")] == ["p0", "p2"]
    assert score_prefix(m, prompt, model="nobody") == []
    with pytest.raises(NotFound, match="pool 'nope' does not exist"):
        score_prefix(m, prompt, pools=["p0", "nope"])


def test_unknown_namespace_and_short_prompts_score_zero():
    m, w = busy_manager()
    prompt = w.families[1][:100]
    assert all(s.cached_tokens == 0 for s in score_prefix(m, prompt, "never-seen-tenant"))
    assert all(s.cached_tokens == 0 for s in score_prefix(m, prompt[:PS]))       # one page: its last token is computed
    assert all(s.cached_tokens == 0 for s in score_prefix(m, np.zeros(0, dtype=np.int64)))


def test_live_workers_are_the_pools_worker_set():
    m, w = busy_manager(num_pools=1)
    m.register_worker("w0", "p0", layer_begin=0, layer_end=1, address="10.0.0.1:50061")
    m.register_worker("w1", "p0", layer_begin=0, layer_end=1, address="10.0.0.2:50061")
    (s, _) = score_prefix(m, w.families[0][:50])
    assert s.workers == (("w0", "10.0.0.1:50061"), ("w1", "10.0.0.2:50061"))


def test_injected_hash_function_is_used():
    """A pool whose hash_fn is replaced (tests force collisions) is scored with that function."""
    m, _ = busy_manager(num_pools=1, steps=0)
    pool = m.pool_and_lock("p0")[0]
    pool.prefix.hash_fn = lambda pages, col, *_: (col + 1).astype(np.uint64)
    a = np.arange(1, 41, dtype=np.int64)
    pool.step(admit_ids=[1], admit_tokens=[40], admit_token_ids=a)
    assert score_prefix(m, a)[0].cached_tokens == 36
    b = a.copy()
    b[5] = 999                                                   # same (colliding) hashes, other tokens
    assert score_prefix(m, b)[0].cached_tokens == 4 == admit_now(m, "p0", b, "")


def test_api_checks_the_request_before_decoding():
    m, _ = busy_manager(num_pools=1, steps=0)
    api = ManagerAPI(m)
    with pytest.raises(InvalidArgument, match="token_ids is required"):
        api.ScorePrefix(pb.ScorePrefixRequest(pools=["p0"]))
    with pytest.raises(InvalidArgument, match="INT32 or INT64"):
        api.ScorePrefix(pb.ScorePrefixRequest(token_ids=cpb.Tensor(dtype=cpb.FLOAT32, data=b"\0" * 8)))
    big = cpb.Tensor(dtype=cpb.INT32, data=b"\0" * (4 * (MAX_SCORE_TOKENS + 1)))
    with pytest.raises(InvalidArgument, match=f"at most {MAX_SCORE_TOKENS}"):
        api.ScorePrefix(pb.ScorePrefixRequest(token_ids=big))
    with pytest.raises(InvalidArgument, match="must be 1-D"):
        api.ScorePrefix(pb.ScorePrefixRequest(token_ids=cpb.Tensor(dtype=cpb.INT64, shape=[2, 2], data=b"\0" * 32)))
    with pytest.raises(InvalidArgument, match="whole number"):
        api.ScorePrefix(pb.ScorePrefixRequest(token_ids=cpb.Tensor(dtype=cpb.INT64, data=b"\0" * 9)))
    prompt = np.arange(1, 30)
    assert score_request(prompt).token_ids.dtype == cpb.INT32                 # ids that fit travel as INT32
    wide = score_request([1, 2**40]).token_ids
    assert wide.dtype == cpb.INT64 and np.frombuffer(wide.data, "<i8").tolist() == [1, 2**40]
    reply = api.ScorePrefix(score_request(prompt, pools=("p0",)))
    assert reply.num_tokens == 29 and reply.scores[0].cached_tokens == 0
    api.Step(step_request("p0", admit=[1], admit_tokens=[29], admit_token_ids=prompt))
    reply = api.ScorePrefix(score_request(prompt, pools=("p0",)))               # registered pages, still in use
    assert (reply.scores[0].cached_tokens, reply.scores[0].cached_pages, reply.scores[0].page_size) == (28, 7, PS)
    r = api.Step(step_request("p0", admit=[2], admit_tokens=[29], admit_token_ids=prompt))
    assert r.admit_cached_tokens.data == np.array([28], dtype="<i8").tobytes()


def test_a_page_whose_parent_is_another_copy_is_not_a_hit():
    """Two prompts admitted in one step share 3 pages: the second's copies stay unregistered, so its 4th page hangs
    off a parent slot no lookup reaches. Hashes alone would say 5 pages; the parent chain says 3 (as Step does)."""
    m, _ = busy_manager(num_pools=1, steps=0)
    common = np.arange(1, 13)
    a = np.concatenate((common, np.arange(100, 121)))
    b = np.concatenate((common, np.arange(200, 221)))
    m.pool_and_lock("p0")[0].step(admit_ids=[1, 2], admit_tokens=[33, 33], admit_token_ids=np.concatenate((a, b)))
    (s,) = score_prefix(m, b, pools=["p0"])
    assert s.cached_tokens == 12 == admit_now(m, "p0", b, "")
    assert score_prefix(m, a, pools=["p0"])[0].cached_tokens == 32 == admit_now(m, "p0", a, "")


def test_the_api_scores_only_the_pools_the_caller_may_read():
    """ManagerAPI.ScorePrefix with `readable` (the caller's token's pools): no other pool is scored, and the
    readable ones score what an admission would get."""
    m, w = busy_manager()
    api = ManagerAPI(m)
    prompt = w.families[1][:100]
    everyone = api.ScorePrefix(score_request(prompt))
    assert [s.pool for s in everyone.scores] == ["p0", "p1", "p2", "plain"]
    reply = api.ScorePrefix(score_request(prompt), readable=frozenset({"p2", "p0"}))
    assert [(s.pool, s.cached_tokens) for s in reply.scores] == [(p, admit_now(m, p, prompt, "")) for p in ("p0", "p2")]
    assert reply.num_tokens == len(prompt) and any(s.cached_tokens for s in reply.scores)
