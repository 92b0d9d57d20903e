"""NATS store units that need no server: fencing.check_ack's whole contract (docs/HA.md fencing: a write counts
only if it sits right after the position the writer expected, and "duplicate" is success only for the writer's
own retry), and what NatsStore and Lease hold right after opening, through a recording stand-in for NatsLink
(the calls they make, the waits: docs/HA.md "Threading", "NATS did not answer listing snapshots within 10 s")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvservice.state.nats.config import Fenced, StoreError
from kvservice.state.nats.fencing import check_ack
from kvservice.state.nats.journal import NatsStore
from kvservice.state.nats.leader import Lease, LeaseConfig
from tests.unit.test_mut_r3sn_lease import RecordingLink


# ---- check_ack ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("seq", "duplicate", "sent_before", "expected_last"),
                         [(1, False, False, 0), (8123, False, False, 8122), (8123, True, True, 8122),
                          (8123, False, True, 8122)])
def test_check_ack_returns_the_stream_sequence_right_after_the_expected_one(seq, duplicate, sent_before,
                                                                            expected_last):
    """A first publish, or this writer's own retry answered as a duplicate, stored at expected_last + 1."""
    assert check_ack(seq, duplicate, sent_before, expected_last) == seq


@pytest.mark.parametrize(("seq", "expected_last"), [(8125, 8122), (8122, 8122), (1, 5)])
def test_check_ack_fences_a_message_not_right_after_the_expected_one(seq, expected_last):
    """Another writer appended in between: Fenced, saying where it was stored and after what."""
    for duplicate, sent_before in ((False, False), (True, True)):
        with pytest.raises(Fenced) as err:
            check_ack(seq, duplicate, sent_before, expected_last)
        assert str(err.value) == (f"NATS stored the journal message at stream sequence {seq}, not right after "
                                  f"{expected_last}: another writer appended in between")
        assert isinstance(err.value, StoreError)


def test_check_ack_fences_a_first_publish_answered_as_a_duplicate():
    """A duplicate of a message this writer never sent is another writer's: Fenced, even at the right place."""
    with pytest.raises(Fenced) as err:
        check_ack(8123, True, False, 8122)
    assert str(err.value) == ("NATS answered a first publish as a duplicate of stream message 8123: another writer "
                              "used this message id; this manager does not count it as written")


# ---- a stand-in link --------------------------------------------------------------------------------------
class StoreLink(RecordingLink):
    """test_mut_r3sn_lease's recording link (config, call recording its arguments and returning `result`), plus
    what NatsStore also reads when opening: nc.max_payload and js (only handed to a coroutine that never runs)."""

    def __init__(self, request_seconds: float = 2.0, max_payload: int = 1024 * 1024) -> None:
        super().__init__(request_seconds)
        self.nc, self.js = SimpleNamespace(max_payload=max_payload), None


# ---- NatsStore ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("max_payload", "part"), [(1024 * 1024, 1024 * 1024 - 1024), (8 * 1024 * 1024,
                                                                                        8 * 1024 * 1024 - 1024),
                                                   (5121, 4097), (5120, 4096), (5000, 4096), (1024, 4096)])
def test_entry_parts_leave_a_kibibyte_for_headers_but_are_at_least_4096_bytes(max_payload, part):
    """max_part_bytes = the server's max_payload less 1024 bytes of header room, never under 4096 (hand-computed)."""
    store = NatsStore(StoreLink(max_payload=max_payload))
    assert store.max_part_bytes == part


def test_a_new_store_opens_its_assets_once_and_starts_empty():
    """One call (ensure_assets, waited max(10 s, 3 requests), named); every position and counter starts at 0."""
    lk = StoreLink(request_seconds=4.5)
    store = NatsStore(lk)
    assert lk.calls == [("ensure_assets", 13.5, "opening the journal stream and the snapshot bucket")]
    assert store._obs is lk.result
    assert (store.epoch, store.writer, store.max_epoch, store.seq, store.last_stream_seq, store.first_stream_seq,
            store.appends, store.append_retries, store.pending) == (0, "", 0, 0, 0, 0, 0, 0, None)
    assert (store.readonly, store.owns_link, store.durable, store.guard) == (False, False, True, None)
    assert store.path == store.location == f"nats://127.0.0.1:4222 (stream KVS_{lk.config.name})"
    assert store.incarnation == 1


@pytest.mark.parametrize(("request_seconds", "wait"), [(0.5, 10.0), (2.0, 10.0), (10.0, 10.0), (12.5, 12.5)])
@pytest.mark.parametrize(("name", "seq"), [("snap-00000000000000000042", 42), ("snap-00000000000000987654", 987654),
                                           ("", 0)])
def test_newest_snapshot_seq_lists_once_waiting_at_least_ten_seconds(request_seconds, wait, name, seq):
    """One listing, waited max(10 s, request_seconds) and named "listing snapshots"; the position is the number
    in the newest snap-<seq> name, 0 when there is none."""
    lk = StoreLink(request_seconds=request_seconds)
    store = NatsStore(lk)
    lk.result = name
    assert store.newest_snapshot_seq() == seq
    assert lk.calls[1:] == [("NatsStore._newest_snapshot_name", wait, "listing snapshots")]


# ---- Lease ----------------------------------------------------------------------------------------------
def test_a_new_lease_holds_nothing_and_has_observed_no_holder():
    """Right after opening: not held, not lost, epoch/revision/bound 0, no renewals or failures, and no holder
    seen yet (None: kvservice/server/ha.py tests `lease.holder is not None` before reading its epoch)."""
    lk = RecordingLink(2.0)
    lease = Lease(lk, LeaseConfig(), "node-a", "10.0.0.7:50051")
    assert lease.holder is None
    assert (lease.held, lease.lost, lease.epoch, lease.revision, lease.valid_until, lease.renewals,
            lease.renew_failures) == (False, None, 0, 0, 0.0, 0, 0)
    assert (lease.node, lease.address) == ("node-a", "10.0.0.7:50051") and lease.kv is lk.result
    assert lease._seen is None and lease._on_lost is None and lease._renewer is None
