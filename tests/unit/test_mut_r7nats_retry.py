"""retry_startup's whole contract on a clock only its sleeps move (kvservice/state/nats/config.py docstring): a
StoreError is retried, each one logged as a WARNING "<what>: <message>; retrying", sleeping 0.2 s doubling to at
most 2 s, for as long as the next sleep ends by the deadline; then StoreError
"<what>: still failing after <seconds> s: <message>" (a plain StoreError, not the last one raised). JournalGap, Fenced
and Unrecoverable are raised at once, untried again; other exceptions pass through."""

from __future__ import annotations

import logging

import pytest

from kvservice.state.nats import config as nats_config
from kvservice.state.nats.config import Fenced, JournalGap, StoreError, Unrecoverable

from .test_nats_edges import FakeTime


class Refusing:
    def __init__(self, errors, result="ok") -> None:
        self.errors, self.result, self.calls = list(errors), result, 0

    def __call__(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.result


@pytest.fixture
def clock(monkeypatch):
    c = FakeTime()
    monkeypatch.setattr(nats_config, "time", c)
    return c


def test_each_retry_is_logged_in_the_errors_words(clock, caplog):
    attempt = Refusing([StoreError("not elected 1"), StoreError("not elected 2")])
    with caplog.at_level(logging.DEBUG, logger="kvservice.nats"):
        assert nats_config.retry_startup("opening x", attempt, seconds=60.0) == "ok"
    assert attempt.calls == 3 and clock.sleeps == pytest.approx([0.2, 0.4])
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvservice.nats"] == [
        (logging.WARNING, "opening x: not elected 1; retrying"),
        (logging.WARNING, "opening x: not elected 2; retrying")]


@pytest.mark.parametrize("kind", [JournalGap, Fenced, Unrecoverable])
def test_the_errors_a_retry_cannot_mend_are_raised_at_once(clock, kind):
    err = kind("as it is " + kind.__name__)
    attempt = Refusing([err])
    with pytest.raises(kind) as caught:
        nats_config.retry_startup("x", attempt, seconds=60.0)
    assert caught.value is err and attempt.calls == 1 and clock.sleeps == []


def test_other_errors_pass_through_untried(clock):
    attempt = Refusing([ValueError("a bug")])
    with pytest.raises(ValueError, match=r"^a bug$"):
        nats_config.retry_startup("x", attempt, seconds=60.0)
    assert attempt.calls == 1 and clock.sleeps == []


def test_tries_go_on_while_the_next_sleep_ends_by_the_deadline_then_the_refusal_names_the_last_error(clock):
    """seconds=0.75: tries at +0, +0.2 and +0.6 (0.6 + 0.8 passes the deadline): three tries, then the refusal;
    seconds=0.5: two (0.2 + 0.4 passes it)."""
    attempt = Refusing([StoreError(f"no {i}") for i in range(10)])
    with pytest.raises(StoreError) as caught:
        nats_config.retry_startup("opening y", attempt, seconds=0.75)
    assert type(caught.value) is StoreError
    assert caught.value.message == "opening y: still failing after 0.75 s: no 2"
    assert attempt.calls == 3 and clock.sleeps == pytest.approx([0.2, 0.4])
    attempt = Refusing([StoreError(f"no {i}") for i in range(10)])
    clock.sleeps.clear()
    with pytest.raises(StoreError, match=r"^opening y: still failing after 0.5 s: no 1$"):
        nats_config.retry_startup("opening y", attempt, seconds=0.5)
    assert attempt.calls == 2


def test_a_sleep_that_ends_exactly_at_the_deadline_is_still_taken(clock):
    """seconds=0.2: the first sleep (0.2 s) ends exactly at the deadline: one more try, then the refusal."""
    attempt = Refusing([StoreError(f"no {i}") for i in range(10)])
    with pytest.raises(StoreError, match=r"^z: still failing after 0.2 s: no 1$"):
        nats_config.retry_startup("z", attempt, seconds=0.2)
    assert attempt.calls == 2 and clock.sleeps == pytest.approx([0.2])


def test_the_default_is_sixty_seconds(clock):
    """Without seconds: tries go on while the next sleep ends within 60 s (0.2+0.4+0.8+1.6 then 2 s each)."""
    attempt = Refusing([StoreError(f"no {i}") for i in range(100)])
    with pytest.raises(StoreError) as caught:
        nats_config.retry_startup("w", attempt)
    assert caught.value.message == f"w: still failing after 60 s: no {attempt.calls - 1}"
    assert sum(clock.sleeps) <= 60.0 < sum(clock.sleeps) + 2.0 and attempt.calls == 33
