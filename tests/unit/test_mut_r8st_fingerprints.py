"""PrefixDigests' default bounds (kvservice/state/fingerprints.py; the journal builds it with the defaults): at
most 256 prefixes kept, 16 MiB of prefix bytes; a full table is emptied before a new prefix goes in (class
docstring). Oracle: that policy recomputed by hand, and hashlib's blake2b-128 for every value."""

import hashlib

import numpy as np

from kvservice.state.fingerprints import PrefixDigests


def test_the_default_table_holds_256_prefixes_then_empties_for_the_next():
    rng = np.random.default_rng(8256)
    d = PrefixDigests()
    assert (d.max_keys, d.max_bytes) == (256, 16 << 20)
    cuts = []
    for k in range(257):
        data = rng.bytes(int(rng.integers(1024, 1400)) + 256)       # prefix = all but the last 256 bytes
        assert d(f"pool-{k}", data) == hashlib.blake2b(data, digest_size=16).digest()
        cuts.append(len(data) - 256)
        if k < 256:
            assert d.kept_bytes == sum(cuts)                           # 256 keys still fit
    assert d.kept_bytes == cuts[-1]                                    # the 257th emptied the table first
    assert d.hits == 0
