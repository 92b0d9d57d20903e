"""Page hashes of the prefix cache: the default chained 64-bit hash, and vLLM's sha256-cbor block hash.

Two modes (``--prefix-hash``), each a function with the signature of :func:`page_hashes`:

``kvservice`` (default): page j of a prompt gets ``h_j = mix(h_{j-1} ^ T_j ^ j * M2)`` with
``h_{-1} = mix(namespace + GOLD)``, ``mix`` splitmix64's finaliser and ``T_j`` the page's own token
hash, ``mix(sum over t of mix(token_t + (t + 1) * GOLD))`` (mod 2^64). ``T`` is computed for every
page of a batch at once with a few NumPy passes over the token array (no loop over tokens), the
chain with one short pass per page column (or plain integers for one prompt). Deterministic in
every process (a journal replays to the same cache). Not collision resistant against a tenant who
crafts prompts; a hash is only a candidate that token ids confirm (prefix.py), except in pools of
sliding-window groups only, where the parent page's hash stands in for the parent page
(docs/ARCHITECTURE.md): use ``vllm-sha256-cbor`` where that matters.

``vllm-sha256-cbor``: vLLM's ``hash_block_tokens`` with ``sha256_cbor``: block j's 32-byte hash is
``sha256(cbor((parent, tuple(tokens), extra_keys), canonical))``, the first block's parent being
``NONE_HASH = sha256(cbor(seed))`` (vLLM's rule: ``PYTHONHASHSEED`` when set, else the fixed seed
"vllm-none-hash" of vLLM >= 0.12; vLLM 0.11 without PYTHONHASHSEED draws a random seed, which no
other process can match). ``extra_keys`` is None, or for a request with a cache salt (first block
only) ``(("cache_salt", salt),)`` as vLLM 0.33 tags it; an extra key (a LoRA name) is appended to
every block's keys as ``("extra_key", key)``. The pool keeps the low 64 bits of each hash
(``int.from_bytes(h, "big") & (2**64 - 1)``, what vLLM publishes with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``; 0 is kept as 1), so a router computing vLLM's hashes from
token ids finds our pages. The CBOR encoding of a batch's token arrays is built with NumPy; only
the sha256 of each page (chained, so one call per page) runs per page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from itertools import repeat

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_MASK = (1 << 64) - 1
# Shift counts as NumPy scalars made once: a ufunc given a fresh np.uint64 each call costs ~16 k instructions more.
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)
_M1_I, _M2_I, _GOLD_I = int(_M1), int(_M2), int(_GOLD)
_POS: dict[int, np.ndarray] = {}

DEFAULT_MODE = "kvservice"
VLLM_SHA256_CBOR = "vllm-sha256-cbor"
HASH_MODES = (DEFAULT_MODE, VLLM_SHA256_CBOR)
#: vLLM's seed of NONE_HASH when PYTHONHASHSEED is not set (vLLM >= 0.12, cryptographic hash functions).
VLLM_DEFAULT_SEED = "vllm-none-hash"


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


def _mix_int(x: int) -> int:
    """_mix on one Python int (< 2^64)."""
    x ^= x >> 30
    x = (x * _M1_I) & _MASK
    x ^= x >> 27
    x = (x * _M2_I) & _MASK
    return x ^ (x >> 31)


def chain_ints(h: int, terms: list[int], out: list[int], cols: list[int] | None = None) -> int:
    """The chain on plain integers: for each term c (a page's token hash ^ its column * M2), h = mix(h ^ c),
    appended to out (0 kept as 1). h: the chain's value before the first term. Returns the last h.
    cols: the pages' columns, when terms are the token hashes alone (the column's part is then added here).
    (_mix_int inlined: for a long prompt this loop is the chain's whole cost.)"""
    m1, m2, mask = _M1_I, _M2_I, _MASK
    for c, j in zip(terms, cols if cols is not None else repeat(0, len(terms)), strict=True):
        x = h ^ c ^ (j * m2 & mask)
        x ^= x >> 30
        x = (x * m1) & mask
        x ^= x >> 27
        x = (x * m2) & mask
        h = x ^ (x >> 31)
        out.append(h or 1)
    return h


def token_hashes(pages: np.ndarray) -> np.ndarray:
    """Each page's own token hash T (before chaining): pages int64 [N, page_size] -> uint64 [N].

    T = mix(sum_t mix(token_t + (t + 1) * GOLD)) mod 2^64: NumPy over the whole array, in place.
    """
    ps = pages.shape[1]
    pos = _POS.get(ps)
    if pos is None:
        pos = _POS[ps] = np.arange(1, ps + 1, dtype=np.uint64) * _GOLD
    # Array ufuncs on uint64 wrap silently (only NumPy scalar arithmetic warns of overflow): no errstate needed.
    # int64 -> uint64 is the same bits: a view, added into a fresh array we own (no separate copy).
    src = pages.view(np.uint64) if pages.dtype == np.int64 else pages.astype(np.uint64)
    x = np.add(src, pos)
    t = np.empty_like(x)                         # one scratch array for the three shifts
    np.right_shift(x, _S30, out=t)
    x ^= t
    x *= _M1
    np.right_shift(x, _S27, out=t)
    x ^= t
    x *= _M2
    np.right_shift(x, _S31, out=t)
    x ^= t
    return _mix(np.add.reduce(x, axis=1))


def page_hashes(pages: np.ndarray, col: np.ndarray, starts: np.ndarray, full: np.ndarray,
                namespaces: np.ndarray) -> np.ndarray:
    """Chained hashes of the full pages of A prompts, stored ragged (no A x longest-prompt array).

    pages: int64 [N, page_size] token ids of every full page, prompt after prompt.
    col: int64 [N] index of each page inside its prompt; starts: int64 [A] first page of each prompt;
    full: int64 [A] full pages of each prompt (N = full.sum()); namespaces: int64 [A] id per (salt, extra key).
    Returns uint64 [N], never 0. Work: a few NumPy passes over the tokens, then the chain.
    """
    n = len(pages)
    if not n:
        return np.zeros(0, dtype=np.uint64)
    if len(full) == 1:                                   # one prompt: the chain on plain integers
        out_l: list[int] = []
        chain_ints(_mix_int((int(namespaces[0]) + _GOLD_I) & _MASK), token_hashes(pages).tolist(), out_l,
                   col.tolist())
        return np.array(out_l, dtype=np.uint64)
    with np.errstate(over="ignore"):
        terms = token_hashes(pages) ^ (col.astype(np.uint64) * _M2)
        out = np.empty(n, dtype=np.uint64)
        order = np.argsort(-full, kind="stable")             # longest prompts first: column j's prompts are a prefix
        f, st = full[order], starts[order]
        h = _mix(namespaces[order].astype(np.uint64) + _GOLD)
        p = int(f[0])
        active = np.searchsorted(-f, -np.arange(p), side="left")   # prompts with more than j full pages
        for j in range(p):                                    # one pass per page column
            k = int(active[j])
            at = st[:k] + j
            h[:k] = _mix(h[:k] ^ terms[at])
            out[at] = h[:k]
        out[out == 0] = 1
    return out


def prompt_hashes(pages: np.ndarray, namespace: int,
                  hash_fn: Callable[..., np.ndarray] = page_hashes) -> np.ndarray:
    """Chained hashes of one prompt's full pages: pages int64 [P, page_size] -> uint64 [P]."""
    p = len(pages)
    return hash_fn(pages, np.arange(p, dtype=np.int64), np.zeros(1, dtype=np.int64),
                   np.array([p], dtype=np.int64), np.array([namespace], dtype=np.int64))


# ---- vLLM's sha256-cbor block hash --------------------------------------------------------------
def cbor(value: object) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic) of None, bool, int, bytes, str, list or tuple."""
    if value is None:
        return b"\xf6"
    if value is True or value is False:
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _head(0, value) if value >= 0 else _head(1, -1 - value)
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode()
        return _head(3, len(raw)) + raw
    if isinstance(value, (list, tuple)):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | info]) + n.to_bytes(size, "big")
    raise ValueError(f"integer {n} does not fit CBOR's 64-bit argument")


def _cbor_ints(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CBOR of every token of every page, concatenated: (bytes uint8 [B], page_end int64 [N] offsets).

    Vectorised: each token's head byte and argument width from its value, then a scatter of the
    big-endian argument bytes.
    """
    tok = pages.reshape(-1)
    neg = tok < 0
    arg = np.where(neg, -1 - tok, tok).view(np.uint64)       # CBOR's argument: n, or -1 - n for a negative n
    width = np.full(len(arg), 8, dtype=np.int64)
    info = np.full(len(arg), 27, dtype=np.uint8)
    for limit, w, code in ((1 << 32, 4, 26), (1 << 16, 2, 25), (1 << 8, 1, 24)):
        small = arg < np.uint64(limit)
        width[small] = w
        info[small] = code
    tiny = arg < np.uint64(24)
    width[tiny] = 0
    info[tiny] = arg[tiny].astype(np.uint8)
    head = np.where(neg, np.uint8(0x20), np.uint8(0)) | info
    size = 1 + width
    end = np.cumsum(size)
    start = end - size
    out = np.empty(int(end[-1]) if len(end) else 0, dtype=np.uint8)
    out[start] = head
    be = arg.astype(">u8").view(np.uint8).reshape(-1, 8)     # big-endian bytes of each argument
    for w in (1, 2, 4, 8):
        sel = np.flatnonzero(width == w)
        if len(sel):
            dst = start[sel, None] + 1 + np.arange(w)
            out[dst] = be[sel, 8 - w:]
    page_end = end.reshape(pages.shape)[:, -1] if pages.size else np.zeros(len(pages), dtype=np.int64)
    return out, page_end


