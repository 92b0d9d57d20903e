"""Snapshot bytes against the layout written in kvservice/state/snapshot.py's docstring and docs/DURABILITY.md.

The oracle is the documented layout, read and written here by hand (struct, json, hashlib), and a
plain-Python model of the ``runs`` encoding: never the module's own encoder to check its decoder or
the reverse.
"""

import hashlib
import json
import struct

import numpy as np
import pytest

from kvservice.contract.errors import StateError
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.core.pool_state import PoolState
from kvservice.manager.workers import WorkerRecord
from kvservice.state import snapshot as snap

METHODS = ["Alpha", "Beta", "Gamma"]
KEYS = {"format", "version", "seq", "incarnation", "lineage", "created", "pools", "workers", "window", "arrays"}


def b2(data: bytes) -> bytes:
    return hashlib.blake2b(bytes(data), digest_size=16).digest()


def joined(enc) -> bytes:
    return b"".join(bytes(c) for c in enc.chunks)


def model_runs(values: list[int], kind: str):
    """(step, starts, lengths) as documented: runs of a fixed step in (-1, 1, 0), kept only if 4x smaller."""
    if kind != "i" or len(values) < 64:
        return None
    best = None
    for step in (-1, 1, 0):
        starts = [0] + [i + 1 for i in range(len(values) - 1) if values[i + 1] - values[i] != step]
        if best is None or len(starts) < len(best[1]):
            best = (step, starts)
    step, starts = best
    if len(starts) * 16 * 4 > len(values) * 8:
        return None
    ends = [*starts[1:], len(values)]
    return step, [values[s] for s in starts], [e - s for s, e in zip(starts, ends, strict=True)]


def parse(blob: bytes) -> tuple[dict, int]:
    magic, container, hlen, hd = struct.unpack("<8sII16s", blob[:32])
    assert magic == b"KVSNAP\r\n" and container == 1
    header = blob[32:32 + hlen]
    assert b2(header) == hd
    base = 32 + hlen
    base += -base % 64
    assert blob[32 + hlen:base] == bytes(base - 32 - hlen)
    return json.loads(header), base


def runs_array(rng, n: int, step: int) -> np.ndarray:
    out, v = [], int(rng.integers(-10**6, 10**6))
    while len(out) < n:
        k = int(rng.integers(20, 60))
        out += [v + step * i for i in range(k)]
        v = int(rng.integers(-10**6, 10**6))
    return np.array(out[:n], dtype=np.int64)


def sample_arrays(rng) -> dict[str, np.ndarray]:
    return {
        "raw_i8": rng.integers(-2**62, 2**62, size=300, dtype=np.int64),
        "up": runs_array(rng, 500, 1),
        "down": runs_array(rng, 400, -1),
        "flat": runs_array(rng, 256, 0),
        "up_i4": runs_array(rng, 300, 1).astype(np.int32),
        "short_run_i8": np.arange(40, dtype=np.int64) + 7,          # < 64 values: raw
        "u8_runs_no": np.arange(200, dtype=np.uint64) + 3,          # unsigned: never runs
        "mat_i4": rng.integers(-2**31, 2**31, size=(7, 5), dtype=np.int32),
        "bytes": rng.integers(1, 256, size=33, dtype=np.uint8),
        "flags": rng.integers(0, 2, size=19).astype(bool),
        "floats": rng.standard_normal(13) * 1e3,
        "big_endian": rng.integers(-2**31, 2**31, size=11, dtype=np.int32).astype(">i4"),
        "empty": np.zeros(0, dtype=np.int64),
        "u4": rng.integers(1, 2**32, size=9, dtype=np.uint64).astype(np.uint32),
        # at the 4x threshold: 64 values (512 bytes) in 8 runs (8 * 16 * 4 = 512) are runs, in 9 runs raw
        "edge_runs": np.concatenate([np.arange(8) + int(v) for v in rng.integers(-10**6, 10**6, size=8)]),
        "edge_raw": np.concatenate([np.arange(k) + int(v) for k, v in
                                    zip([8] * 7 + [4, 4], rng.integers(-10**6, 10**6, size=9), strict=True)]),
        "one_short": np.arange(63, dtype=np.int64) * -1 + 5,
    }


