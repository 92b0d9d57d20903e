"""Cost bounded before anything changes (issue #11 items 3 and 8): reply-size bounds against real replies,
refusals that leave the pool as it was and say what would fit, token counts that cannot overflow."""

import numpy as np
import pytest

from kvservice.contract.errors import InvalidArgument, KVError, ResourceExhausted
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.core.invariants import assert_invariants
from kvservice.core.limits import TENSOR_FRAMING, check_step_counts
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.state.tree import state_tree
from kvservice.v1 import block_manager_pb2 as pb

HYBRID = CacheSpec((LayerSpec(2, 64), LayerSpec(2, 128), LayerSpec(1, 64, sliding_window=24)) * 2, 8, "interleaved")
POOLS = {
    "per_layer": (CacheSpec.uniform(4, 2, 64, page_size=4), False),
    "interleaved64": (CacheSpec.uniform(64, 1, 64, page_size=16, layout="interleaved"), False),
    "hybrid": (HYBRID, False),
    "prefix": (CacheSpec.uniform(2, 1, 64, page_size=4), True),
}


def ids(a):
    return to_tensor(np.asarray(a, dtype=np.uint64))


def counts(a):
    return to_tensor(np.asarray(a, dtype=np.int64))


def random_step(rng, pool_name, tokens, next_id, max_seq_len):
    """A step the pool accepts (given enough slots): frees, extensions, forks, admissions of random sizes.

    tokens: seq_id -> tokens held, of the live sequences."""
    r = pb.StepRequest(pool=pool_name, omit_tables=bool(rng.random() < 0.3),
                       include_block_table=bool(rng.random() < 0.4))
    live = list(tokens)
    rng.shuffle(live)
    free, ext, parents = live[:len(live) // 5], live[len(live) // 5:len(live) // 2], live[len(live) // 2:][:2]
    ext_k = [int(rng.integers(1, max(2, min(40, max_seq_len - tokens[i])))) for i in ext]
    keep = [j for j, i in enumerate(ext) if tokens[i] + ext_k[j] <= max_seq_len]
    ext, ext_k = [ext[j] for j in keep], [ext_k[j] for j in keep]
    if ext:
        r.extend_seq_ids.CopyFrom(ids(ext))
        r.extend_num_tokens.CopyFrom(counts(ext_k))
    if free:
        r.free_seq_ids.CopyFrom(ids(free))
    if parents and rng.random() < 0.5:
        r.fork_parent_ids.CopyFrom(ids(parents))
        r.fork_child_ids.CopyFrom(ids(range(next_id, next_id + len(parents))))
        next_id += len(parents)
    n_adm = int(rng.integers(0, 5))
    if n_adm:
        r.admit_seq_ids.CopyFrom(ids(range(next_id, next_id + n_adm)))
        r.admit_num_tokens.CopyFrom(counts(rng.integers(1, min(max_seq_len, 90), n_adm)))
        next_id += n_adm
    return r, next_id


@pytest.mark.parametrize("kind", sorted(POOLS))
def test_reply_bound_covers_every_real_reply_and_is_tight(kind):
    """Both bounds are >= the serialized reply of the step they bound; the exact one is within framing of it."""
    spec, prefix = POOLS[kind]
    m = BlockManager()
    m.create_pool("p", spec, Sizing(num_slots=3000, max_seq_len=400), (), prefix)
    api = ManagerAPI(m)
    rng = np.random.default_rng(11 + len(kind))
    next_id, compared = 1, 0
    for _ in range(60):
        with m.locked("p") as pool:
            live_ids, toks = pool.sequences()
        tokens = dict(zip(live_ids.tolist(), toks.tolist(), strict=True))
        r, next_id = random_step(rng, "p", tokens, next_id, 400)
        exact, quick, blind = (api.step_reply_bound(r, level) for level in (2, 1, 0))
        try:
            reply = api.Step(r)
        except ResourceExhausted:         # out of slots: nothing to compare
            continue
        size = reply.ByteSize()
        assert size <= exact.total <= quick.total <= blind.total, (size, exact, quick, blind)
        # Each part bounds its own part of the reply: the slot mappings (with their generations), per space.
        mapped = sum(pb.SpaceTables(slot_mapping=t.slot_mapping, slot_generations=t.slot_generations).ByteSize()
                     for t in reply.tables)
        assert mapped <= exact.slot_mappings, (kind, mapped, exact)
        # Past the framing allowances (a Tensor's 64, the fixed part), the data parts are within 5 % of the reply.
        framing = exact.rest + len(reply.tables) * 7 * TENSOR_FRAMING
        slack = exact.total - size
        assert slack <= framing + size // 20, (kind, size, exact)
        compared += 1
        with m.locked("p") as pool:
            assert_invariants(pool)
    assert compared > 40


def interleaved_manager(limit, spaces=64):
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(spaces, 1, 64, page_size=16, layout="interleaved"),
                  Sizing(max_batch=200, max_seq_len=4096))
    return m, ManagerAPI(m, max_reply_bytes=limit)


