"""PrefixDigests (kvservice/state/fingerprints.py) against hashlib and a plain-Python model of its documented policy.

The value is blake2b-128 of the whole request, whatever is kept. The policy (class docstring and constants):
a request whose prefix (everything but its last TAIL = 256 bytes) is MIN_PREFIX = 1024 .. MAX_PREFIX = 2**20
bytes long keeps that prefix per key; a later request of that key that is longer than the kept prefix and starts
with it is a hit (only its tail hashed); at most max_keys prefixes and max_bytes prefix bytes are kept, a full
table being emptied before a new prefix goes in.
"""

import hashlib

import numpy as np

from kvservice.state.fingerprints import PrefixDigests


class Model:
    """The documented policy, by hand: key -> kept prefix bytes; hits counted."""

    def __init__(self, max_keys: int, max_bytes: int) -> None:
        self.max_keys, self.max_bytes = max_keys, max_bytes
        self.kept: dict[str, bytes] = {}
        self.hits = 0

    def __call__(self, key: str, data: bytes) -> None:
        p = self.kept.get(key)
        if p is not None and len(data) > len(p) and data[:len(p)] == p:
            self.hits += 1
            return
        cut = len(data) - 256
        if cut < 1024 or cut > min(1 << 20, self.max_bytes):          # never more than max_bytes kept
            return
        self.kept.pop(key, None)
        if len(self.kept) >= self.max_keys or sum(map(len, self.kept.values())) + cut > self.max_bytes:
            self.kept.clear()
        self.kept[key] = data[:cut]

    @property
    def kept_bytes(self) -> int:
        return sum(map(len, self.kept.values()))


def blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def test_the_prefix_bounds_are_inclusive_at_both_ends():
    rng = np.random.default_rng(29)
    for cut, kept in ((1023, False), (1024, True), (1 << 20, True), ((1 << 20) + 1, False)):
        d = PrefixDigests()
        first = rng.bytes(cut + 256)
        assert d("p", first) == blake(first)
        assert d.kept_bytes == (cut if kept else 0)
        later = first[:cut] + rng.bytes(300)              # same prefix, a new tail
        assert d("p", later) == blake(later)
        assert d.hits == int(kept)


def test_digests_and_what_is_kept_follow_the_model_over_random_requests():
    """Random requests over a few keys: prefixes repeated (hits), changed by one byte, too short, too long,
    prefixes equal to the whole request; a small table so both bounds empty it."""
    rng = np.random.default_rng(2929)
    for max_keys, max_bytes in ((3, 1 << 20), (8, 5000), (2, 3000), (4, 1500)):
        d, model = PrefixDigests(max_keys=max_keys, max_bytes=max_bytes), Model(max_keys, max_bytes)
        last: dict[str, bytes] = {}
        for _ in range(400):
            key = f"pool{int(rng.integers(5))}"
            kind = int(rng.integers(6))
            base = last.get(key)
            if base is not None and kind <= 2:                            # a steady loop: same prefix, new tail
                data = base[:len(base) - 256] + rng.bytes(int(rng.integers(1, 600)))
            elif base is not None and kind == 3:                          # one byte of the prefix differs
                data = bytearray(base)
                data[int(rng.integers(len(base) - 256))] ^= 1 + int(rng.integers(255))
                data = bytes(data)
            elif base is not None and kind == 4:                          # exactly the kept prefix (not longer)
                data = base[:len(base) - 256]
            else:
                data = rng.bytes(int(rng.choice([100, 1279, 1280, 1281, 2000, 2900])))
            assert d(key, data) == blake(data)
            model(key, data)
            if len(data) >= 1280:
                last[key] = data
            assert (d.hits, d.kept_bytes) == (model.hits, model.kept_bytes)
            assert len(model.kept) <= max_keys and model.kept_bytes <= max_bytes
        assert model.hits > 20


def test_a_request_longer_than_max_prefix_is_hashed_whole_and_keeps_nothing():
    rng = np.random.default_rng(4)
    d = PrefixDigests()
    big = rng.bytes((1 << 20) + 257)
    assert d("p", big) == blake(big) and d.kept_bytes == 0
    assert d("p", big + b"x") == blake(big + b"x") and d.hits == 0


def test_the_table_fills_to_exactly_its_bounds_before_it_is_emptied():
    rng = np.random.default_rng(5)
    d = PrefixDigests(max_keys=2, max_bytes=3000)
    a, b = rng.bytes(1024 + 256), rng.bytes(1976 + 256)
    d("a", a)
    d("b", b)                                            # 1024 + 1976 = 3000 bytes: exactly max_bytes, both kept
    assert d.kept_bytes == 3000
    assert d("a", a + b"1") == blake(a + b"1") and d("b", b + b"1") == blake(b + b"1") and d.hits == 2
    c = rng.bytes(1100 + 256)
    d("c", c)                                            # a third key: the full table is emptied first
    assert d.kept_bytes == 1100
    d("a", a + b"2")
    assert d.hits == 2                                   # a's prefix went with the rest
    d("c", rng.bytes(1500 + 256))                        # replacing c's own prefix frees its bytes first
    assert d.kept_bytes == 1025 + 1500                   # a + "2" kept a 1025-byte prefix


def test_a_prefix_longer_than_max_bytes_is_never_kept():
    """max_bytes bounds the kept prefixes in all, even below MAX_PREFIX: a request whose prefix alone is longer is
    hashed whole and leaves the table as it was."""
    rng = np.random.default_rng(6)
    d = PrefixDigests(max_keys=4, max_bytes=2000)
    small, big = rng.bytes(1500 + 256), rng.bytes(2001 + 256)
    d("a", small)
    assert d.kept_bytes == 1500
    assert d("b", big) == blake(big) and d.kept_bytes == 1500
    assert d("b", big + b"x") == blake(big + b"x") and d.hits == 0
    assert d("a", small + b"y") == blake(small + b"y") and d.hits == 1
