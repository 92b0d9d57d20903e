"""kvservice/core/limits.py check_step_counts' refusals as a client sees them: the error's metadata and the
google.rpc.ErrorInfo detail that kvservice/contract/status.py's to_status puts on the gRPC status.

Oracle: kvservice/contract/errors.py's documented contract (``metadata``: string key/values, e.g. how many
slots were needed), and the least page demand recomputed by hand in plain Python integers (sum of
floor(count / page_size), negatives as 0), which never wrap.
"""

from __future__ import annotations

import numpy as np
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvservice.contract.errors import InvalidArgument, ResourceExhausted
from kvservice.contract.status import DOMAIN, to_status
from kvservice.core.limits import check_step_counts


def _error_info(err) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo detail that the gRPC status of ``err`` carries (decoded from its trailing metadata)."""
    status = to_status(err)
    raw = dict(status.trailing_metadata)["grpc-status-details-bin"]
    (detail,) = status_pb2.Status.FromString(raw).details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    return info


@pytest.mark.parametrize("page_size", [1, 3, 4])   # (big // ps + 2) x 5 >= 2^62: summed exactly
def test_a_step_too_large_for_the_pool_reports_needed_and_num_slots(page_size):
    rng = np.random.default_rng(800 + page_size)
    big = 2**63 - int(rng.integers(1000, 10_000))
    counts = np.array([big, int(rng.integers(1, 100)), big - 5, -3, 0], dtype=np.int64)
    least = sum(max(c, 0) // page_size for c in counts.tolist())
    with pytest.raises(ResourceExhausted) as exc:
        check_step_counts("pool-r8", 2**63, least - 1, page_size,
                          [("extend_num_tokens", counts), ("admit_num_tokens", None)])
    err = exc.value
    assert err.reason == "RESOURCE_EXHAUSTED"
    assert err.metadata == {"needed": str(least), "num_slots": str(least - 1)}
    info = _error_info(err)
    assert info.reason == "RESOURCE_EXHAUSTED" and info.domain == DOMAIN
    assert dict(info.metadata) == {"needed": str(least), "num_slots": str(least - 1)}
    assert to_status(err).details == (f"pool 'pool-r8': this step needs at least {least} slots, the pool has "
                                      f"{least - 1}; split the step")


def test_a_count_over_max_seq_len_reports_the_value_and_the_limit():
    rng = np.random.default_rng(8)
    e = rng.integers(1, 300, 12, dtype=np.int64)
    e[7] = 301
    with pytest.raises(InvalidArgument) as exc:
        check_step_counts("q", 300, 1000, 16, [("extend_num_tokens", e), ("admit_num_tokens", None)])
    err = exc.value
    assert err.reason == "OVER_MAX_SEQ_LEN"
    assert err.metadata == {"value": "301", "max_seq_len": "300"}
    info = _error_info(err)
    assert info.reason == "OVER_MAX_SEQ_LEN" and dict(info.metadata) == {"value": "301", "max_seq_len": "300"}
    assert err.message == ("extend_num_tokens[7] = 301 tokens: pool 'q' takes at most max_seq_len=300 tokens per "
                           "sequence")
