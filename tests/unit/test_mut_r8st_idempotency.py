"""IdempotencyWindow.lookup's refusals, whole (kvservice/state/idempotency.py): a reused id is INVALID_ARGUMENT
REQUEST_ID_REUSED and an id whose reply was dropped is ALREADY_EXISTS REQUEST_ALREADY_APPLIED, each with its exact
message (naming the configured reply-cache bytes and replay_replies) and the id as request_id metadata (KVError
keeps metadata values as strings). Oracle: the messages as the module writes them, filled in by hand."""

import secrets

import numpy as np
import pytest

from kvservice.contract.errors import AlreadyExists, InvalidArgument
from kvservice.state.idempotency import IdempotencyWindow
from kvservice.state.journal_config import JournalConfig
from kvservice.v1 import block_manager_pb2 as pb


def test_lookup_refusals_carry_their_message_reason_and_request_id():
    rng = np.random.default_rng(8808)
    cache, replays = int(rng.integers(50, 90)), int(rng.integers(3, 40))
    w = IdempotencyWindow(JournalConfig(reply_cache_bytes=cache, replay_replies=replays))
    rid = "tenant/" + secrets.token_hex(5)
    fp = rng.bytes(16)
    w.remember(rid, "Step", fp, 7, 1000.0, None)                  # applied, its reply not kept
    with pytest.raises(InvalidArgument) as err:
        w.lookup(rid, "DeletePool", fp)
    assert err.value.message == (f"request_id {rid!r} was already used by a different Step request; use a fresh id "
                                 "per request")
    assert (err.value.reason, err.value.metadata) == ("REQUEST_ID_REUSED", {"request_id": rid})
    with pytest.raises(AlreadyExists) as err:
        w.lookup(rid, "Step", fp)
    assert err.value.message == (f"Step {rid!r} was already applied; its reply is no longer kept (the reply cache "
                                 f"keeps {cache} bytes; a restart rebuilds the replies of the last {replays} Steps)")
    assert (err.value.reason, err.value.metadata) == ("REQUEST_ALREADY_APPLIED", {"request_id": rid})
    reply = pb.StepReply()
    w.remember("kept", "Step", fp, 8, 1001.0, reply)
    assert w.lookup("kept", "Step", fp) is reply and w.hits == 1
