"""PageTableMirror against a plain-Python model of the tables, with replies built by hand from block_manager.proto's
documented layout (StepReply, SpaceTables, TableDelta, GroupDelta, SpaceDelta), not by the manager's encoder.

The model holds, per row, its token count and, per index space, a dict position -> (page, generation) of the pages
it holds, and per layer group the position of its first held page. Every output of the mirror (block_table,
page_table's CSR and last_page_len, slot_mapping, generations, slot_generations, num_pages, full_reply) is
compared with what the model gives, after a full reply and after each delta of a random run that mixes steady
decode steps (tokens_added or explicit counts), prefill chunks, reordered batches with admitted rows,
sliding-window releases and copy-on-write replacements. Bad replies: refused (MirrorError), the mirror then
holding nothing."""

from __future__ import annotations

import numpy as np
import pytest

from kvservice.contract.errors import KVError
from kvservice.contract.mirror import MirrorError, PageTableMirror
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1.common_pb2 import FLOAT32, INT64

# index space -> (layer group, index dtype); group 1 has a sliding window (its first page moves)
SPACES = {0: (0, np.int32), 1: (0, np.int64), 2: (1, np.int32)}
INFO = {0: (1, 0, 5000, 0), 1: (2, 3, 9000, 100), 2: (1, 0, 7000, 40)}     # scale, offset, upper_bound, base


