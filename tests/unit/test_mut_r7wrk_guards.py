"""Guard-zone helpers of kvservice.worker.guards pinned whole: what check_guarded refuses and its exact words (a
buffer that is not flat uint8 bytes, a guard that is not a positive multiple of 16 fitting twice), the payload view
(exactly the bytes between the zones, as the dtype asked), and a report's truth (any corrupted byte)."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.worker.guards import GuardReport, check_guarded, guarded_view


def test_the_buffer_must_be_flat_bytes():
    with pytest.raises(ValueError) as e:
        check_guarded(np.zeros((4, 32), np.uint8), 16)
    assert str(e.value) == "buf: expected shape [total_bytes] = (None,), got (4, 32)"
    with pytest.raises(TypeError) as e:
        check_guarded(np.zeros(64, np.uint16), 16)
    assert str(e.value) == "buf: expected dtype uint8, got uint16"


@pytest.mark.parametrize(("guard", "size"), [(0, 64), (-16, 64), (1, 64), (8, 64), (17, 64), (48, 64), (32, 63)])
def test_a_guard_that_is_no_positive_multiple_of_16_fitting_twice_is_refused(guard, size):
    with pytest.raises(ValueError) as e:
        check_guarded(np.zeros(size, np.uint8), guard)
    assert str(e.value) == f"guard_bytes {guard} must be a positive multiple of 16 and fit twice in the buffer"


@pytest.mark.parametrize(("guard", "size"), [(16, 32), (16, 33), (32, 64), (4096, 8192 + 5)])
def test_a_guard_fitting_twice_is_taken(guard, size):
    check_guarded(np.zeros(size, np.uint8), guard)


def test_the_payload_view_is_exactly_the_bytes_between_the_zones():
    rng = np.random.default_rng()
    guard, payload = 32, 8 * int(rng.integers(1, 100))
    buf = rng.integers(0, 256, 2 * guard + payload, dtype=np.uint8)
    for dtype in (np.uint8, np.float16, np.float32, np.uint16):
        v = guarded_view(buf, guard, dtype)
        assert v.dtype == dtype and v.nbytes == payload and np.shares_memory(v, buf)
        assert v.view(np.uint8).tolist() == buf[guard:guard + payload].tolist()


def test_a_report_is_true_for_any_corrupted_byte():
    assert not GuardReport(0, -1) and GuardReport(1, 0) and GuardReport(2, 7)
    assert (GuardReport(3, 5).corrupted_bytes, GuardReport(3, 5).first_offset) == (3, 5)