def test_issue_reply_over_the_limit_is_refused_before_anything_changes():
    """Issue #11 item 3, scaled: a 64-space pool, 10 x 1000 tokens, a 4 MiB limit. Refused, nothing held; the
    retry of the same step is refused again (never ALREADY_EXISTS); split as the message says, it goes through."""
    limit = 4 << 20
    m, api = interleaved_manager(limit)
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=ids([500]), admit_num_tokens=counts([33])))
    before = state_tree(m)
    r = pb.StepRequest(pool="p", admit_seq_ids=ids(range(1, 11)), admit_num_tokens=counts([1000] * 10))
    for _ in range(2):
        with pytest.raises(ResourceExhausted) as exc:
            api.Step(r)
        assert state_tree(m) == before
    e = exc.value
    assert e.reason == "REPLY_TOO_LARGE" and e.metadata["limit"] == str(limit)
    assert f"message limit of {limit} bytes" in e.message and "nothing was changed" in e.message
    assert "10000 new tokens x 64 index spaces" in e.message and "--max-message-bytes" in e.message
    per_step = int(e.message.split("at most about ")[1].split()[0])
    assert 4000 < per_step < 7000          # 12 bytes per token and space: slot mapping and generation
    per_seq = per_step // 1000
    for lo in range(1, 11, per_seq):
        chunk = list(range(lo, min(lo + per_seq, 11)))
        reply = api.Step(pb.StepRequest(pool="p", admit_seq_ids=ids(chunk),
                                        admit_num_tokens=counts([1000] * len(chunk))))
        assert 0 < reply.ByteSize() <= limit
    with m.locked("p") as pool:
        assert pool.num_sequences == 11
        assert_invariants(pool)


@pytest.mark.parametrize(("flags", "advice", "fix"), [
    ({"include_block_table": True}, "leave include_block_table off", {"include_block_table": False}),
    ({}, "set omit_tables", {"omit_tables": True}),
])
def test_refusal_names_the_option_that_makes_it_fit(flags, advice, fix):
    """Long sequences decoding one token each: tables (or block tables) dominate; the named option fits."""
    m, unlimited = interleaved_manager(0, spaces=8)
    ids_ = list(range(1, 161))
    unlimited.Step(pb.StepRequest(pool="p", admit_seq_ids=ids(ids_), admit_num_tokens=counts([4000] * 160),
                                  omit_tables=True))
    step = pb.StepRequest(pool="p", extend_seq_ids=ids(ids_), extend_num_tokens=counts([1] * 160), **flags)
    size = unlimited.step_reply_bound(step).total
    without = unlimited.step_reply_bound(pb.StepRequest(**{**_fields(step), **fix})).total
    limit = (size + without) // 2
    api = ManagerAPI(m, max_reply_bytes=limit)
    before = state_tree(m)
    with pytest.raises(ResourceExhausted) as exc:
        api.Step(step)
    assert advice in exc.value.message and state_tree(m) == before
    fixed = pb.StepRequest(**{**_fields(step), **fix})
    assert api.Step(fixed).ByteSize() <= limit


def _fields(msg):
    return {f.name: v for f, v in msg.ListFields()}


