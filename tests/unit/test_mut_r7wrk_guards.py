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


class Launches:
    """A kernel_api.Backend that records each launch (name, grid, block, a copy of the arguments) and runs none."""

    xp, sms = np, 1

    def __init__(self) -> None:
        self.calls = []

    def launch(self, name, grid, block, args):
        self.calls.append((name, tuple(grid), block, [a.copy() if isinstance(a, np.ndarray) else a for a in args]))

    @staticmethod
    def to_host(a):
        return np.asarray(a)


@pytest.mark.parametrize("guard", [16, 4096, 2**17])
def test_the_guard_kernels_launch_one_thread_per_guard_byte_in_at_most_1024_blocks(guard):
    """guard_fill and guard_check launch a 1-D grid of ceil(2 G / 128) blocks of 128 threads (one per byte of the two
    zones), capped at 1024 blocks (guard.cu's loops stride over the rest), with (buf, total bytes, G) and, for the
    check, a result (count 0, first ~0) the kernel fills; a result left as it was reads clean."""
    from kvservice.worker import guards

    n = 2 * guard + 48
    buf = np.zeros(n, np.uint8)
    be = Launches()
    guards.guard_fill(be, buf, guard)
    assert guards.guard_check(be, buf, guard) == GuardReport(0, -1)
    blocks = min(1024, -(-2 * guard // 128))
    (fill_name, fill_grid, fill_block, fill_args), (check_name, check_grid, check_block, check_args) = be.calls
    assert (fill_name, fill_grid, fill_block) == ("kv_guard_fill", (blocks, 1, 1), 128)
    assert (check_name, check_grid, check_block) == ("kv_guard_check", (blocks, 1, 1), 128)
    assert all(a[0].dtype == np.uint8 and a[0].shape == (n,) for a in (fill_args, check_args))
    assert [type(a) for a in fill_args[1:]] == [np.int64, np.int64] and fill_args[1:] == [n, guard]
    assert [type(a) for a in check_args[1:3]] == [np.int64, np.int64] and check_args[1:3] == [n, guard]
    assert check_args[3].dtype == np.uint64 and check_args[3].tolist() == [0, 2**64 - 1]


def test_the_canary_pattern_is_bytes_of_the_documented_formula():
    from kvservice.worker.guards import guard_pattern

    for n in (0, 1, 16, 300):
        p = guard_pattern(n)
        assert p.dtype == np.uint8 and p.shape == (n,)
        assert p.tolist() == [0xA5 ^ ((i * 29) & 0xFF) for i in range(n)]
