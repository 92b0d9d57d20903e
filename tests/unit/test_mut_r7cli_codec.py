"""codec.parse_step / parse_copies name the field of a malformed tensor (kvservice/contract/wire.py's from_tensor:
"InvalidArgument naming the field"): a reply tensor of a dtype the field does not allow (FLOAT32 where
block_manager.proto says integers) is refused with "<field>: dtype FLOAT32 not allowed here", for every tensor of
a space's tables and of the copy-on-write pairs and their generations; a well-formed reply parses to its values.
"""

from __future__ import annotations

import pytest

from kvservice.client.codec import parse_copies, parse_step
from kvservice.contract.errors import InvalidArgument
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from tests.unit.test_mut_s21a_client import _le


def _t(dtype, fmt, values, shape=None):
    return cpb.Tensor(dtype=dtype, shape=shape or [len(values)], data=_le(fmt, values))


def _reply():
    space = pb.SpaceTables(index_space=0, group=0, scale=1, upper_bound=64,
                           slot_mapping=_t(cpb.INT64, "q", [20, 21]), indptr=_t(cpb.INT32, "i", [0, 1]),
                           indices=_t(cpb.INT32, "i", [5]), last_page_len=_t(cpb.INT32, "i", [2]))
    copies = pb.SlotCopies(group=0, pairs=_t(cpb.INT64, "q", [5, 9], [1, 2]),
                           generations=_t(cpb.UINT32, "I", [3, 4], [1, 2]))
    return pb.StepReply(seq_ids=_t(cpb.UINT64, "Q", [11]), num_tokens=_t(cpb.INT64, "q", [2]),
                        new_token_indptr=_t(cpb.INT64, "q", [0, 2]), tables=[space], layer_index_space=[0],
                        copies=[copies])


def test_a_well_formed_reply_parses_to_its_values():
    res = parse_step(_reply())
    st = res.tables[0]
    assert (st.slot_mapping.tolist(), st.table.indptr.tolist(), st.table.indices.tolist()) == ([20, 21], [0, 1], [5])
    assert st.table.last_page_len.tolist() == [2] and res.copies[0].tolist() == [[5, 9]]
    assert res.copy_generations[0].tolist() == [[3, 4]]


@pytest.mark.parametrize("field", ["slot_mapping", "indptr", "indices", "last_page_len"])
def test_a_malformed_table_tensor_is_refused_naming_its_field(field):
    reply = _reply()
    getattr(reply.tables[0], field).CopyFrom(_t(cpb.FLOAT32, "i", [1]))
    with pytest.raises(InvalidArgument) as err:
        parse_step(reply)
    assert str(err.value) == f"{field}: dtype FLOAT32 not allowed here"


@pytest.mark.parametrize("field", ["pairs", "generations"])
def test_a_malformed_copy_tensor_is_refused_naming_its_field(field):
    reply = _reply()
    getattr(reply.copies[0], field).CopyFrom(_t(cpb.FLOAT32, "i", [1, 2], [1, 2]))
    for parse in (parse_step, parse_copies):
        with pytest.raises(InvalidArgument) as err:
            parse(reply)
        assert str(err.value) == f"{field}: dtype FLOAT32 not allowed here"
