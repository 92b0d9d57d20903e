"""Fingerprints of serialized requests: a reused request_id must carry the same request (kvservice/state/journal.py).

``digest`` hashes a request whole; ``PrefixDigests`` gives the same value for the requests of a steady decode
loop while hashing only the bytes after the prefix they repeat.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvservice.state import snapshot as snap


def digest(data: bytes) -> bytes:
    """16-byte fingerprint of a serialized request (a reused request_id must carry the same request)."""
    return snap.digest16(data)


class PrefixDigests:
    """digest() of requests that repeat a long prefix, hashing only what follows it.

    A steady decode loop sends the same arrays every step; what changes (request_id, stream_seq,
    delta fields) is serialized after them. Per key (the pool), the hash state after the last long
    request's prefix is kept; a request starting with those same bytes hashes only its tail. The
    value is digest(data) exactly: blake2b is computed over the bytes in order, wherever it pauses.
    Not thread-safe (the journal calls it under its lock). Bounded whatever the requests (the key is
    an unchecked pool name): at most max_keys prefixes of at most MAX_PREFIX bytes each, max_bytes in
    all; a longer request (or one whose prefix alone exceeds max_bytes) is hashed whole, and a full table is
    emptied before a new prefix goes in.
    """

    MIN_PREFIX = 1024          # shorter requests are hashed whole (cheap anyway)
    MAX_PREFIX = 1 << 20       # longer ones too: a steady decode request at B=1024 is ~20 KB
    TAIL = 256                 # bytes left out of a new prefix: where request_id and stream_seq sit

    def __init__(self, max_keys: int = 256, max_bytes: int = 16 << 20) -> None:
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self._longest = min(self.MAX_PREFIX, max_bytes)     # a prefix longer than max_bytes is never kept
        self._kept: dict[str, tuple[bytes, Any]] = {}     # key -> (prefix bytes, hash state after them)
        self.kept_bytes = 0
        self.hits = 0

    def __call__(self, key: str, data: bytes) -> bytes:
        kept = self._kept.get(key)
        if kept is not None and len(data) > len(kept[0]) and data.startswith(kept[0]):
            h = kept[1].copy()
            h.update(memoryview(data)[len(kept[0]):])
            self.hits += 1
            return h.digest()
        cut = len(data) - self.TAIL
        if not self.MIN_PREFIX <= cut <= self._longest:
            return digest(data)
        h = hashlib.blake2b(digest_size=16)
        h.update(memoryview(data)[:cut])
        old = self._kept.pop(key, None)
        if old is not None:
            self.kept_bytes -= len(old[0])
        if len(self._kept) >= self.max_keys or self.kept_bytes + cut > self.max_bytes:
            self._kept.clear()
            self.kept_bytes = 0
        self._kept[key] = (data[:cut], h.copy())
        self.kept_bytes += cut
        h.update(memoryview(data)[cut:])
        return h.digest()


__all__ = ["PrefixDigests", "digest"]
