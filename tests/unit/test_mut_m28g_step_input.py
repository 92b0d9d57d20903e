"""decode_step checked whole against what the request carries: each array field decoded from its Tensor (None when
unset), the flags, salts and extra keys (None when there are none), the count summaries (min, max, exact sum),
sequences, new tokens and count ranges, computed here by hand from random requests; and an undecodable array
named in InvalidArgument."""

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.wire import to_tensor
from kvservice.manager.step_input import STEP_ARRAYS, decode_step
from kvservice.v1 import block_manager_pb2 as pb

IDS = ("free_seq_ids", "extend_seq_ids", "admit_seq_ids", "fork_parent_ids", "fork_child_ids")


def _summary(a):
    if a is None or not len(a):
        return None
    v = [int(x) for x in a]
    return min(v), max(v), sum(v) if min(v) >= 0 else 0


def test_a_decoded_step_is_what_the_request_carries():
    rng = np.random.default_rng(99)
    for _ in range(200):
        r = pb.StepRequest(pool=f"pool-{int(rng.integers(100))}", omit_tables=bool(rng.random() < 0.5),
                           include_block_table=bool(rng.random() < 0.5))
        sent = {}
        for f in STEP_ARRAYS:
            if rng.random() < 0.4:
                continue
            n = int(rng.integers(0, 6))
            if f in IDS:
                a = rng.integers(1, 2**40, n).astype(rng.choice([np.uint64, np.int64]))
            elif f == "admit_token_ids":
                a = rng.integers(0, 50_000, int(rng.integers(0, 30))).astype(np.int32)
            else:
                a = rng.integers(-3 if rng.random() < 0.2 else 1, 1000, n).astype(rng.choice([np.int32, np.int64]))
            getattr(r, f).CopyFrom(to_tensor(a))
            sent[f] = a
        salts = [f"s{int(x)}" for x in rng.integers(0, 9, int(rng.integers(0, 3)))]
        keys = [f"k{int(x)}" for x in rng.integers(0, 9, int(rng.integers(0, 3)))]
        r.admit_cache_salts.extend(salts)
        r.admit_extra_keys.extend(keys)
        d = decode_step(r)
        assert d.pool == r.pool
        for f in STEP_ARRAYS:
            got = getattr(d, f)
            if f not in sent:
                assert got is None, f
            else:
                assert got.dtype == sent[f].dtype and got.tolist() == sent[f].tolist(), f
        assert d.tables is (not r.omit_tables) and d.block_table is r.include_block_table
        assert d.admit_salts == (salts or None) and d.admit_extra_keys == (keys or None)
        ext, adm = _summary(sent.get("extend_num_tokens")), _summary(sent.get("admit_num_tokens"))
        assert d.extend_counts == ext and d.admit_counts == adm
        assert d.count_ranges == (None if ext is None else ext[:2], None if adm is None else adm[:2])
        assert d.sequences == sum(len(sent.get(f, ())) for f in ("free_seq_ids", "extend_seq_ids",
                                                                   "admit_seq_ids", "fork_child_ids"))
        tokens = (ext[2] if ext else 0) + (adm[2] if adm else 0)
        assert d.new_tokens == max(tokens, len(sent.get("admit_token_ids", ())))


@pytest.mark.parametrize("field", STEP_ARRAYS)
def test_an_undecodable_array_is_named(field):
    r = pb.StepRequest(pool="p")
    t = getattr(r, field)
    t.CopyFrom(to_tensor(np.arange(1, 4, dtype=np.int64)))
    t.data = t.data[:-3]                                      # not a whole number of items
    with pytest.raises(InvalidArgument) as e:
        decode_step(r)
    assert field in e.value.message
