"""Prefix scores: how many tokens of a prompt each pool's prefix cache holds now (the ScorePrefix RPC).

A router asks this before sending a request, to pick the replica that recomputes least
(compare llm-d's GetPodScores). The answer for a pool is exactly what a Step admitting the
prompt would return in ``admit_cached_tokens`` at that moment: full pages whose chained hash is
indexed *and* whose cached page matches the prompt's tokens, namespace (salt + extra key) and
parent page, at most ``(n - 1) // page_size`` pages. Nothing changes (no LRU touch, no pin).

Cost: the prompt's page hashes are computed once per namespace id (NumPy over the pages, the
chain in Python integers), lazily in chunks of pages, and each pool is walked chunk by chunk
only while it keeps matching: a pool that misses at page 3 costs a few dictionary lookups.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

import numpy as np

from .errors import InvalidArgument
from .manager import BlockManager
from .prefix import _GOLD, _M1, _M2, _mix, page_hashes

#: Prompt tokens one ScorePrefix may carry.
MAX_SCORE_TOKENS = 1 << 20
#: Pages hashed and checked per round; later rounds run only while some pool still matches.
CHUNK_PAGES = 256
_MASK = (1 << 64) - 1
_GOLD_I, _M1_I, _M2_I = int(_GOLD), int(_M1), int(_M2)


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
    """Chained page hashes of one prompt for one namespace id, computed in chunks on demand.

    Equal to prefix.page_hashes(pages[None], [ns])[0] (tests hold it to that).
    pages: int64 [P, page_size].
    """

    def __init__(self, pages: np.ndarray, ns: int) -> None:
        self.pages = pages
        self.h = _mix_int((ns + _GOLD_I) & _MASK)
        self.out: list[int] = []
        self._page_h: np.ndarray | None = None

    def upto(self, n: int) -> list[int]:
        """The hashes computed so far, at least the first n pages' (n <= P). Read-only."""
        if len(self.out) < n:
            if self._page_h is None:
                self._page_h = _page_only_hashes(self.pages)
            h, out = self.h, self.out
            for j, ph in enumerate(self._page_h[len(out):n].tolist(), start=len(out)):
                h = _mix_int(h ^ ph ^ ((j * _M2_I) & _MASK))
                out.append(h or 1)
            self.h = h
        return self.out


def _mix_int(x: int) -> int:
    """prefix._mix (splitmix64 finaliser) on one Python int."""
    x ^= x >> 30
    x = (x * _M1_I) & _MASK
    x ^= x >> 27
    x = (x * _M2_I) & _MASK
    return x ^ (x >> 31)


def _page_only_hashes(pages: np.ndarray) -> np.ndarray:
    """Each page's own token hash, before chaining (the first loop of prefix.page_hashes): uint64 [P]."""
    with np.errstate(over="ignore"):
        tok = pages.astype(np.uint64)
        h = np.full(len(pages), _GOLD, dtype=np.uint64)
        for t in range(pages.shape[1]):
            h = _mix(h ^ (tok[:, t] + _GOLD))
    return h


def chained_hashes(pages: np.ndarray, ns: int) -> np.ndarray:
    """uint64 [P]: the Step's chained hashes of one prompt's full pages (int64 [P, page_size]) in namespace ns."""
    return np.array(_Chain(pages, ns).upto(len(pages)), dtype=np.uint64)


def _cached_pages(cache: object, pages: np.ndarray, limit: int, ns: int, chain: _Chain | None) -> int:
    """Pages of the prompt the cache would serve now (PrefixCache.match's rule, walked chunk by chunk)."""
    get = cache.by_hash.get
    prev = -1
    lo = 0
    while lo < limit:
        hi = min(limit, lo + CHUNK_PAGES)
        hashes = chain.upto(hi)[lo:hi] if chain is not None else \
            cache.hash_fn(pages[None, :hi], np.array([ns], dtype=np.int64))[0, lo:hi].tolist()
        cand = np.fromiter(map(get, hashes, repeat(-1)), dtype=np.int64, count=hi - lo)
        safe = np.maximum(cand, 0)
        ok = cand >= 0
        ok &= cache.namespace[safe] == ns
        ok &= (cache.tokens[safe] == pages[lo:hi]).all(axis=1)
        ok &= cache.parent[safe] == np.concatenate(([prev], cand[:-1]))
        if not ok.all():
            return lo + int(np.argmin(ok))
        prev = int(cand[-1])
        lo = hi
    return limit


def score_prefix(manager: BlockManager, token_ids: np.ndarray, salt: str = "", extra_key: str = "",
                 pools: list[str] | None = None, model: str = "") -> list[PrefixScore]:
    """Score one prompt against pools.

    token_ids: int32/int64 [n], the prompt (n <= MAX_SCORE_TOKENS).
    pools: names to score (NotFound for an unknown one), in this order; None/empty = every pool, by
    name, only those created for `model` when it is given.
    """
    tok = np.asarray(token_ids)
    if tok.ndim != 1 or tok.dtype.kind not in "iu":
        raise InvalidArgument(f"token_ids must be a 1-D integer array, got shape {tok.shape} dtype {tok.dtype}")
    if len(tok) > MAX_SCORE_TOKENS:
        raise InvalidArgument(f"token_ids has {len(tok)} tokens; ScorePrefix takes at most {MAX_SCORE_TOKENS}",
                              reason="LIMIT_EXCEEDED", limit=MAX_SCORE_TOKENS)
    tok = tok.astype(np.int64, copy=False)
    if pools:
        names = list(dict.fromkeys(pools))
        for name in names:
            with manager.locked(name):         # NotFound now, before any work
                pass
    else:
        names = manager.pool_names()
    alive: dict[str, list[tuple[str, str]]] = {}
    for w in manager.workers.workers():
        if w.alive:
            alive.setdefault(w.pool, []).append((w.worker_id, w.address))
    chains: dict[tuple[int, int], _Chain] = {}     # (page_size, ns) -> chain
    out = []
    for name in names:
        with manager.locked(name) as pool:
            if not pools and model and pool.model != model:
                continue
            cache, ps = pool.prefix, pool.page_size
            hits = 0
            if cache is not None and len(tok) > ps:
                ids, new = cache.namespace_ids([salt], [extra_key])
                if not new:                     # a namespace the cache has never seen holds nothing
                    ns = int(ids[0])
                    full = len(tok) // ps
                    pages = tok[:full * ps].reshape(full, ps)
                    chain = None
                    if cache.hash_fn is page_hashes:
                        chain = chains.get((ps, ns))
                        if chain is None:
                            chain = chains[(ps, ns)] = _Chain(pages, ns)
                    hits = _cached_pages(cache, pages, (len(tok) - 1) // ps, ns, chain)
            out.append(PrefixScore(name, hits * ps, ps, cache is not None, tuple(alive.get(name, ()))))
    return out


__all__ = ["MAX_SCORE_TOKENS", "PrefixScore", "chained_hashes", "score_prefix"]
