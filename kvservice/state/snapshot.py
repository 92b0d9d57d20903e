"""Snapshot format: NumPy arrays behind a JSON header, versioned and checksummed; nothing in it executes.

A snapshot holds every pool (as ``pool_state.PoolState``: domain terms, not attributes), the worker
records and the idempotency window at one journal position. Layout (one file, or one blob):

    bytes 0-7    magic b"KVSNAP\\r\\n"
    bytes 8-11   container version, uint32 little-endian (CONTAINER)
    bytes 12-15  header length H, uint32 little-endian
    bytes 16-31  blake2b-128 digest of the header
    bytes 32..   header, UTF-8 JSON
    from the next multiple of 64: the arrays, each at its header offset, 64-byte aligned

The header: ``{"format": "kvservice-snapshot", "version": VERSION, "seq", "incarnation", "lineage", "created",
"pools": {name: PoolState.meta}, "workers": [record fields], "window": {"methods": [...]},
"arrays": [{"name", "dtype", "shape", "encoding", "offset", "nbytes", "digest"}, ...]}``. Array
names are ``pool/<pool>/<array>`` and ``window/<array>``; dtypes come from a fixed list of
little-endian integer and float types (no objects, so loading never runs code). Encoding ``raw``
is the array's bytes; ``runs`` (for free lists and slot lists, which are mostly arithmetic runs)
stores int64 starts then int64 lengths of runs with a fixed ``step``. Every array has its own
digest and so has the header: a damaged snapshot is named, never loaded.

A reader refuses a newer ``version`` (upgrade first) and reads every older one; the format is
described in docs/DURABILITY.md so the next release can keep reading it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvservice.contract.errors import StateError
from kvservice.contract.geometry import CacheSpec, LayerSpec, group_windows
from kvservice.contract.sizing import Plan, Sizing
from kvservice.core.invariants import check_pool_state
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.core.pool_state import IdRuns, PoolState
from kvservice.manager.workers import WorkerRecord

MAGIC = b"KVSNAP\r\n"
CONTAINER = 1
VERSION = 1
FORMAT_NAME = "kvservice-snapshot"
ALIGN = 64
MAX_HEADER_BYTES = 1 << 28
_PREFIX = struct.Struct("<8sII16s")
DTYPES = frozenset({"<i8", "<u8", "<i4", "<u4", "|u1", "|b1", "<f8"})


def digest16(*parts: bytes | memoryview) -> bytes:
    """blake2b-128 of the concatenated parts (the checksum of snapshots and journal entries)."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p)
    return h.digest()


