"""Prefix scores: how many tokens of a prompt each pool's prefix cache holds now (the ScorePrefix RPC).

A router asks this before sending a request, to pick the replica that recomputes least
(compare llm-d's GetPodScores). The answer for a pool is exactly what a Step admitting the
prompt would return in ``admit_cached_tokens`` at that moment: full pages whose chained hash is
indexed *and* whose cached page matches the prompt's tokens, namespace (salt + extra key) and
parent page, at most ``(n - 1) // page_size`` pages. Nothing changes (no LRU touch, no pin).

Cost: each page's own token hash is computed once per (page size, namespace id), with NumPy.
Pools with one full-attention cache are answered together by the manager's fleet index
(fleet_index.py): one walk along the prompt's pages (a dictionary lookup per page, which gives
the page's chained hash, as far as any pool holds the prompt) and one token comparison per page
for all of them. The chain itself (Python integers, shared by the pools) is computed only for
the pools asked one by one: the others (hybrid and
sliding pools, injected hash functions) and the few the index cannot settle (a hash collision,
a stale parent pointer) are asked one by one (_pool_hits): a pool that does not hold the first
page costs one dictionary lookup; the others are checked with NumPy over all pages at once,
looking hashes up in the cache's NumPy mirror of its index (hash_index.py), in two rounds (the
first FIRST_PAGES pages, then the rest) so that a pool missing early costs little.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from kvservice.contract.errors import InvalidArgument, NotFound
from kvservice.contract.wire import from_tensor
from kvservice.core.hashing import _GOLD, _M2, _mix_int, chain_ints, page_hashes, prompt_hashes, token_hashes
from kvservice.manager.pools import BlockManager
from kvservice.v1 import block_manager_pb2 as pb

#: Prompt tokens one ScorePrefix may carry.
MAX_SCORE_TOKENS = 1 << 20
#: Pages checked in the first round; the rest only if all of them were hits.
FIRST_PAGES = 64
_MASK = (1 << 64) - 1
_GOLD_I = int(_GOLD)


@dataclass(frozen=True, slots=True)
class PrefixScore:
    """One pool's score. workers: (worker_id, address) of its live workers."""

    pool: str
    cached_tokens: int
    page_size: int
    prefix_caching: bool
    workers: tuple[tuple[str, str], ...] = ()

    @property
    def cached_pages(self) -> int:
        return self.cached_tokens // self.page_size


class _Chain:
    """Chained page hashes of one prompt for one namespace id, computed on demand (shared by the pools).

    Equal to prefix.prompt_hashes(pages, ns) (tests hold it to that).
    pages: int64 [P, page_size].
    """

    def __init__(self, pages: np.ndarray, ns: int) -> None:
        self.pages = pages
        self.seed = self.h = _mix_int((ns + _GOLD_I) & _MASK)     # the chain's value before page 0
        self.out: list[int] = []
        self._array = np.zeros(0, dtype=np.uint64)
        self._page_h: list[int] | None = None

    def terms(self) -> list[int]:
        """Per page, what the chain mixes in: the page's own token hash ^ j * M2 (mod 2^64). Page j's chain
        value is mix(value of page j - 1 ^ terms[j]), the first page's predecessor being `seed`."""
        if self._page_h is None:
            with np.errstate(over="ignore"):
                cols = np.arange(len(self.pages), dtype=np.uint64) * _M2
            self._page_h = (_page_only_hashes(self.pages) ^ cols).tolist()
        return self._page_h

    def upto(self, n: int) -> np.ndarray:
        """uint64 [>= n]: the hashes of at least the first n pages (n <= P). Read-only."""
        if len(self._array) >= n:
            return self._array
        self.h = chain_ints(self.h, self.terms()[len(self.out):n], self.out)
        self._array = np.array(self.out, dtype=np.uint64)
        return self._array


def _page_only_hashes(pages: np.ndarray) -> np.ndarray:
    """Each page's own token hash, before chaining (hashing.token_hashes): uint64 [P]."""
    return token_hashes(pages)


def chained_hashes(pages: np.ndarray, ns: int) -> np.ndarray:
    """uint64 [P]: the Step's chained hashes of one prompt's full pages (int64 [P, page_size]) in namespace ns."""
    return _Chain(pages, ns).upto(len(pages))[:len(pages)].copy()


