"""What the journal says when a change fails unexpectedly (a bug, not a KVError refusal).

docs/DURABILITY.md ("A bug is healed from the journal") and Journal._resync: the manager is rebuilt from the
journal, and the reason "<method> failed unexpectedly (<ErrType>: <msg>)" is logged; if the rebuild itself
fails the journal stops with that reason, which every later call's UNAVAILABLE message and the server's
on_fail hook carry.
"""

import logging

import pytest

from kvservice.contract.errors import JournalUnavailable
from kvservice.manager.pools import BlockManager
from kvservice.state.journal import Journal, JournalConfig
from kvservice.v1 import block_manager_pb2 as pb
from tests.unit.test_journal import run, setup_pools

CFG = JournalConfig(compact_every=1000, background_snapshots=False)


def failing(request):
    raise ValueError("lost 7 pages")


def test_an_unexpected_error_is_logged_with_its_method_type_and_message(caplog):
    """The rebuild's log record names the method, the exception type and its message, with the traceback."""
    j = Journal(BlockManager(), config=CFG)
    setup_pools(j)
    with caplog.at_level(logging.ERROR, logger="kvservice.state.journal"):
        with pytest.raises(ValueError, match="lost 7 pages"):
            j.execute("DeletePool", pb.DeletePoolRequest(pool="a"), failing)
    records = [r for r in caplog.records if r.name == "kvservice.state.journal"]
    assert [r.getMessage() for r in records] == [
        "DeletePool failed unexpectedly (ValueError: lost 7 pages); rebuilding the manager from the journal"]
    assert records[0].levelno == logging.ERROR and records[0].exc_info[0] is ValueError
    assert j.resyncs == 1 and j.failed is None


def test_a_failed_rebuild_stops_the_journal_with_the_unexpected_error_as_reason():
    """If the rebuild cannot read the store, the journal stops; the reason starts with the original failure."""
    j = Journal(BlockManager(), config=CFG)
    setup_pools(j)
    told = []
    j.on_fail = told.append

    def gone():
        raise OSError("store gone")

    j.store.load_snapshot = gone
    with pytest.raises(ValueError, match="lost 7 pages"):
        j.execute("DeletePool", pb.DeletePoolRequest(pool="a"), failing)
    why = ("DeletePool failed unexpectedly (ValueError: lost 7 pages), and rebuilding the manager from the "
           "journal failed (OSError: store gone)")
    assert j.failed == why and told == [why] and j.resyncs == 0
    with pytest.raises(JournalUnavailable) as err:
        run(j, "DeletePool", pb.DeletePoolRequest(pool="b"))
    assert str(err.value) == (f"the manager stopped accepting requests: {why}; it must restart "
                              "(state is recovered from its state dir)")
