"""Log lines of the manager and the worker: text for people, or one JSON object a line for log pipelines.

``--log-format json`` writes each record as one JSON object on one line (stderr), with the keys

- ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``message``;
- where known: ``pool``, ``request_id``, ``stream_id``, ``worker_id``, ``epoch`` (the leader epoch a
  replicated manager serves under, or a worker's registration epoch), ``node``;
- ``exception``: the traceback, when the record carries one.

A field is known when the code that logs passes it (``log.warning(..., extra={"pool": name})``) or when
the process set it for every later record (:func:`set_process_fields`: a manager that took the lease
sets its epoch). Levels mean something: INFO for what a healthy system does (a standby taking over is
INFO on the new leader), WARNING for what an operator should look at (a lost lease), ERROR and above
for failures.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any, TextIO

#: Record attributes copied into a JSON line when set (by `extra=` or set_process_fields).
FIELDS = ("pool", "request_id", "stream_id", "worker_id", "epoch", "node")
FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_process_fields: dict[str, Any] = {}
_lock = threading.Lock()


def set_process_fields(**fields: Any) -> None:
    """Fields every later record of this process carries unless a record sets its own (None removes one; a
    callable is called for each record: ``epoch=lambda: store.epoch``)."""
    with _lock:
        for key, value in fields.items():
            if key not in FIELDS:
                raise ValueError(f"unknown log field {key!r}; known: {', '.join(FIELDS)}")
            if value is None:
                _process_fields.pop(key, None)
            else:
                _process_fields[key] = value


class JsonFormatter(logging.Formatter):
    """One JSON object a line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        doc: dict[str, Any] = {"ts": ts, "level": record.levelname, "logger": record.name,
                               "message": record.getMessage()}
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is None:
                value = _process_fields.get(key)
                value = value() if callable(value) else value
            if value is not None and value != "" and value != 0:
                doc[key] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            doc["exception"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def configure(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Set the root logger of a command line: `level` (a name of LEVELS), `fmt` (text or json), on stderr."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format {fmt!r}: expected one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
