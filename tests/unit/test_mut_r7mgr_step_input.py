"""decode_step's refusal of an array that cannot be decoded (its docstring: InvalidArgument naming the field,
nothing changed): any failure of the decoder becomes InvalidArgument with the message "<field>: cannot be decoded
(<error type>: <error>)" and the field in its metadata; the decoder's own InvalidArgument passes through as it is."""

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.contract.wire import to_tensor
from kvservice.manager import step_input
from kvservice.manager.step_input import STEP_ARRAYS, decode_step
from kvservice.v1 import block_manager_pb2 as pb


@pytest.mark.parametrize("field", STEP_ARRAYS)
def test_any_decoder_failure_is_invalid_argument_naming_the_field(field, monkeypatch):
    real = step_input.from_tensor

    def failing(t, name, *a):
        if name == field:
            raise ValueError(f"no room for {name}")
        return real(t, name, *a)

    r = pb.StepRequest(pool="p")
    for f in STEP_ARRAYS:
        getattr(r, f).CopyFrom(to_tensor(np.arange(1, 4, dtype=np.int64)))
    monkeypatch.setattr(step_input, "from_tensor", failing)
    with pytest.raises(InvalidArgument) as e:
        decode_step(r)
    assert (e.value.message, e.value.reason, e.value.metadata) == \
        (f"{field}: cannot be decoded (ValueError: no room for {field})", "INVALID_ARGUMENT", {"field": field})
    assert e.value.__cause__ is None and e.value.__suppress_context__
    own = InvalidArgument("the decoder's own words", field="x")

    def refusing(t, name, *a):
        raise own

    monkeypatch.setattr(step_input, "from_tensor", refusing)
    with pytest.raises(InvalidArgument) as e:
        decode_step(r)
    assert e.value is own
