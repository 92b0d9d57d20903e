"""kvservice/core/hashing.py against references that share none of its code: RFC 8949's own encoding examples
(Appendix A) for the vectorised CBOR of token arrays, a CBOR encoder written here with struct for vLLM's block
hash (sha256 of cbor((parent, tokens, extra_keys)), docs/DESIGN.md / the module docstring), and the documented
chained 64-bit hash on plain Python integers for token_hashes and page_hashes."""

import hashlib
import struct

import numpy as np
import pytest

from kvservice.core import hashing
from kvservice.core.hashing import (
    VLLM_DEFAULT_SEED,
    chain_ints,
    low64,
    page_hashes,
    token_hashes,
    vllm_block_hashes,
)

MASK = 2**64 - 1
GOLD, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

#: RFC 8949 Appendix A: integer -> its encoding (hex), plus the int64 extremes a token array can hold.
RFC_INTS = {0: "00", 1: "01", 10: "0a", 23: "17", 24: "1818", 25: "1819", 100: "1864", 1000: "1903e8",
            1000000: "1a000f4240", 1000000000000: "1b000000e8d4a51000", -1: "20", -10: "29", -100: "3863",
            -1000: "3903e7", 255: "18ff", 256: "190100", 65535: "19ffff", 65536: "1a00010000",
            2**32 - 1: "1affffffff", 2**32: "1b0000000100000000", 2**63 - 1: "1b7fffffffffffffff",
            -2**63: "3b7fffffffffffffff", -24: "37", -25: "3818", -257: "390100"}


def enc(v) -> bytes:
    """Canonical CBOR of None, int, bytes, str and tuples, written from RFC 8949 section 3 with struct."""
    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
            if n < 1 << (8 * struct.calcsize(fmt)):
                return bytes([major << 5 | info]) + struct.pack(fmt, n)
        raise AssertionError(n)
    if v is None:
        return b"\xf6"
    if isinstance(v, int):
        return head(0, v) if v >= 0 else head(1, -1 - v)
    if isinstance(v, bytes):
        return head(2, len(v)) + v
    if isinstance(v, str):
        return head(3, len(v.encode())) + v.encode()
    return head(4, len(v)) + b"".join(enc(x) for x in v)


