"""BlockManager.create_pool and delete_pool checked whole (kvservice/manager/pools.py, fleet_index.py's module
docstring, allocator.generation_seed's documented rule): every refusal's exact message, reason and metadata; what a
creation leaves behind (the incarnation on the pool and in the manager, every layer group's slots starting at the
generation seed (incarnation ^ incarnation >> 32) mod 2^32, the default hash mode and seed, the model, membership
of the fleet index for exactly the pools with one full-attention prefix cache); and what a deletion takes away
(the pool, its incarnation, its workers and its fleet bit, which the next member reuses)."""

import numpy as np
import pytest

from kvservice.contract.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager

FULL = CacheSpec.uniform(2, 1, 64, page_size=4)
HYBRID = CacheSpec((LayerSpec(1, 64), LayerSpec(1, 64, sliding_window=8)), 4)
SLIDING = CacheSpec((LayerSpec(1, 64, sliding_window=8),), 4)
SIZE = Sizing(num_slots=8, max_seq_len=32)


def _refusal(kind, call):
    with pytest.raises(kind) as e:
        call()
    return e.value.message, e.value.reason, e.value.metadata


def test_every_refusal_of_create_delete_and_restore_has_its_exact_message():
    m = BlockManager()
    m.create_pool("p0", FULL, SIZE, incarnation=3)
    bad = "INVALID_ARGUMENT"
    assert _refusal(InvalidArgument, lambda: m.create_pool("x", FULL, SIZE, prefix_hash="md5")) == \
        ("prefix_hash 'md5' is not a hash mode; use one of kvservice, vllm-sha256-cbor", "UNKNOWN_HASH_MODE", {})
    for seed in ("", "s" * 257, "a\tb"):
        assert _refusal(InvalidArgument, lambda s=seed: m.create_pool("x", FULL, SIZE, prefix_hash_seed=s)) == \
            (f"prefix_hash_seed must be 1..256 printable characters, got {len(seed)}", bad, {})
    for inc in (-1, 2**63):
        assert _refusal(InvalidArgument, lambda i=inc: m.create_pool("x", FULL, SIZE, incarnation=i)) == \
            (f"incarnation must be in [0, 2^63), got {inc}", bad, {})
    assert _refusal(InvalidArgument, lambda: m.create_pool("a/b", FULL, SIZE)) == \
        ("pool name 'a/b' must match [A-Za-z0-9_.-]{1,64}", bad, {})
    assert _refusal(InvalidArgument, lambda: m.create_pool("x", FULL, SIZE, model="m" * 257)) == \
        ("model name must be at most 256 printable characters, got 257", bad, {})
    assert _refusal(AlreadyExists, lambda: m.create_pool("p0", FULL, SIZE)) == \
        ("pool 'p0' already exists", "ALREADY_EXISTS", {"pool": "p0"})
    m.pool_and_lock("p0")[0].step(admit_ids=[1, 2], admit_tokens=[3, 9])
    assert _refusal(FailedPrecondition, lambda: m.delete_pool("p0")) == \
        ("pool 'p0' still holds 2 sequences; free them or pass force", "FAILED_PRECONDITION",
         {"pool": "p0", "sequences": "2"})
    for inc in (0, 2**63):
        assert _refusal(InvalidArgument, lambda i=inc: m.restore_incarnation("p0", i)) == \
            (f"incarnation must be in [1, 2^63), got {inc}", bad, {})
    assert _refusal(NotFound, lambda: m.delete_pool("gone")) == \
        ("pool 'gone' does not exist", "NOT_FOUND", {"pool": "gone"})
    assert m.pool_names() == ["p0"] and m.incarnations() == {"p0": 3}