def test_counts_over_max_seq_len_are_refused_before_the_pool_adds_them():
    """Issue #11 item 8: with no server cap, counts near 2^63 wrapped inside the pool; a step holding them also
    admitted 65,536 sequences, which stayed behind with zero tokens. Now refused first, nothing changed."""
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(2, 1, 64), Sizing(num_slots=200_000, max_seq_len=4096))
    api = ManagerAPI(m)
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=ids([1, 2]), admit_num_tokens=counts([5, 5])))
    before = state_tree(m)
    for dtype, big in ((np.int64, 2**63 - 1), (np.uint64, 2**64 - 1), (np.int64, 4097)):
        r = pb.StepRequest(pool="p", extend_seq_ids=ids([1, 2]),
                           extend_num_tokens=to_tensor(np.array([big, big - 2], dtype=dtype)),
                           admit_seq_ids=ids(np.arange(10, 10 + 65_536)), admit_num_tokens=counts(np.ones(65_536)))
        with pytest.raises(InvalidArgument) as exc:
            api.Step(r)
        assert "max_seq_len=4096" in exc.value.message or "must be > 0" in exc.value.message
        if big == 4097:                                   # the field and entry are named, as the request spells them
            assert exc.value.message.startswith("extend_num_tokens[0] = 4097 tokens: pool 'p'")
        assert state_tree(m) == before
    with m.locked("p") as pool:
        assert pool.sequences()[1].tolist() == [5, 5]
        assert_invariants(pool)


def test_page_sums_that_could_wrap_are_summed_exactly():
    """A batch whose int64 page sums could pass 2^62 is summed in Python integers and refused by its least need."""
    big = np.full(4, 2**61, dtype=np.int64)
    with pytest.raises(ResourceExhausted, match="needs at least 9223372036854775808 slots"):
        check_step_counts("p", 2**61, 2**40, 1, [("admit_num_tokens", big)])
    check_step_counts("p", 2**61, 2**40, 1, [("admit_num_tokens", big[:1])])     # one count: no sum to wrap
    with pytest.raises(InvalidArgument, match=r"admit_num_tokens\[2\] = 9"):
        check_step_counts("p", 8, 100, 1, [("admit_num_tokens", np.array([1, 2, 9]))])


def test_total_slots_bound_the_memory_of_all_pools():
    """max_total_slots sums slots x groups over pools: many pools each under max_pool_slots cannot add up past it."""
    from kvservice.server.limits import Limits
    from kvservice.state.startup import create_request

    m = BlockManager()
    lim = Limits(max_pool_slots=1000, max_total_slots=2500)
    two_groups = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=32)), 16)
    for name in ("a", "b"):
        lim.check("CreatePool", create_request(name, two_groups, Sizing(num_slots=500), ()), m)
        m.create_pool(name, two_groups, Sizing(num_slots=500))
    assert m.total_slots() == 2000
    with pytest.raises(ResourceExhausted) as exc:
        lim.check("CreatePool", create_request("c", two_groups, Sizing(num_slots=300), ()), m)
    assert exc.value.reason == "LIMIT_EXCEEDED" and "hold 2000 of its 2500" in exc.value.message
    lim.check("CreatePool", create_request("c", two_groups, Sizing(num_slots=250), ()), m)   # exactly 2500
    m.delete_pool("a")
    lim.check("CreatePool", create_request("c", two_groups, Sizing(num_slots=300), ()), m)


