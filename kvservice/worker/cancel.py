"""A kernel call's deadline and cancellation, handed from the worker's RPC thread to the kernel loop.

A CPU kernel runs in the RPC's own thread (the emulated .cu kernels one launch at a time per
library), so work a client abandoned would keep a thread, and the emulation's launch lock, for as
long as it takes: after one huge call every later call waited behind it. Here the RPC sets a
:class:`CallBound` (its gRPC deadline, and a flag set when the RPC ends for any reason) for the
thread; the kernel loops read it between units of work and stop with :class:`KernelCancelled`:
the emulated launch between blocks (kernels/kv_emu.h, ``kv_emu_launch_until``), the NumPy decode
between rows. Work done before the stop stays done (as on a device: a call that timed out may
have written part of its slots), so a caller retries the call. A GPU kernel is not interrupted.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

_local = threading.local()


class KernelCancelled(Exception):
    """The call's deadline passed, or its RPC ended, while its kernel ran: the rest was not run."""


@dataclass
class CallBound:
    """deadline: time.monotonic() seconds after which the kernel stops (None = none); flag: 1 once the
    RPC ended (a C int the emulation reads between blocks)."""

    deadline: float | None = None
    flag: ctypes.c_int = field(default_factory=ctypes.c_int)

    def cancel(self) -> None:
        self.flag.value = 1

    @property
    def deadline_ns(self) -> int:
        """The deadline on CLOCK_MONOTONIC in ns (time.monotonic's clock on Linux); 0 = none."""
        return 0 if self.deadline is None else max(1, int(self.deadline * 1e9))

    def expired(self) -> bool:
        return bool(self.flag.value) or (self.deadline is not None and time.monotonic() >= self.deadline)


@contextmanager
def bounded(deadline: float | None) -> Iterator[CallBound]:
    """Kernels this thread runs inside the block stop at `deadline` or when the bound is cancelled."""
    bound = CallBound(deadline)
    outer = getattr(_local, "bound", None)
    _local.bound = bound
    try:
        yield bound
    finally:
        _local.bound = outer


def current() -> CallBound | None:
    """This thread's bound (None outside :func:`bounded`)."""
    return getattr(_local, "bound", None)


def check(kernel: str) -> None:
    """KernelCancelled if this thread's bound has expired (call between units of a kernel's work)."""
    bound = current()
    if bound is not None and bound.expired():
        raise KernelCancelled(f"{kernel}: stopped, the call's deadline passed or its caller went away")


__all__ = ["CallBound", "KernelCancelled", "bounded", "check", "current"]
