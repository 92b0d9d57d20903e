"""kvservice/contract/mirror.py's refusals whose words are plain string literals, compared whole (their earlier
tests matched with pytest.raises(match=...), a search that a message with words added around it still passes): an
empty mirror's outputs and full reply, an unknown index space, and a delta that leaves a row without tokens; each
leaves the mirror as documented (an output refusal changes nothing, a refused delta leaves it holding nothing).
A reply with any integer field of the wire malformed (a FLOAT32 tensor) is refused as one MirrorError naming that
field, full replies and deltas alike (every field a delta can carry), and the mirror then holds nothing.
"""

import numpy as np
import pytest

from kvservice.contract.mirror import MirrorError, PageTableMirror
from kvservice.contract.wire import to_tensor
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_mut_m28a_mirror import Model, check, holding, row_without_tokens_delta


def test_an_empty_mirror_refuses_every_output_with_the_documented_words():
    m = PageTableMirror(4)
    for out in (m.page_table, m.generations, m.num_pages, m.slot_mapping):
        with pytest.raises(MirrorError) as e:
            out(0)
        assert str(e.value) == "the mirror holds no tables (apply a reply with tables first)"
    with pytest.raises(MirrorError) as e:
        m.full_reply()
    assert str(e.value) == "the mirror holds no tables"
    assert m.seq == 0 and m.spaces == {}


def test_an_unknown_space_is_named_with_the_spaces_held_and_nothing_changes():
    model = Model(np.random.default_rng(5), 4)
    m = holding(model, [(1, 9, 1), (2, 5, 1)], 3)
    held = sorted(m.spaces)
    for out in (m.page_table, m.generations, m.num_pages, m.slot_mapping):
        with pytest.raises(MirrorError) as e:
            out(99)
        assert str(e.value) == f"no index space 99; spaces: {held}"
    check(m, model, 3)


def test_a_delta_that_leaves_a_row_without_tokens_is_refused_with_the_whole_message():
    m = holding(Model(np.random.default_rng(7), 4, {0: (0, np.int32)}), [(1, 8, 1), (2, 3, 1)], 1)
    with pytest.raises(MirrorError) as e:
        m.apply(row_without_tokens_delta())
    assert str(e.value) == "every row holds at least one token"
    assert (m.seq, m.spaces) == (0, {})


def _floats(t):
    """A FLOAT32 tensor of the same length (integers only are allowed in every field of a reply)."""
    from kvservice.contract.wire import from_tensor

    return to_tensor(np.zeros(len(from_tensor(t, "x", "iuf")), dtype=np.float32))


def _a_full_delta(seed: int):
    """A base full reply and a reordered-batch delta on it with every optional field set: base_rows, group 0's
    replaced_rows, group 1's first_rows and first_pages, and per space replaced (+ generations) and pages."""
    from tests.unit.test_mut_m28a_mirror import batch_delta

    for s in range(seed, seed + 200):
        rng = np.random.default_rng(s)
        model = Model(rng, 3)
        model.rows = [model.row(10 + i, int(rng.integers(4, 15)), 2, window="any") for i in range(6)]
        base = model.full_reply(1)
        reply, _ = batch_delta(model, 2, 1, 100, one_token_row=False)
        groups = {g.group: g for g in reply.delta.groups}
        if 0 in groups and 1 in groups and all(len(st.delta.replaced.data) for st in reply.tables if st.group == 0):
            return base, reply
    raise AssertionError("no delta with every field in 200 seeds")


FULL_FIELDS = ["seq_ids", "num_tokens", "new_token_indptr", "indptr", "indices", "generations"]
DELTA_FIELDS = ["num_tokens", "new_token_indptr", "base_rows", "seq_ids", "replaced_rows", "first_rows",
                "first_pages", "replaced", "replaced_generations", "pages", "generations"]


@pytest.mark.parametrize("field", FULL_FIELDS)
def test_a_full_reply_with_a_malformed_field_is_refused_naming_it(field):
    """apply() wraps the wire's refusal of a field into one MirrorError naming the field, and holds nothing."""
    base, _ = _a_full_delta(40)
    bad = pb.StepReply()
    bad.CopyFrom(base)
    target = bad.tables[0] if field in ("indptr", "indices", "generations") else bad
    getattr(target, field).CopyFrom(_floats(getattr(target, field)))
    m = PageTableMirror(3)
    with pytest.raises(MirrorError) as e:
        m.apply(bad)
    assert str(e.value) == f"the reply does not fit the tables it names ({field}: dtype FLOAT32 not allowed here)"
    assert (m.seq, m.spaces) == (0, {})


@pytest.mark.parametrize("field", DELTA_FIELDS)
def test_a_delta_with_a_malformed_field_is_refused_naming_it(field):
    base, reply = _a_full_delta(40)
    m = PageTableMirror(3)
    m.apply(base)
    ok = PageTableMirror(3)
    ok.apply(base)
    ok.apply(reply)                                       # the delta as made applies
    bad = pb.StepReply()
    bad.CopyFrom(reply)
    if field in ("base_rows",):
        target = bad.delta
    elif field in ("replaced_rows",):
        target = next(g for g in bad.delta.groups if g.group == 0)
    elif field in ("first_rows", "first_pages"):
        target = next(g for g in bad.delta.groups if g.group == 1)
    elif field in ("replaced", "replaced_generations", "pages", "generations"):
        target = bad.tables[0].delta
    else:
        target = bad
    getattr(target, field).CopyFrom(_floats(getattr(target, field)))
    with pytest.raises(MirrorError) as e:
        m.apply(bad)
    assert str(e.value) == f"the reply does not fit the tables it names ({field}: dtype FLOAT32 not allowed here)"
    assert (m.seq, m.spaces) == (0, {})
