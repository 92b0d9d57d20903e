"""Hostile UpdateTables requests, shared by tests/fuzz/test_fuzz_worker.py and bench/bench_worker_tables.py.

- `issue_cases`: the reports of issue 26 item 3 rebuilt: a ~120-byte full reply whose one row claims
  2^26 pages in int64 (it pinned 512 MiB per table id), deltas that claim billions of tokens or rows
  (one took a worker to 3.1 GiB), a reply of another pool's plan, and the largest table the pool's
  bounds accept (what a hostile tenant may legitimately hold).
- `mutate`: one random change of a real StepStream reply (dtypes, sizes, values, index spaces, the
  binding fields), driven by a `random.Random` (hypothesis' st.randoms() in the fuzzer), so the same
  mutations run under hypothesis and in the benchmark.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from kvservice.v1 import worker_pb2 as wpb

HUGE = (2**26 * 16, 2**31 - 1, 2**40, 2**62, -1, 0)


def _t(a: np.ndarray, code: int) -> cpb.Tensor:
    return cpb.Tensor(dtype=code, data=np.ascontiguousarray(a).tobytes())


def full_reply(rows: int, tokens: int, page_size: int, num_slots: int, seq: int = 1,
               stream_id: str = "", new_tokens: bool = True) -> pb.StepReply:
    """A well-formed full reply of one index space (per_layer, base 0): `rows` rows of `tokens` tokens each,
    pages cycling over the pool's slots, every generation 1; every token new (or none: new_tokens False)."""
    pages = -(-tokens // page_size)
    r = pb.StepReply(stream_seq=seq, stream_id=stream_id)
    r.seq_ids.CopyFrom(_t(np.arange(1, rows + 1, dtype=np.uint64), cpb.UINT64))
    r.num_tokens.CopyFrom(_t(np.full(rows, tokens, np.int64), cpb.INT64))
    r.new_token_indptr.CopyFrom(_t(np.arange(rows + 1, dtype=np.int64) * (tokens if new_tokens else 0), cpb.INT64))
    t = r.tables.add(index_space=0, group=0, scale=1, offset=0, upper_bound=num_slots, base=0)
    nnz = rows * pages
    t.indptr.CopyFrom(_t(np.arange(rows + 1, dtype=np.int32) * pages, cpb.INT32))
    t.indices.CopyFrom(_t((np.arange(nnz) % num_slots).astype(np.int32), cpb.INT32))
    t.last_page_len.CopyFrom(_t(np.full(rows, tokens - (pages - 1) * page_size, np.int32), cpb.INT32))
    t.generations.CopyFrom(_t(np.ones(nnz, np.uint32), cpb.UINT32))
    if not new_tokens:
        t.slot_mapping.CopyFrom(_t(np.zeros(0, np.int64), cpb.INT64))
        t.slot_generations.CopyFrom(_t(np.zeros(0, np.uint32), cpb.UINT32))
        return r
    tok = np.arange(rows * tokens) % tokens
    row = np.arange(rows * tokens) // tokens
    sm = (row * pages + tok // page_size) % num_slots * page_size + tok % page_size
    t.slot_mapping.CopyFrom(_t(sm.astype(np.int64), cpb.INT64))
    t.slot_generations.CopyFrom(_t(np.ones(len(sm), np.uint32), cpb.UINT32))
    return r


def issue_cases(page_size: int, num_slots: int, max_rows: int,
                max_pages: int) -> list[tuple[str, wpb.UpdateTablesRequest]]:
    """(name, request) of the issue's reports and the largest acceptable table, for a one-space per_layer pool."""
    out = []
    pin = pb.StepReply(stream_seq=1)                   # ~100 bytes claiming one row of 2^26 int64 pages
    pin.seq_ids.CopyFrom(_t(np.array([1], np.uint64), cpb.UINT64))
    pin.num_tokens.CopyFrom(_t(np.array([2**26 * page_size], np.int64), cpb.INT64))
    pin.new_token_indptr.CopyFrom(_t(np.array([0, 1], np.int64), cpb.INT64))
    t = pin.tables.add(index_space=0, upper_bound=num_slots, scale=1)
    t.indptr.CopyFrom(_t(np.array([0, 0], np.int64), cpb.INT64))
    t.indices.CopyFrom(_t(np.zeros(0, np.int64), cpb.INT64))
    t.last_page_len.CopyFrom(_t(np.array([1], np.int32), cpb.INT32))
    out.append(("one row claiming 2^26 int64 pages", wpb.UpdateTablesRequest(table_id="pin", step=pin)))
    base = full_reply(1, 5, page_size, num_slots, stream_id="s")
    out.append(("base of the deltas", wpb.UpdateTablesRequest(table_id="d", step=base)))
    for name, field in (("tokens_added 2^40", "tokens_added"), ("base_rows of 2^18 rows", "base_rows"),
                        ("num_tokens 2^62 each", "num_tokens")):
        d = pb.StepReply(stream_seq=2, stream_id="s")
        d.delta.base_seq = 1
        if field == "tokens_added":
            d.delta.tokens_added = 2**40
        elif field == "base_rows":
            d.delta.base_rows.CopyFrom(_t(np.zeros(1 << 18, np.int32), cpb.INT32))
            d.seq_ids.CopyFrom(_t(np.arange(1 << 18, dtype=np.uint64), cpb.UINT64))
            d.num_tokens.CopyFrom(_t(np.full(1 << 18, 6, np.int64), cpb.INT64))
            d.new_token_indptr.CopyFrom(_t(np.arange((1 << 18) + 1, dtype=np.int64), cpb.INT64))
        else:
            d.num_tokens.CopyFrom(_t(np.array([2**62], np.int64), cpb.INT64))
            d.new_token_indptr.CopyFrom(_t(np.array([0, 1], np.int64), cpb.INT64))
        t = d.tables.add(index_space=0, upper_bound=num_slots, scale=1)
        t.delta.pages.CopyFrom(_t(np.zeros(0, np.int32), cpb.INT32))
        t.delta.replaced.CopyFrom(_t(np.zeros(0, np.int32), cpb.INT32))
        t.delta.generations.CopyFrom(_t(np.zeros(0, np.uint32), cpb.UINT32))
        t.delta.replaced_generations.CopyFrom(_t(np.zeros(0, np.uint32), cpb.UINT32))
        out.append((f"delta: {name}", wpb.UpdateTablesRequest(table_id="d", step=d)))
    out.append(("rows past the pool's bound", wpb.UpdateTablesRequest(
        table_id="rows", step=full_reply(max_rows + 1, 1, page_size, num_slots))))
    other = full_reply(1, 5, page_size, num_slots)
    other.tables[0].upper_bound = num_slots * 4                       # another pool's plan
    out.append(("another plan's index space", wpb.UpdateTablesRequest(table_id="plan", step=other)))
    out.append(("the largest table the bounds accept", wpb.UpdateTablesRequest(
        table_id="max", step=full_reply(max_rows, max_pages * page_size, page_size, num_slots, new_tokens=False))))
    return out


def _garbage(rnd: random.Random) -> cpb.Tensor:
    code = rnd.choice([0, 3, 10, 11, 12, 13, 99])
    shape = rnd.choice([[], [rnd.randint(0, 8)], [2**32, 2**32], [rnd.randint(0, 4), 2]])
    return cpb.Tensor(dtype=code, shape=shape, data=bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 40))))


