"""Guard zones around every cache buffer: ``[G canary | payload | G canary]``, filled and checked by the
kernels of guard.cu (kernel_api's backends) or by NumPy (ops_numpy). Byte ``i`` of either zone is
``0xA5 ^ (i * 29 & 0xff)`` (``guard_pattern``, the same formula as ``kv_guard_byte``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvservice.worker.kernel_api import I64, NO_KEY, THREADS, Backend, check_array


@dataclass(frozen=True)
class GuardReport:
    corrupted_bytes: int
    first_offset: int  # from the buffer start, -1 if clean

    def __bool__(self) -> bool:
        return self.corrupted_bytes > 0


def check_guarded(buf: Any, guard_bytes: int) -> None:
    check_array("buf", buf, (None,), np.uint8, "[total_bytes]")
    if guard_bytes <= 0 or guard_bytes % 16 or 2 * guard_bytes > buf.shape[0]:
        raise ValueError(f"guard_bytes {guard_bytes} must be a positive multiple of 16 and fit twice in the buffer")


def guard_fill(be: Backend, buf: Any, guard_bytes: int) -> None:
    """Write the canary pattern into both guard zones of ``buf`` (uint8 [total_bytes])."""
    check_guarded(buf, guard_bytes)
    blocks = min(1024, math.ceil(2 * guard_bytes / THREADS))
    be.launch("kv_guard_fill", (blocks, 1, 1), THREADS, [buf, I64(buf.shape[0]), I64(guard_bytes)])


def guard_check(be: Backend, buf: Any, guard_bytes: int) -> GuardReport:
    """Count corrupted canary bytes of ``buf`` (uint8 [total_bytes]) and the first offset."""
    check_guarded(buf, guard_bytes)
    res = be.xp.asarray(np.array([0, NO_KEY], dtype=np.uint64))
    blocks = min(1024, math.ceil(2 * guard_bytes / THREADS))
    be.launch("kv_guard_check", (blocks, 1, 1), THREADS, [buf, I64(buf.shape[0]), I64(guard_bytes), res])
    r = be.to_host(res)
    return GuardReport(int(r[0]), -1 if int(r[0]) == 0 else int(r[1]))


def guard_pattern(n: int) -> np.ndarray:
    """Canary bytes of one guard zone (same formula as kv_guard_byte)."""
    return (0xA5 ^ ((np.arange(n, dtype=np.int64) * 29) & 0xFF)).astype(np.uint8)


def guarded_view(buf: Any, guard_bytes: int, dtype: Any) -> Any:
    """The payload of a guarded buffer as a flat array of ``dtype``."""
    return buf[guard_bytes: buf.shape[0] - guard_bytes].view(dtype)
