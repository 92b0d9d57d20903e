"""Why a state dir cannot be written (kvservice/state/sqlite/unusable.py), for every cause its docstring lists: OS
errors by errno and SQLite errors by their error name or, for SQLite builds that give none, their message text
(the messages SQLite itself prints). tests/integration/test_state_dir_unusable.py makes real read-only and full
volumes; these run in the mutation check's state selection."""

from __future__ import annotations

import errno
import sqlite3

import pytest

from kvservice.state.sqlite.unusable import unusable_state


def _sqlite(message: str, name: str = "") -> sqlite3.Error:
    e = sqlite3.OperationalError(message)
    if name:
        e.sqlite_errorname = name
    return e


@pytest.mark.parametrize(("err", "reason", "words"), [
    (OSError(errno.EROFS, "Read-only file system", "/d/MANIFEST"), "STATE_NOT_WRITABLE", "/d/MANIFEST"),
    (OSError(errno.EACCES, "Permission denied"), "STATE_NOT_WRITABLE", "write access"),
    (OSError(errno.EPERM, "Operation not permitted"), "STATE_NOT_WRITABLE", "write access"),
    (OSError(errno.ENOSPC, "No space left on device"), "STATE_DISK_FULL", "is full"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "STATE_DISK_FULL", "is full"),
    (OSError(errno.EIO, "Input/output error"), "STATE_IO_ERROR", "I/O error"),
    (_sqlite("attempt to write a readonly database"), "STATE_NOT_WRITABLE", "write access"),
    (_sqlite("x", "SQLITE_READONLY_DBMOVED"), "STATE_NOT_WRITABLE", "write access"),
    (_sqlite("database or disk is full"), "STATE_DISK_FULL", "is full"),
    (_sqlite("x", "SQLITE_FULL"), "STATE_DISK_FULL", "is full"),
    (_sqlite("disk I/O error"), "STATE_IO_ERROR", "I/O error"),
    (_sqlite("x", "SQLITE_IOERR_FSYNC"), "STATE_IO_ERROR", "I/O error"),
    (_sqlite("unable to open database file"), "STATE_NOT_WRITABLE", "cannot open"),
    (_sqlite("x", "SQLITE_CANTOPEN"), "STATE_NOT_WRITABLE", "cannot open"),
])
def test_each_cause_is_named_with_its_reason(err, reason, words):
    e = unusable_state(err, "/d")
    assert e is not None and e.reason == reason
    assert words in e.message and "/d" in e.message


@pytest.mark.parametrize("err", [OSError(errno.ENOENT, "No such file"), _sqlite("no such table: x"),
                                 _sqlite("x", "SQLITE_CONSTRAINT"), ValueError("x")])
def test_other_errors_are_not_a_state_dir_that_cannot_be_written(err):
    assert unusable_state(err, "/d") is None


def test_startup_retries_store_errors_within_its_time_and_names_the_last_one():
    """retry_startup (state/nats/config.py): a StoreError is retried until the time is up, then named; the errors
    that retrying cannot mend (a gap, a fence) go through at once. Counted attempts, no wall-clock assert."""
    from kvservice.state.nats.config import Fenced, StoreError, retry_startup

    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise StoreError(f"stream not ready ({len(calls)})")
        return "ok"

    assert retry_startup("create stream", flaky, seconds=30) == "ok" and len(calls) == 3
    with pytest.raises(StoreError, match=r"create stream: still failing after 0\.05 s: never") as e:
        retry_startup("create stream", lambda: (_ for _ in ()).throw(StoreError("never")), seconds=0.05)
    assert type(e.value) is StoreError
    fenced = []
    with pytest.raises(Fenced):
        retry_startup("x", lambda: fenced.append(1) or (_ for _ in ()).throw(Fenced("deposed")), seconds=30)
    assert fenced == [1]


def test_a_read_only_state_dir_names_both_remedies():
    """docs/operations.md: a dir the manager cannot write: give its user write access, or mount the volume
    read-write; and check-state reads it without writing."""
    e = unusable_state(OSError(errno.EROFS, "Read-only file system", "/srv/kv/ACKED"), "/srv/kv")
    assert e.reason == "STATE_NOT_WRITABLE"
    assert e.message.startswith("state dir /srv/kv cannot be written (Read-only file system: /srv/kv/ACKED); ")
    assert "give its user write access to the dir and every file in it" in e.message
    assert e.message.endswith("or mount the volume read-write (kvservice check-state DIR reads it without writing)")
