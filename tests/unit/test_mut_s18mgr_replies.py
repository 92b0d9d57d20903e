"""StepReply and PoolStats checked whole against a plain-Python model of random steps in an interleaved 3-space pool
(docs/DESIGN.md): a row of n tokens holds ceil(n / page_size) slots; slot x is page base_s + x * scale_s + offset_s
in space s; a page table is FlashInfer's CSR (indptr, indices, last_page_len in 1..page_size); a slot mapping is
page * page_size + position in page; a block table pads rows with -1; a slot keeps its pages while its sequence
lives and no two live sequences share one (no prefix caching here)."""

import numpy as np

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import from_tensor, to_tensor
from kvservice.manager.api import ManagerAPI
from kvservice.manager.pools import BlockManager
from kvservice.v1 import block_manager_pb2 as pb

PS = 4
LAYERS = 3
SLOTS = 64


def _u64(a):
    return to_tensor(np.asarray(a, dtype=np.uint64))


def _i64(a):
    return to_tensor(np.asarray(a, dtype=np.int64))


def _arr(t):
    return from_tensor(t, "t").astype(np.int64).tolist()


def _page(s, slot):
    """Page of `slot` in space s of the interleaved pool: base_s + slot * scale + offset_s."""
    return 3 * s * SLOTS + slot * LAYERS + s