def _ints(rnd: random.Random, code: int) -> cpb.Tensor:
    n = rnd.randint(0, 6)
    vals = [rnd.choice([rnd.randint(-3, 70), *HUGE]) for _ in range(n)]
    dt = {10: np.int32, 11: np.int64, 12: np.uint64, 13: np.uint32}[code]
    info = np.iinfo(dt)
    return _t(np.array([min(max(v, info.min), info.max) for v in vals], dtype=dt), code)


def _space_tensor(rnd: random.Random, r: pb.StepReply) -> None:
    if not r.tables:
        return
    t = rnd.choice(list(r.tables))
    names = ["indptr", "indices", "last_page_len", "slot_mapping", "generations", "slot_generations"]
    target = t.delta if t.HasField("delta") and rnd.random() < 0.7 else t
    if target is t.delta:
        names = ["pages", "replaced", "generations", "replaced_generations"]
    name = rnd.choice(names)
    x = rnd.random()
    if x < 0.3:
        target.ClearField(name)
    elif x < 0.6:
        getattr(target, name).CopyFrom(_garbage(rnd))
    else:
        getattr(target, name).CopyFrom(_ints(rnd, rnd.choice([10, 11, 12, 13])))


def _space_fields(rnd: random.Random, r: pb.StepReply) -> None:
    if not r.tables:
        return
    t = rnd.choice(list(r.tables))
    f = rnd.choice(["index_space", "group", "scale", "offset", "upper_bound", "base"])
    setattr(t, f, rnd.choice([0, 1, 2, 7, 2**31 - 1, 2**32 - 1] if f in ("index_space", "group") else
                              [0, 1, 4, 2**31, 2**63 - 1]))