@dataclass(frozen=True, slots=True)
class WindowState:
    """The idempotency window as data.

    ids: (request_id, method, request digest (16 bytes), journal seq, wall-clock seconds), oldest first.
    replies: (request_id, method, serialized reply), oldest first (the most recent ones only).
    """

    ids: list[tuple[str, str, bytes, int, float]] = field(default_factory=list)
    replies: list[tuple[str, str, bytes]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A decoded snapshot: journal position, the incarnation that wrote it, and the state.

    lineage: the state history it belongs to (kvservice.state.stores.new_lineage; 0 in snapshots written
    before lineages).
    """

    seq: int
    incarnation: int
    created: float
    pools: dict[str, PoolState]
    workers: list[WorkerRecord]
    window: WindowState
    lineage: int = 0


@dataclass(frozen=True, slots=True)
class Encoded:
    """An encoded snapshot: header digest (identifies it), total bytes, and the chunks to write in order."""

    header_digest: bytes
    nbytes: int
    chunks: list[bytes | memoryview]


# ---- encoding ------------------------------------------------------------------------------------
def _runs(a: np.ndarray) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(step, starts, lengths) of a 1-D signed integer array as arithmetic runs, if that is much smaller."""
    if a.ndim != 1 or a.dtype.kind != "i" or len(a) < 64:
        return None
    x = a.astype(np.int64, copy=False)
    d = np.diff(x)
    best_step, best = 0, len(x) + 1
    for step in (-1, 1, 0):
        r = int(np.count_nonzero(d != step)) + 1
        if r < best:
            best_step, best = step, r
    if best * 16 * 4 > x.nbytes:                      # keep runs only if at least 4x smaller
        return None
    starts = np.concatenate(([0], np.flatnonzero(d != best_step) + 1))
    lengths = np.diff(np.concatenate((starts, [len(x)])))
    return best_step, x[starts], lengths.astype(np.int64)


def _window_arrays(window: WindowState, methods: list[str]) -> dict[str, np.ndarray]:
    def packed(strings: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.zeros(len(strings) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in strings], out=offsets[1:])
        return np.frombuffer(b"".join(strings), dtype=np.uint8).copy(), offsets

    code = {m: i for i, m in enumerate(methods)}
    rid_bytes, rid_off = packed([rid.encode() for rid, *_ in window.ids])
    rep_bytes, rep_off = packed([data for _, _, data in window.replies])
    rep_rids, rep_ridoff = packed([rid.encode() for rid, _, _ in window.replies])
    return {
        "ids/rid": rid_bytes, "ids/rid_offsets": rid_off,
        "ids/method": np.array([code[m] for _, m, *_ in window.ids], dtype=np.uint8),
        "ids/digest": np.frombuffer(b"".join(d for _, _, d, _, _ in window.ids), dtype=np.uint8).reshape(-1, 16).copy(),
        "ids/seq": np.array([s for *_, s, _ in window.ids], dtype=np.int64),
        "ids/at": np.array([t for *_, t in window.ids], dtype=np.float64),
        "replies/rid": rep_rids, "replies/rid_offsets": rep_ridoff,
        "replies/method": np.array([code[m] for _, m, _ in window.replies], dtype=np.uint8),
        "replies/data": rep_bytes, "replies/offsets": rep_off,
    }


def encode(seq: int, incarnation: int, created: float, pools: dict[str, PoolState], workers: list[WorkerRecord],
           window: WindowState, methods: list[str], lineage: int = 0) -> Encoded:
    """Encode a snapshot (the expensive part of a snapshot: run it outside the journal lock)."""
    named: list[tuple[str, np.ndarray]] = []
    for name, st in pools.items():
        named += [(f"pool/{name}/{k}", v) for k, v in st.arrays.items()]
    named += [(f"window/{k}", v) for k, v in _window_arrays(window, methods).items()]
    entries, buffers, offset = [], [], 0
    for name, arr in named:
        if isinstance(arr, IdRuns):                 # a free stack kept as runs (pool.Pool.capture_state)
            entry: dict[str, Any] = {"name": name, "dtype": "<i8", "shape": [arr.n]}
            runs = (-1, arr.tops - arr.starts, np.diff(np.append(arr.starts, arr.n)).astype(np.int64))
        else:
            arr = np.ascontiguousarray(arr)
            if arr.dtype.str not in DTYPES:
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            entry = {"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape)}
            runs = _runs(arr)
        if runs is not None:
            step, starts, lengths = runs
            data = memoryview(np.concatenate((starts, lengths)).astype("<i8")).cast("B")
            entry.update(encoding="runs", step=step, runs=len(starts))
        else:
            data = memoryview(arr).cast("B") if arr.size else memoryview(b"")
            entry["encoding"] = "raw"
        entry.update(offset=offset, nbytes=len(data), digest=digest16(data).hex())
        entries.append(entry)
        pad = -len(data) % ALIGN
        buffers += [data, bytes(pad)] if pad else [data]
        offset += len(data) + pad
    header = json.dumps({
        "format": FORMAT_NAME, "version": VERSION, "seq": seq, "incarnation": incarnation, "lineage": lineage,
        "created": created, "pools": {name: st.meta for name, st in pools.items()},
        "workers": [{k: v for k, v in asdict(w).items() if k != "last_heartbeat"} for w in workers],
        "window": {"methods": methods}, "arrays": entries}, separators=(",", ":")).encode()
    hd = digest16(header)
    head = _PREFIX.pack(MAGIC, CONTAINER, len(header), hd) + header
    head += bytes(-len(head) % ALIGN)
    return Encoded(hd, len(head) + offset, [head, *buffers])


# ---- decoding ------------------------------------------------------------------------------------
def decode(blob: bytes | memoryview, where: str = "snapshot") -> Snapshot:
    """Verify and decode a snapshot. StateError naming the damaged part (header, or which array)."""
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise StateError(f"{where}: {len(view)} bytes, too short to be a snapshot (truncated)")
    magic, container, hlen, hd = _PREFIX.unpack(view[:_PREFIX.size])
    if magic != MAGIC:
        raise StateError(f"{where}: not a kvservice snapshot (magic {bytes(magic)!r}): damaged or another file")
    if container != CONTAINER:
        raise StateError(f"{where}: container version {container} is not {CONTAINER}: damaged or written by "
                         "another kvservice release")
    if hlen > min(MAX_HEADER_BYTES, len(view) - _PREFIX.size):
        raise StateError(f"{where}: header length {hlen} does not fit the {len(view)}-byte file (damaged)")
    header = view[_PREFIX.size:_PREFIX.size + hlen]
    if digest16(header) != hd:
        raise StateError(f"{where}: header fails its checksum (damaged)")
    try:
        h = json.loads(bytes(header))
        if h.get("format") != FORMAT_NAME:
            raise StateError(f"{where}: format {h.get('format')!r} is not {FORMAT_NAME!r}")
        if not isinstance(h.get("version"), int) or h["version"] > VERSION or h["version"] < 1:
            raise StateError(f"{where}: snapshot version {h.get('version')} was written by a newer kvservice; this "
                             f"release reads versions 1..{VERSION}: upgrade kvservice", reason="STATE_TOO_NEW")
        base = _PREFIX.size + hlen
        base += -base % ALIGN
        arrays = {e["name"]: _array(view, base, e, where) for e in h["arrays"]}
        pools = {}
        for name, meta in h["pools"].items():
            prefix = f"pool/{name}/"
            pools[name] = PoolState(meta, {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)})
        workers = [WorkerRecord(**w, last_heartbeat=0.0) for w in h["workers"]]
        window = _window(arrays, list(h["window"]["methods"]))
        return Snapshot(int(h["seq"]), int(h["incarnation"]), float(h["created"]), pools, workers, window,
                        int(h.get("lineage", 0)))
    except StateError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise StateError(f"{where}: malformed header ({type(err).__name__}: {err}); written by an incompatible "
                         "kvservice?") from None


def _array(view: memoryview, base: int, e: dict, where: str) -> np.ndarray:
    name, dtype, shape = e["name"], e["dtype"], tuple(int(d) for d in e["shape"])
    if dtype not in DTYPES or len(shape) > 2 or any(d < 0 for d in shape):
        raise StateError(f"{where}: array {name!r} has dtype {dtype!r} shape {shape}, not allowed")
    start, nbytes = base + int(e["offset"]), int(e["nbytes"])
    if start < base or start + nbytes > len(view):
        raise StateError(f"{where}: array {name!r} lies past the end of the file (truncated or damaged)")
    data = view[start:start + nbytes]
    if digest16(data).hex() != e["digest"]:
        raise StateError(f"{where}: array {name!r} fails its checksum (damaged)")
    size = int(np.prod(shape, dtype=np.int64))
    if e["encoding"] == "raw":
        if nbytes != size * np.dtype(dtype).itemsize:
            raise StateError(f"{where}: array {name!r}: {nbytes} bytes for shape {shape} {dtype}")
        return np.frombuffer(data, dtype=dtype, count=size).reshape(shape)
    if e["encoding"] == "runs":
        r, step = int(e["runs"]), int(e["step"])
        if nbytes != 16 * r or step not in (-1, 0, 1) or len(shape) != 1:
            raise StateError(f"{where}: array {name!r}: malformed runs")
        both = np.frombuffer(data, dtype="<i8", count=2 * r)
        starts, lengths = both[:r], both[r:]
        if (lengths < 1).any() or int(lengths.sum()) != size:
            raise StateError(f"{where}: array {name!r}: runs add up to {int(lengths.sum())}, not {size}")
        offs = np.cumsum(lengths) - lengths
        out = np.repeat(starts - step * offs, lengths) + step * np.arange(size, dtype=np.int64)
        return out.astype(dtype)
    raise StateError(f"{where}: array {name!r}: unknown encoding {e['encoding']!r}")


def _window(arrays: dict[str, np.ndarray], methods: list[str]) -> WindowState:
    def unpacked(data: np.ndarray, offsets: np.ndarray) -> list[bytes]:
        raw = data.tobytes()
        o = offsets.tolist()
        if len(o) < 1 or o[0] != 0 or o[-1] != len(raw) or any(b < a for a, b in itertools.pairwise(o)):
            raise ValueError("window string offsets are inconsistent")
        return [raw[a:b] for a, b in itertools.pairwise(o)]

    w = {k[len("window/"):]: v for k, v in arrays.items() if k.startswith("window/")}
    rids = [r.decode() for r in unpacked(w["ids/rid"], w["ids/rid_offsets"])]
    digests = w["ids/digest"]
    ids = [(rid, methods[int(m)], bytes(digests[i]), int(s), float(t)) for i, (rid, m, s, t) in
           enumerate(zip(rids, w["ids/method"].tolist(), w["ids/seq"].tolist(), w["ids/at"].tolist(), strict=True))]
    rep_rids = [r.decode() for r in unpacked(w["replies/rid"], w["replies/rid_offsets"])]
    datas = unpacked(w["replies/data"], w["replies/offsets"])
    replies = [(rid, methods[int(m)], d) for rid, m, d in zip(rep_rids, w["replies/method"].tolist(), datas,
                                                              strict=True)]
    return WindowState(ids, replies)


# ---- pools: plan, checks, rebuild -----------------------------------------------------------------
def pool_plan(meta: dict) -> Plan:
    """The plan a PoolState's pool was made with (planning is deterministic)."""
    s = meta["spec"]
    layers: list[LayerSpec] = []
    for kv_heads, head_dim, dtype, window, count, *k_only in s["layers"]:
        layers += [LayerSpec(int(kv_heads), int(head_dim), str(dtype), int(window), bool(k_only and k_only[0]))] \
            * int(count)
    spec = CacheSpec(tuple(layers), int(s["page_size"]), str(s["layout"]))
    # States written before groups were sized apart have no group_slots: every group had num_slots.
    counts = meta.get("group_slots") or [int(meta["num_slots"])] * len(group_windows(spec))
    return plan(spec, Sizing(group_slots=tuple(int(c) for c in counts), max_seq_len=int(meta["max_seq_len"])),
                tuple(meta["backends"]))


def build_pools(pools: dict[str, PoolState], where: str) -> dict[str, Pool]:
    """Pools rebuilt from their states after checking every invariant; StateError listing the problems."""
    out, problems = {}, []
    for name, st in pools.items():
        try:
            p = pool_plan(st.meta)
            found = check_pool_state(st, p)
            if not found:
                out[name] = Pool.from_state(st, p)
        except Exception as err:              # whatever a damaged state provokes: a named problem, not a crash
            found = [f"cannot be rebuilt ({type(err).__name__}: {getattr(err, 'message', err)})"]
        problems += [f"pool {name!r}: {f}" for f in found]
    if problems:
        raise StateError(f"{where}: {len(problems)} problem(s): {'; '.join(problems[:4])}", problems=problems)
    return out


def verify_pools(pools: dict[str, Pool], names: set[str] | None = None) -> list[str]:
    """The invariant problems of live pools (each exported and checked; only `names` if given); [] if sound."""
    problems = []
    for name, pool in pools.items():
        if names is not None and name not in names:
            continue
        problems += [f"pool {name!r}: {f}" for f in check_pool_state(pool.export_state(), pool.plan)]
    return problems


__all__ = ["Encoded", "Snapshot", "WindowState", "build_pools", "decode", "digest16", "encode",
           "pool_plan", "verify_pools"]