def test_step_replies_and_stats_equal_a_model_of_random_steps():
    rng = np.random.default_rng(1866)
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(LAYERS, 1, 64, page_size=PS, layout="interleaved"),
                  Sizing(num_slots=SLOTS, max_seq_len=SLOTS * PS))
    api = ManagerAPI(m)
    live: dict[int, list[int]] = {}        # seq -> [tokens, slots...]
    slots_of: dict[int, list[int]] = {}
    next_id, steps, admitted, refused, checked, peak = 1, 0, 0, 0, 0, 0
    for _ in range(50):
        ids = list(live)
        free = [i for i in ids if rng.random() < 0.2]
        ext = [i for i in ids if i not in free and rng.random() < 0.6]
        k = rng.integers(1, 2 * PS + 2, len(ext)).tolist()
        n_adm = int(rng.integers(0, 3))
        adm = rng.integers(1, 4 * PS, n_adm).tolist()
        adm_ids = list(range(next_id, next_id + n_adm))
        r = pb.StepRequest(pool="p", include_block_table=bool(rng.random() < 0.5))
        if free:
            r.free_seq_ids.CopyFrom(_u64(free))
        if ext:
            r.extend_seq_ids.CopyFrom(_u64(ext))
            r.extend_num_tokens.CopyFrom(_i64(k))
        if adm:
            r.admit_seq_ids.CopyFrom(_u64(adm_ids))
            r.admit_num_tokens.CopyFrom(_i64(adm))
        held_after = sum(-(-n // PS) for i, (n, *_) in live.items() if i not in free) \
            + sum(-(-(live[i][0] + kk) // PS) - -(-live[i][0] // PS) for i, kk in zip(ext, k, strict=True)) \
            + sum(-(-n // PS) for n in adm)
        try:
            reply = api.Step(r)
        except Exception as e:                       # only running out of slots may refuse a well-formed step
            assert held_after > SLOTS, e
            refused += bool(adm)
            continue
        steps += 1
        admitted += n_adm
        for i in free:
            del live[i], slots_of[i]
        old = {i: live[i][0] for i in ext}
        for i, kk in zip(ext, k, strict=True):
            live[i][0] += kk
        for i, n in zip(adm_ids, adm, strict=True):
            live[i] = [n]
            slots_of[i] = []
        next_id += n_adm
        batch = ext + adm_ids
        toks = [live[i][0] for i in batch]
        new = k + adm
        assert _arr(reply.seq_ids) == batch
        assert _arr(reply.num_tokens) == toks
        assert _arr(reply.new_token_indptr) == np.concatenate(([0], np.cumsum(new, dtype=np.int64))).tolist()
        assert _arr(reply.admit_cached_tokens) == [0] * n_adm if n_adm else True
        assert list(reply.layer_index_space) == [0, 1, 2]
        assert len(reply.tables) == LAYERS
        pages_per_row = [-(-n // PS) for n in toks]
        t0 = reply.tables[0]
        ind0 = _arr(t0.indices)
        slots = [(p - 0) // LAYERS for p in ind0]
        at = 0
        for i, n_pages in zip(batch, pages_per_row, strict=True):
            mine = slots[at:at + n_pages]
            at += n_pages
            kept = slots_of[i]
            assert mine[:len(kept)] == kept, i             # a live sequence's pages never move
            slots_of[i] = mine
        every = [s for v in slots_of.values() for s in v]
        assert len(every) == len(set(every)) == sum(-(-n[0] // PS) for n in live.values())
        assert all(0 <= s < SLOTS for s in every)
        width = max(pages_per_row, default=0)
        for s, t in enumerate(reply.tables):
            assert (t.index_space, t.group, t.scale, t.offset, t.base, t.upper_bound) == \
                (s, 0, LAYERS, s, 3 * s * SLOTS, 3 * (s + 1) * SLOTS)
            assert _arr(t.indptr) == np.concatenate(([0], np.cumsum(pages_per_row, dtype=np.int64))).tolist()
            assert _arr(t.indices) == [_page(s, slot) for i in batch for slot in slots_of[i]]
            assert _arr(t.last_page_len) == [(n - 1) % PS + 1 for n in toks]
            want_map = []
            for i, kk in zip(batch, new, strict=True):
                start = old.get(i, 0)
                want_map += [_page(s, slots_of[i][p // PS]) * PS + p % PS for p in range(start, start + kk)]
            assert _arr(t.slot_mapping) == want_map
            gens = _arr(t.generations)
            assert len(gens) == len(ind0) and all(g > 0 for g in gens)
            assert gens == _arr(reply.tables[0].generations)   # one slot, one generation, every space
            sg = _arr(t.slot_generations)
            assert len(sg) == len(want_map) and all(g > 0 for g in sg)
            if r.include_block_table:
                bt = np.asarray(_arr(t.block_table)).reshape(len(batch), -1) if batch else np.zeros((0, 0))
                assert bt.shape[1] >= width
                for row, i in enumerate(batch):
                    want = [_page(s, x) for x in slots_of[i]]
                    assert bt[row, :len(want)].tolist() == want and (bt[row, len(want):] == -1).all()
            else:
                assert not t.HasField("block_table")
        assert reply.num_free_slots == SLOTS - len(every)
        info = api.GetPool(pb.GetPoolRequest(pool="p"))
        st = info.stats
        assert (info.name, st.num_slots, st.num_free_slots, st.num_sequences, st.num_tokens, st.steps,
                st.admitted, st.refused, st.prefix_caching, st.prefix_cache_hits, st.cached_slots) == \
            ("p", SLOTS, SLOTS - len(every), len(live), sum(v[0] for v in live.values()), steps, admitted,
             refused, False, 0, 0)
        peak = max(peak, len(every))
        assert st.peak_used_slots == peak
        checked += 1
    assert checked > 30 and admitted > 20


def test_prefix_cache_stats_and_cached_tokens_follow_a_freed_and_readmitted_prompt():
    """A prompt of n tokens registers its n // ps full pages; freed, they stay cached (held by the cache only);
    admitted again it is served (n - 1) // ps pages (the last token is always computed), each a cache hit."""
    rng = np.random.default_rng(1877)
    m = BlockManager()
    m.create_pool("c", CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=SLOTS, max_seq_len=SLOTS * PS),
                  prefix_caching=True)
    api = ManagerAPI(m)
    n = int(rng.integers(3 * PS + 1, 6 * PS))
    prompt = rng.integers(1, 30_000, n)

    def admit(seq):
        return api.Step(pb.StepRequest(pool="c", admit_seq_ids=_u64([seq]), admit_num_tokens=_i64([n]),
                                       admit_token_ids=_i64(prompt)))

    def stats():
        return api.GetPool(pb.GetPoolRequest(pool="c")).stats

    first = admit(1)
    assert _arr(first.admit_cached_tokens) == [0]
    s = stats()
    assert (s.prefix_caching, s.prefix_cache_hits, s.cached_slots, s.num_free_slots, s.event_sequence) == \
        (True, 0, 0, SLOTS - -(-n // PS), 1)
    api.Step(pb.StepRequest(pool="c", free_seq_ids=_u64([1])))
    s = stats()
    assert (s.prefix_cache_hits, s.cached_slots, s.num_sequences, s.num_tokens) == (0, n // PS, 0, 0)
    again = admit(2)
    served = (n - 1) // PS
    assert _arr(again.admit_cached_tokens) == [served * PS]
    s = stats()
    assert (s.prefix_cache_hits, s.num_sequences, s.num_tokens, s.admitted) == (served, 1, n, 2)
    assert _arr(again.tables[0].indices)[:served] == _arr(first.tables[0].indices)[:served]