def _candidates(cache: object, hashes: np.ndarray) -> np.ndarray:
    """int64 [n]: the slot registered for each hash, or -1 (the NumPy mirror when the cache has one)."""
    index = getattr(getattr(cache, "sink", None), "index", None)
    if index is not None:
        cand = index.lookup(hashes)
        stale = cand >= 0
        stale[stale] = cache.hash[cand[stale]] != hashes[stale]      # forgotten since: not a candidate
        cand[stale] = -1
        return cand
    get = cache.by_hash.get
    return np.fromiter(map(get, hashes.tolist(), repeat(-1)), dtype=np.int64, count=len(hashes))


def _cached_pages(cache: object, pages: np.ndarray, limit: int, ns: int,
                  hashes_upto: Callable[[int], np.ndarray]) -> int:
    """Pages of the prompt the cache would serve now (PrefixCache.match's rule).

    Checked in two rounds, the first FIRST_PAGES pages and then the rest, so a pool that misses early
    costs little. hashes_upto(n): uint64 [>= n], the prompt's chained hashes.
    """
    if cache.by_hash.get(int(hashes_upto(1)[0])) is None:
        return 0
    prev, lo = -1, 0
    for hi in (min(limit, FIRST_PAGES), limit):
        if hi <= lo:
            continue
        h = hashes_upto(hi)[lo:hi]
        cand = _candidates(cache, h)
        safe = np.maximum(cand, 0)
        ok = cand >= 0
        ok &= cache.namespace[safe] == ns
        ok &= cache.parent[safe] == np.concatenate(([prev], cand[:-1]))
        ok &= (cache.tokens[safe] == pages[lo:hi]).all(axis=1)
        if not ok.all():
            return lo + int(np.argmin(ok))
        prev, lo = int(cand[-1]), hi
    return limit


def _check_prompt(token_ids: np.ndarray) -> np.ndarray:
    """The prompt as int64 [n], or InvalidArgument."""
    tok = np.asarray(token_ids)
    if tok.ndim != 1 or tok.dtype.kind not in "iu":
        raise InvalidArgument(f"token_ids must be a 1-D integer array, got shape {tok.shape} dtype {tok.dtype}")
    if len(tok) > MAX_SCORE_TOKENS:
        raise InvalidArgument(f"token_ids has {len(tok)} tokens; ScorePrefix takes at most {MAX_SCORE_TOKENS}",
                              reason="LIMIT_EXCEEDED", limit=MAX_SCORE_TOKENS)
    return tok.astype(np.int64, copy=False)


def _pool_names(manager: BlockManager, pools: list[str] | None, readable: frozenset[str] | None = None) -> list[str]:
    """The pools to score: those named (NotFound for an unknown one, or one outside `readable`, in the words of
    an unknown one), else every pool the caller may read (readable None = every pool)."""
    if pools:
        names = list(dict.fromkeys(pools))
        for name in names:
            if readable is not None and name not in readable:
                raise NotFound(f"pool {name!r} does not exist", pool=name)      # as for a pool nobody has
            manager.pool_and_lock(name)        # NotFound now, before any work (without waiting for the pool)
        return names
    names = manager.pool_names()
    return names if readable is None else [n for n in names if n in readable]


def _live_workers(manager: BlockManager) -> dict[str, list[tuple[str, str]]]:
    alive: dict[str, list[tuple[str, str]]] = {}
    for w in manager.workers.workers():
        if w.alive:
            alive.setdefault(w.pool, []).append((w.worker_id, w.address))
    return alive


def _chain(chains: dict[tuple[int, int], _Chain], tok: np.ndarray, ps: int, ns: int) -> _Chain:
    """The prompt's chain for (page_size, namespace id), made once per query."""
    chain = chains.get((ps, ns))
    if chain is None:
        full = len(tok) // ps
        chain = chains[(ps, ns)] = _Chain(tok[:full * ps].reshape(full, ps), ns)
    return chain