def sample_window(rng) -> snap.WindowState:
    ids = [(f"r{int(rng.integers(10**9))}-é{i}", METHODS[int(rng.integers(3))], rng.bytes(16),
            int(rng.integers(1, 10**9)), float(rng.uniform(1, 2e9))) for i in range(6)]
    ids.append(("", "Gamma", rng.bytes(16), 5, 0.25))
    replies = [(f"q{i}ü", METHODS[int(rng.integers(3))], rng.bytes(int(rng.integers(0, 40)))) for i in range(5)]
    replies.append(("last", "Alpha", b""))
    return snap.WindowState(ids, replies)


def sample_worker(rng) -> WorkerRecord:
    return WorkerRecord(f"w{int(rng.integers(100))}", "p0", 0, 3, 1, 2, "cpu", "dev", int(rng.integers(1, 2**40)),
                        "10.0.0.1:7", int(rng.integers(1, 100)), 123.5, False, 4, "tok")


def test_encode_writes_the_documented_layout_and_decode_reads_it_back():
    rng = np.random.default_rng(2811)
    arrays = sample_arrays(rng)
    meta = {"name": "p0", "x": int(rng.integers(1, 1000)), "nested": {"k": [1, 2]}}
    pools = {"p0": PoolState(meta, arrays), "p1": PoolState({"name": "p1"}, {"one": np.array([5], np.int64)})}
    window = sample_window(rng)
    worker = sample_worker(rng)
    seq, inc, created, lineage = 987654321, 42, 1712.25, int(rng.integers(1, 2**63))
    enc = snap.encode(seq, inc, created, pools, [worker], window, METHODS, lineage=lineage)
    blob = joined(enc)
    assert enc.nbytes == len(blob)
    h, base = parse(blob)
    assert enc.header_digest == b2(blob[32:32 + struct.unpack("<I", blob[12:16])[0]])
    assert set(h) == KEYS
    assert (h["format"], h["version"], h["seq"], h["incarnation"], h["lineage"], h["created"]) == \
        ("kvservice-snapshot", 1, seq, inc, lineage, created)
    assert h["pools"] == {"p0": meta, "p1": {"name": "p1"}}
    want_worker = {"worker_id": worker.worker_id, "pool": "p0", "layer_begin": 0, "layer_end": 3, "tp_rank": 1,
                   "tp_size": 2, "backend": "cpu", "device_name": "dev",
                   "device_memory_bytes": worker.device_memory_bytes, "address": "10.0.0.1:7", "epoch": worker.epoch,
                   "alive": False, "incarnation": 4, "owner": "tok"}
    assert h["workers"] == [want_worker]
    assert h["window"] == {"methods": METHODS}
    entries = {e["name"]: e for e in h["arrays"]}
    assert len(entries) == len(h["arrays"])
    end = 0
    for e in h["arrays"]:
        assert set(e) >= {"name", "dtype", "shape", "encoding", "offset", "nbytes", "digest"}
        assert e["offset"] % 64 == 0 and e["offset"] >= end                 # in order, 64-byte aligned
        end = e["offset"] + e["nbytes"]
        data = blob[base + e["offset"]:base + e["offset"] + e["nbytes"]]
        assert len(data) == e["nbytes"] and b2(data).hex() == e["digest"]
    assert base + end <= len(blob) <= base + end + 63
    for k, a in arrays.items():
        e = entries[f"pool/p0/{k}"]
        le = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
        assert e["dtype"] == le.dtype.str and e["shape"] == list(a.shape)
        data = blob[base + e["offset"]:base + e["offset"] + e["nbytes"]]
        runs = model_runs([int(v) for v in a.tolist()], a.dtype.kind) if a.ndim == 1 else None
        if runs is None:
            assert e["encoding"] == "raw"
            assert data == le.tobytes()
        else:
            step, starts, lengths = runs
            assert (e["encoding"], e["step"], e["runs"]) == ("runs", step, len(starts))
            assert data == struct.pack(f"<{2 * len(starts)}q", *starts, *lengths)
    assert {e["encoding"] for e in h["arrays"]} == {"raw", "runs"}
    assert {entries[f"pool/p0/{k}"].get("step") for k in ("up", "down", "flat")} == {1, -1, 0}
    assert [entries[f"pool/p0/{k}"]["encoding"] for k in ("edge_runs", "edge_raw", "one_short")] == \
        ["runs", "raw", "raw"]

    s = snap.decode(blob, "here")
    assert (s.seq, s.incarnation, s.created, s.lineage) == (seq, inc, created, lineage)
    assert s.workers == [WorkerRecord(**want_worker, last_heartbeat=0.0)]
    assert s.window == window
    assert set(s.pools) == {"p0", "p1"} and s.pools["p0"].meta == meta
    for k, a in arrays.items():
        got = s.pools["p0"].arrays[k]
        assert got.dtype == a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else got.dtype == a.dtype
        assert got.shape == a.shape and np.array_equal(got, a)
    assert np.array_equal(s.pools["p1"].arrays["one"], [5])


