"""Why a state dir cannot be written, in one line a person can act on.

``kvservice serve --state-dir DIR`` writes DIR before it serves (its lock, the MANIFEST, ACKED, the
database's incarnation, the startup pools). A read-only volume, a read-only database file or a full
disk fails one of those writes with an OSError (EACCES, EPERM, EROFS, ENOSPC, EDQUOT, EIO) or an
SQLite error (SQLITE_READONLY*, SQLITE_PERM, SQLITE_CANTOPEN, SQLITE_FULL, SQLITE_IOERR*).
:func:`unusable_state` names the cause and the remedy (a StateError); the CLI prints it on one
line and exits 2 (no traceback). Nothing recovered is lost: recovery reads before it writes, and a refused start leaves
the dir as it was.
"""

from __future__ import annotations

import errno
import sqlite3

from kvservice.contract.errors import StateError

NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def _kind(err: BaseException) -> str | None:
    """"read-only", "full", "io", "cannot-open" or None (not a write failure of the state dir)."""
    if isinstance(err, sqlite3.Error):
        name = getattr(err, "sqlite_errorname", "") or ""
        text = str(err)
        if name.startswith(("SQLITE_READONLY", "SQLITE_PERM")) or "readonly database" in text:
            return "read-only"
        if name == "SQLITE_FULL" or "disk is full" in text:
            return "full"
        if name.startswith("SQLITE_IOERR") or "disk I/O error" in text:
            return "io"
        if name.startswith("SQLITE_CANTOPEN") or "unable to open" in text:
            return "cannot-open"
        return None
    if isinstance(err, OSError):
        if err.errno in NOT_WRITABLE:
            return "read-only"
        if err.errno in NO_SPACE:
            return "full"
        if err.errno == errno.EIO:
            return "io"
    return None


def _detail(err: BaseException) -> str:
    if isinstance(err, OSError):
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror or err}{where}"
    return f"SQLite: {err}"


def unusable_state(err: BaseException, state_dir: str) -> StateError | None:
    """A StateError saying why `state_dir` cannot be served and what to do (its reason: STATE_NOT_WRITABLE,
    STATE_DISK_FULL or STATE_IO_ERROR), or None if `err` is not a failed write of a state dir."""
    kind = _kind(err)
    what = _detail(err)
    if kind == "read-only":
        return StateError(f"state dir {state_dir} cannot be written ({what}); the manager writes its journal, "
                          "snapshots and lock there: give its user write access to the dir and every file in it, "
                          "or mount the volume read-write (kvservice check-state DIR reads it without writing)",
                          reason="STATE_NOT_WRITABLE")
    if kind == "full":
        return StateError(f"the volume of state dir {state_dir} is full ({what}); free space or grow the volume, "
                          "then start again (what was acknowledged before is still on it)", reason="STATE_DISK_FULL")
    if kind == "io":
        return StateError(f"state dir {state_dir}: the volume reported an I/O error ({what}); check the device "
                          "(dmesg), then run kvservice check-state DIR", reason="STATE_IO_ERROR")
    if kind == "cannot-open":
        return StateError(f"state dir {state_dir}: SQLite cannot open its database ({what}); check that the dir "
                          "exists and that the manager's user may write it", reason="STATE_NOT_WRITABLE")
    return None


__all__ = ["NOT_WRITABLE", "NO_SPACE", "unusable_state"]
