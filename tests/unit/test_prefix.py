"""kvservice.core.prefix's pure parts against plain-Python references: chained page hashes, namespace ids."""

import numpy as np
import pytest

from kvservice.core.prefix import Namespaces, page_hashes

MASK = 2**64 - 1
GOLD, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix(x):
    """splitmix64's finaliser on a Python int."""
    x ^= x >> 30
    x = (x * M1) & MASK
    x ^= x >> 27
    x = (x * M2) & MASK
    return x ^ (x >> 31)


def page_hash(tokens):
    """A page's own token hash: mix of the sum of each token's mix, position-salted (hashing.token_hashes)."""
    return mix(sum(mix((t + (i + 1) * GOLD) & MASK) for i, t in enumerate(tokens)) & MASK)


def prompt_hashes_model(pages, ns):
    """Chained hashes of one prompt's full pages (0 is reserved for 'no page' and becomes 1)."""
    h, out = mix((ns + GOLD) & MASK), []
    for j, page in enumerate(pages):
        h = mix(h ^ page_hash(page) ^ ((j * M2) & MASK))
        out.append(h or 1)
    return out


@pytest.mark.parametrize("prompts", [6, 1])
def test_page_hashes_match_a_model_over_ragged_prompts(prompts):
    """Many prompts (one NumPy pass per page column) and one prompt (plain integers): the same chain."""
    rng = np.random.default_rng(17 + prompts)
    full = rng.integers(0 if prompts > 1 else 1, 5, prompts)
    ns = rng.integers(0, 4, prompts)
    ps = 3
    pages = rng.integers(-5, 2**62, (int(full.sum()), ps))
    starts = np.cumsum(full) - full
    col = np.concatenate([np.arange(f) for f in full]).astype(np.int64)
    got = page_hashes(pages, col, starts, full, ns)
    want = [h for a in range(prompts)
            for h in prompt_hashes_model(pages[starts[a]:starts[a] + full[a]].tolist(), int(ns[a]))]
    assert got.dtype == np.uint64 and got.tolist() == want


def test_a_page_whose_chained_hash_is_zero_gets_one():
    """0 marks a slot with no page: a page whose chain comes out 0 must not get it."""
    from kvservice.manager.fleet_index import unmix

    def un(x):
        return int(unmix(np.array([x], dtype=np.uint64))[0])

    rng = np.random.default_rng(3)
    ns, ps = 2, 4
    head = rng.integers(1, 50_000, ps - 1).tolist()
    # The first page's chain is mix(mix(ns + GOLD) ^ T): 0 exactly when T = mix(ns + GOLD) ^ unmix(0); T is
    # mix(S), S the sum of each token's mix, so the last token is chosen to complete S.
    want_s = un(mix((ns + GOLD) & MASK) ^ un(0))
    partial = sum(mix((t + (i + 1) * GOLD) & MASK) for i, t in enumerate(head)) & MASK
    last = (un((want_s - partial) & MASK) - ps * GOLD) & MASK
    assert mix(mix((ns + GOLD) & MASK) ^ page_hash([*head, last])) == 0      # the chain really is 0
    page = np.array([[*head, last - 2**64 if last >= 2**63 else last]], dtype=np.int64)
    got = page_hashes(page, np.array([0]), np.array([0]), np.array([1]), np.array([ns]))
    assert got.tolist() == [1]


def test_namespace_ids_are_dense_and_remembered_only_when_added():
    spaces = Namespaces()
    ids, new = spaces.ids(["t1", "t2", "t1", ""], ["", "lora", "", ""])
    assert ids.dtype == np.int64
    assert ids.tolist() == [0, 1, 0, 2] and new == {("t1", ""): 0, ("t2", "lora"): 1, ("", ""): 2}
    again, _ = spaces.ids(["", "t1"], ["", ""])
    assert again.tolist() == [0, 1]                      # nothing remembered yet: numbered afresh
    spaces.add(new)
    ids, new = spaces.ids(["t2", "t3"], ["lora", ""])
    assert ids.tolist() == [1, 3] and new == {("t3", ""): 3}


def test_namespace_ids_refuse_salts_and_keys_of_different_lengths():
    """One extra key per salt: a shorter list is an error, never ids left uninitialised."""
    with pytest.raises(ValueError):
        Namespaces().ids(["t1", "t2", "t3"], ["k"])


@pytest.mark.parametrize("ps", [1, 5, 16])
def test_token_hashes_match_the_model_with_a_fresh_position_table(monkeypatch, ps):
    """token_hashes against the plain-Python page hash, its per-page-size position table built afresh (a table
    cached by an earlier call would hide how it is built)."""
    from kvservice.core import hashing
    monkeypatch.setattr(hashing, "_POS", {})
    rng = np.random.default_rng(900 + ps)
    pages = rng.integers(-(2**62), 2**62, (7, ps))
    got = hashing.token_hashes(pages)
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == [page_hash([int(t) & MASK for t in row]) for row in pages]