def test_window_arrays_are_packed_strings_with_offsets():
    rng = np.random.default_rng(5)
    window = sample_window(rng)
    blob = joined(snap.encode(1, 1, 0.0, {}, [], window, METHODS))
    h, base = parse(blob)
    assert h["lineage"] == 0 and h["pools"] == {} and h["workers"] == []           # no lineage given: 0

    def arr(name):
        e = next(e for e in h["arrays"] if e["name"] == f"window/{name}")
        assert e["encoding"] == "raw"
        data = blob[base + e["offset"]:base + e["offset"] + e["nbytes"]]
        return np.frombuffer(data, dtype=e["dtype"]).reshape(e["shape"])

    rids = [r.encode() for r, *_ in window.ids]
    assert arr("ids/rid").tobytes() == b"".join(rids)
    assert arr("ids/rid_offsets").tolist() == list(np.cumsum([0] + [len(r) for r in rids]))
    assert arr("ids/method").tolist() == [METHODS.index(m) for _, m, *_ in window.ids]
    assert arr("ids/digest").tolist() == [list(d) for _, _, d, _, _ in window.ids]
    assert arr("ids/seq").tolist() == [s for *_, s, _ in window.ids]
    assert arr("ids/at").tolist() == [t for *_, t in window.ids]
    datas = [d for *_, d in window.replies]
    assert arr("replies/data").tobytes() == b"".join(datas)
    assert arr("replies/offsets").tolist() == list(np.cumsum([0] + [len(d) for d in datas]))
    assert arr("replies/rid").tobytes() == b"".join(r.encode() for r, *_ in window.replies)
    assert arr("replies/method").tolist() == [METHODS.index(m) for _, m, _ in window.replies]
    assert snap.decode(blob).window == window


# ---- decoding hand-made blobs ---------------------------------------------------------------------
def make_blob(arrays: list[tuple[dict, bytes]], **over) -> bytes:
    """A snapshot written by hand from the documented layout (entries get offset, nbytes, digest)."""
    entries, body = [], b""
    for e, data in arrays:
        e = {"offset": len(body), "nbytes": len(data), "digest": b2(data).hex(), **e}
        entries.append(e)
        body += data + bytes(-len(data) % 64)
    h = {"format": "kvservice-snapshot", "version": 1, "seq": 11, "incarnation": 2, "created": 3.5,
         "pools": {"p": {"m": 1}}, "workers": [], "window": {"methods": METHODS}, "arrays": entries}
    h.update(over)
    h = {k: v for k, v in h.items() if v is not None}
    header = json.dumps(h).encode()
    head = struct.pack("<8sII16s", b"KVSNAP\r\n", 1, len(header), b2(header)) + header
    return head + bytes(-len(head) % 64) + body


def empty_window() -> list[tuple[dict, bytes]]:
    z = struct.pack("<q", 0)
    out = []
    for name, dt, data, shape in [("ids/rid", "|u1", b"", [0]), ("ids/rid_offsets", "<i8", z, [1]),
                                  ("ids/method", "|u1", b"", [0]), ("ids/digest", "|u1", b"", [0, 16]),
                                  ("ids/seq", "<i8", b"", [0]), ("ids/at", "<f8", b"", [0]),
                                  ("replies/rid", "|u1", b"", [0]), ("replies/rid_offsets", "<i8", z, [1]),
                                  ("replies/method", "|u1", b"", [0]), ("replies/data", "|u1", b"", [0]),
                                  ("replies/offsets", "<i8", z, [1])]:
        out.append(({"name": f"window/{name}", "dtype": dt, "shape": shape, "encoding": "raw"}, data))
    return out


def runs_entry(name, dtype, n, step, starts, lengths, **extra):
    e = {"name": f"pool/p/{name}", "dtype": dtype, "shape": [n], "encoding": "runs", "step": step,
         "runs": len(starts), **extra}
    return e, struct.pack(f"<{2 * len(starts)}q", *starts, *lengths)


