"""The idempotency window's arrays in a snapshot have one fixed layout, empty or not (docs/DURABILITY.md: the window
is stored as arrays ``window/ids/*`` and ``window/replies/*``; the dtypes are from the documented list).

An idle manager's first snapshot has an empty window: its arrays must carry the same dtypes as a full window's
(``ids/seq`` int64 journal positions, ``ids/at`` float64 seconds, offsets int64, bytes and method codes uint8),
or a reader that checks them would see another format. The header is parsed by hand (struct + json).
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.state import snapshot as snap
from kvservice.state.journal_config import METHODS

from .test_mut_m28e_snapshot import empty_window, make_blob

# (name, dtype, shape of an empty window), as a reader expects them
EMPTY = [("ids/rid", "|u1", [0]), ("ids/rid_offsets", "<i8", [1]), ("ids/method", "|u1", [0]),
         ("ids/digest", "|u1", [0, 16]), ("ids/seq", "<i8", [0]), ("ids/at", "<f8", [0]),
         ("replies/rid", "|u1", [0]), ("replies/rid_offsets", "<i8", [1]), ("replies/method", "|u1", [0]),
         ("replies/data", "|u1", [0]), ("replies/offsets", "<i8", [1])]


def window_entries(window: snap.WindowState) -> dict[str, dict]:
    blob = b"".join(bytes(c) for c in snap.encode(3, 1, 0.5, {}, [], window, METHODS).chunks)
    hlen = struct.unpack("<I", blob[12:16])[0]
    h = json.loads(blob[32:32 + hlen])
    return {e["name"][len("window/"):]: e for e in h["arrays"] if e["name"].startswith("window/")}


def test_an_empty_window_has_the_same_array_layout_as_a_full_one():
    rng = np.random.default_rng(7_20)
    full = snap.WindowState(
        [(f"r{i}", METHODS[i % len(METHODS)], rng.bytes(16), int(rng.integers(1, 2**40)), float(rng.uniform(1, 9)))
         for i in range(3)],
        [(f"q{i}", METHODS[0], rng.bytes(int(rng.integers(1, 9)))) for i in range(2)])
    empty = window_entries(snap.WindowState())
    assert [(k, e["dtype"], e["shape"], e["encoding"]) for k, e in empty.items()] == \
        [(k, dt, shape, "raw") for k, dt, shape in EMPTY]
    assert [e["nbytes"] for e in empty.values()] == [8 if shape == [1] else 0 for _, _, shape in EMPTY]
    got = window_entries(full)
    assert {k: e["dtype"] for k, e in got.items()} == {k: dt for k, dt, _ in EMPTY}
    assert snap.decode(b"".join(bytes(c) for c in snap.encode(3, 1, 0.5, {}, [], snap.WindowState(),
                                                               METHODS).chunks)).window == snap.WindowState()


def test_the_header_is_compact_json_and_an_array_may_end_at_the_end_of_the_file():
    """Seven replies: the last array (window/replies/offsets, 8 int64) is 64 bytes, so the file ends where it does
    (no padding after it). That file decodes; one byte shorter, the array is named as lying past the end. The
    header is JSON without spaces (its digest is over exactly those bytes)."""
    rng = np.random.default_rng(7_21)
    window = snap.WindowState([], [(f"q{i}", METHODS[1], rng.bytes(int(rng.integers(1, 20)))) for i in range(7)])
    blob = b"".join(bytes(c) for c in snap.encode(9, 2, 1.5, {}, [], window, METHODS).chunks)
    hlen = struct.unpack("<I", blob[12:16])[0]
    header = blob[32:32 + hlen]
    assert header == json.dumps(json.loads(header), separators=(",", ":")).encode() and b" " not in header
    h = json.loads(header)
    base = 32 + hlen + (-(32 + hlen) % 64)
    last = h["arrays"][-1]
    assert (last["name"], last["nbytes"]) == ("window/replies/offsets", 64)
    assert base + last["offset"] + last["nbytes"] == len(blob)
    assert snap.decode(blob).window == window
    with pytest.raises(StateError) as ei:
        snap.decode(blob[:-1], "W")
    assert ei.value.message == "W: array 'window/replies/offsets' lies past the end of the file (truncated or damaged)"


def test_a_malformed_header_is_named_with_the_python_error_and_the_likely_cause():
    with pytest.raises(StateError) as ei:
        snap.decode(make_blob(empty_window(), seq=None), "W")
    assert ei.value.message == "W: malformed header (KeyError: 'seq'); written by an incompatible kvservice?"
    with pytest.raises(StateError) as ei:
        snap.decode(make_blob(empty_window(), workers=[{"no_such_field": 1}]), "W")
    assert ei.value.message.startswith("W: malformed header (TypeError: ")
    assert ei.value.message.endswith("; written by an incompatible kvservice?")
