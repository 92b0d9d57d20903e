"""The writer identity strings and the acknowledgement check (kvservice/state/nats/fencing.py docstrings), and how a
refused JetStream request is worded (assets.reason): ids are "<epoch>.<writer>.<seq>.<part>" and
"fence.<epoch>.<writer>" (hand-written here), an acknowledgement is the sequence right after the expected last one,
"duplicate" counts for a retry only, and each refusal is Fenced with its exact words."""

from __future__ import annotations

import secrets

import nats.js.errors
import pytest

from kvservice.state.nats.assets import reason
from kvservice.state.nats.config import Fenced
from kvservice.state.nats.fencing import check_ack, fence_id, message_id


def test_message_and_fence_ids_join_their_fields_with_dots():
    writer = secrets.token_hex(8)
    epoch, seq, part = 1 + secrets.randbelow(99), 1 + secrets.randbelow(9999), secrets.randbelow(9)
    assert message_id(epoch, writer, seq, part) == f"{epoch}.{writer}.{seq}.{part}"
    assert message_id(12, "ab", 34, 5) == "12.ab.34.5"
    assert fence_id(epoch, writer) == "fence." + str(epoch) + "." + writer
    assert fence_id(7, "cd") == "fence.7.cd"


def test_an_acknowledgement_counts_right_after_the_expected_last_and_a_duplicate_only_for_a_retry():
    last = secrets.randbelow(1000)
    assert check_ack(last + 1, False, False, last) == last + 1
    assert check_ack(last + 1, False, True, last) == last + 1
    assert check_ack(last + 1, True, True, last) == last + 1
    with pytest.raises(Fenced) as err:
        check_ack(last + 1, True, False, last)
    assert err.value.message == (f"NATS answered a first publish as a duplicate of stream message {last + 1}: another "
                                 "writer used this message id; this manager does not count it as written")
    for seq in (last, last + 2):
        with pytest.raises(Fenced) as err:
            check_ack(seq, True, True, last)
        assert err.value.message == (f"NATS stored the journal message at stream sequence {seq}, not right after "
                                     f"{last}: another writer appended in between")


def test_a_refusal_without_a_description_is_named_by_its_class_and_text():
    err = nats.js.errors.APIError(code=503, description=None, err_code=None)
    assert reason(err) == f"APIError: {err}" and str(err) != ""
    described = nats.js.errors.APIError(code=500, description="insufficient resources", err_code=10074)
    assert reason(described) == "insufficient resources (err_code 10074)"