def vllm_extra_keys(salt: str, extra_key: str, first: bool) -> tuple | None:
    """The extra keys hashed with a block (vLLM 0.33's tags): the salt on the first block, the extra key on all."""
    keys: list[tuple[str, str]] = []
    if extra_key:
        keys.append(("extra_key", extra_key))
    if first and salt:
        keys.append(("cache_salt", salt))
    return tuple(keys) if keys else None


def vllm_block_hashes(pages: np.ndarray, seed: str = VLLM_DEFAULT_SEED, salt: str = "", extra_key: str = "",
                      parent: bytes | None = None) -> list[bytes]:
    """vLLM's 32-byte block hashes of one prompt's full pages (int64 [P, page_size]), chained from `parent`
    (None = the first block, whose parent is NONE_HASH = sha256(cbor(seed)))."""
    if not len(pages):
        return []
    none_hash = hashlib.sha256(cbor(seed)).digest()
    body, ends = _cbor_ints(pages)
    ps = pages.shape[1]
    tokens_head = _head(4, ps)
    first_keys = cbor(vllm_extra_keys(salt, extra_key, True))
    other_keys = cbor(vllm_extra_keys(salt, extra_key, False))
    raw = body.tobytes()
    out: list[bytes] = []
    prev = parent
    lo = 0
    for j, hi in enumerate(ends.tolist()):
        keys = first_keys if j == 0 and parent is None else other_keys
        prev = hashlib.sha256(b"\x83\x58\x20" + (prev or none_hash) + tokens_head + raw[lo:hi] + keys).digest()
        out.append(prev)
        lo = hi
    return out


