"""Guard zones (kvservice.worker.guards) on the emulated .cu kernels and the NumPy ones, against the documented byte
formula (byte i of either zone is 0xA5 ^ (i * 29 & 0xff)) written out in plain Python: what the fill writes (and
leaves), what the check counts and where it says the first bad byte is, and the sizes it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.worker import kernels_cpu, ops_numpy
from kvservice.worker.guards import GuardReport, guard_pattern

OPS = pytest.mark.parametrize("ops", [kernels_cpu, ops_numpy], ids=["emulated", "numpy"])


def _zone(n: int) -> list[int]:
    return [0xA5 ^ (i * 29 & 0xFF) for i in range(n)]


@OPS
@pytest.mark.parametrize("guard", [16, 4096])
def test_fill_writes_the_documented_bytes_in_both_zones_and_nothing_else(ops, guard):
    rng = np.random.default_rng(guard)
    payload = int(rng.integers(1, 5000))
    buf = rng.integers(0, 256, 2 * guard + payload, dtype=np.uint8)
    before = buf.copy()
    ops.guard_fill(buf, guard)
    assert buf[:guard].tolist() == _zone(guard) == buf[guard + payload:].tolist()
    assert np.array_equal(buf[guard:guard + payload], before[guard:guard + payload])
    assert guard_pattern(guard).tolist() == _zone(guard)


@OPS
def test_check_counts_every_corrupted_byte_and_names_the_first(ops):
    """Clean: (0, -1) and false. k corrupted bytes anywhere in the zones (k = 1 included): count k, the lowest
    offset from the buffer start, true. Payload bytes are never counted."""
    rng = np.random.default_rng(29)
    guard, payload = 2048, 3000
    n = 2 * guard + payload
    buf = np.zeros(n, np.uint8)
    ops.guard_fill(buf, guard)
    clean = ops.guard_check(buf, guard)
    assert clean == GuardReport(0, -1) and not clean
    buf[guard:guard + payload] = rng.integers(0, 256, payload, dtype=np.uint8)     # the payload is not a guard
    assert ops.guard_check(buf, guard) == GuardReport(0, -1)
    zones = np.concatenate([np.arange(guard), np.arange(guard + payload, n)])
    for k in (1, 2, 37):
        work = buf.copy()
        hit = rng.choice(zones, k, replace=False)
        work[hit] ^= rng.integers(1, 256, k, dtype=np.uint8)
        rep = ops.guard_check(work, guard)
        assert rep == GuardReport(k, int(hit.min())) and rep
    back = buf.copy()
    back[n - 1] ^= 0x5A                               # only the very last byte
    assert ops.guard_check(back, guard) == GuardReport(1, n - 1)


@OPS
def test_guard_sizes_are_checked(ops):
    """A guard is a positive multiple of 16 bytes that fits twice in the buffer (exactly twice is allowed); the
    buffer is uint8."""
    for guard, size in ((0, 64), (-16, 64), (8, 64), (24, 64), (48, 64), (32, 63)):
        with pytest.raises(ValueError, match="must be a positive multiple of 16 and fit twice"):
            ops.guard_fill(np.zeros(size, np.uint8), guard)
        with pytest.raises(ValueError, match="must be a positive multiple of 16 and fit twice"):
            ops.guard_check(np.zeros(size, np.uint8), guard)
    exact = np.zeros(64, np.uint8)
    ops.guard_fill(exact, 32)
    assert exact.tolist() == _zone(32) * 2 and ops.guard_check(exact, 32) == GuardReport(0, -1)
    with pytest.raises(TypeError, match="buf: expected dtype uint8, got int8"):
        ops.guard_fill(np.zeros(64, np.int8), 16)
