"""kvservice/server/limits.py Limits.check and its Step caps, the parts a plain count of a 1-D request leaves open.

Oracles: Limits.check's docstring (a Step is checked on the decoding the caller passes, decoded once; only a missing
one is decoded here), _check_step's (the caps read the arrays as decoded: a count array of any shape has its
largest entry capped), the class docstring (max_request_id: characters of a request_id; a request without one has
none) and the refusal text written out by hand (docs/SECURITY.md#limits: value, limit, the server flag).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvservice.client.codec import step_request
from kvservice.contract.errors import InvalidArgument
from kvservice.contract.wire import to_tensor
from kvservice.manager.pools import BlockManager
from kvservice.manager.step_input import decode_step
from kvservice.server.limits import Limits


def _msg(what: str, value: int, limit: int, unit: str, flag: str) -> str:
    hint = f" (server flag {flag})" if flag else ""
    return f"{what}: {value} {unit} is over this server's limit of {limit}{hint}; split the request"


@pytest.mark.parametrize("field", ["extend_num_tokens", "admit_num_tokens"])
def test_a_count_array_of_two_dimensions_has_its_largest_entry_capped(field) -> None:
    """Counts sent as a 2-D array (no 1-D summary: the pool refuses the shape later) are still capped entry by
    entry here, with the largest entry named."""
    rng = np.random.default_rng(7 if field[0] == "e" else 8)
    cap = int(rng.integers(100, 1000))
    big = cap + int(rng.integers(1, 10**6))
    counts = np.array([[3, big], [1, 2]], dtype=np.int64)
    r = step_request("p", extend=[1, 2, 3, 4], extend_tokens=[1, 1, 1, 1]) if field[0] == "e" else \
        step_request("p", admit=[1, 2, 3, 4], admit_tokens=[1, 1, 1, 1])
    getattr(r, field).CopyFrom(to_tensor(counts))
    with pytest.raises(InvalidArgument) as err:
        Limits(max_step_tokens=cap, max_step_sequences=0).check("Step", r, BlockManager())
    assert err.value.message == _msg(f"{field} entry", big, cap, "tokens", "--max-step-tokens")
    assert (err.value.reason, err.value.metadata) == ("LIMIT_EXCEEDED", {"value": str(big), "limit": str(cap)})


def test_a_step_is_checked_on_the_decoding_passed_not_decoded_again() -> None:
    rng = np.random.default_rng(11)
    n = int(rng.integers(5, 20))
    small = step_request("p", admit=[1], admit_tokens=[1])
    big = step_request("p", admit=list(range(1, n + 1)), admit_tokens=[1] * n)
    lim, m = Limits(max_step_sequences=n - 1), BlockManager()
    with pytest.raises(InvalidArgument) as err:
        lim.check("Step", small, m, decode_step(big))
    assert err.value.message == _msg("sequences in one Step", n, n - 1, "ids", "--max-step-sequences")
    lim.check("Step", big, m, decode_step(small))         # the passed decoding is what is checked
    with pytest.raises(InvalidArgument):
        lim.check("Step", big, m)                         # none passed: decoded here


def test_a_request_without_a_request_id_has_none_to_cap() -> None:
    m = BlockManager()
    Limits(max_request_id=1).check("GetPool", SimpleNamespace(), m)
    with pytest.raises(InvalidArgument) as err:
        Limits(max_request_id=1).check("GetPool", SimpleNamespace(request_id="ab"), m)
    assert err.value.message == _msg("request_id", 2, 1, "characters", "")
    assert (err.value.reason, err.value.metadata) == ("LIMIT_EXCEEDED", {"value": "2", "limit": "1"})