def test_a_creation_seeds_every_group_joins_the_fleet_by_kind_and_a_deletion_takes_it_all_away():
    rng = np.random.default_rng(7076)
    m = BlockManager()
    incs = {name: int(rng.integers(2**40, 2**63)) for name in ("full", "hyb", "sld", "plain")}
    kinds = {"full": (FULL, True), "hyb": (HYBRID, True), "sld": (SLIDING, True), "plain": (FULL, False)}
    for name, (spec, caching) in kinds.items():
        pool = m.create_pool(name, spec, SIZE, prefix_caching=caching, incarnation=incs[name], model=f"m-{name}")
        assert (pool.incarnation, m.incarnation(name), pool.model) == (incs[name], incs[name], f"m-{name}")
        assert (pool.prefix_hash, pool.prefix_hash_seed) == ("kvservice", "vllm-none-hash")
        seed = (incs[name] ^ (incs[name] >> 32)) % 2**32
        assert len(pool.allocators) == (2 if name == "hyb" else 1)
        for a in pool.allocators:
            assert a.generation.tolist() == [seed] * len(a.generation), name
    members = {name: getattr(m.pool_and_lock(name)[0].prefix, "fleet", None) for name in kinds}
    assert members["full"] is not None and members["full"].bit == 0 and m.fleet._bits == [members["full"]]
    assert members["hyb"] is None and members["sld"] is None and members["plain"] is None
    m.register_worker("w-full", "full")
    m.register_worker("w-hyb", "hyb")
    full_cache = m.pool_and_lock("full")[0].prefix
    m.delete_pool("full")
    assert m.pool_names() == ["hyb", "plain", "sld"] and "full" not in m.incarnations()
    assert [w.worker_id for w in m.workers.workers()] == ["w-hyb"]
    assert full_cache.fleet is None and members["full"].bit is None and m.fleet._bits == [None]
    with pytest.raises(NotFound):
        m.incarnation("full")
    again = m.create_pool("full", FULL, SIZE, prefix_caching=True, incarnation=incs["full"] + 1)
    assert again.prefix.fleet.bit == 0 and m.fleet._bits == [again.prefix.fleet]


def test_restore_replaces_every_pool_rebuilds_the_fleet_and_keeps_or_derives_incarnations():
    """BlockManager.restore (the journal's hook): the recovered pools replace every pool (each with a lock of its
    own), the fleet index is built again from their caches, each pool's incarnation is the one it carries, or, for
    a pool recovered without one, its workers' (or a new one in [1, 2^63)); worker records are replaced only when
    given."""
    from kvservice.manager.workers import WorkerRecord

    m = BlockManager()
    m.create_pool("old", FULL, SIZE, prefix_caching=True)
    m.register_worker("w-old", "old")
    src = BlockManager()
    pools = {name: src.create_pool(name, FULL, SIZE, prefix_caching=True, incarnation=inc)
             for name, inc in (("a", 11), ("b", 12), ("c", 13))}
    pools["b"].incarnation = pools["c"].incarnation = 0          # recovered from a state without incarnations
    rec = WorkerRecord("w-b", "b", 0, 2, 0, 1, "cpu", "", 0, "", 4, 0.0, True, 77, "tok")
    old_fleet = m.fleet
    m.restore(pools, [rec])
    assert m.pool_names() == ["a", "b", "c"] and m.fleet is not old_fleet
    with pytest.raises(NotFound):
        m.incarnation("old")
    assert [(w.worker_id, w.pool, w.epoch, w.incarnation, w.owner) for w in m.workers.workers()] == \
        [("w-b", "b", 4, 77, "tok")]
    assert [pools[n].prefix.fleet.index is m.fleet for n in "abc"] == [True, True, True]
    assert sorted(m.fleet._bits, key=lambda b: b.bit) == [pools[n].prefix.fleet for n in "abc"]
    locks = {n: m.pool_and_lock(n)[1] for n in "abc"}
    assert len({id(lk) for lk in locks.values()}) == 3 and not any(lk.locked() for lk in locks.values())
    assert (m.incarnation("a"), m.incarnation("b"), pools["b"].incarnation) == (11, 77, 77)
    c = m.incarnation("c")
    assert 1 <= c < 2**63 and pools["c"].incarnation == c == m.incarnation("c")
    m.restore({"a": pools["a"]})
    assert m.pool_names() == ["a"] and [w.worker_id for w in m.workers.workers()] == ["w-b"]
