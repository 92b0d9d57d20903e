"""PoolGate.writing (kvservice/state/gate.py) is a plain context manager: an exception raised inside it reaches
the caller (the gate never swallows a failed change), and the pool is released for its readers all the same.
Oracle: Python's with-statement protocol (__exit__ returning a false value re-raises)."""

import pytest

from kvservice.state.gate import PoolGate


def test_an_error_inside_a_write_propagates_and_the_pool_is_released():
    gate = PoolGate()
    with pytest.raises(KeyError, match="boom"), gate.writing("p"):
        raise KeyError("boom")
    with gate.reading("p"):                 # released: a reader does not wait (same thread, would block forever)
        pass