def test_decode_expands_hand_written_runs():
    rng = np.random.default_rng(77)
    cases = {}
    for name, dtype, step in [("up", "<i8", 1), ("down", "<i8", -1), ("flat", "<i4", 0), ("down4", "<i4", -1)]:
        lengths = [int(x) for x in rng.integers(1, 9, size=5)]
        starts = [int(x) for x in rng.integers(-1000, 1000, size=5)]
        want = [s + step * i for s, k in zip(starts, lengths, strict=True) for i in range(k)]
        cases[name] = (dtype, want, runs_entry(name, dtype, len(want), step, starts, lengths))
    raw = rng.integers(-9, 9, size=(3, 4)).astype("<i8")
    tail = rng.integers(-9, 9, size=8).astype("<i8")          # 64 bytes: ends exactly at the end of the file
    blob = make_blob([c[2] for c in cases.values()] +
                     [({"name": "pool/p/raw", "dtype": "<i8", "shape": [3, 4], "encoding": "raw"}, raw.tobytes())] +
                     empty_window() +
                     [({"name": "pool/p/tail", "dtype": "<i8", "shape": [8], "encoding": "raw"}, tail.tobytes())],
                     lineage=None)
    assert blob.endswith(tail.tobytes())
    s = snap.decode(blob)
    assert (s.seq, s.incarnation, s.created, s.lineage) == (11, 2, 3.5, 0)       # no lineage: 0
    got = s.pools["p"].arrays
    for name, (dtype, want, _) in cases.items():
        assert got[name].dtype == np.dtype(dtype) and got[name].tolist() == want, name
    assert got["raw"].tolist() == raw.tolist() and got["tail"].tolist() == tail.tolist()
    assert s.window == snap.WindowState([], [])


def bad(blob: bytes, *words: str, reason: str | None = None) -> StateError:
    with pytest.raises(StateError) as ei:
        snap.decode(blob, "W")
    for w in ("W", *words):
        assert w in ei.value.message, (w, ei.value.message)
    if reason:
        assert ei.value.reason == reason
    return ei.value


def test_damaged_or_foreign_headers_are_named():
    good = make_blob(empty_window())
    snap.decode(good)
    bad(good[:31], "31 bytes", "too short")
    bad(b"KVSNAP\n\n" + good[8:], "not a kvservice snapshot", "KVSNAP\\n\\n")
    bad(good[:8] + struct.pack("<I", 2) + good[12:], "container version 2")
    bad(good[:12] + struct.pack("<I", len(good)) + good[16:], f"header length {len(good)}")
    bad(good[:40] + bytes([good[40] ^ 1]) + good[41:], "header fails its checksum")
    bad(make_blob(empty_window(), format="other-thing"), "'other-thing'", "'kvservice-snapshot'")
    err = bad(make_blob(empty_window(), version=2), "version 2", "versions 1..1", reason="STATE_TOO_NEW")
    assert err.problems == [err.message]
    bad(make_blob(empty_window(), version=0), "version 0", reason="STATE_TOO_NEW")
    bad(make_blob(empty_window(), version="1"), "version 1", reason="STATE_TOO_NEW")
    bad(make_blob(empty_window(), seq=None), "malformed header", "KeyError")


@pytest.mark.parametrize(("entry", "words"), [
    (({"name": "pool/p/a", "dtype": "<i2", "shape": [1], "encoding": "raw"}, b"\1\0"), ["'pool/p/a'", "'<i2'"]),
    (({"name": "pool/p/a", "dtype": "<i8", "shape": [1, 1, 1], "encoding": "raw"}, bytes(8)), ["not allowed"]),
    (({"name": "pool/p/a", "dtype": "<i8", "shape": [-1], "encoding": "raw"}, bytes(8)), ["not allowed"]),
    (({"name": "pool/p/a", "dtype": "<i8", "shape": [2], "encoding": "raw"}, bytes(8)), ["8 bytes for shape (2,)"]),
    (({"name": "pool/p/a", "dtype": "<i8", "shape": [2], "encoding": "zip"}, bytes(16)), ["unknown encoding 'zip'"]),
    (({"name": "pool/p/a", "dtype": "<i8", "shape": [1], "encoding": "raw", "offset": 10**6}, bytes(8)),
     ["lies past the end of the file (truncated or damaged)"]),
    (({"name": "pool/p/a", "dtype": "<i8", "shape": [1], "encoding": "raw", "offset": -64}, bytes(8)),
     ["lies past the end of the file (truncated or damaged)"]),
    (({"name": "pool/p/a", "dtype": "<i8", "shape": [1], "encoding": "raw", "digest": "00" * 16}, bytes(8)),
     ["fails its checksum (damaged)"]),
    (runs_entry("a", "<i8", 3, 2, [0], [3]), ["malformed runs"]),
    (runs_entry("a", "<i8", 3, 1, [0], [3], runs=2), ["malformed runs"]),
    (runs_entry("a", "<i8", 3, 1, [0], [3], shape=[3, 1]), ["malformed runs"]),
    (runs_entry("a", "<i8", 3, 1, [0, 5], [3, 0]), ["runs add up to 3, not 3"]),
    (runs_entry("a", "<i8", 4, 1, [0], [3]), ["runs add up to 3, not 4"]),
])
def test_a_damaged_array_is_named(entry, words):
    bad(make_blob([entry, *empty_window()]), "array", *words)