def _pool_hits(pool: object, tok: np.ndarray, salt: str, extra_key: str, chains: dict[tuple[int, int], _Chain]) -> int:
    """Pages of the prompt one pool would serve now, asking the pool itself (the per-pool path; pool locked)."""
    cache, ps = pool.prefix, pool.page_size
    if cache is None or len(tok) <= ps:
        return 0
    ids, new = cache.namespace_ids([salt], [extra_key])
    if new:                                    # a namespace the cache has never seen holds nothing
        return 0
    ns = int(ids[0])
    if len(pool.prefixes) > 1 or any(pool.windows):        # hybrid or sliding: every group's rule
        full = not pool.windows[pool.prefixes.index(cache)]
        if full and cache.hash_fn is page_hashes and cache.by_hash.get(int(_chain(chains, tok, ps, ns).upto(1)[0])) \
                is None:
            return 0                           # the full group must serve page 0: without it, nothing is served
        return pool.cached_prefix_pages(tok, salt, extra_key)
    limit = (len(tok) - 1) // ps
    if cache.hash_fn is page_hashes:
        chain = _chain(chains, tok, ps, ns)
        return _cached_pages(cache, chain.pages, limit, ns, chain.upto)
    full = len(tok) // ps                      # an injected hash function (tests): its hashes, all at once
    pages = tok[:full * ps].reshape(full, ps)
    own = prompt_hashes(pages, ns, cache.hash_fn)
    return _cached_pages(cache, pages, limit, ns, lambda n: own)


def score_prefix(manager: BlockManager, token_ids: np.ndarray, salt: str = "", extra_key: str = "",
                 pools: list[str] | None = None, model: str = "",
                 readable: frozenset[str] | None = None) -> list[PrefixScore]:
    """Score one prompt against pools.

    token_ids: int32/int64 [n], the prompt (n <= MAX_SCORE_TOKENS).
    pools: names to score (NotFound for an unknown one), in this order; None/empty = every pool, by
    name, only those created for `model` when it is given (a pool deleted meanwhile is left out).
    readable: the pools the caller may read (its token's; None = all): no other pool is read, named or
    not, and the fleet index is walked only as far as one of them serves the prompt, so neither the
    answer nor its time depends on other tenants' caches (docs/SECURITY.md#fairness).

    Pools whose cache is a member of the manager's fleet index (fleet_index.py) are answered by
    one walk of that index per (page size, namespace id); the others (hybrid and sliding-only pools,
    injected hash functions) and members whose answer ends on a mixed or stale entry are asked one by
    one (_pool_hits). A member is read without its lock, as of its last Step: a Step in flight is not
    waited for. A prompt of at most one page scores 0 everywhere without asking (hits are whole pages
    and leave the last token to compute).
    """
    tok = _check_prompt(token_ids)
    chains: dict[tuple[int, int], _Chain] = {}     # (page_size, ns) -> chain
    rows, jobs = _collect(manager, tok, salt, extra_key, pools, model, chains, readable)
    ask = _answer_from_index(manager.fleet, tok, salt, extra_key, rows, jobs, chains, readable is not None)
    for r in ask:                                  # rows the index cannot settle: asked one by one
        try:
            with manager.locked(rows[r][0]) as pool:
                rows[r][1] = _pool_hits(pool, tok, salt, extra_key, chains)
        except NotFound:
            if pools:
                raise
            rows[r][1] = None                          # deleted meanwhile: left out
    alive = _live_workers(manager)
    return [PrefixScore(name, hits * ps, ps, caching, tuple(alive.get(name, ())))
            for name, hits, ps, caching in rows if hits is not None]


def _collect(manager: BlockManager, tok: np.ndarray, salt: str, extra_key: str, pools: list[str] | None,
             model: str, chains: dict, readable: frozenset[str] | None = None,
             ) -> tuple[list[list], dict[tuple[int, int], list[tuple[int, object]]]]:
    """The pools to score, in answer order, as rows [name, hits (None = from the index), page_size, caching],
    and the rows the fleet index answers, by (page_size, namespace id): [(row, member)]. Pools outside the
    index are scored here, under their lock."""
    fleet = manager.fleet
    rows: list[list] = []
    jobs: dict[tuple[int, int], list[tuple[int, object]]] = {}
    for name in _pool_names(manager, pools, readable):
        try:
            pool, lock = manager.pool_and_lock(name)
        except NotFound:
            if pools:
                raise
            continue                                   # deleted since the names were listed: not a pool now
        if not pools and model and pool.model != model:
            continue
        cache, ps = pool.prefix, pool.page_size
        if len(tok) <= ps:                             # hits are whole pages short of the last token: none
            rows.append([name, 0, ps, cache is not None])
            continue
        member = getattr(cache, "fleet", None)
        if member is None or member.index is not fleet or cache.hash_fn is not page_hashes:
            with lock:
                rows.append([name, _pool_hits(pool, tok, salt, extra_key, chains), ps, cache is not None])
            continue
        # Read from the index without waiting for the pool: a Step brings the index up to date when it
        # ends, so the index holds the pool as of its last Step (a Step in flight is not waited for).
        ids, new = cache.namespace_ids([salt], [extra_key])
        if new:
            rows.append([name, 0, ps, True])
            continue
        if (member.dirty or member.dirty_slots) and lock.acquire(blocking=False):
            try:                                       # changed outside a Step (tests, tools): catch up
                member.flush()
            finally:
                lock.release()
        jobs.setdefault((ps, int(ids[0])), []).append((len(rows), member))
        rows.append([name, None, ps, True])
    return rows, jobs


