"""BlockManager's own rules, each case against its documented bound: pool names ([A-Za-z0-9_.-]{1,64}), model
names (<= 256 printable), hash modes and seeds (1..256 printable), incarnations ([0, 2^63) at creation, [1, 2^63)
restored), a refused creation changing nothing; heartbeats checked against the pool's current incarnation; the
total of slot units over the pools (slots x layer groups x slot_units)."""

import numpy as np
import pytest

from kvservice.contract.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.hashing import DEFAULT_MODE, HASH_MODES
from kvservice.manager.pools import BlockManager, slot_units

SPEC = CacheSpec.uniform(2, 1, 64, page_size=4)
SIZE = Sizing(num_slots=8, max_seq_len=32)


def _create(m, name="p", **kw):
    return m.create_pool(name, SPEC, SIZE, **kw)


@pytest.mark.parametrize(("kw", "ok"), [
    ({"name": "a" * 64}, True), ({"name": "a" * 65}, False), ({"name": ""}, False), ({"name": "p\n"}, False),
    ({"name": "A-z_0.9"}, True), ({"name": "a/b"}, False), ({"name": "a b"}, False),
    ({"model": "m" * 256}, True), ({"model": "m" * 257}, False), ({"model": "m\x00"}, False), ({"model": ""}, True),
    ({"prefix_hash": "nope"}, False), ({"prefix_hash_seed": ""}, False), ({"prefix_hash_seed": "s" * 256}, True),
    ({"prefix_hash_seed": "s" * 257}, False), ({"prefix_hash_seed": "s\t"}, False),
    ({"incarnation": -1}, False), ({"incarnation": 2**63}, False), ({"incarnation": 2**63 - 1}, True),
    ({"incarnation": 1}, True),
])
def test_create_pool_accepts_exactly_the_documented_values(kw, ok):
    m = BlockManager()
    _create(m, "other", incarnation=4)
    kw = dict(kw)
    name = kw.pop("name", "p")
    if not ok:
        with pytest.raises(InvalidArgument):
            _create(m, name, **kw)
        assert m.pool_names() == ["other"] and m.incarnations() == {"other": 4}
        return
    pool = _create(m, name, **kw)
    assert m.pool_names() == sorted(["other", name])
    assert pool.incarnation == m.incarnation(name) == kw.get("incarnation", pool.incarnation)
    assert pool.model == kw.get("model", "") and pool.prefix_hash == DEFAULT_MODE
    if "prefix_hash_seed" in kw:
        assert pool.prefix_hash_seed == kw["prefix_hash_seed"]


def test_every_hash_mode_is_accepted_and_a_taken_name_is_refused():
    m = BlockManager()
    for i, mode in enumerate(HASH_MODES):
        assert _create(m, f"p{i}", prefix_hash=mode, prefix_caching=True).prefix_hash == mode
    with pytest.raises(AlreadyExists):
        _create(m, "p0", incarnation=5)
    assert m.pool_names() == [f"p{i}" for i in range(len(HASH_MODES))] and 5 not in m.incarnations().values()


def test_random_incarnations_are_in_range_and_restored_ones_checked():
    m = BlockManager()
    incs = {_create(m, f"p{i}").incarnation for i in range(20)}
    assert len(incs) == 20 and all(1 <= i < 2**63 for i in incs)
    for bad in (0, -3, 2**63):
        with pytest.raises(InvalidArgument):
            m.restore_incarnation("p0", bad)
    m.restore_incarnation("p0", 2**63 - 1)
    assert m.incarnation("p0") == 2**63 - 1 and m.pool_and_lock("p0")[0].incarnation == 2**63 - 1
    with pytest.raises(NotFound):
        m.restore_incarnation("nope", 5)


def test_heartbeats_are_checked_against_the_pools_current_incarnation():
    m = BlockManager()
    _create(m, incarnation=10)
    rec = m.register_worker("w", "p")
    assert rec.incarnation == 10 and rec.epoch == 1
    m.heartbeat("w", 1, "p", 10)
    m.heartbeat("w", 1)                                  # an older worker: no pool named
    with pytest.raises(FailedPrecondition) as e:
        m.heartbeat("w", 1, "p", 11)
    assert e.value.reason == "STALE_INCARNATION" and e.value.metadata["incarnation"] == "10"
    with pytest.raises(FailedPrecondition) as e:
        m.register_worker("w2", "p", incarnation=9)
    assert e.value.reason == "STALE_INCARNATION"
    m.delete_pool("p")
    _create(m, incarnation=11)
    with pytest.raises(NotFound):                       # its record went with the deleted pool
        m.heartbeat("w", 1, "p", 11)
    with pytest.raises(NotFound):
        m.heartbeat("w", 1, "nope")


def test_total_slots_sums_slots_times_groups_times_units():
    rng = np.random.default_rng(6)
    m = BlockManager()
    want = 0
    for i in range(6):
        ps = int(rng.choice([4, 16]))
        slots = int(rng.integers(4, 200))
        caching = bool(rng.random() < 0.5)
        m.create_pool(f"p{i}", CacheSpec.uniform(2, 1, 64, page_size=ps), Sizing(num_slots=slots, max_seq_len=64),
                      prefix_caching=caching)
        units = -(-(56 + 1100 + 40 * ps) // 56) if caching else 1
        assert slot_units(ps, caching) == units
        want += slots * units
        assert m.total_slots() == want
    assert slot_units(16, True) == 33 and slot_units(64, True) == 67     # the values its docstring gives