class Model:
    def __init__(self, rng: np.random.Generator, ps: int, spaces: dict = SPACES) -> None:
        self.rng, self.ps, self.spaces = rng, ps, spaces
        self.rows: list[dict] = []          # {"id", "num", "k", "first": {group: pos}, "pages": {sid: {pos: (p, g)}}}

    def held(self, r: dict) -> int:
        return -(-r["num"] // self.ps)

    def new_page(self, sid: int) -> tuple[int, int]:
        return int(self.rng.integers(1, 4000)), int(self.rng.integers(1, 2**32))

    def fill(self, r: dict, lo_by_group: dict[int, int]) -> None:
        """Give r new pages at positions [lo, held) of each space (lo per group)."""
        for sid, (g, _) in self.spaces.items():
            for pos in range(lo_by_group[g], self.held(r)):
                r["pages"][sid][pos] = self.new_page(sid)

    def row(self, seq_id: int, num: int, k: int, window: bool | str = False) -> dict:
        """A row holding num tokens, its last k new; window: group 1's first page is random, up to the page of its
        first new token (True) or up to its last page ("any": a window past some new tokens, whose slots are -1)."""
        k = min(k, num)
        r = {"id": seq_id, "num": num, "k": k, "first": {}, "pages": {sid: {} for sid in self.spaces}}
        last = -(-num // self.ps) - 1 if window == "any" else (num - k) // self.ps
        for g in {g for g, _ in self.spaces.values()}:
            r["first"][g] = int(self.rng.integers(0, last + 1)) if (g == 1 and window) else 0
        self.fill(r, r["first"])
        return r

    # ---- what a full reply carries, per the proto's comments ----
    def tables(self, sid: int) -> dict:
        g, dt = self.spaces[sid]
        ps = self.ps
        cnt = [self.held(r) - r["first"][g] for r in self.rows]
        indices = [r["pages"][sid][p][0] for r in self.rows for p in range(r["first"][g], self.held(r))]
        gens = [r["pages"][sid][p][1] for r in self.rows for p in range(r["first"][g], self.held(r))]
        slots, slot_gens = [], []
        for r in self.rows:
            for pos in range(r["num"] - r["k"], r["num"]):
                page, gen = r["pages"][sid].get(pos // ps, (-1, 0)) if pos // ps >= r["first"][g] else (-1, 0)
                slots.append(page * ps + pos % ps if page >= 0 else -1)     # -1: skip (a page not held)
                slot_gens.append(gen)
        width = max((self.held(r) for r in self.rows), default=0)
        block = np.full((len(self.rows), width), -1, dtype=dt)
        for i, r in enumerate(self.rows):
            for p in range(r["first"][g], self.held(r)):
                block[i, p] = r["pages"][sid][p][0]
        return {"indptr": np.concatenate([[0], np.cumsum(cnt)]).astype(dt), "indices": np.array(indices, dtype=dt),
                "last_page_len": np.array([r["num"] - (self.held(r) - 1) * ps for r in self.rows], dtype=np.int32),
                "slot_mapping": np.array(slots, dtype=np.int64), "generations": np.array(gens, dtype=np.uint32),
                "slot_generations": np.array(slot_gens, dtype=np.uint32), "block_table": block}

    def batch(self) -> dict:
        return {"seq_ids": np.array([r["id"] for r in self.rows], dtype=np.uint64),
                "num_tokens": np.array([r["num"] for r in self.rows], dtype=np.int64),
                "new_token_indptr": np.concatenate([[0], np.cumsum([r["k"] for r in self.rows])]).astype(np.int64)}

    def full_reply(self, seq: int, with_gens: bool = True) -> pb.StepReply:
        b = self.batch()
        reply = pb.StepReply(stream_seq=seq, seq_ids=to_tensor(b["seq_ids"]), num_tokens=to_tensor(b["num_tokens"]),
                             new_token_indptr=to_tensor(b["new_token_indptr"]))
        for sid, (g, _) in self.spaces.items():
            t = self.tables(sid)
            scale, offset, ub, base = INFO[sid]
            st = reply.tables.add(index_space=sid, group=g, scale=scale, offset=offset, upper_bound=ub, base=base)
            for f in ("indptr", "indices", "last_page_len", "slot_mapping"):
                getattr(st, f).CopyFrom(to_tensor(t[f]))
            if with_gens:
                st.generations.CopyFrom(to_tensor(t["generations"]))
                st.slot_generations.CopyFrom(to_tensor(t["slot_generations"]))
        return reply


def check(m: PageTableMirror, model: Model, seq: int, with_gens: bool = True) -> None:
    assert m.seq == seq and m.batch_size == len(model.rows) and m.has_generations == with_gens
    b = model.batch()
    np.testing.assert_array_equal(m.seq_ids, b["seq_ids"])
    np.testing.assert_array_equal(m.num_tokens, b["num_tokens"])
    np.testing.assert_array_equal(m.new_token_indptr, b["new_token_indptr"])
    for sid in model.spaces:
        want = model.tables(sid)
        pt = m.page_table(sid)
        for f, got in (("indptr", pt.indptr), ("indices", pt.indices), ("last_page_len", pt.last_page_len),
                       ("slot_mapping", m.slot_mapping(sid)), ("block_table", m.block_table(sid))):
            assert got.dtype == want[f].dtype, (sid, f, got.dtype)
            np.testing.assert_array_equal(got, want[f], err_msg=f"space {sid} {f}")
        assert m.num_pages(sid) == len(want["indices"])
        if with_gens:
            np.testing.assert_array_equal(m.generations(sid), want["generations"])
            np.testing.assert_array_equal(m.slot_generations(sid), want["slot_generations"])
        else:
            assert m.generations(sid) is None and m.slot_generations(sid) is None
    full = m.full_reply()
    assert full.stream_seq == seq
    for f, v in b.items():
        np.testing.assert_array_equal(from_tensor(getattr(full, f), f), v, err_msg=f)
    assert [st.index_space for st in full.tables] == sorted(model.spaces)
    for st in full.tables:
        want = model.tables(st.index_space)
        assert (st.group, st.scale, st.offset, st.upper_bound, st.base) == \
            (model.spaces[st.index_space][0], *INFO[st.index_space])
        fields = ["indptr", "indices", "last_page_len", "slot_mapping"] + \
            (["generations", "slot_generations"] if with_gens else [])
        for f in fields:
            got = from_tensor(getattr(st, f), f)
            assert got.dtype == want[f].dtype, f
            np.testing.assert_array_equal(got, want[f], err_msg=f)
        assert not st.HasField("generations") or with_gens


def holding(model: Model, rows: list[tuple[int, int, int]], seq: int) -> PageTableMirror:
    """A mirror of model's page size that applied model's full reply at seq, model holding rows (seq_id, num, k)."""
    model.rows = [model.row(*r) for r in rows]
    m = PageTableMirror(model.ps)
    m.apply(model.full_reply(seq))
    return m


def row_without_tokens_delta() -> pb.StepReply:
    """A same-batch delta on seq 1 over two rows of one int32 space: one row gains a page, the other drops to 0
    tokens (two pages sent, one per row that changed): not a steady decode step."""
    reply = pb.StepReply(stream_seq=2)
    reply.delta.base_seq = 1
    reply.num_tokens.CopyFrom(to_tensor(np.array([9, 0], dtype=np.int64)))
    reply.new_token_indptr.CopyFrom(to_tensor(np.array([0, 1, 1], dtype=np.int64)))
    reply.tables.add(index_space=0).delta.pages.CopyFrom(to_tensor(np.array([55, 66], dtype=np.int32)))
    return reply


def _space_delta(st: pb.SpaceTables, dt, pages: list, gens: list, replaced: list, replaced_gens: list,
                 with_gens: bool) -> None:
    st.delta.pages.CopyFrom(to_tensor(np.array(pages, dtype=dt)))
    if replaced:
        st.delta.replaced.CopyFrom(to_tensor(np.array(replaced, dtype=dt)))
    if with_gens:
        st.delta.generations.CopyFrom(to_tensor(np.array(gens, dtype=np.uint32)))
        if replaced:
            st.delta.replaced_generations.CopyFrom(to_tensor(np.array(replaced_gens, dtype=np.uint32)))


def decode_delta(model: Model, seq: int, base: int, t: int, tokens_added: bool, with_gens: bool = True,
                 moves: bool = False) -> pb.StepReply:
    """Same batch, every row + t tokens: new pages after each row's last one. moves: also slide group 1's window
    of some rows (a GroupDelta: the general path, src None)."""
    rng = model.rng
    held_p = [model.held(r) for r in model.rows]
    for r in model.rows:
        r["num"] += t
        r["k"] = t
    reply = pb.StepReply(stream_seq=seq)
    reply.delta.base_seq = base
    if tokens_added:
        reply.delta.tokens_added = t
    else:
        b = model.batch()
        reply.num_tokens.CopyFrom(to_tensor(b["num_tokens"]))
        reply.new_token_indptr.CopyFrom(to_tensor(b["new_token_indptr"]))
    if moves:
        rows, firsts = [], []
        for i, r in enumerate(model.rows):
            if rng.random() < 0.5:
                new_first = int(rng.integers(r["first"][1], model.held(r)))
                if new_first != r["first"][1]:
                    for sid, (g, _) in model.spaces.items():
                        if g == 1:
                            for p in range(r["first"][1], new_first):
                                r["pages"][sid].pop(p, None)
                    r["first"][1] = new_first
                    rows.append(i)
                    firsts.append(new_first)
        if rows:
            gd = reply.delta.groups.add(group=1)
            gd.first_rows.CopyFrom(to_tensor(np.array(rows, dtype=np.int32)))
            gd.first_pages.CopyFrom(to_tensor(np.array(firsts, dtype=np.int64)))
    pages = {sid: ([], []) for sid in model.spaces}
    for r, hp in zip(model.rows, held_p, strict=True):
        for sid, (g, _) in model.spaces.items():
            for pos in range(max(hp, r["first"][g]), model.held(r)):
                r["pages"][sid][pos] = model.new_page(sid)
                pages[sid][0].append(r["pages"][sid][pos][0])
                pages[sid][1].append(r["pages"][sid][pos][1])
    for sid, (g, dt) in model.spaces.items():
        st = reply.tables.add(index_space=sid, group=g)
        _space_delta(st, dt, pages[sid][0], pages[sid][1], [], [], with_gens)
    return reply


def batch_delta(model: Model, seq: int, base: int, next_id: int, one_token_row: bool) -> tuple[pb.StepReply, int]:
    """A reordered batch: some base rows dropped, the rest shuffled and extended (0..9 tokens), new rows admitted
    (one of them holding a single token if asked); group 0 replaces some continued rows' last page
    (copy-on-write), group 1 slides some windows and admits some rows with a first page past 0."""
    rng, ps = model.rng, model.ps
    old = model.rows
    keep = [i for i in range(len(old)) if rng.random() < 0.75]
    rng.shuffle(keep)
    entries: list[tuple[int, dict]] = []
    for i in keep:
        r = old[i]
        hp = model.held(r)
        k = int(rng.integers(0, 10))
        r2 = {"id": r["id"], "num": r["num"] + k, "k": k, "first": dict(r["first"]),
              "pages": {sid: dict(p) for sid, p in r["pages"].items()}, "held_p": hp}
        entries.append((i, r2))
    n_new = int(rng.integers(1, 4))
    for j in range(n_new):
        num = 1 if (one_token_row and j == 0) else int(rng.integers(1, 6 * ps))
        r2 = model.row(next_id, num, int(rng.integers(1, num + 1)), window="any")
        next_id += 1
        entries.insert(int(rng.integers(0, len(entries) + 1)), (-1, r2))
    reply = pb.StepReply(stream_seq=seq)
    d = reply.delta
    d.base_seq = base
    d.base_rows.CopyFrom(to_tensor(np.array([i for i, _ in entries], dtype=np.int32)))
    new_rows = [r for _, r in entries]
    b = {"seq_ids": np.array([r["id"] for r in new_rows], dtype=np.uint64),
         "num_tokens": np.array([r["num"] for r in new_rows], dtype=np.int64),
         "new_token_indptr": np.concatenate([[0], np.cumsum([r["k"] for r in new_rows])]).astype(np.int64)}
    for f, v in b.items():
        getattr(reply, f).CopyFrom(to_tensor(v))
    replaced_rows, first_rows, first_pages = [], [], []
    for row, (src, r) in enumerate(entries):
        if src < 0:
            if r["first"][1]:
                first_rows.append(row)
                first_pages.append(r["first"][1])
            continue
        if rng.random() < 0.4:                          # copy-on-write of the base's last page (group 0)
            replaced_rows.append(row)
        if rng.random() < 0.4:
            nf = int(rng.integers(r["first"][1], -(-r["num"] // ps)))
            if nf != r["first"][1]:
                first_rows.append(row)
                first_pages.append(nf)
    if replaced_rows:
        gd = d.groups.add(group=0)
        gd.replaced_rows.CopyFrom(to_tensor(np.array(replaced_rows, dtype=np.int32)))
    if first_rows:
        gd = d.groups.add(group=1)
        gd.first_rows.CopyFrom(to_tensor(np.array(first_rows, dtype=np.int32)))
        gd.first_pages.CopyFrom(to_tensor(np.array(first_pages, dtype=np.int64)))
    moved = dict(zip(first_rows, first_pages, strict=True))
    per_space = {sid: ([], [], [], []) for sid in model.spaces}     # pages, gens, replaced, replaced gens
    for row, (src, r) in enumerate(entries):
        if src < 0:
            for sid, (g, _) in model.spaces.items():
                for pos in range(r["first"][g], model.held(r)):
                    per_space[sid][0].append(r["pages"][sid][pos][0])
                    per_space[sid][1].append(r["pages"][sid][pos][1])
            continue
        hp = r.pop("held_p")
        if row in moved:
            for sid, (g, _) in model.spaces.items():
                if g == 1:
                    for p in range(r["first"][1], moved[row]):
                        r["pages"][sid].pop(p, None)
            r["first"][1] = moved[row]
        for sid, (g, _) in model.spaces.items():
            if g == 0 and row in replaced_rows:
                r["pages"][sid][hp - 1] = model.new_page(sid)
                per_space[sid][2].append(r["pages"][sid][hp - 1][0])
                per_space[sid][3].append(r["pages"][sid][hp - 1][1])
            for pos in range(max(hp, r["first"][g]), model.held(r)):
                r["pages"][sid][pos] = model.new_page(sid)
                per_space[sid][0].append(r["pages"][sid][pos][0])
                per_space[sid][1].append(r["pages"][sid][pos][1])
    for sid, (g, dt) in model.spaces.items():
        st = reply.tables.add(index_space=sid, group=g)
        _space_delta(st, dt, *per_space[sid], with_gens=True)
    model.rows = new_rows
    return reply, next_id


class ArrayModule:
    """Hands NumPy's functions out but is not numpy: the mirror then takes its device branches (xp is not np,
    CuPy on a GPU worker: no read-only arrays, a fresh indptr per step), on host memory."""

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.mark.parametrize("xp", ["numpy", "device"])
@pytest.mark.parametrize("seed", range(4))
def test_the_mirror_gives_the_models_tables_after_full_replies_and_random_deltas(seed, xp, monkeypatch):
    """Steady decode steps (one token per row) take the mirror's shortcut (_append_only answers True): it is the
    documented O(B) path of a decode loop; a prefill chunk (rows gaining several pages) is declined by it.
    xp "device": the same run on a mirror whose array module is not numpy (its device branches)."""
    shortcut: list[bool] = []
    plain = PageTableMirror._append_only

    def spy(self, reply, num_n, tok):
        shortcut.append(plain(self, reply, num_n, tok))
        return shortcut[-1]
    monkeypatch.setattr(PageTableMirror, "_append_only", spy)
    rng = np.random.default_rng(1000 + seed)
    ps = [1, 2, 3, 4][seed]
    model = Model(rng, ps)
    model.rows = [model.row(10 + i, int(rng.integers(1, 5 * ps)), int(rng.integers(1, 3)), window="any")
                  for i in range(int(rng.integers(2, 6)))]
    m = PageTableMirror(ps, xp=np if xp == "numpy" else ArrayModule())
    assert (m.xp is np) == (xp == "numpy")
    seq = 1
    m.apply(model.full_reply(seq))
    check(m, model, seq)
    next_id = 100
    for step in range(14):
        seq += 1
        kind = step % 5
        if kind == 0:                   # every row starts a new page: num_tokens multiples of ps, then + 1
            for r in model.rows:
                r["num"] = model.held(r) * ps
                r["k"] = 1
            m.apply(model.full_reply(seq))
            check(m, model, seq)
            seq += 1
            reply = decode_delta(model, seq, seq - 1, 1, tokens_added=True)
        elif kind == 1:
            reply = decode_delta(model, seq, seq - 1, 1, tokens_added=bool(step % 2))
        elif kind == 2:                 # a prefill chunk: rows gain several pages (the general path)
            reply = decode_delta(model, seq, seq - 1, int(rng.integers(2 * ps, 4 * ps + 1)), tokens_added=False)
        elif kind == 3:
            reply = decode_delta(model, seq, seq - 1, int(rng.integers(1, 2 * ps + 1)), tokens_added=True,
                                 moves=True)
        else:
            reply, next_id = batch_delta(model, seq, seq - 1, next_id, one_token_row=step % 2 == 0)
        shortcut.clear()
        m.apply(reply)
        check(m, model, seq)
        assert shortcut == {0: [True], 1: [True], 2: [False], 4: []}.get(kind, shortcut), (kind, shortcut)


def test_a_delta_that_leaves_a_row_without_tokens_is_refused():
    """A same-batch delta where one row gains a page and another drops to 0 tokens (two pages sent, one per row
    that changed) is not a steady decode step: refused, the mirror then holds nothing."""
    m = holding(Model(np.random.default_rng(7), 4, {0: (0, np.int32)}), [(1, 8, 1), (2, 3, 1)], 1)
    with pytest.raises(MirrorError, match="every row holds at least one token"):
        m.apply(row_without_tokens_delta())
    assert m.seq == 0


def test_decode_pages_of_the_wrong_dtype_are_refused_even_when_their_bytes_fit():
    """int32 index spaces, two rows each gaining a page, the pages sent as one INT64 (8 bytes, as two INT32 would
    be): refused naming the dtypes, never read as two pages or broadcast."""
    rng = np.random.default_rng(8)
    ps = 2
    model = Model(rng, ps, {0: (0, np.int32), 1: (1, np.int32)})
    model.rows = [model.row(1, 4, 1), model.row(2, 6, 1)]
    m = PageTableMirror(ps)
    m.apply(model.full_reply(1))
    reply = pb.StepReply(stream_seq=2)
    reply.delta.base_seq = 1
    reply.delta.tokens_added = 1
    for sid in (0, 1):
        reply.tables.add(index_space=sid).delta.pages.CopyFrom(to_tensor(np.array([77], dtype=np.int64)))
    with pytest.raises(MirrorError, match="pages are int64, the space's index dtype is int32"):
        m.apply(reply)
    assert m.seq == 0


def test_a_bad_indptr_and_an_unknown_space_are_named():
    model = Model(np.random.default_rng(9), 2)
    m = holding(model, [(1, 5, 1), (2, 2, 2)], 3)
    with pytest.raises(MirrorError, match=r"no index space 7; spaces: \[0, 1, 2\]"):
        m.page_table(7)
    bad = model.full_reply(4)
    bad.tables[1].indptr.dtype = FLOAT32
    with pytest.raises(MirrorError, match="indptr: dtype FLOAT32 not allowed here"):
        m.apply(bad)
    assert m.seq == 0
    bad = model.full_reply(5)
    bad.tables[0].indices.dtype = INT64
    bad.tables[0].indices.data = b"\x01" * 12
    with pytest.raises(MirrorError, match="indices"):
        m.apply(bad)
    for field in ("seq_ids", "num_tokens", "new_token_indptr"):
        bad = model.full_reply(6)
        getattr(bad, field).dtype = FLOAT32
        with pytest.raises((MirrorError, KVError), match=rf"{field}: dtype FLOAT32 not allowed here"):
            m.apply(bad)


def test_without_generations_the_mirror_holds_and_sends_none():
    """A full reply without generations (an older manager): no generations anywhere, full_reply sends none. A delta
    without them after a full reply with them: the mirror drops them (has_generations False) until a full reply."""
    rng = np.random.default_rng(11)
    ps = 3
    model = Model(rng, ps)
    model.rows = [model.row(5 + i, int(rng.integers(1, 12)), 1, window=True) for i in range(3)]
    m = PageTableMirror(ps)
    m.apply(model.full_reply(1, with_gens=False))
    check(m, model, 1, with_gens=False)
    m.apply(decode_delta(model, 2, 1, 1, tokens_added=True, with_gens=False))
    check(m, model, 2, with_gens=False)
    m.apply(model.full_reply(3))
    check(m, model, 3)
    for seq, (t, shortcut) in enumerate(((1, True), (ps + 1, False)), start=4):
        m.apply(model.full_reply(seq - 1 + 10))
        m.apply(decode_delta(model, seq + 10, seq - 1 + 10, t, tokens_added=shortcut, with_gens=False))
        check(m, model, seq + 10, with_gens=False)


@pytest.mark.parametrize("damage", ["one_space", "short", "shape"])
def test_malformed_generations_of_a_decode_step_are_refused_naming_them(damage):
    """A steady decode delta whose generations are too short, or with a shape that does not match their bytes, is
    refused (MirrorError naming generations), never applied without them; sent for some spaces only, the mirror
    applies the pages and holds no generations (as after any reply without them)."""
    rng = np.random.default_rng(12)
    ps = 2
    model = Model(rng, ps)
    model.rows = [model.row(1, 4, 1), model.row(2, 6, 1), model.row(3, 2, 1)]
    m = PageTableMirror(ps)
    m.apply(model.full_reply(1))
    reply = decode_delta(model, 2, 1, 1, tokens_added=True)
    g = reply.tables[1].delta.generations
    if damage == "one_space":           # not malformed: a space without them, so the mirror holds none
        reply.tables[1].delta.ClearField("generations")
        m.apply(reply)
        check(m, model, 2, with_gens=False)
        return
    if damage == "short":
        g.data = g.data[:-4]
    else:
        g.shape[:] = [len(g.data) // 4 + 1]
    with pytest.raises(MirrorError, match=r"(\(generations: shape \[4\] declares 4 items but the data holds 3)|"
                                          r"(index space 1: generations must be UINT32 \[3\])"):
        m.apply(reply)
    assert m.seq == 0


@pytest.mark.parametrize("seed", range(2))
def test_with_a_sliding_window_and_prefix_caching_the_mirror_equals_the_managers_full_tables(seed, monkeypatch):
    """The manager's own full replies as the oracle (tests/unit/test_delta_mirror.py's twin: the same random ops on
    a streamed pool with a mirror and a unary one) for a spec none of its specs is: a sliding-window group with
    prefix caching. A prefix hit admits tokens wholly before the window: their slot_mapping is -1 (SKIP_SLOT,
    kernels write nothing) and slot_generations 0 in a full reply, and so in the mirror (it gave page -1 * page_size
    + offset, a negative slot, before)."""
    from kvservice.contract.geometry import CacheSpec, LayerSpec
    from tests import support_stream
    from tests.unit import test_delta_mirror

    spec = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=6)), support_stream.PAGE, "interleaved")
    monkeypatch.setitem(test_delta_mirror.SPECS, "window_prefix", (spec, True))
    test_delta_mirror.test_mirror_equals_full_tables_on_random_ops("window_prefix", seed)


@pytest.mark.parametrize("damage", ["unknown_space", "few_ids", "row_past_base", "few_base_rows", "float_ids"])
def test_a_delta_that_does_not_fit_the_base_is_refused_naming_why(damage):
    rng = np.random.default_rng(13)
    ps = 2
    model = Model(rng, ps)
    model.rows = [model.row(1, 5, 1), model.row(2, 6, 1), model.row(3, 3, 1)]
    m = PageTableMirror(ps)
    m.apply(model.full_reply(1))
    if damage == "unknown_space":              # a steady decode step naming a space the mirror does not hold
        reply = decode_delta(model, 2, 1, 1, tokens_added=True)
        reply.tables[2].index_space = 9
        want = r"delta names index space 9; the mirror holds \[0, 1, 2\]"
    else:
        reply, _ = batch_delta(model, 2, 1, 100, one_token_row=False)
        b = len(model.rows)
        if damage == "few_ids":
            reply.seq_ids.CopyFrom(to_tensor(from_tensor(reply.seq_ids, "seq_ids")[:-1]))
            want = rf"delta rows \({b} base rows, {b - 1} ids, {b} counts\) do not fit a base batch of 3"
        elif damage == "float_ids":
            reply.seq_ids.dtype = FLOAT32
            want = r"\(seq_ids: dtype FLOAT32 not allowed here\)"
        elif damage == "few_base_rows":
            reply.delta.base_rows.CopyFrom(to_tensor(from_tensor(reply.delta.base_rows, "base_rows")[1:]))
            want = rf"delta rows \({b - 1} base rows, {b} ids, {b} counts\) do not fit a base batch of 3"
        else:
            rows = from_tensor(reply.delta.base_rows, "base_rows").copy()
            rows[-1] = 3
            reply.delta.base_rows.CopyFrom(to_tensor(rows))
            want = rf"delta rows \({b} base rows, {b} ids, {b} counts\) do not fit a base batch of 3"
    with pytest.raises(MirrorError, match=want):
        m.apply(reply)
    assert m.seq == 0


def test_a_decode_step_up_to_the_mirrors_bounds_takes_the_shortcut_and_one_past_them_is_refused(monkeypatch):
    """max_entries (B x longest row) and max_width (pages per row) are inclusive bounds: a decode step that makes the
    tables exactly that big is applied by the shortcut; the next page past either bound is refused."""
    taken: list[bool] = []
    plain = PageTableMirror._append_only

    def spy(self, reply, num_n, tok):
        taken.append(plain(self, reply, num_n, tok))
        return taken[-1]
    monkeypatch.setattr(PageTableMirror, "_append_only", spy)
    ps = 2
    for bound in ("entries", "width"):
        rng = np.random.default_rng(14)
        model = Model(rng, ps, {0: (0, np.int32), 1: (1, np.int64)})
        model.rows = [model.row(1, 6, 1), model.row(2, 4, 1)]      # 3 and 2 pages; the next token: 4 and 3
        m = PageTableMirror(ps, max_entries=8 if bound == "entries" else 1 << 20,
                            max_width=4 if bound == "width" else None)
        m.apply(model.full_reply(1))
        taken.clear()
        m.apply(decode_delta(model, 2, 1, 1, tokens_added=True))
        check(m, model, 2)
        assert taken == [True]
        m.apply(decode_delta(model, 3, 2, 1, tokens_added=True))     # 8 and 6 tokens: still 4 and 3 pages
        check(m, model, 3)
        with pytest.raises(MirrorError, match="over this mirror's"):
            m.apply(decode_delta(model, 4, 3, 1, tokens_added=True))
        assert m.seq == 0


def test_what_apply_refuses_or_ignores_and_what_it_then_holds():
    """apply(): a refused request's reply (error set) changes nothing; a delta on another base is refused and changes
    nothing; a delta's own mistakes leave the mirror holding nothing; a full reply without CSR tables holds none."""
    from kvservice.contract.geometry import MAX_COUNT

    with pytest.raises(ValueError, match="page_size must be > 0, got 0"):
        PageTableMirror(0)
    rng = np.random.default_rng(15)
    ps = 3
    model = Model(rng, ps)
    model.rows = [model.row(1, 7, 2), model.row(2, 4, 1)]
    m = PageTableMirror(ps)
    with pytest.raises(MirrorError, match="the mirror holds no tables"):
        m.full_reply()
    with pytest.raises(MirrorError, match=r"the mirror holds no tables \(apply a reply with tables first\)"):
        m.page_table(0)
    with pytest.raises(MirrorError, match=r"applies to the reply of request 4; the mirror holds nothing \(ask for full "
                                          r"tables: delta_base 0\)"):
        m.apply(decode_delta(model, 5, 4, 1, tokens_added=True))
    model.rows = [model.row(1, 7, 2), model.row(2, 4, 1)]
    m.apply(model.full_reply(6))
    m.apply(pb.StepReply(stream_seq=7, error=pb.RequestStatus(code=8, message="no room")))
    check(m, model, 6)
    wrong = decode_delta(Model(rng, ps), 8, 5, 1, tokens_added=True)
    with pytest.raises(MirrorError, match="applies to the reply of request 5; the mirror holds 6"):
        m.apply(wrong)
    check(m, model, 6)                                  # nothing changed
    for damage, want in (("counts", "a delta with tokens_added covers the base batch alone"),
                         ("huge", f"tokens_added {MAX_COUNT + 1} is more than a sequence can gain in a step "
                                  f"\\({MAX_COUNT}\\)"),
                         ("indptr", "new_token_indptr has 2 entries for 2 rows")):
        m.apply(model.full_reply(6))
        reply = pb.StepReply(stream_seq=7)
        reply.delta.base_seq = 6
        if damage == "counts":
            reply.delta.tokens_added = 1
            reply.num_tokens.CopyFrom(to_tensor(np.array([8, 5], dtype=np.int64)))
        elif damage == "huge":
            reply.delta.tokens_added = MAX_COUNT + 1
        else:
            reply.num_tokens.CopyFrom(to_tensor(np.array([8, 5], dtype=np.int64)))
            reply.new_token_indptr.CopyFrom(to_tensor(np.array([0, 1], dtype=np.int64)))
        with pytest.raises(MirrorError, match=want):
            m.apply(reply)
        assert m.seq == 0 and m.spaces == {}
    bare = model.full_reply(9)
    for st in bare.tables:
        st.ClearField("indptr")
    m.apply(bare)
    assert m.seq == 0 and not m.has_generations
    np.testing.assert_array_equal(m.num_tokens, [7, 4])


@pytest.mark.parametrize("indptr, n_indices", [
    ([0, 4, 3], 3),     # a row with a negative page count, every first page still >= 0
    ([0, 6, 6], 6),     # every count >= 0, but the first row holds more pages than its tokens need
])
def test_a_full_reply_whose_indptr_breaks_either_bound_alone_is_refused_naming_it(indptr, n_indices):
    """Each bound on its own refuses the reply: no row may have a negative page count, and no row may hold more
    pages than its tokens need (its first held page would sit before position 0). Nothing is then held."""
    model = Model(np.random.default_rng(12), 2, {0: (0, np.int32)})
    m = holding(model, [(1, 9, 1), (2, 2, 1)], 3)                 # 5 pages and 1 page held
    bad = model.full_reply(4)
    st = bad.tables[0]
    st.indptr.CopyFrom(to_tensor(np.array(indptr, np.int32)))
    st.indices.CopyFrom(to_tensor(np.arange(1, n_indices + 1, dtype=np.int32)))
    st.generations.CopyFrom(to_tensor(np.ones(n_indices, np.uint32)))
    with pytest.raises(MirrorError) as err:
        m.apply(bad)
    assert str(err.value) == (f"index space 0: indptr does not describe 2 rows of {n_indices} pages within "
                              "their sequences")
    assert m.seq == 0 and m.spaces == {}
