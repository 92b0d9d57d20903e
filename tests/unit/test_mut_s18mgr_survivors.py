"""Manager functions held whole to independent oracles (mutation sample seed 18): the level-1 and level-2 reply
bounds against page counts computed by hand from the live sequences (docs/DESIGN.md: a row of n tokens holds
ceil(n / page_size) pages), the event ring's byte accounting and retention against a plain-Python ring (bytes of
hashes and token ids; oldest committed batches dropped past either bound), the per-tenant watcher cap's documented
default (half of max_watchers, at least 1), index-space bases in Step replies (base_0 = 0, base_{s+1} =
upper_bound_s) and the per-pool ScorePrefix path of a cache without an event index against a model of admitted
prompts."""

import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.core.cache_events import AllBlocksCleared, Batch, BlockRemoved, BlockStored
from kvservice.core.hashing import page_hashes
from kvservice.core.limits import ReplyModel, StepShape, step_reply_bound
from kvservice.manager.api import ManagerAPI
from kvservice.manager.event_log import EventLog, EventsConfig, LoggedBatch, _nbytes
from kvservice.manager.pools import BlockManager
from kvservice.manager.routing import score_prefix, score_prefix_per_pool
from kvservice.v1 import block_manager_pb2 as pb

PS = 4


def _u64(a):
    return to_tensor(np.asarray(a, dtype=np.uint64))


def _i64(a):
    return to_tensor(np.asarray(a, dtype=np.int64))


def _ceil(n):
    return -(-n // PS)


def test_level_one_and_two_reply_bounds_use_the_pools_tokens_as_documented():
    """Level 1 bounds the extended rows' pages by the pool's token total ((live + k) // ps + E, at most
    E * max_pages); level 2 by each row's own ceil((old + k) / ps). Hand-counted shapes, random live rows."""
    rng = np.random.default_rng(1802)
    max_seq_len = 240                      # max_pages = 60: far above what the few live tokens need
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=400, max_seq_len=max_seq_len))
    api = ManagerAPI(m)
    live: dict[int, int] = {}
    next_id, checked = 1, 0
    for _ in range(25):
        ext = [i for i in live if rng.random() < 0.6 and live[i] < max_seq_len - 3 * PS]
        k = rng.integers(1, 3 * PS, len(ext)).tolist()
        n_adm = int(rng.integers(0, 3))
        adm = rng.integers(1, 5 * PS, n_adm).tolist()
        adm_ids = list(range(next_id, next_id + n_adm))
        r = pb.StepRequest(pool="p")
        if ext:
            r.extend_seq_ids.CopyFrom(_u64(ext))
            r.extend_num_tokens.CopyFrom(_i64(k))
        if adm:
            r.admit_seq_ids.CopyFrom(_u64(adm_ids))
            r.admit_num_tokens.CopyFrom(_i64(adm))
        r.omit_tables = bool(rng.random() < 0.3)
        r.include_block_table = bool(rng.random() < 0.5)
        with m.locked("p") as pool:
            model = ReplyModel.of(pool.plan)
        assert model.max_pages == max_seq_len // PS
        a_pages = [_ceil(n) for n in adm]
        new_tokens = sum(k) + sum(adm)
        rows, e, a = len(ext) + n_adm, len(ext), n_adm
        quick = min(e * model.max_pages, (sum(live.values()) + sum(k)) // PS + e) + sum(a_pages)
        quick_wide = model.max_pages if e else max(a_pages, default=0)
        own = [_ceil(live[i] + kk) for i, kk in zip(ext, k, strict=True)]
        exact = sum(own) + sum(a_pages)
        exact_wide = max(own + a_pages, default=0)
        tables, bt = not r.omit_tables, r.include_block_table
        want1 = step_reply_bound(model, StepShape(rows, e, a, new_tokens, (quick,), quick_wide), tables, bt)
        want2 = step_reply_bound(model, StepShape(rows, e, a, new_tokens, (exact,), exact_wide), tables, bt)
        assert api.step_reply_bound(r, level=1) == want1
        assert api.step_reply_bound(r, level=2) == want2
        if e and tables:
            checked += quick < e * model.max_pages        # the pool's token total made the level-1 bound tighter
        api.Step(r)
        for i, kk in zip(ext, k, strict=True):
            live[i] += kk
        live.update(zip(adm_ids, adm, strict=True))
        next_id += n_adm
    assert checked > 5


def _stored(rng, pages, itemsize):
    dt = np.int64 if itemsize == 8 else np.int32
    return BlockStored(0, rng.integers(1, 2**62, pages).astype(np.uint64), 0,
                       rng.integers(1, 30_000, pages * PS).astype(dt), PS)


def test_the_ring_counts_the_bytes_of_hashes_and_tokens_and_drops_the_oldest_past_its_bounds():
    rng = np.random.default_rng(1818)
    max_batches, max_bytes = 6, 900
    log = EventLog("p", 0, max_batches, max_bytes)
    model: list[tuple[int, int]] = []          # (seq, bytes) retained
    for seq in range(1, 60):
        events, size = [], 0
        for _ in range(int(rng.integers(0, 4))):
            kind = int(rng.integers(3))
            n = int(rng.integers(1, 6))
            if kind == 0:
                item = int(rng.choice([4, 8]))
                events.append(_stored(rng, n, item))
                size += 8 * n + item * n * PS        # uint64 hashes, n * page_size token ids
            elif kind == 1:
                events.append(BlockRemoved(0, rng.integers(1, 2**62, n).astype(np.uint64)))
                size += 8 * n
            else:
                events.append(AllBlocksCleared())
        lb = LoggedBatch(Batch(seq, tuple(events)), 0.0, 0)
        lb.nbytes = _nbytes(lb.batch)
        assert lb.nbytes == size
        log.append(lb)
        log.commit(seq)
        model.append((seq, size))
        while len(model) > 1 and (len(model) > max_batches or sum(b for _, b in model) > max_bytes):
            model.pop(0)
        assert [b.seq for b in log.batches] == [s for s, _ in model]
        assert log.bytes == sum(b for _, b in model)
        assert log.oldest == model[0][0]


@pytest.mark.parametrize("n, cap", [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 3), (7, 3), (9, 4), (12, 6),
                                    (13, 6)])