def _answer_from_index(fleet: object, tok: np.ndarray, salt: str, extra_key: str, rows: list[list],
                       jobs: dict[tuple[int, int], list[tuple[int, object]]], chains: dict,
                       only_members: bool = True) -> list[int]:
    """Fill the hits of the rows the fleet index settles (one walk per page size and namespace); returns
    the rows it cannot (a mixed or stale entry, or a pool that left the index). only_members: walk only as
    far as the rows' pools serve the prompt (a caller that may not read every pool)."""
    ask: list[int] = []
    for (ps, ns), members in jobs.items():
        limit = (len(tok) - 1) // ps
        chain = _chain(chains, tok, ps, ns)
        terms = chain.terms()[:limit]
        with fleet.lock:
            served, check = fleet.served_pages(ps, chain.seed, terms, chain.pages, (salt, extra_key),
                                               [m for _, m in members], only_members)
            for (r, _), hits, chk in zip(members, served.tolist(), check.tolist(), strict=True):
                if chk:                          # a stale or mixed entry of its own, or the pool left the index
                    ask.append(r)
                else:
                    rows[r][1] = hits
    return ask


def score_prefix_per_pool(manager: BlockManager, token_ids: np.ndarray, salt: str = "", extra_key: str = "",
                          pools: list[str] | None = None, model: str = "",
                          readable: frozenset[str] | None = None) -> list[PrefixScore]:
    """score_prefix asking every pool itself, without the fleet index (the reference and the bench's baseline)."""
    tok = _check_prompt(token_ids)
    names = _pool_names(manager, pools, readable)
    alive = _live_workers(manager)
    chains: dict[tuple[int, int], _Chain] = {}
    out = []
    for name in names:
        with manager.locked(name) as pool:
            if not pools and model and pool.model != model:
                continue
            hits = _pool_hits(pool, tok, salt, extra_key, chains)
            out.append(PrefixScore(name, hits * pool.page_size, pool.page_size, pool.prefix is not None,
                                   tuple(alive.get(name, ()))))
    return out


_ITEMSIZE = {10: 4, 11: 8}          # token_ids dtypes: INT32, INT64


def score_prefix_reply(manager: BlockManager, request: pb.ScorePrefixRequest,
                       readable: frozenset[str] | None = None) -> pb.ScorePrefixReply:
    """ScorePrefix: decode (size checked before decoding), score the pools of `readable` (None = all), encode."""
    if not request.HasField("token_ids"):
        raise InvalidArgument("token_ids is required: the prompt's token ids, INT32 or INT64")
    t = request.token_ids
    if t.dtype not in _ITEMSIZE:
        raise InvalidArgument("token_ids must be INT32 or INT64")
    if len(t.data) // _ITEMSIZE[t.dtype] > MAX_SCORE_TOKENS:
        raise InvalidArgument(f"token_ids has {len(t.data) // _ITEMSIZE[t.dtype]} tokens; ScorePrefix takes at most "
                              f"{MAX_SCORE_TOKENS}", reason="LIMIT_EXCEEDED", limit=MAX_SCORE_TOKENS)
    tok = from_tensor(t, "token_ids")
    if tok.ndim != 1:
        raise InvalidArgument(f"token_ids must be 1-D, got shape {list(tok.shape)}")
    scores = score_prefix(manager, np.asarray(tok), request.cache_salt, request.extra_key, list(request.pools),
                          request.model, readable)
    return pb.ScorePrefixReply(num_tokens=len(tok), scores=[
        pb.PrefixScore(pool=s.pool, cached_tokens=s.cached_tokens, cached_pages=s.cached_pages, page_size=s.page_size,
                       prefix_caching=s.prefix_caching, worker_ids=[w for w, _ in s.workers],
                       worker_addresses=[a for _, a in s.workers]) for s in scores])


__all__ = ["MAX_SCORE_TOKENS", "PrefixScore", "chained_hashes", "score_prefix", "score_prefix_per_pool",
           "score_prefix_reply"]