def test_the_rfc_examples_encode_token_by_token_with_page_ends():
    """_cbor_ints of a [N, page_size] array: the concatenation of each token's RFC 8949 encoding, and each page's
    end offset into it."""
    vals = list(RFC_INTS)
    rng = np.random.default_rng(8949)
    rng.shuffle(vals)
    ps = 4
    vals = vals[:len(vals) // ps * ps]
    pages = np.array(vals, dtype=np.int64).reshape(-1, ps)
    body, ends = hashing._cbor_ints(pages)
    want = [bytes.fromhex(RFC_INTS[v]) for v in vals]
    assert body.dtype == np.uint8 and body.tobytes() == b"".join(want)
    sizes = np.array([len(w) for w in want]).reshape(-1, ps).sum(axis=1)
    assert ends.tolist() == np.cumsum(sizes).tolist()


def ref_block_hashes(pages, seed, salt, key, parent=None):
    none_hash = hashlib.sha256(enc(seed)).digest()
    out, prev = [], parent
    for j, page in enumerate(pages.tolist()):
        keys = (("extra_key", key),) if key else ()
        if j == 0 and parent is None and salt:
            keys += (("cache_salt", salt),)
        prev = hashlib.sha256(enc((prev or none_hash, tuple(page), keys or None))).digest()
        out.append(prev)
    return out


@pytest.mark.parametrize(("salt", "key"), [("", ""), ("tenant-7", ""), ("", "lora-a"), ("s\u00e9l", "lora-b")])
def test_vllm_block_hashes_are_sha256_of_the_documented_cbor_and_chain_from_a_parent(salt, key):
    """Random tokens over every CBOR width; a prompt hashed in two parts (the second from the first's last hash)
    gives the same chain, the salt only on the very first block; low64 is the digest's low 8 bytes."""
    rng = np.random.default_rng(len(salt) * 7 + len(key))
    widths = rng.choice([20, 200, 60_000, 2**31, 2**40], (7, 5))
    pages = rng.integers(0, widths, dtype=np.int64)
    seed = "seed-" + str(int(rng.integers(1, 1000)))
    got = vllm_block_hashes(pages, seed, salt, key)
    assert got == ref_block_hashes(pages, seed, salt, key)
    assert vllm_block_hashes(pages[:3], seed, salt, key) + vllm_block_hashes(pages[3:], seed, salt, key,
                                                                            parent=got[2]) == got
    assert got[3:] == ref_block_hashes(pages[3:], seed, salt, key, parent=got[2])
    assert [low64(d) for d in got] == [int.from_bytes(d[24:], "big") or 1 for d in got]
    assert vllm_block_hashes(pages[:0], seed, salt, key) == []
    assert vllm_block_hashes(pages[:1], VLLM_DEFAULT_SEED)[0] == ref_block_hashes(pages[:1], VLLM_DEFAULT_SEED,
                                                                                  "", "")[0]


def mix(x: int) -> int:
    x ^= x >> 30
    x = (x * M1) & MASK
    x ^= x >> 27
    x = (x * M2) & MASK
    return x ^ (x >> 31)


@pytest.mark.parametrize("ps", [1, 2, 5, 16])
def test_token_hashes_and_the_chain_are_the_documented_formula(ps):
    """T = mix(sum_t mix(token_t + (t + 1) GOLD)); h_j = mix(h_{j-1} ^ T_j ^ j M2), h_-1 = mix(ns + GOLD);
    chain_ints with and without the columns; page_hashes over ragged prompts (longest first inside)."""
    rng = np.random.default_rng(ps)
    pages = rng.integers(0, 2**63 - 1, (9, ps), dtype=np.int64)
    t = [mix(sum(mix((v + (i + 1) * GOLD) & MASK) for i, v in enumerate(row)) & MASK) for row in pages.tolist()]
    assert token_hashes(pages).tolist() == t
    assert token_hashes(pages.astype(np.int32) if ps == 1 else pages).dtype == np.uint64
    full = np.array([2, 0, 4, 3], dtype=np.int64)
    starts = np.cumsum(full) - full
    col = np.concatenate([np.arange(f) for f in full]).astype(np.int64)
    ns = rng.integers(0, 5, len(full))
    want = []
    for a, (st, f) in enumerate(zip(starts.tolist(), full.tolist(), strict=True)):
        h = mix((int(ns[a]) + GOLD) & MASK)
        for j in range(f):
            h = mix(h ^ t[st + j] ^ ((j * M2) & MASK))
            want.append(h or 1)
    assert page_hashes(pages, col, starts, full, ns).tolist() == want
    out: list[int] = []
    h0 = mix((int(ns[2]) + GOLD) & MASK)
    last = chain_ints(h0, t[2:6], out, [0, 1, 2, 3])
    assert out == want[2:6] and last == want[5]
    plain: list[int] = []
    terms = [t[2 + j] ^ ((j * M2) & MASK) for j in range(4)]
    assert chain_ints(h0, terms, plain) == want[5] and plain == want[2:6]


def unmix(y: int) -> int:
    """The inverse of mix (each step is invertible: an xor-shift by s undone by repeating it, a multiply by the
    inverse of an odd number mod 2^64)."""
    def unshift(x, s):
        out = x
        for _ in range(64 // s + 1):
            out = x ^ (out >> s)
        return out
    y = unshift(y, 31)
    y = (y * pow(M2, -1, 2**64)) & MASK
    y = unshift(y, 27)
    y = (y * pow(M1, -1, 2**64)) & MASK
    return unshift(y, 30)


def test_a_zero_chained_hash_becomes_one_in_a_batch_of_prompts_too():
    """A one-token page crafted so that its chain is 0 (T_0 = h_-1): 0 marks 'no page', so it is kept as 1, on the
    batch path (several prompts) as on the one-prompt path; the next page chains from the true value 0."""
    rng = np.random.default_rng(0)
    assert all(unmix(mix(x)) == x for x in rng.integers(0, 2**63, 20).tolist())
    ns = 3
    token = (unmix((ns + GOLD) & MASK) - GOLD) & MASK                # mix(token + 1 x GOLD) summed alone = ns + GOLD
    first = np.array([token], dtype=np.uint64).view(np.int64)
    other = rng.integers(1, 50_000, 3)
    pages = np.concatenate((first, other[:1], other[1:])).reshape(-1, 1)     # prompt A: 2 pages; prompt B: 2 pages
    full, starts = np.array([2, 2]), np.array([0, 2])
    col = np.array([0, 1, 0, 1])
    got = page_hashes(pages, col, starts, full, np.array([ns, 0]))
    t1 = mix(mix((int(other[0]) + GOLD) & MASK))
    assert got[0] == 1 and got[1] == mix(0 ^ t1 ^ M2)
    one = page_hashes(pages[:2], col[:2], starts[:1], full[:1], np.array([ns]))
    assert one.tolist() == got[:2].tolist()


def test_low64_keeps_zero_as_one():
    assert low64(bytes(range(24)) + bytes(8)) == 1
    assert low64(bytes(24) + (5).to_bytes(8, "big")) == 5
    assert low64(bytes([0xFF] * 32)) == MASK


def test_cbor_refuses_what_it_cannot_encode_by_name():
    with pytest.raises(ValueError, match=r"^integer 18446744073709551616 does not fit CBOR's 64-bit argument$"):
        hashing.cbor(2**64)
    with pytest.raises(TypeError, match=r"^cannot CBOR-encode float$"):
        hashing.cbor((1, 2.5))
    assert hashing.cbor(2**64 - 1) == bytes.fromhex("1bffffffffffffffff") and hashing.cbor(-2**64) == \
        bytes.fromhex("3bffffffffffffffff")


def test_the_vllm_hash_fn_hashes_each_prompt_with_its_own_salt_and_key():
    """VllmHash over a batch of prompts of different namespaces equals vllm_block_hashes of each prompt alone with
    its (salt, extra key), low 64 bits; a prompt without a full page is skipped."""
    from kvservice.core.prefix import Namespaces

    names = Namespaces()
    ids, new = names.ids(["", "tenant-a", "tenant-b", ""], ["", "", "lora", "lora"])
    names.add(new)
    fn = hashing.make_hash_fn("vllm-sha256-cbor", names, "seed-9")
    rng = np.random.default_rng(9)
    full = np.array([2, 0, 3, 1, 2], dtype=np.int64)
    ns = np.array([ids[1], ids[0], ids[2], ids[3], ids[0]], dtype=np.int64)
    pages = rng.integers(0, 2**33, (int(full.sum()), 4))
    starts = np.cumsum(full) - full
    col = np.concatenate([np.arange(f) for f in full]).astype(np.int64)
    got = fn(pages, col, starts, full, ns)
    want = []
    for st, f, i in zip(starts.tolist(), full.tolist(), ns.tolist(), strict=True):
        salt, key = names.name_of(i)
        want += [low64(d) for d in ref_block_hashes(pages[st:st + f], "seed-9", salt, key)]
    assert got.tolist() == want
    assert hashing.make_hash_fn("kvservice", names) is page_hashes