def test_the_default_per_tenant_watcher_cap_is_half_of_max_watchers_at_least_one(n, cap):
    assert EventsConfig(max_watchers=n).watchers_per_tenant() == cap
    assert EventsConfig(max_watchers=n, max_watchers_per_tenant=5).watchers_per_tenant() == 5


def test_step_reply_tables_carry_each_index_spaces_base_and_bounds():
    """Three spaces of an interleaved 3-layer pool (scale 3, offset s): space s owns [base_s, upper_bound_s),
    base_0 = 0, base_{s+1} = upper_bound_s, upper_bound_s - base_s = num_slots * scale_s (docs/DESIGN.md)."""
    rng = np.random.default_rng(77)
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(3, 1, 64, page_size=PS, layout="interleaved"),
                  Sizing(num_slots=96, max_seq_len=96))
    with m.locked("p") as pool:
        num_slots = pool.plan.num_slots
    api = ManagerAPI(m)
    n = rng.integers(1, 5 * PS, 3)
    reply = api.Step(pb.StepRequest(pool="p", admit_seq_ids=_u64([5, 6, 7]), admit_num_tokens=_i64(n)))
    got = [(t.index_space, t.group, t.scale, t.offset, t.base, t.upper_bound) for t in reply.tables]
    assert got == [(s, 0, 3, s, 3 * s * num_slots, 3 * (s + 1) * num_slots) for s in range(3)]
    assert all(t.base > 0 for t in reply.tables[1:])


def _model_hits(admitted, prompt, salt):
    """Pages served: the longest run of leading full pages (at most (n - 1) // ps) some admitted prompt of the
    same salt began with."""
    best = 0
    for j in range(1, (len(prompt) - 1) // PS + 1):
        head = prompt[:j * PS]
        if not any(s == salt and len(p) >= j * PS and p[:j * PS] == head for p, s in admitted):
            break
        best = j
    return best


def test_per_pool_scores_of_a_cache_without_an_event_index_follow_the_model():
    """The per-pool path reads the cache's by_hash when it has no event index; prompts that leave a cached
    prefix mid-way (a hash the cache does not hold) score the pages before it."""
    rng = np.random.default_rng(1833)
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=2000, max_seq_len=400),
                  prefix_caching=True)
    pool = m.pool_and_lock("p")[0]
    fams = [rng.integers(1, 30_000, 80) for _ in range(3)]
    admitted = []
    for i in range(10):
        fam = fams[i % 3]
        p = np.concatenate((fam[:int(rng.integers(PS + 1, 80))], rng.integers(1, 30_000, int(rng.integers(0, 7)))))
        salt = str(rng.choice(["", "t"]))
        with m.locked("p"):
            pool.step(admit_ids=[i + 1], admit_tokens=[len(p)], admit_token_ids=p, admit_salts=[salt])
        admitted.append((p.tolist(), salt))
    pool.prefix.sink = None             # a cache without the event index: candidates come from by_hash
    partial = 0
    for _ in range(40):
        fam = fams[int(rng.integers(3))]
        q = np.concatenate((fam[:int(rng.integers(1, 80))], rng.integers(1, 30_000, int(rng.integers(1, 9)))))
        salt = str(rng.choice(["", "t"]))
        want = _model_hits(admitted, q.tolist(), salt)
        (score,) = score_prefix_per_pool(m, q.astype(np.int64), salt)
        assert score.cached_tokens == want * PS, (q, salt)
        partial += 0 < want < (len(q) - 1) // PS
    assert partial > 5


def test_a_hash_shared_across_salts_never_serves_another_salts_pages():
    """Forced collisions: a hash function that ignores the namespace gives a prompt the same hashes under every
    salt; the cache still serves a page only to its own salt (docs/DESIGN.md: prefix caching is per salt)."""
    rng = np.random.default_rng(1844)
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(1, 1, 64, page_size=PS), Sizing(num_slots=400, max_seq_len=200),
                  prefix_caching=True)
    pool = m.pool_and_lock("p")[0]
    pool.prefix.hash_fn = lambda pages, col, starts, full, ns: page_hashes(pages, col, starts, full, ns * 0)
    p = rng.integers(1, 30_000, int(rng.integers(4 * PS + 1, 8 * PS)))
    q = rng.integers(1, 30_000, 3 * PS)
    with m.locked("p"):
        pool.step(admit_ids=[1], admit_tokens=[len(p)], admit_token_ids=p, admit_salts=["a"])
        pool.step(admit_ids=[2], admit_tokens=[len(q)], admit_token_ids=q, admit_salts=["b"])
    for score in (score_prefix, score_prefix_per_pool):
        assert score(m, p.astype(np.int64), "a")[0].cached_tokens == (len(p) - 1) // PS * PS
        assert score(m, p.astype(np.int64), "b")[0].cached_tokens == 0
        assert score(m, q.astype(np.int64), "b")[0].cached_tokens == (len(q) - 1) // PS * PS
        assert score(m, q.astype(np.int64), "a")[0].cached_tokens == 0
