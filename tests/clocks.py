"""Time for tests without sleeping: a clock moved by hand, and a bounded wait on another thread's condition."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ManualClock:
    """A clock the test moves by hand: calling it returns ``now`` (seconds); set or add to ``now`` to move it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def until(cond: Callable[[], object], seconds: float = 30.0) -> bool:
    """Wait for a condition another thread makes true (checked every 20 ms), at most ``seconds``.
    Returns whether it came true: the caller asserts it, with its own message."""
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.02)
    return True
