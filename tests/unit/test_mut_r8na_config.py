"""parse_state_url takes exactly nats://HOST:PORT per comma-separated server (kvservice/state/nats/config.py
docstring and its refusal message): a server written with a second "://" is not HOST:PORT and is refused naming it,
however the rest of it reads."""

from __future__ import annotations

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.state.nats.config import parse_state_url


@pytest.mark.parametrize("part", ["nats://h:1://x:2", "nats://a.example:4222://b:4223"])
def test_a_server_with_a_second_scheme_separator_is_refused_naming_it(part):
    with pytest.raises(InvalidArgument) as err:
        parse_state_url(f"nats://ok.example:4222,{part}")
    assert err.value.message == f"--state: {part!r} is not nats://HOST:PORT"


def test_servers_keep_their_scheme_and_lose_trailing_slashes():
    assert parse_state_url("nats://h1:4222//,h2:5/").servers == ("nats://h1:4222", "nats://h2:5")