def low64(digest: bytes) -> int:
    """The low 64 bits of a vLLM block hash (vLLM's int form of it), never 0 (0 is kept as 1)."""
    return (int.from_bytes(digest, "big") & _MASK) or 1


class VllmHash:
    """The ``vllm-sha256-cbor`` mode as a PrefixCache hash function (page_hashes' signature).

    namespaces: the pool's Namespaces (ids -> (salt, extra key)), read for each prompt's extra keys.
    seed: NONE_HASH's seed (vLLM's PYTHONHASHSEED, or its default).
    """

    mode = VLLM_SHA256_CBOR

    def __init__(self, namespaces: object, seed: str = VLLM_DEFAULT_SEED) -> None:
        self.namespaces = namespaces
        self.seed = seed

    def __call__(self, pages: np.ndarray, col: np.ndarray, starts: np.ndarray, full: np.ndarray,
                 namespaces: np.ndarray) -> np.ndarray:
        out = np.empty(len(pages), dtype=np.uint64)
        names = self.namespaces.names()
        for a, (st, f) in enumerate(zip(starts.tolist(), full.tolist(), strict=True)):
            if not f:
                continue
            salt, key = names.get(int(namespaces[a]), ("", ""))
            digests = vllm_block_hashes(pages[st:st + f], self.seed, salt, key)
            out[st:st + f] = [low64(d) for d in digests]
        return out


def make_hash_fn(mode: str, namespaces: object, seed: str = VLLM_DEFAULT_SEED) -> Callable[..., np.ndarray]:
    """The hash function of a mode (HASH_MODES); ValueError naming the known modes."""
    if mode == DEFAULT_MODE:
        return page_hashes
    if mode == VLLM_SHA256_CBOR:
        return VllmHash(namespaces, seed)
    raise ValueError(f"unknown prefix hash mode {mode!r}; known: {', '.join(HASH_MODES)}")


__all__ = ["DEFAULT_MODE", "HASH_MODES", "VLLM_DEFAULT_SEED", "VLLM_SHA256_CBOR", "VllmHash", "cbor", "chain_ints",
           "low64", "make_hash_fn", "page_hashes", "prompt_hashes", "token_hashes", "vllm_block_hashes",
           "vllm_extra_keys"]
