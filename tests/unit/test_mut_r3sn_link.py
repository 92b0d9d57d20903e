"""NatsLink.call's message when the coroutine itself times out (nats-py's own deadline, a builtin TimeoutError), as
its docstring says: "NATS timed out <what> after <s> s (<ErrorClass>[: <text>]; <url>)", the ": <text>" part only
when the error has a text."""

from __future__ import annotations

import re

import pytest

from kvservice.state.nats.config import StoreError

from .test_nats_store import link  # noqa: F401  (fixture)


async def _times_out(err: BaseException):
    raise err


@pytest.mark.parametrize(("err", "shown"), [(TimeoutError(), "TimeoutError"),
                                            (TimeoutError("deadline passed"), "TimeoutError: deadline passed")])
def test_a_timeout_inside_the_call_names_what_how_long_the_error_and_the_url(link, err, shown):  # noqa: F811
    """A coroutine raising TimeoutError (no text / with text) -> StoreError with exactly that shape; no ": " part
    for an error without text."""
    with pytest.raises(StoreError) as caught:
        link.call(_times_out(err), 30.0, "reading the thing")
    tail = re.escape(f"({shown}; {link.config.url})")
    pattern = r"NATS timed out reading the thing after \d+\.\d\d s " + tail
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)