def test_a_prefix_cached_slot_counts_what_its_cached_page_costs():
    """Issue 27: a prefix-cached pool's cached pages cost ~1.1 KB + 40 B a token beside the slot (measured), so each
    of its slots counts slot_units of max_total_slots: 33 at page size 16, by the documented cost model."""
    from kvservice.manager.pools import CACHED_PAGE_BYTES, CACHED_TOKEN_BYTES, SLOT_UNIT_BYTES, slot_units
    from kvservice.server.limits import Limits
    from kvservice.state.startup import create_request

    assert slot_units(16, False) == slot_units(64, False) == 1
    for ps in (1, 16, 64, 256):                   # units x unit bytes cover the slot and its cached page, tightly
        need = SLOT_UNIT_BYTES + CACHED_PAGE_BYTES + CACHED_TOKEN_BYTES * ps
        assert (slot_units(ps, True) - 1) * SLOT_UNIT_BYTES < need <= slot_units(ps, True) * SLOT_UNIT_BYTES
    assert slot_units(16, True) == 33 and slot_units(64, True) == 67      # the figures docs/SECURITY.md gives
    m = BlockManager()
    lim = Limits(max_pool_slots=10_000, max_total_slots=33 * 1000 + 20)
    spec = CacheSpec.uniform(2, 1, 64, page_size=16)
    with pytest.raises(ResourceExhausted) as exc:
        lim.check("CreatePool", create_request("c", spec, Sizing(num_slots=1001), (), prefix_caching=True), m)
    assert exc.value.reason == "LIMIT_EXCEEDED" and exc.value.message.startswith(
        "pool 'c' needs 33033 slot units (1001 slots x layer groups, each counting 33 because a cached page")
    assert m.pool_names() == []
    lim.check("CreatePool", create_request("c", spec, Sizing(num_slots=1001), ()), m)   # plain: 1,001 units
    lim.check("CreatePool", create_request("c", spec, Sizing(num_slots=1000), (), prefix_caching=True), m)
    m.create_pool("c", spec, Sizing(num_slots=1000), prefix_caching=True)
    assert m.total_slots() == 33_000
    with pytest.raises(ResourceExhausted, match="hold 33000 of its 33020"):
        lim.check("CreatePool", create_request("d", spec, Sizing(num_slots=21), ()), m)
    lim.check("CreatePool", create_request("d", spec, Sizing(num_slots=20), ()), m)


def test_listings_that_could_pass_the_limit_are_refused_or_lowered():
    """ListSequences without a limit over the message limit: refused, naming a limit that fits (which does).
    ValidatePageTable lists at most 1,000 violations whatever max_reports says."""
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(1, 1, 64, page_size=1), Sizing(num_slots=5000, max_seq_len=8))
    ManagerAPI(m).Step(pb.StepRequest(pool="p", admit_seq_ids=ids(np.arange(1, 3001) * 2**40),
                                      admit_num_tokens=counts(np.full(3000, 1))))
    limit = 50_000
    api = ManagerAPI(m, max_reply_bytes=limit)
    with pytest.raises(ResourceExhausted) as exc:
        api.ListSequences(pb.ListSequencesRequest(pool="p"))
    fits = int(exc.value.metadata["fits"])
    assert exc.value.reason == "REPLY_TOO_LARGE" and f"pass limit <= {fits}" in exc.value.message
    reply = api.ListSequences(pb.ListSequencesRequest(pool="p", limit=fits))
    assert len(reply.sequences) == fits and reply.total == 3000 and reply.ByteSize() <= limit
    # The rule (manager/api.py): 64 bytes for the reply's own fields, SEQUENCE_INFO_BYTES + 11 per layer group
    # for each sequence, each at least protobuf's worst case (every varint at 2^64 - 1). At a limit of exactly
    # 64 + k such entries, k sequences are listed and k + 1 are refused naming k.
    from kvservice.manager.api import SEQUENCE_INFO_BYTES
    per_seq = SEQUENCE_INFO_BYTES + 11
    worst = pb.ListSequencesReply(sequences=[pb.SequenceInfo(seq_id=2**64 - 1, num_tokens=2**64 - 1,
                                  num_slots=2**64 - 1, num_slots_per_group=[2**64 - 1])]).ByteSize()
    assert worst <= per_seq and pb.ListSequencesReply(total=2**64 - 1).ByteSize() <= 64
    k = int(np.random.default_rng(238).integers(5, 900))
    exact = ManagerAPI(m, max_reply_bytes=64 + k * per_seq)
    assert len(exact.ListSequences(pb.ListSequencesRequest(pool="p", limit=k)).sequences) == k
    with pytest.raises(ResourceExhausted) as exc:
        exact.ListSequences(pb.ListSequencesRequest(pool="p", limit=k + 1))
    assert int(exc.value.metadata["fits"]) == k
    bad = np.full(5000, 10**6, dtype=np.int64)                    # every index out of bounds
    report = api.ValidatePageTable(pb.ValidatePageTableRequest(
        pool="p", layer=0, indptr=counts([0, 5000]), indices=counts(bad), last_page_len=counts([1]),
        max_reports=2**32 - 1))
    assert report.num_violations == 5000 and len(report.violations) == 1000


