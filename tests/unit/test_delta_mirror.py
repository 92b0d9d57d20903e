"""Incremental tables in-process: a StreamSession's deltas applied by PageTableMirror equal full tables.

Every step of random op sequences (admissions with prompts, decode, prefill chunks, forks with
copy-on-write, frees, mixed steps, refused mistakes) over a per-layer pool, a hybrid interleaved
pool with a sliding window and a prefix-caching pool goes to pool "a" through StreamSession.apply
with delta_tables and to its twin "b" through ManagerAPI.Step with full tables and block tables.
After every step the mirror's CSR, slot mapping and block table must equal b's, values and dtypes.
Some steps run on "a" outside the stream, or ask the stream for full tables, or no tables, or name
a wrong base: the session must then fall back to full tables, and stay exact.
"""

import numpy as np
import pytest

from kvservice.client import codec
from kvservice.contract.errors import KVError
from kvservice.contract.mirror import MirrorError, PageTableMirror
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.manager import delta
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.manager.step_input import decode_step
from kvservice.server.stream import StreamSession
from kvservice.v1 import block_manager_pb2 as pb
from tests.support_stream import MAX_LEN, NUM_SLOTS, PAGE, SPECS, Driver, assert_same_tables


class Twin:
    """Pool "a" behind a stream session with a mirror, pool "b" behind unary Step: the same ops on both."""

    def __init__(self, spec_name: str, num_slots: int = NUM_SLOTS) -> None:
        spec, prefix = SPECS[spec_name]
        self.api = ManagerAPI(BlockManager())
        for name in ("a", "b"):
            self.api.CreatePool(codec.create_pool_request(name, spec, Sizing(num_slots=num_slots, max_seq_len=MAX_LEN),
                                                          prefix_caching=prefix))
        self.session = StreamSession("s")
        self.mirror = PageTableMirror(PAGE)
        self.seq = 0
        self.kinds: dict[str, int] = {}

    def delta_reply(self, ra: pb.StepRequest) -> pb.StepReply:
        """Stream `ra` (a Step of pool "a") asking for delta tables on the mirror's base: the raw reply, not applied."""
        self.seq += 1
        ra.stream_seq, ra.delta_tables, ra.delta_base = self.seq, True, self.mirror.seq
        return self.session.apply(self.api, ra)

    def step(self, kw: dict, mode: str = "delta") -> codec.StepResult | None:
        """One op on both pools; mode: delta, full (stream without deltas), none (omit_tables), bad_base, foreign."""
        rb = codec.step_request("b", block_table=True, **kw)
        try:
            full = codec.parse_step(self.api.Step(rb))
        except KVError:
            full = None
        ra = codec.step_request("a", tables=mode != "none", **kw)
        if mode == "foreign":               # another client's unary Step on the stream's pool
            try:
                self.api.Step(ra)
            except KVError:
                assert full is None
            return full
        self.seq += 1
        ra.stream_seq = self.seq
        ra.delta_tables = ra.accept_tokens_added = mode in ("delta", "bad_base")      # as today's client
        ra.delta_base = self.mirror.seq + 1000 if mode == "bad_base" else self.mirror.seq
        try:
            reply = self.session.apply(self.api, ra)
        except KVError:
            assert full is None, "the stream refused a step the twin took"
            return None
        assert full is not None, "the stream took a step the twin refused"
        assert reply.stream_seq == self.seq
        kind = "delta" if reply.HasField("delta") else "full"
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if mode in ("full", "bad_base"):
            assert kind == "full"
        self.mirror.apply(reply)
        if mode == "none":
            assert self.mirror.seq == 0
        else:
            assert self.mirror.seq == self.seq
            assert_same_tables(self.mirror, full, f"step {self.seq} {kw}")
        return full


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("seed", range(4))
def test_mirror_equals_full_tables_on_random_ops(spec_name, seed):
    twin = Twin(spec_name)
    rng = np.random.default_rng(seed)
    driver = Driver(rng, SPECS[spec_name][1])
    for i in range(160):
        kw = driver.draw()
        mode = "delta"
        if i % 37 == 36:
            mode = "foreign"
        elif i % 29 == 28:
            mode = ["full", "none", "bad_base"][i % 3]
        full = twin.step(kw, mode)
        if full is not None:
            driver.update(kw, full.seq_ids)
    assert twin.kinds.get("delta", 0) > 4 * twin.kinds.get("full", 0), twin.kinds   # mostly incremental


