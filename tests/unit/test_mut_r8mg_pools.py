"""BlockManager.register_worker as a journal replays it (enforce=False): a registration's incarnation is adopted
only by a pool that has none (a state saved without one); a pool that has an incarnation keeps it, whatever a
replayed registration carries (0 included); and the STALE_INCARNATION refusal's metadata. Oracle: the docstrings
of BlockManager.register_worker and restore_incarnation (docs/DESIGN.md: an incarnation names one creation of a
pool, in [1, 2^63))."""

import pytest

from kvservice.contract.errors import FailedPrecondition
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.manager.pools import BlockManager

SPEC = CacheSpec.uniform(2, 1, 64, page_size=4)


def test_a_replayed_registration_never_changes_the_incarnation_of_a_pool_that_has_one():
    m = BlockManager()
    m.create_pool("p", SPEC, Sizing(num_slots=16, max_seq_len=32), incarnation=7777)
    for i, carried in enumerate((0, 5555, 7777)):
        rec = m.register_worker(f"w{i}", "p", incarnation=carried, enforce=False)
        assert rec.incarnation == 7777 and m.incarnation("p") == 7777, carried
    with m.locked("p") as pool:
        assert pool.incarnation == 7777


def test_a_pool_without_an_incarnation_adopts_the_first_replayed_registrations():
    m = BlockManager()
    pool = m.create_pool("p", SPEC, Sizing(num_slots=16, max_seq_len=32), incarnation=7777)
    pool.incarnation = 0
    m.restore({"p": pool})                                  # a state saved without incarnations
    assert m.register_worker("w0", "p", incarnation=4242, enforce=False).incarnation == 4242
    assert m.register_worker("w1", "p", incarnation=9999, enforce=False).incarnation == 4242
    assert m.incarnation("p") == 4242 and pool.incarnation == 4242


def test_a_stale_registration_or_heartbeat_names_pool_incarnation_and_worker():
    m = BlockManager()
    m.create_pool("p", SPEC, Sizing(num_slots=16, max_seq_len=32), incarnation=7777)
    rec = m.register_worker("w0", "p")
    want = {"pool": "p", "incarnation": "7777", "worker_id": "w0"}
    with pytest.raises(FailedPrecondition) as e:
        m.heartbeat("w0", rec.epoch, "p", 1234)
    assert (e.value.reason, e.value.metadata) == ("STALE_INCARNATION", want)
    with pytest.raises(FailedPrecondition) as e:
        m.register_worker("w1", "p", incarnation=1234)
    assert (e.value.reason, e.value.metadata) == ("STALE_INCARNATION", {**want, "worker_id": "w1"})