def test_one_long_prompt_among_thousands_of_short_ones_costs_its_tokens_not_a_padded_matrix():
    """One 100,000-token prompt among 4,095 one-token admissions: a 900 KB request that the prefix lookup
    once padded to 4096 x 100,000 int64s (3 GiB). Prompt pages are ragged now: the step runs in one go
    and its peak Python-side allocation stays a small multiple of the prompt's tokens."""
    import tracemalloc
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(2, 1, 64), Sizing(num_slots=20_000, max_seq_len=200_000), (), True)
    api = ManagerAPI(m, max_reply_bytes=128 << 20)
    n = np.ones(4096, np.int64)
    n[0] = 100_000
    tokens = np.random.default_rng(3).integers(1, 50_000, int(n.sum()))
    req = pb.StepRequest(pool="p", admit_seq_ids=ids(np.arange(1, 4097)), admit_num_tokens=counts(n),
                         admit_token_ids=counts(tokens), omit_tables=True)
    tracemalloc.start()
    api.Step(req)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 100 * int(n.sum()) * 8, f"peak {peak} bytes for {int(n.sum())} tokens"     # ~80 MB; 3 GiB before
    with m.locked("p") as pool:
        assert pool.num_sequences == 4096
        assert_invariants(pool)


def test_pages_after_bounds_every_groups_entries_and_is_exact_for_extensions():
    """A plain replay of the bound, group by group (issue 28): the real table entries of each layer group
    (the reply's indices of its index spaces) never exceed pages_after's figure for that group, and for a
    step of extensions only it is exact. A sliding group's kept pages depend on where the window stood
    *before* the step (pages released by this step are still in its reply); counting them from after the step
    gives a bound below the reply, which the byte-level test above can miss inside its framing allowance."""
    from kvservice.core.limits import ReplyModel, pages_after

    m = BlockManager()
    m.create_pool("p", HYBRID, Sizing(num_slots=3000, max_seq_len=400))
    api = ManagerAPI(m)
    rng = np.random.default_rng(28)
    next_id, exact_steps = 1, 0
    for step in range(80):
        with m.locked("p") as pool:
            live_ids, toks = pool.sequences()
            model = ReplyModel.of(pool.plan)
        tokens = dict(zip(live_ids.tolist(), toks.tolist(), strict=True))
        r, next_id = random_step(rng, "p", tokens, next_id, 400)
        r.omit_tables = False
        if step % 2:                                   # every other step: extensions only
            for f in ("free_seq_ids", "fork_parent_ids", "fork_child_ids", "admit_seq_ids", "admit_num_tokens"):
                r.ClearField(f)
        e_ids = np.frombuffer(r.extend_seq_ids.data, np.uint64).tolist() if r.HasField("extend_seq_ids") else []
        e_k = np.frombuffer(r.extend_num_tokens.data, np.int64) if e_ids else np.zeros(0, np.int64)
        a_n = np.frombuffer(r.admit_num_tokens.data, np.int64) if r.HasField("admit_num_tokens") else \
            np.zeros(0, np.int64)
        parents = np.frombuffer(r.fork_parent_ids.data, np.uint64).tolist() if r.HasField("fork_parent_ids") else []
        e_old = np.array([tokens[i] for i in e_ids], np.int64)
        c_tokens = np.array([tokens[i] for i in parents], np.int64)
        bound, _ = pages_after(model.page_size, model.max_pages, model.windows, e_old, e_k, a_n, c_tokens,
                               len(parents), None)
        try:
            reply = api.Step(r)
        except ResourceExhausted:
            continue
        only_extensions = not (len(a_n) or parents)
        for st in reply.tables:
            entries = len(from_tensor(st.indices, "indices"))
            assert entries <= bound[st.group], (step, st.group, entries, bound)
            if only_extensions:
                assert entries == bound[st.group], (step, st.group, entries, bound)
        exact_steps += only_extensions and bool(e_ids)
    assert exact_steps >= 20