def test_digest16_is_blake2b_128_of_the_parts_joined():
    rng = np.random.default_rng(6)
    parts = [rng.bytes(int(rng.integers(0, 90))) for _ in range(4)]
    assert snap.digest16(*parts) == b2(b"".join(parts))
    assert snap.digest16(memoryview(parts[0]), parts[1]) == b2(parts[0] + parts[1])
    assert snap.digest16() == b2(b"")


@pytest.mark.parametrize("part", ["ids", "replies"])
def test_window_columns_of_different_lengths_are_a_malformed_header(part):
    """One more request id than methods (or reply bodies): damage, never a silently shorter window."""
    win = empty_window()
    at = {e["name"]: i for i, (e, _) in enumerate(win)}
    win[at[f"window/{part}/rid"]] = ({**win[at[f"window/{part}/rid"]][0], "shape": [1]}, b"a")
    win[at[f"window/{part}/rid_offsets"]] = ({**win[at[f"window/{part}/rid_offsets"]][0], "shape": [2]},
                                             struct.pack("<2q", 0, 1))
    bad(make_blob(win), "malformed header", "ValueError")


@pytest.mark.parametrize("offsets", [[1], [1, 1], [0, 2, 1], [0, 0]])
def test_inconsistent_window_offsets_are_a_malformed_header(offsets):
    win = empty_window()
    win[0] = ({**win[0][0], "shape": [1]}, b"a")                          # one byte of request ids
    win[1] = ({**win[1][0], "shape": [len(offsets)]}, struct.pack(f"<{len(offsets)}q", *offsets))
    bad(make_blob(win), "malformed header", "offsets are inconsistent")


# ---- pools ----------------------------------------------------------------------------------------
def real_pool(rng) -> Pool:
    spec = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 128), LayerSpec(2, 64, sliding_window=32)), 16, "interleaved")
    p = plan(spec, Sizing(num_slots=int(rng.integers(40, 90)), max_seq_len=512), ())
    return Pool("p0", p)


def plan_key(p) -> tuple:
    g = p.geometry
    return (g.spec, g.groups, g.layers, g.index_spaces, g.pool_pages, p.max_seq_len, p.backends, p.warnings)


def test_pool_plan_is_the_plan_the_pool_was_made_with():
    rng = np.random.default_rng(3)
    pool = real_pool(rng)
    st = pool.export_state()
    assert plan_key(snap.pool_plan(st.meta)) == plan_key(pool.plan)
    older = {k: v for k, v in st.meta.items() if k != "group_slots"}
    assert plan_key(snap.pool_plan(older)) == plan_key(pool.plan)
    wrong = {**st.meta, "max_seq_len": 1024}
    assert snap.pool_plan(wrong).max_seq_len == 1024


def test_verify_pools_of_sound_live_pools_finds_nothing():
    rng = np.random.default_rng(8)
    pools = {"a": real_pool(rng), "b": real_pool(rng)}
    assert snap.verify_pools(pools) == []
    assert snap.verify_pools(pools, {"a"}) == []
    assert snap.verify_pools(pools, set()) == []


def test_build_pools_lists_every_problem_and_names_four():
    rng = np.random.default_rng(4)
    good = real_pool(rng).export_state()
    states = {"ok": good}
    for i in range(5):
        states[f"bad{i}"] = PoolState({k: v for k, v in good.meta.items() if k != "spec"}, good.arrays)
    with pytest.raises(StateError) as ei:
        snap.build_pools(states, "WHERE")
    err = ei.value
    assert len(err.problems) == 5
    assert all(p.startswith(f"pool 'bad{i}': cannot be rebuilt (KeyError") for i, p in enumerate(err.problems))
    assert err.message.startswith("WHERE: 5 problem(s): ")
    assert err.message.count("cannot be rebuilt") == 4 and "bad4" not in err.message
    out = snap.build_pools({"ok": good}, "WHERE")
    assert list(out) == ["ok"] and out["ok"].export_state().meta == good.meta