def test_steady_decode_sends_only_new_pages():
    """A decode batch of 64: a reply carries no ids, no CSR, no slot mapping; only pages that start."""
    twin = Twin("per_layer", num_slots=1024)
    ids = np.arange(1, 65)
    lens = np.random.default_rng(3).integers(1, 40, 64)
    twin.step({"admit": ids, "admit_tokens": lens})
    for _ in range(PAGE + 1):
        ra = codec.step_request("a", extend=ids, extend_tokens=1)
        twin.seq += 1
        ra.stream_seq, ra.delta_tables, ra.delta_base = twin.seq, True, twin.mirror.seq
        ra.accept_tokens_added = True
        reply = twin.session.apply(twin.api, ra)
        lens = lens + 1
        starts = int(((lens - 1) % PAGE == 0).sum())         # rows whose new token opens a page
        (st,) = reply.tables
        assert len(reply.seq_ids.data) == 0 and not reply.delta.HasField("base_rows")
        assert reply.delta.tokens_added == 1 and not reply.HasField("num_tokens")      # counts follow from +1
        assert not reply.HasField("new_token_indptr")
        assert not st.HasField("indptr") and not st.HasField("slot_mapping")
        assert len(st.delta.pages.data) == 4 * starts and len(st.delta.replaced.data) == 0
        twin.mirror.apply(reply)
        full = codec.parse_step(twin.api.Step(codec.step_request("b", extend=ids, extend_tokens=1, block_table=True)))
        assert_same_tables(twin.mirror, full, "decode")


def _delta_step(twin: Twin, kw: dict, accept: bool = True) -> pb.StepReply:
    ra = codec.step_request("a", **kw)
    twin.seq += 1
    ra.stream_seq, ra.delta_tables, ra.delta_base = twin.seq, True, twin.mirror.seq
    ra.accept_tokens_added = accept
    return twin.session.apply(twin.api, ra)


def test_a_client_that_does_not_accept_tokens_added_gets_the_counts():
    """A StepStream client from before tokens_added (no accept_tokens_added) gets num_tokens and
    new_token_indptr in every delta, as it did: a manager upgraded under it keeps working."""
    twin = Twin("per_layer")
    twin.step({"admit": [1, 2, 3], "admit_tokens": [3, 9, 17]})
    for kw, counts in (({"extend": [1, 2, 3], "extend_tokens": 1}, [4, 10, 18]),        # the opened-pages path
                       ({"extend": [1, 2, 3], "extend_tokens": 1}, [5, 11, 19]),
                       ({"extend": [1, 2, 3], "extend_tokens": 3}, [8, 14, 22])):       # a uniform extend
        reply = _delta_step(twin, kw, accept=False)
        assert reply.HasField("delta") and reply.delta.tokens_added == 0
        assert np.frombuffer(reply.num_tokens.data, np.int64).tolist() == counts
        k = kw["extend_tokens"]
        assert np.frombuffer(reply.new_token_indptr.data, np.int64).tolist() == [0, k, 2 * k, 3 * k]
        twin.mirror.apply(reply)
        assert twin.mirror.num_tokens.tolist() == counts


def test_a_uniform_extend_sends_tokens_added_and_a_mixed_one_sends_counts():
    twin = Twin("per_layer")
    twin.step({"admit": [1, 2, 3], "admit_tokens": [3, 9, 17]})
    reply = _delta_step(twin, {"extend": [1, 2, 3], "extend_tokens": 3})       # speculative decode: +3 each
    assert reply.delta.tokens_added == 3 and not reply.HasField("num_tokens")
    twin.mirror.apply(reply)
    full = codec.parse_step(twin.api.Step(codec.step_request(
        "b", extend=[1, 2, 3], extend_tokens=3, block_table=True)))
    assert twin.mirror.num_tokens.tolist() == [6, 12, 20] == full.num_tokens.tolist()
    assert twin.mirror.new_token_indptr.tolist() == [0, 3, 6, 9] == full.new_token_indptr.tolist()
    assert_same_tables(twin.mirror, full, "uniform +3")
    reply = _delta_step(twin, {"extend": [1, 2, 3], "extend_tokens": [1, 2, 1]})
    assert reply.delta.tokens_added == 0
    assert np.frombuffer(reply.num_tokens.data, np.int64).tolist() == [7, 14, 21]
    twin.mirror.apply(reply)
    assert twin.mirror.new_token_indptr.tolist() == [0, 1, 3, 4]


