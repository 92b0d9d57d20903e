"""kvservice/contract/mirror.py's refusals whose words are plain string literals, compared whole (their earlier
tests matched with pytest.raises(match=...), a search that a message with words added around it still passes): an
empty mirror's outputs and full reply, an unknown index space, and a delta that leaves a row without tokens; each
leaves the mirror as documented (an output refusal changes nothing, a refused delta leaves it holding nothing)."""

import numpy as np
import pytest

from kvservice.contract.mirror import MirrorError, PageTableMirror
from kvservice.contract.wire import to_tensor
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_mut_m28a_mirror import Model, check


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
    rng = np.random.default_rng(5)
    model = Model(rng, 4)
    model.rows = [model.row(1, 9, 1), model.row(2, 5, 1)]
    m = PageTableMirror(4)
    m.apply(model.full_reply(3))
    held = sorted(m.spaces)
    for out in (m.page_table, m.generations, m.num_pages, m.slot_mapping):
        with pytest.raises(MirrorError) as e:
            out(99)
        assert str(e.value) == f"no index space 99; spaces: {held}"
    check(m, model, 3)


def test_a_delta_that_leaves_a_row_without_tokens_is_refused_with_the_whole_message():
    rng = np.random.default_rng(7)
    model = Model(rng, 4, {0: (0, np.int32)})
    model.rows = [model.row(1, 8, 1), model.row(2, 3, 1)]
    m = PageTableMirror(4)
    m.apply(model.full_reply(1))
    reply = pb.StepReply(stream_seq=2)
    reply.delta.base_seq = 1
    reply.num_tokens.CopyFrom(to_tensor(np.array([9, 0], dtype=np.int64)))
    reply.new_token_indptr.CopyFrom(to_tensor(np.array([0, 1, 1], dtype=np.int64)))
    reply.tables.add(index_space=0).delta.pages.CopyFrom(to_tensor(np.array([55, 66], dtype=np.int32)))
    with pytest.raises(MirrorError) as e:
        m.apply(reply)
    assert str(e.value) == "every row holds at least one token"
    assert (m.seq, m.spaces) == (0, {})
