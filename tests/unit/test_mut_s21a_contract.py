"""kvservice/contract/errors.py's StateError (seed-21 survivor): its documented fields.

The class docstring: "The message says what is wrong and what to do; ``problems`` lists every finding of a
check." A StateError raised with one message lists that message as its one problem; one given its findings lists
them all, as its own list (the caller's list may change later). Like every KVError it keeps its message (also its
str()), its reason (STATE_ERROR unless given) and its metadata as strings.
"""

from __future__ import annotations

from kvservice.contract.errors import KVError, StateError


def test_a_state_error_lists_its_message_as_its_one_problem_by_default():
    err = StateError("state dir /s is busy; stop the other manager")
    assert isinstance(err, KVError)
    assert (err.message, str(err), err.reason, err.metadata) == \
        ("state dir /s is busy; stop the other manager", "state dir /s is busy; stop the other manager",
         "STATE_ERROR", {})
    assert err.problems == ["state dir /s is busy; stop the other manager"]
    assert StateError("m", problems=[]).problems == ["m"]                  # no findings given: the message


def test_a_state_error_keeps_its_own_copy_of_every_finding():
    found = ["journal.db: 3 entries missing", "snapshot 7: checksum mismatch", "ackmark: behind the journal"]
    err = StateError("the state dir is damaged; run check-state --repair", "STATE_DAMAGED", found, entries=3)
    assert (err.message, err.reason, err.metadata) == \
        ("the state dir is damaged; run check-state --repair", "STATE_DAMAGED", {"entries": "3"})
    assert err.problems == found and err.problems is not found
    found.append("later")
    assert err.problems == ["journal.db: 3 entries missing", "snapshot 7: checksum mismatch",
                            "ackmark: behind the journal"]