@pytest.mark.parametrize("damage", ["base_rows", "num_tokens", "indptr", "huge"])
def test_a_malformed_tokens_added_delta_is_refused_by_the_mirror(damage):
    twin = Twin("per_layer")
    twin.step({"admit": [1, 2], "admit_tokens": [3, 5]})
    reply = _delta_step(twin, {"extend": [1, 2], "extend_tokens": 1})
    assert reply.delta.tokens_added == 1
    if damage == "base_rows":
        reply.delta.base_rows.CopyFrom(to_tensor(np.array([0, 1], np.int32)))
    elif damage == "num_tokens":
        reply.num_tokens.CopyFrom(to_tensor(np.array([4, 6], np.int64)))
    elif damage == "indptr":
        reply.new_token_indptr.CopyFrom(to_tensor(np.array([0, 1, 2], np.int64)))
    else:
        reply.delta.tokens_added = 1 << 62        # would overflow int64 token counts
    with pytest.raises(MirrorError, match="tokens_added"):
        twin.mirror.apply(reply)
    assert twin.mirror.seq == 0               # nothing half-applied is kept: the next request asks for full tables


def test_copy_on_write_replaces_the_last_page():
    twin = Twin("per_layer")
    twin.step({"admit": [1], "admit_tokens": [6]})              # 2 pages, the last one half full
    before = twin.mirror.block_table(0)[0].tolist()
    ra = codec.step_request("a", fork=[(1, 2)], extend=[1], extend_tokens=1)   # the child shares page 2 ...
    twin.seq += 1
    ra.stream_seq, ra.delta_tables, ra.delta_base = twin.seq, True, twin.mirror.seq
    reply = twin.session.apply(twin.api, ra)                    # ... so the parent's append copies it
    (gd,) = reply.delta.groups
    assert np.frombuffer(gd.replaced_rows.data, np.int32).tolist() == [0]     # row 0 (seq 1) moved its page
    assert np.frombuffer(reply.delta.base_rows.data, np.int32).tolist() == [0, -1]   # the child is sent whole
    (copy,) = reply.copies
    src, dst = np.frombuffer(copy.pairs.data, np.int64).tolist()
    assert src == before[1] and np.frombuffer(reply.tables[0].delta.replaced.data, np.int32).tolist() == [dst]
    assert np.frombuffer(reply.tables[0].delta.pages.data, np.int32).tolist() == before     # the child's pages
    twin.mirror.apply(reply)
    assert twin.mirror.block_table(0).tolist() == [[before[0], dst], before]


def test_sliding_window_release_moves_the_first_page():
    twin = Twin("hybrid")
    twin.step({"admit": [1], "admit_tokens": [12]})
    ra = codec.step_request("a", extend=[1], extend_tokens=[5])
    reply = twin.delta_reply(ra)
    moved = {gd.group: np.frombuffer(gd.first_pages.data, np.int64).tolist() for gd in reply.delta.groups}
    assert moved == {1: [1]}          # window 6 at token 12: pages before position 1 (tokens 0-3) released
    twin.mirror.apply(reply)
    sliding = next(s for s in twin.mirror.spaces.values() if s.info.group == 1).info.id
    assert twin.mirror.block_table(sliding)[0, 0] == -1 and twin.mirror.block_table(sliding)[0, 1] >= 0


def test_a_delta_on_the_wrong_base_is_refused_by_the_mirror():
    twin = Twin("per_layer")
    twin.step({"admit": [1, 2], "admit_tokens": [3, 5]})
    ra = codec.step_request("a", extend=[1, 2], extend_tokens=1)
    reply = twin.delta_reply(ra)
    stale = PageTableMirror(PAGE)
    with pytest.raises(MirrorError, match="mirror holds nothing"):
        stale.apply(reply)
    bad = pb.StepReply()
    bad.CopyFrom(reply)
    bad.tables[0].delta.pages.data += b"\x00\x00\x00\x00"
    with pytest.raises(MirrorError, match="delta has"):
        twin.mirror.apply(bad)


