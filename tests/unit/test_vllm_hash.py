"""The vllm-sha256-cbor hash mode against vLLM's own hash_block_tokens (from its wheels, tests/vllm_ref.py).

A router that computes vLLM's block hashes from token ids (llm-d's indexer does) must find our pages:
the pool's hash of each full prompt page is the low 64 bits of vLLM's 32-byte block hash.
"""

import types

import numpy as np
import pytest

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.hashing import VLLM_DEFAULT_SEED, cbor, low64, vllm_block_hashes
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from tests.vllm_ref import module

PS = 16


def _vllm_chain(version, monkeypatch, tokens, seed, salt=""):
    """vLLM's block hashes of a prompt, computed by vLLM's own functions of that version."""
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    ku = module(version, "vllm.v1.core.kv_cache_utils")
    sha = getattr(ku, "sha256_cbor", None) or module(version, "vllm.utils.hashing").sha256_cbor
    ku.init_none_hash(sha)
    request = types.SimpleNamespace(mm_features=[], mm_positions=[], mm_hashes=[], lora_request=None,
                                    cache_salt=salt or None, prompt_embeds=None)
    out, parent = [], None
    for j in range(len(tokens) // PS):
        start = j * PS
        extra = ku.generate_block_hash_extra_keys(request, start, start + PS, 0)[0] if salt else None
        parent = ku.hash_block_tokens(sha, parent, tokens[start:start + PS].tolist(), extra)
        out.append(bytes(parent))
    return out


def _pool(seed=VLLM_DEFAULT_SEED):
    return Pool("v", plan(CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=64, max_seq_len=1024)),
                prefix_caching=True, prefix_hash="vllm-sha256-cbor", prefix_hash_seed=seed)


@pytest.mark.parametrize("salt", ["", "tenant-7"])
def test_our_hashes_are_vllm_0_33s_with_its_default_seed(monkeypatch, salt):
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 200_000, 5 * PS + 3)          # random non-zero ids, 1- to 5-byte CBOR ints
    tokens[:4] = [0, 23, 24, 65_536]                       # CBOR width boundaries
    want = _vllm_chain("0.33.0", monkeypatch, tokens, None, salt)
    assert vllm_block_hashes(tokens[:5 * PS].reshape(5, PS), VLLM_DEFAULT_SEED, salt) == want
    pool = _pool()
    pool.step(admit_ids=[1], admit_tokens=[len(tokens)], admit_token_ids=tokens, admit_salts=[salt])
    assert pool.prefix.hash[pool.sequence_slots(1)[:5]].tolist() == [low64(h) for h in want]


def test_one_prompts_hashes_through_the_vllm_hash_fn_are_vllm_0_33s(monkeypatch):
    """prompt_hashes (ScorePrefix's path) with a vllm-sha256-cbor pool's hash function: vLLM's own chain."""
    from kvservice.core.hashing import prompt_hashes

    tokens = np.random.default_rng(15).integers(1, 200_000, 4 * PS)
    want = _vllm_chain("0.33.0", monkeypatch, tokens, None)
    pool = _pool()
    got = prompt_hashes(tokens.reshape(4, PS), 0, pool.prefix.hash_fn)
    assert got.dtype == np.uint64 and got.tolist() == [low64(h) for h in want]


def test_unsalted_hashes_are_vllm_0_11s_given_its_pythonhashseed(monkeypatch):
    """vLLM 0.11 seeds NONE_HASH from PYTHONHASHSEED (random without it); with the same seed we agree."""
    tokens = np.random.default_rng(6).integers(0, 150_000, 3 * PS)
    want = _vllm_chain("0.11.0", monkeypatch, tokens, "4242")
    pool = _pool(seed="4242")
    pool.step(admit_ids=[1], admit_tokens=[len(tokens)], admit_token_ids=tokens)
    assert pool.prefix.hash[pool.sequence_slots(1)[:2]].tolist() == [low64(h) for h in want[:2]]
    assert vllm_block_hashes(tokens.reshape(3, PS), "4242") == want


def test_our_cbor_is_canonical_cbor():
    import cbor2

    for v in (None, 0, 23, 24, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**64 - 1, -1, -24, -25, -2**63,
              b"", b"\x00" * 32, "", "salt", "ü" * 30, (), (1, (2, "x"), None), [b"ab", [3] * 300]):
        assert cbor(v) == cbor2.dumps(v, canonical=True), v
    pages = np.array([[0, 23, 24, 255, 256, 65_535, 65_536, 2**32 - 1], [2**32, 2**40, -1, -24, -25, -256, -2**63, 7]])
    from kvservice.core.hashing import _cbor_ints
    body, ends = _cbor_ints(pages)
    raw = body.tobytes()
    assert raw[:ends[0]] == b"".join(cbor2.dumps(int(t)) for t in pages[0])
    assert raw[ends[0]:ends[1]] == b"".join(cbor2.dumps(int(t)) for t in pages[1])


def test_an_unknown_hash_mode_is_refused_with_the_known_ones():
    from kvservice.contract.errors import InvalidArgument
    from kvservice.manager.pools import BlockManager

    with pytest.raises(InvalidArgument, match="use one of kvservice, vllm-sha256-cbor"):
        BlockManager().create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=64),
                                   prefix_caching=True, prefix_hash="md5")


def test_cbor_of_simple_values_and_heads_is_rfc_8949():
    """Byte strings from RFC 8949's appendix A (encoding examples), typed here: the simple values, integers at each
    head width, negative integers, strings, byte strings and arrays."""
    from kvservice.core.hashing import cbor

    examples = [(False, "f4"), (True, "f5"), (None, "f6"), (0, "00"), (23, "17"), (24, "1818"), (100, "1864"),
                (1000, "1903e8"), (1000000, "1a000f4240"), (1000000000000, "1b000000e8d4a51000"),
                (18446744073709551615, "1bffffffffffffffff"), (-1, "20"), (-100, "3863"), (-1000, "3903e7"),
                ("", "60"), ("a", "6161"), ("IETF", "6449455446"), (b"", "40"), (b"\x01\x02\x03\x04", "4401020304"),
                ([], "80"), ([1, 2, 3], "83010203"), ([1, [2, 3], [4, 5]], "8301820203820405")]
    for value, hexed in examples:
        assert cbor(value).hex() == hexed, value


def test_a_prompt_without_a_full_page_does_not_stop_the_batchs_later_prompts(monkeypatch):
    """One step admits a prompt shorter than a page before one of three pages: the second still gets vLLM's
    hashes (the first has no full page to hash, and the batch goes on past it)."""
    rng = np.random.default_rng(16)
    short = rng.integers(1, 200_000, PS - 5)
    long_ = rng.integers(1, 200_000, 3 * PS + 2)
    want = _vllm_chain("0.33.0", monkeypatch, long_, None)
    pool = _pool()
    pool.step(admit_ids=[1, 2], admit_tokens=[len(short), len(long_)],
              admit_token_ids=np.concatenate([short, long_]))
    assert pool.prefix.hash[pool.sequence_slots(2)[:3]].tolist() == [low64(h) for h in want]
