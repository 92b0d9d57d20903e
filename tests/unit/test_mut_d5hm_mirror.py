"""PageTableMirror: deltas with TableDelta.tokens_added, against block_manager.proto's comment on the field and the
plain-Python table model of tests/unit/test_mut_m28a_mirror.py.

The proto: tokens_added > 0 only with base_rows empty; every row of the base batch gained exactly that many tokens;
StepReply.num_tokens and new_token_indptr are then empty (num_tokens: the base's plus tokens_added; row b's new
tokens: [b * tokens_added, (b + 1) * tokens_added)). A delta that breaks that is refused (MirrorError, its exact
message), the mirror then holding nothing; a full reply brings it back.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.geometry import MAX_COUNT
from kvservice.contract.mirror import MirrorError, PageTableMirror
from kvservice.contract.wire import to_tensor
from tests.unit.test_mut_m28a_mirror import Model, check, decode_delta

REFUSED = ("a delta with tokens_added covers the base batch alone; it carries no base_rows, num_tokens or "
           "new_token_indptr")


def _mirror(seed: int) -> tuple[PageTableMirror, Model, int]:
    rng = np.random.default_rng(seed)
    ps = int(rng.integers(2, 9))
    model = Model(rng, ps)
    model.rows = [model.row(int(i), int(rng.integers(1, 40)), 1) for i in rng.choice(1000, 5, replace=False) + 1]
    m = PageTableMirror(ps)
    m.apply(model.full_reply(1))
    check(m, model, 1)
    return m, model, ps


@pytest.mark.parametrize("seed", [3, 17])
def test_tokens_added_deltas_give_the_models_tables_and_counts(seed):
    """A run of tokens_added deltas (1 token, then random counts up to two pages): after each, every output of the
    mirror equals the model's, num_tokens is the base's plus t and new_token_indptr is b * t."""
    m, model, ps = _mirror(seed)
    seq = 1
    for t in [1, 1, *np.random.default_rng(seed).integers(1, 2 * ps + 1, 4).tolist(), 1]:
        before = np.asarray(m.num_tokens).copy()
        reply = decode_delta(model, seq + 1, seq, int(t), tokens_added=True)
        assert not reply.HasField("num_tokens") and not reply.HasField("new_token_indptr")
        m.apply(reply)
        seq += 1
        check(m, model, seq)
        assert m.num_tokens.tolist() == (before + t).tolist()
        assert m.new_token_indptr.tolist() == [b * int(t) for b in range(len(model.rows) + 1)]


@pytest.mark.parametrize("extra", ["base_rows", "num_tokens", "new_token_indptr"])
def test_a_tokens_added_delta_that_carries_counts_or_rows_is_refused_naming_what_it_may_not_carry(extra):
    """tokens_added with base_rows, num_tokens or new_token_indptr: refused with the exact message, the mirror
    holding nothing after it; the next full reply applies."""
    m, model, _ = _mirror(29)
    b = len(model.rows)
    reply = decode_delta(model, 2, 1, 1, tokens_added=True)
    value = {"base_rows": np.arange(b, dtype=np.int32), "num_tokens": np.array([r["num"] for r in model.rows]),
             "new_token_indptr": np.arange(b + 1, dtype=np.int64)}[extra]
    target = reply.delta if extra == "base_rows" else reply
    getattr(target, extra).CopyFrom(to_tensor(value))
    with pytest.raises(MirrorError) as err:
        m.apply(reply)
    assert str(err.value) == REFUSED
    assert m.seq == 0 and m.spaces == {}
    m.apply(model.full_reply(3))
    check(m, model, 3)


def test_tokens_added_past_max_count_is_refused_naming_the_bound():
    """geometry.MAX_COUNT is the most a sequence can gain in one step: one more is refused, naming both."""
    m, model, _ = _mirror(31)
    reply = decode_delta(model, 2, 1, 1, tokens_added=True)
    reply.delta.tokens_added = MAX_COUNT + 1
    with pytest.raises(MirrorError) as err:
        m.apply(reply)
    assert MAX_COUNT == 1 << 40
    assert str(err.value) == ("tokens_added 1099511627777 is more than a sequence can gain in a step "
                              "(1099511627776)")
    assert m.seq == 0


def test_a_reply_whose_arrays_do_not_fit_is_refused_naming_the_cause_and_nothing_is_kept():
    """apply: a reply that fails inside (a wire refusal, a KVError: its message; a row index past the batch, an
    IndexError: its text) becomes one MirrorError "the reply does not fit the tables it names (<cause>)", raised
    without chaining the cause; the mirror then holds nothing until a full reply."""
    m, model, _ = _mirror(37)
    bad = model.full_reply(2)
    bad.num_tokens.CopyFrom(to_tensor(np.array([r["num"] for r in model.rows], dtype=np.float32)))
    with pytest.raises(MirrorError) as err:
        m.apply(bad)
    assert str(err.value) == "the reply does not fit the tables it names (num_tokens: dtype FLOAT32 not allowed here)"
    assert err.value.__cause__ is None and err.value.__suppress_context__ and m.seq == 0
    m.apply(model.full_reply(3))
    check(m, model, 3)

    b = len(model.rows)
    reply = decode_delta(model, 4, 3, 1, tokens_added=False)
    gd = reply.delta.groups.add(group=1)                      # a window moved on a row the batch does not have
    gd.first_rows.CopyFrom(to_tensor(np.array([b + 94], dtype=np.int32)))
    gd.first_pages.CopyFrom(to_tensor(np.array([0], dtype=np.int64)))
    with pytest.raises(MirrorError) as err:
        m.apply(reply)
    msg = str(err.value)
    assert msg.startswith("the reply does not fit the tables it names (") and msg.endswith(")"), msg
    assert str(b + 94) in msg and err.value.__cause__ is None and m.seq == 0 and m.spaces == {}
