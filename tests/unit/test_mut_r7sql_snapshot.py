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

from kvservice.state import snapshot as snap
from kvservice.state.journal_config import METHODS

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