@pytest.mark.parametrize("kind", sorted(POOLS))
def test_the_extend_only_cost_shortcut_equals_the_general_bound(kind, monkeypatch):
    """check_step_cost's shortcut for extend-only steps (limits.extend_bound: c0 + ce * E + cs * S) gives the very
    StepCost the general path (_quick_shape + step_reply_bound) gives, on random steps of every kind, with tables,
    block tables or neither, and at random E and S far past any real step (the affinity it rests on)."""
    from kvservice.core.limits import ReplyModel, StepShape, extend_bound, step_reply_bound
    from kvservice.manager import api as api_module
    from kvservice.manager.api import StepCost
    from kvservice.manager.step_input import decode_step

    spec, prefix = POOLS[kind]
    m = BlockManager()
    m.create_pool("p", spec, Sizing(num_slots=4000, max_seq_len=400), prefix_caching=prefix)
    api = ManagerAPI(m, max_reply_bytes=1 << 22)
    real = api_module.extend_bound
    rng = np.random.default_rng(7)
    with m.locked("p") as pool:
        model = ReplyModel.of(pool.plan)
        for tables in (False, True):
            for block_table in (False, True):
                c0, ce, cs = extend_bound(model, tables, block_table)
                for _ in range(50):
                    e, t = int(rng.integers(0, 1 << 20)), int(rng.integers(0, 1 << 40))
                    shape = StepShape(e, e, 0, t, (e * model.max_pages,) * len(model.index_bytes), model.max_pages)
                    assert c0 + ce * e + cs * t == step_reply_bound(model, shape, tables, block_table).total
    next_id, shortcut = 1, 0
    calls = []
    monkeypatch.setattr(api_module, "extend_bound", lambda *a: calls.append(a) or real(*a))
    for i in range(60):
        with m.locked("p") as pool:
            live_ids, toks = pool.sequences()
        tokens = dict(zip(live_ids.tolist(), toks.tolist(), strict=True))
        r, next_id = random_step(rng, "p", tokens, next_id, 400)
        if i % 2:                                                  # every other step: extensions only
            for f in ("free_seq_ids", "fork_parent_ids", "fork_child_ids", "admit_seq_ids", "admit_num_tokens"):
                r.ClearField(f)
        step = decode_step(r)
        with m.locked("p") as pool:
            n = len(calls)
            got = api.check_step_cost(pool, step)
            shortcut += len(calls) > n
            shape = api_module._quick_shape(model, step, [step.extend_counts, step.admit_counts])
            want = StepCost(False, 0) if shape is None else \
                StepCost(True, step_reply_bound(model, shape, step.tables, step.block_table).total)
            assert got == want, (i, got, want)
        try:
            api.Step(r)
        except KVError:                                             # a refused step changes nothing
            pass
    assert shortcut >= 20, shortcut


@pytest.mark.parametrize("field", ["extend_num_tokens", "admit_num_tokens"])
def test_the_request_only_bound_names_the_field_over_max_seq_len(field):
    """step_reply_bound(level 0) checks the counts before any arithmetic, and names the offending field."""
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(2, 1, 64), Sizing(num_slots=64, max_seq_len=256))
    api = ManagerAPI(m)
    api.Step(pb.StepRequest(pool="p", admit_seq_ids=ids([1]), admit_num_tokens=counts([5])))
    big = {"extend_num_tokens": dict(extend_seq_ids=ids([1]), extend_num_tokens=counts([300])),
           "admit_num_tokens": dict(admit_seq_ids=ids([2]), admit_num_tokens=counts([257]))}[field]
    with pytest.raises(InvalidArgument, match=field):
        api.step_reply_bound(pb.StepRequest(pool="p", **big), 0)


