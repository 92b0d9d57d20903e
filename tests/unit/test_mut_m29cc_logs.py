"""JSON log lines (kvservice/contract/logs.py) checked whole against the format docs/operations.md and the module
doc give: one JSON object a line, ``ts`` in UTC ISO 8601 with milliseconds and a ``Z``, ``level``, ``logger``,
``message``, the known fields (pool, request_id, stream_id, worker_id, epoch, node) where set, ``exception`` with
the traceback. Oracles: a fixed hand-computed timestamp, datetime (not time.strftime) for random ones, the
traceback module for the exception text, and the raw line for what JSON parsing hides (non-ASCII kept as is)."""

from __future__ import annotations

import io
import json
import logging
import random
import sys
import traceback
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import PurePosixPath

import pytest

from kvservice.contract import logs


def _record(msg: str, args: tuple = (), created: float = 1700000000.0, msecs: float = 123.0,
            level: int = logging.WARNING, name: str = "kvservice.m29cc", **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord(name, level, __file__, 1, msg, args, None)
    rec.created, rec.msecs = created, msecs
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


@pytest.fixture(autouse=True)
def _no_process_fields():
    logs.set_process_fields(**dict.fromkeys(logs.FIELDS))
    yield
    logs.set_process_fields(**dict.fromkeys(logs.FIELDS))


def test_a_line_is_the_documented_object_with_every_known_field_in_order():
    rng = random.Random(29)
    extra = {"pool": f"pool-{rng.randint(1, 999)}", "request_id": f"rid-{rng.getrandbits(40):x}",
             "stream_id": f"s{rng.randint(1, 10**6)}", "worker_id": f"w-{rng.randint(1, 99)}",
             "epoch": rng.randint(1, 10**9), "node": f"node-{rng.randint(1, 9)}"}
    line = logs.JsonFormatter().format(_record("pool %s has %d free", ("p", 17), **extra))
    doc = json.loads(line)
    # 1700000000 s after the epoch is 2023-11-14 22:13:20 UTC (hand-checked); msecs 123.
    assert list(doc) == ["ts", "level", "logger", "message", *logs.FIELDS]
    assert doc == {"ts": "2023-11-14T22:13:20.123Z", "level": "WARNING", "logger": "kvservice.m29cc",
                   "message": "pool p has 17 free", **extra}
    assert "\n" not in line


@pytest.mark.parametrize("seed", range(5))
def test_the_timestamp_is_utc_to_the_millisecond(seed):
    rng = random.Random(seed)
    sec = rng.randint(0, 4 * 10**9)
    ms = rng.choice([0, 7, 42, rng.randint(0, 999)]) + rng.random() * 0.99     # msecs is truncated, not rounded
    doc = json.loads(logs.JsonFormatter().format(_record("m", created=sec + ms / 1000, msecs=ms)))
    want = datetime.fromtimestamp(sec, UTC).isoformat(timespec="seconds").replace("+00:00", "")
    assert doc["ts"] == f"{want}.{int(ms):03d}Z"
    assert len(doc["ts"]) == len("2023-11-14T22:13:20.123Z")


def test_non_ascii_text_is_written_as_is_and_values_json_cannot_hold_as_their_text():
    msg = "pool réservé 池 ✓ " + "".join(chr(random.Random(3).randint(0x100, 0x2FF)) for _ in range(5))
    path = PurePosixPath("/var/lib/kvservice/état")
    line = logs.JsonFormatter().format(_record("%s", (msg,), pool=path, epoch=Decimal("12.5")))
    assert msg in line and "\\u" not in line                       # not escaped: the line carries the text
    doc = json.loads(line)
    assert (doc["message"], doc["pool"], doc["epoch"]) == (msg, str(path), "12.5")


def test_empty_and_zero_fields_are_left_out_and_a_record_field_wins_over_the_process_field():
    logs.set_process_fields(node="n-proc", epoch=lambda: 41, pool="proc-pool", worker_id="w-proc")
    doc = json.loads(logs.JsonFormatter().format(_record("x", node="own", request_id=None)))
    # unset (None) on the record: the process's value (a callable is called); a record's own value wins;
    # request_id / stream_id are set nowhere.
    assert {k: doc[k] for k in logs.FIELDS if k in doc} == {"pool": "proc-pool", "worker_id": "w-proc",
                                                           "epoch": 41, "node": "own"}
    # "" and 0 given by the record itself: left out (the record says it has none), never "" or 0 in a line.
    doc = json.loads(logs.JsonFormatter().format(_record("x", pool="", epoch=0, node="own")))
    assert {k: doc[k] for k in logs.FIELDS if k in doc} == {"worker_id": "w-proc", "node": "own"}
    logs.set_process_fields(node=None, epoch=lambda: 0, pool="", worker_id=None)
    doc = json.loads(logs.JsonFormatter().format(_record("y", stream_id=0, request_id="")))
    assert set(doc) == {"ts", "level", "logger", "message"}


def test_an_exception_or_a_stack_is_carried_whole():
    try:
        raise KeyError("missing-slot-31")
    except KeyError:
        info = sys.exc_info()
    rec = _record("failed", level=logging.ERROR)
    rec.exc_info = info
    doc = json.loads(logs.JsonFormatter().format(rec))
    assert doc["exception"] == "".join(traceback.format_exception(*info)).rstrip("\n")
    assert doc["level"] == "ERROR" and doc["message"] == "failed"
    rec = _record("where", level=logging.INFO)
    rec.stack_info = "Stack (most recent call last):\n  File \"x.py\", line 3, in f"
    doc = json.loads(logs.JsonFormatter().format(rec))
    assert doc["exception"] == rec.stack_info and doc["level"] == "INFO"
    assert "exception" not in json.loads(logs.JsonFormatter().format(_record("plain")))


@pytest.mark.parametrize("level", logs.LEVELS)
def test_configure_sets_the_root_level_and_the_text_format(level):
    root = logging.getLogger()
    saved, saved_level = list(root.handlers), root.level
    out = io.StringIO()
    try:
        logs.configure(level.lower(), "text", stream=out)
        assert root.level == getattr(logging, level) and len(root.handlers) == 1
        for lv in logs.LEVELS:
            logging.getLogger("kvservice.m29cc.t").log(getattr(logging, lv), "at %s", lv)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(saved_level)
    lines = out.getvalue().splitlines()
    kept = logs.LEVELS[logs.LEVELS.index(level):]
    assert [line.split(" ", 2)[2] for line in lines] == [f"{lv} kvservice.m29cc.t: at {lv}" for lv in kept]