def test_delta_request_with_block_table_is_refused_and_changes_nothing():
    twin = Twin("per_layer")
    twin.step({"admit": [1], "admit_tokens": [3]})
    with twin.api.manager.locked("a") as pool:
        before = pool.sequences()[1].tolist()
    ra = codec.step_request("a", extend=[1], extend_tokens=1, block_table=True)
    ra.stream_seq, ra.delta_tables = 2, True
    with pytest.raises(KVError, match="include_block_table"):
        twin.session.apply(twin.api, ra)
    with twin.api.manager.locked("a") as pool:
        assert pool.sequences()[1].tolist() == before


def test_a_sequence_recreated_by_another_client_forces_full_tables():
    """Another client frees seq 1 and admits it again with the same token count between two stream steps:
    its counts still line up, but its pages are new. The pool's step counter gives it away."""
    twin = Twin("per_layer")
    twin.step({"admit": [1, 2], "admit_tokens": [5, 9]})
    twin.step({"extend": [1, 2], "extend_tokens": 1})
    twin.step({"free": [1]}, "foreign")
    twin.step({"admit": [3], "admit_tokens": [4]}, "foreign")        # takes seq 1's old pages
    twin.step({"admit": [1], "admit_tokens": [6]}, "foreign")        # seq 1 again, 6 tokens as before
    kinds = dict(twin.kinds)
    twin.step({"extend": [1, 2], "extend_tokens": 1})                # checked against the full tables
    assert twin.kinds["full"] == kinds["full"] + 1


def test_a_recreated_pool_gets_full_tables_and_the_deleted_one_is_not_kept():
    import gc

    twin = Twin("per_layer")
    twin.step({"admit": [1, 2], "admit_tokens": [5, 9]})
    gone = twin.session.held.pool
    twin.api.DeletePool(pb.DeletePoolRequest(pool="a", force=True))
    twin.api.CreatePool(codec.create_pool_request("a", SPECS["per_layer"][0], Sizing(num_slots=NUM_SLOTS,
                                                                                      max_seq_len=MAX_LEN)))
    gc.collect()
    assert gone() is None                       # a stream session does not keep a deleted pool's memory
    ra = codec.step_request("a", admit=[1], admit_tokens=[3])
    ra.stream_seq, ra.delta_tables, ra.delta_base = 2, True, twin.mirror.seq
    reply = twin.session.apply(twin.api, ra)
    assert not reply.HasField("delta") and reply.tables[0].HasField("indptr")


@pytest.mark.parametrize("accept", [True, False])
@pytest.mark.parametrize("spec_name", ["per_layer", "views"])
@pytest.mark.parametrize("seed", range(3))
def test_the_decode_shortcut_answers_byte_for_byte_as_the_general_encoder(spec_name, seed, accept, monkeypatch):
    """encode_delta's steady decode shortcut (_decode_delta) gives the reply its general encoder gives, on random
    batches with admissions and frees between; pool "c" always takes the general encoder."""
    twin = Twin(spec_name, num_slots=2048)
    sizing = Sizing(num_slots=2048, max_seq_len=MAX_LEN)
    twin.api.CreatePool(codec.create_pool_request("c", SPECS[spec_name][0], sizing))
    with twin.api.manager.locked("a") as pa, twin.api.manager.locked("c") as pc:
        for ga, gc in zip(pa.allocators, pc.allocators, strict=True):
            gc.generation[:] = ga.generation          # the same generations (each incarnation seeds its own)
    ref = StreamSession("ref")
    real = delta._decode_delta
    shortcut = []

    def decode_delta(pool, res, base, seq, derive):
        if pool.name == "c":
            return None
        out = real(pool, res, base, seq, derive)
        shortcut.append(out is not None)
        return out

    monkeypatch.setattr(delta, "_decode_delta", decode_delta)
    rng = np.random.default_rng(seed)
    toks: dict[int, int] = {}
    nxt = 1
    for i in range(120):
        if i % 15 == 0:                                # a batch change: admit some, free some (all near MAX_LEN)
            new = list(range(nxt, nxt + int(rng.integers(1, 6))))
            nxt += len(new)
            gone = [x for x, n in toks.items() if rng.random() < 0.3 or n > MAX_LEN - 16]
            lens = rng.integers(1, 3 * PAGE, len(new))
            kept = {x: n + 1 for x, n in toks.items() if x not in gone}
            kw = {"admit": new, "admit_tokens": lens}     # a mixed step: continued rows and rows sent whole
            if kept:
                kw["extend"] = list(kept)
                kw["extend_tokens"] = 1
            if gone:
                kw["free"] = gone
            toks = kept | dict(zip(new, lens.tolist(), strict=True))
        else:
            kw = {"extend": list(toks), "extend_tokens": 1}
            toks = {x: n + 1 for x, n in toks.items()}
        replies = []
        for pool, session in (("a", twin.session), ("c", ref)):
            ra = codec.step_request(pool, **kw)
            ra.stream_seq, ra.delta_tables, ra.delta_base = i + 1, True, i
            ra.accept_tokens_added = accept
            replies.append(session.apply(twin.api, ra))
        a, c = replies
        a.pool_incarnation = c.pool_incarnation = 0
        assert a.SerializeToString(deterministic=True) == c.SerializeToString(deterministic=True), f"step {i} {kw}"
    assert sum(shortcut) >= 90, shortcut               # the shortcut ran on the steady steps