def _batch(rnd: random.Random, r: pb.StepReply) -> None:
    name = rnd.choice(["num_tokens", "new_token_indptr", "seq_ids"])
    x = rnd.random()
    if x < 0.3:
        r.ClearField(name)
    elif x < 0.6:
        getattr(r, name).CopyFrom(_garbage(rnd))
    else:
        getattr(r, name).CopyFrom(_ints(rnd, rnd.choice([11, 12, 10])))


def _delta(rnd: random.Random, r: pb.StepReply) -> None:
    d = r.delta
    x = rnd.random()
    if x < 0.25:
        d.tokens_added = rnd.choice([1, 2, 17, *[h for h in HUGE if h > 0]])
    elif x < 0.5:
        d.base_seq = rnd.choice([0, 1, 2, 3, 2**63])
    elif x < 0.75:
        d.base_rows.CopyFrom(_ints(rnd, 10) if rnd.random() < 0.7 else _garbage(rnd))
    else:
        g = d.groups.add(group=rnd.choice([0, 1, 5]))
        for f in ("first_rows", "first_pages", "replaced_rows"):
            if rnd.random() < 0.5:
                getattr(g, f).CopyFrom(_ints(rnd, 10 if f.endswith("rows") else 11))


def _binding(rnd: random.Random, r: pb.StepReply) -> None:
    f = rnd.choice(["stream_seq", "pool_incarnation", "stream_id", "layer_index_space", "tables"])
    if f == "stream_seq":
        r.stream_seq = rnd.choice([0, 1, 2, 2**63])
    elif f == "pool_incarnation":
        r.pool_incarnation = rnd.choice([1, 2**63 - 1, rnd.getrandbits(63)])
    elif f == "stream_id":
        r.stream_id = rnd.choice(["", "other", "x" * 64])
    elif f == "layer_index_space":
        r.layer_index_space[:] = [rnd.randint(0, 3) for _ in range(rnd.randint(0, 5))]
    elif r.tables and rnd.random() < 0.5:
        r.tables.add().CopyFrom(r.tables[0])                           # a space twice
    elif r.tables:
        del r.tables[rnd.randrange(len(r.tables))]


MUTATIONS: tuple[Callable[[random.Random, pb.StepReply], None], ...] = (
    _space_tensor, _space_tensor, _space_fields, _batch, _delta, _binding)


def mutate(rnd: random.Random, reply: pb.StepReply, changes: int) -> pb.StepReply:
    """A copy of reply with `changes` random changes."""
    r = pb.StepReply()
    r.CopyFrom(reply)
    for _ in range(changes):
        rnd.choice(MUTATIONS)(rnd, r)
    return r
