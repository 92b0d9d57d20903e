"""The state dir's small files: its lock (one serving manager) and its MANIFEST (the witness of what it holds).

MANIFEST: JSON with its own checksum, replaced atomically (write, fsync, rename, fsync the dir); see
kvservice/state/sqlite/store.py for its fields and docs/DURABILITY.md for what each check refuses.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from kvservice.contract.errors import StateError
from kvservice.state import snapshot as snap

FORMAT = 2
MANIFEST = "MANIFEST"
REPAIR = "run `kvservice check-state DIR --repair` to accept the state dir as it is"
RESTORE = "restore the state dir from a backup"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_dir(state_dir: Path, shared: bool = False) -> int | None:
    """flock DIR/lock; exclusive: StateError naming the holder if busy; shared: None if a manager holds it."""
    path = state_dir / "lock"
    if shared and not path.exists():
        return -1
    fd = os.open(path, os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        if shared:
            return None
        raise StateError(f"state dir {state_dir} is in use by another kvservice (pid {holder})",
                         reason="STATE_BUSY") from None
    if not shared:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def read_manifest(state_dir: Path) -> dict[str, Any] | None:
    """The MANIFEST (None if there is none); StateError if it is damaged."""
    path = state_dir / MANIFEST
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_bytes())
        body = {k: v for k, v in m.items() if k != "digest"}
        ok = m.get("digest") == snap.digest16(json.dumps(body, sort_keys=True).encode()).hex()
        if ok:
            for k in ("format", "incarnation", "last_seq", "snapshot_seq"):
                if not isinstance(m[k], int):
                    ok = False
            ok = ok and isinstance(m["running"], bool)
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise StateError(f"{path}: damaged (checksum or fields); it is the witness of how much this dir "
                         f"acknowledged. {REPAIR} after checking it, or {RESTORE}", reason="STATE_DAMAGED")
    return m


def write_manifest(state_dir: Path, **fields: Any) -> None:
    """Replace the MANIFEST atomically (write, fsync, rename, fsync the dir)."""
    body = {"format": FORMAT, **fields, "updated": time.time()}
    body["digest"] = snap.digest16(json.dumps(body, sort_keys=True).encode()).hex()
    tmp = state_dir / (MANIFEST + ".tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps(body, sort_keys=True, indent=1).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, state_dir / MANIFEST)
    fsync_dir(state_dir)


__all__ = ["FORMAT", "MANIFEST", "REPAIR", "RESTORE", "fsync_dir", "lock_dir", "read_manifest", "write_manifest"]
