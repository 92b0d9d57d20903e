"""Waiting for a `kvservice serve` / `kvworker serve` process started with --port-file."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def wait_for_ports(proc: subprocess.Popen, port_file: Path, timeout: float = 60.0, log: Path | None = None,
                   what: str = "process") -> tuple[int, int]:
    """(grpc port, metrics port; 0 = none) once `proc` has written them to port_file.

    Raises RuntimeError with the tail of `log` if the process exits or `timeout` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        fields = port_file.read_text().split() if port_file.exists() else []
        if len(fields) == 2:                       # both written (the file is written in one call)
            return int(fields[0]), int(fields[1])
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"{what} did not start (exit status {proc.poll()}):\n{tail}")
        time.sleep(0.05)