def test_pages_after_takes_fork_children_of_unknown_length_at_max_pages_each():
    """pages_after's documented rule, by hand (page_size 16, max_pages 25, a full group and a 32-token sliding
    one): extended rows 40 + 5 and 100 + 30 tokens hold 3 and 9 pages, of which the sliding group keeps 3 and
    9 - 4 (it releases (100 + 1 - 32) // 16 = 4 pages of the second row); one admission of 17 tokens, 2 pages.
    Two fork children of unknown length (c_tokens None) count 25 pages each, even when the extended rows'
    lengths are known; of known lengths 20 and 33 tokens, 2 + 3 pages."""
    from kvservice.core.limits import pages_after

    e_old, e_k, a_n = np.array([40, 100], np.int64), np.array([5, 30], np.int64), np.array([17], np.int64)
    assert pages_after(16, 25, (0, 32), e_old, e_k, a_n, None, 2, None) == ((3 + 9 + 2 + 50, 3 + 5 + 2 + 50), 25)
    assert pages_after(16, 25, (0, 32), e_old, e_k, a_n, None, 0, None) == ((3 + 9 + 2, 3 + 5 + 2), 9)
    assert pages_after(16, 25, (0, 32), e_old, e_k, a_n, np.array([20, 33], np.int64), 2, None) == \
        ((3 + 9 + 2 + 5, 3 + 5 + 2 + 5), 9)


def test_decoded_step_counts_its_sequences_and_new_tokens():
    """DecodedStep.new_tokens (what --max-step-tokens caps) is the sum of the counts given, or the length of
    admit_token_ids if more; sequences counts every id in the step. Each part alone, then all together."""
    from kvservice.manager.step_input import decode_step

    rng = np.random.default_rng(5)
    e, a = rng.integers(1, 50, 3), rng.integers(1, 50, 4)
    only_admit = decode_step(pb.StepRequest(pool="p", admit_seq_ids=ids([7, 8, 9, 10]), admit_num_tokens=counts(a)))
    assert (only_admit.new_tokens, only_admit.sequences) == (int(a.sum()), 4)
    only_extend = decode_step(pb.StepRequest(pool="p", extend_seq_ids=ids([1, 2, 3]), extend_num_tokens=counts(e)))
    assert (only_extend.new_tokens, only_extend.sequences) == (int(e.sum()), 3)
    nothing = decode_step(pb.StepRequest(pool="p", free_seq_ids=ids([4, 5])))
    assert (nothing.new_tokens, nothing.sequences) == (0, 2)
    tok = rng.integers(1, 1000, int(a.sum()) + int(e.sum()) + 5)
    both = decode_step(pb.StepRequest(pool="p", extend_seq_ids=ids([1, 2, 3]), extend_num_tokens=counts(e),
                                      admit_seq_ids=ids([7, 8, 9, 10]), admit_num_tokens=counts(a),
                                      admit_token_ids=to_tensor(tok), free_seq_ids=ids([4])))
    assert (both.new_tokens, both.sequences) == (len(tok), 8)


def test_plan_limit_check_plans_with_the_requested_backends():
    """Limits.check("Plan") plans the request as sent, its kernel backends included: a page size that a named
    backend's rule refuses (flash-attn 2: page_size % 256 == 0, core/backends.py) is that backend's
    FailedPrecondition, the same request without it or with a page size the rule accepts passes."""
    from kvservice.client.codec import plan_request
    from kvservice.contract.errors import FailedPrecondition
    from kvservice.server.limits import Limits

    lim, m = Limits(), BlockManager()
    sizing = Sizing(num_slots=64, max_seq_len=1024)
    with pytest.raises(FailedPrecondition) as err:
        lim.check("Plan", plan_request(CacheSpec.uniform(2, 4, 64, page_size=16), sizing, ("fa2",)), m)
    assert err.value.reason == "BACKEND_PAGE_SIZE" and "page_size 16" in err.value.message
    lim.check("Plan", plan_request(CacheSpec.uniform(2, 4, 64, page_size=16), sizing, ()), m)
    lim.check("Plan", plan_request(CacheSpec.uniform(2, 4, 64, page_size=256), sizing, ("fa2", "trtllm")), m)