def _rows_by_position(st, held: np.ndarray) -> list[dict[int, int]]:
    """{position: page} of each row of a SpaceTables with CSR tables (held: int64 [B] pages of each row)."""
    ip, idx = st.table.indptr.astype(np.int64), st.table.indices.astype(np.int64)
    out = []
    for b in range(len(ip) - 1):
        pages = idx[ip[b]:ip[b + 1]].tolist()
        first = int(held[b]) - len(pages)
        out.append({first + j: p for j, p in enumerate(pages)})
    return out


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("seed", range(3))
def test_step_changes_equal_a_diff_of_the_full_tables(spec_name, seed, fast):
    """StepResult.changes, which the pool reports from the step's plan, equal what a diff of the extended rows'
    full tables before and after the step finds, per layer group: the pages appended, the last page replaced by
    copy-on-write, the first kept page moved by a sliding window. Random op mixes, with the pool's fast paths on
    and off; the steps ask for no tables and no slot mappings, as the stream's deltas do."""
    api = ManagerAPI(BlockManager())
    spec, prefix = SPECS[spec_name]
    api.CreatePool(codec.create_pool_request("p", spec, Sizing(num_slots=NUM_SLOTS, max_seq_len=MAX_LEN),
                                             prefix_caching=prefix))
    rng = np.random.default_rng(100 + seed)
    driver = Driver(rng, prefix)
    seen = {"grown": 0, "cow": 0, "moved": 0}
    for _ in range(200):
        kw = driver.draw()
        step = decode_step(codec.step_request("p", **kw))
        with api.manager.locked("p") as pool:
            pool._fast = fast
            spaces = pool.plan.geometry.index_spaces
            ps = pool.page_size
            e_ids = step.extend_seq_ids
            try:
                before = pool.tables_for(np.asarray(e_ids)) if e_ids is not None and len(e_ids) else None
                e_held = [-(-pool._num_tokens[pool._rows[int(i)]] // ps) for i in e_ids] if before else []
            except KVError:
                before = None                              # a mistake naming an unknown id: refused below
            try:
                res = api.run_step(pool, step, tables=False, mappings=False)
            except KVError:
                continue
            assert res.tables == ()
            e = res.num_extended
            assert e == (len(e_ids) if e_ids is not None else 0)
            assert len(res.changes) == len(pool.allocators)
            after = pool.tables_for(res.seq_ids[:e]) if e else None
            held_a = (res.num_tokens[:e] + ps - 1) // ps
            for g, ch in enumerate(res.changes):
                head = next(i for i, sp in enumerate(spaces) if sp.group == g)
                sp = spaces[head]
                grown, cow, moved = {}, {}, {}
                if e:
                    rb = _rows_by_position(before[head], np.asarray(e_held, dtype=np.int64))
                    ra = _rows_by_position(after[head], held_a)
                    for b in range(e):
                        hb, ha = int(e_held[b]), int(held_a[b])
                        if ha > hb:
                            grown[b] = [ra[b][j] for j in range(hb, ha)]
                        if hb - 1 in rb[b] and hb - 1 in ra[b] and rb[b][hb - 1] != ra[b][hb - 1]:
                            cow[b] = ra[b][hb - 1]
                        fb = min(rb[b]) if rb[b] else hb
                        fa = min(ra[b]) if ra[b] else ha
                        if fa != fb:
                            moved[b] = fa
                got_grown = {}
                at = 0
                for b, n in zip(ch.grown.tolist(), ch.counts.tolist(), strict=True):
                    got_grown[b] = sp.page_indices(ch.slots[at:at + n]).tolist()
                    at += n
                assert at == len(ch.slots)
                assert got_grown == grown, (g, kw)
                got_cow = dict(zip(ch.cow.tolist(), sp.page_indices(ch.cow_slots).tolist(), strict=True))
                assert {b: p for b, p in got_cow.items() if b in cow or (e_held[b] - 1) in
                        _rows_by_position(after[head], held_a)[b]} == cow, (g, kw)
                assert dict(zip(ch.moved.tolist(), ch.moved_first.tolist(), strict=True)) == moved, (g, kw)
                seen["grown"] += len(grown)
                seen["cow"] += len(cow)
                seen["moved"] += len(moved)
        driver.update(kw, res.seq_ids)
    assert seen["grown"] > 20, seen
    if spec_name == "prefix":
        assert seen["cow"] > 0, seen
    if spec_name == "hybrid":
        assert seen["moved"] > 0, seen


@pytest.mark.parametrize("field", ["first_rows", "replaced"])
def test_a_delta_field_of_a_float_dtype_is_refused_naming_the_field(field):
    """from_tensor names the field it refuses (wire.py); the mirror passes that name on in its MirrorError."""
    if field == "first_rows":                       # a sliding window's release moves group 1's first page
        twin = Twin("hybrid")
        twin.step({"admit": [1], "admit_tokens": [12]})
        ra = codec.step_request("a", extend=[1], extend_tokens=[5])
    else:                                           # a copy-on-write replaces seq 1's last page
        twin = Twin("per_layer")
        twin.step({"admit": [1], "admit_tokens": [6]})
        ra = codec.step_request("a", fork=[(1, 2)], extend=[1], extend_tokens=1)
    reply = twin.delta_reply(ra)
    if field == "first_rows":
        (gd,) = [g for g in reply.delta.groups if g.HasField("first_rows")]
        t = gd.first_rows
    else:
        t = reply.tables[0].delta.replaced
        assert len(t.data) == 4
    t.CopyFrom(to_tensor(np.frombuffer(t.data, np.int32).astype(np.float32)))
    with pytest.raises(MirrorError, match=rf"\({field}: dtype FLOAT32 not allowed here\)"):
        twin.mirror.apply(reply)
    assert twin.mirror.seq == 0


@pytest.mark.parametrize("spec_name", ["per_layer", "hybrid"])
def test_full_reply_of_the_mirror_equals_the_managers_full_reply(spec_name):
    """full_reply() (what resyncs a worker's copy) carries, per index space, the same batch, slot mapping and CSR
    (indptr, indices, last_page_len) as the manager's own full reply to the same ops on a twin pool."""
    from kvservice.contract.wire import from_tensor

    twin = Twin(spec_name)
    rng = np.random.default_rng(41)
    ids = [int(i) for i in rng.choice(np.arange(1, 500), 4, replace=False)]
    twin.step({"admit": ids, "admit_tokens": rng.integers(1, 30, 4).tolist()})
    kw = {"extend": ids, "extend_tokens": rng.integers(1, 9, 4).tolist()}
    manager = twin.api.Step(codec.step_request("b", **kw))
    ra = codec.step_request("a", **kw)
    twin.seq += 1
    ra.stream_seq, ra.delta_tables, ra.delta_base = twin.seq, True, twin.mirror.seq
    twin.mirror.apply(twin.session.apply(twin.api, ra))
    mine = twin.mirror.full_reply()
    assert mine.stream_seq == twin.seq

    def arrays(reply, field):
        return from_tensor(getattr(reply, field), field).tolist()

    for field in ("seq_ids", "num_tokens", "new_token_indptr"):
        assert arrays(mine, field) == arrays(manager, field), field
    assert [t.index_space for t in mine.tables] == sorted(t.index_space for t in manager.tables)
    theirs = {t.index_space: t for t in manager.tables}
    for t in mine.tables:
        for field in ("slot_mapping", "indptr", "indices", "last_page_len"):
            assert arrays(t, field) == arrays(theirs[t.index_space], field), (t.index_space, field)
        assert any(arrays(t, "last_page_len"))


def test_malformed_generations_or_page_dtype_are_refused_naming_space_and_shape():
    """The mirror refuses, naming the index space: a full reply whose generations are not one uint32 per page,
    and a delta whose pages are not the space's index dtype (int32 here)."""
    twin = Twin("per_layer")
    rng = np.random.default_rng(43)
    ids = [int(i) for i in rng.choice(np.arange(1, 500), 3, replace=False)]
    ra = codec.step_request("a", admit=ids, admit_tokens=rng.integers(5, 30, 3).tolist())
    twin.seq += 1
    ra.stream_seq, ra.delta_tables, ra.accept_tokens_added = twin.seq, True, True   # full: the mirror holds nothing
    reply = twin.session.apply(twin.api, ra)
    st = reply.tables[0]
    n = len(st.indices.data) // 4
    assert st.HasField("generations") and len(st.generations.data) == 4 * n
    bad = pb.StepReply()
    bad.CopyFrom(reply)
    bad.tables[0].generations.data = bad.tables[0].generations.data[:-4]           # one generation short
    with pytest.raises(MirrorError) as err:
        twin.mirror.apply(bad)
    assert err.value.args[0] == (f"index space {st.index_space}: generations must be UINT32 [{n}] (one per page), "
                                 f"got uint32 [{n - 1}]")
    assert twin.mirror.seq == 0
    twin.mirror.apply(reply)
    rd = codec.step_request("a", extend=ids, extend_tokens=[20, 20, 20])          # every row gains pages
    twin.seq += 1
    rd.stream_seq, rd.delta_tables, rd.delta_base, rd.accept_tokens_added = twin.seq, True, twin.mirror.seq, True
    delta = twin.session.apply(twin.api, rd)
    pages = delta.tables[0].delta.pages
    assert pages.data
    pages.CopyFrom(to_tensor(np.frombuffer(pages.data, np.int32).astype(np.int64)))
    with pytest.raises(MirrorError) as err:
        twin.mirror.apply(delta)
    assert err.value.args[0] == (f"index space {delta.tables[0].index_space}: pages are int64, the space's index "
                                 "dtype is int32")



def test_a_same_batch_delta_that_names_new_seq_ids_is_refused():
    """A delta without base_rows says "the same batch, every row continued"; one that also carries seq_ids
    contradicts itself, and the mirror refuses it (MirrorError) even where it looks like a steady decode step."""
    twin = Twin("per_layer")
    rng = np.random.default_rng(53)
    ids = [int(i) for i in rng.choice(np.arange(1, 500), 3, replace=False)]
    twin.step({"admit": ids, "admit_tokens": rng.integers(2, 20, 3).tolist()})
    ra = codec.step_request("a", extend=ids, extend_tokens=1)
    twin.seq += 1
    ra.stream_seq, ra.delta_tables, ra.delta_base, ra.accept_tokens_added = twin.seq, True, twin.mirror.seq, True
    reply = twin.session.apply(twin.api, ra)
    assert reply.HasField("delta") and not reply.delta.HasField("base_rows") and not reply.seq_ids.data
    bad = pb.StepReply()
    bad.CopyFrom(reply)
    bad.seq_ids.CopyFrom(to_tensor(np.array([i + 1000 for i in ids], dtype=np.uint64)))
    with pytest.raises(MirrorError, match="a same-batch delta has 3 rows"):
        twin.mirror.apply(bad)



def test_a_stream_result_carries_the_replys_journal_position_and_lineage():
    """StreamCore.result (the stream client's StepResult of a reply it applied to its mirror) passes on the
    reply's JournalPosition: (incarnation, seq) as position and the state's lineage (proto: kept across restarts,
    clients compare it), not only the tables."""
    from kvservice.client.stream_core import StreamCore

    twin = Twin("per_layer")
    rng = np.random.default_rng(61)
    core = StreamCore("a", PAGE, True, "s")
    ids = [int(i) for i in rng.choice(np.arange(1, 500), 2, replace=False)]
    ra = codec.step_request("a", admit=ids, admit_tokens=rng.integers(2, 20, 2).tolist())
    ra.stream_seq, ra.delta_tables, ra.accept_tokens_added = 1, True, True
    reply = twin.session.apply(twin.api, ra)
    incarnation, seq, lineage = (int(x) for x in rng.integers(1, 2**62, 3))
    reply.position.CopyFrom(pb.JournalPosition(incarnation=incarnation, seq=seq, lineage=lineage))
    result = core.result(reply, tables=True, block_table=False)
    assert (result.position, result.lineage) == ((incarnation, seq), lineage)
    assert result.seq_ids.tolist() == ids
