"""The --kv-events-zmq / --kv-events-replay flags, parsed by their documented grammar ``[POOL=][bind:|connect:]
ENDPOINT`` (no POOL = the default pool, no mode = vLLM's rule), and the bind check on what they would open; without
starting a socket. The sockets themselves are tests/integration/test_kv_events_access.py."""

from __future__ import annotations

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.events.zmq import check_access, zmq_configs


def test_flags_split_into_pool_mode_and_endpoint():
    cs = zmq_configs(["a=bind:ipc:///tmp/kv=a.sock", "connect:tcp://127.0.0.1:5557",
                      "b=ipc:///tmp/kv-b.sock"], ["a=tcp://127.0.0.1:5600"], "dflt")
    got = {c.pool: (c.endpoint, c.mode, c.replay_endpoint, c.binds) for c in cs}
    assert got == {"a": ("ipc:///tmp/kv=a.sock", "bind", "tcp://127.0.0.1:5600", True),   # "=" in the endpoint
                   "dflt": ("tcp://127.0.0.1:5557", "connect", "", False),
                   "b": ("ipc:///tmp/kv-b.sock", "auto", "", True)}                     # ipc: vLLM's rule binds


def test_a_pool_published_twice_or_a_replay_without_a_publisher_is_named():
    with pytest.raises(InvalidArgument, match="pool 'a' is published twice"):
        zmq_configs(["a=tcp://127.0.0.1:1", "a=tcp://127.0.0.1:2"], [], "d")
    with pytest.raises(InvalidArgument, match="pool 'z' has no --kv-events-zmq publisher"):
        zmq_configs(["a=tcp://127.0.0.1:1"], ["z=tcp://127.0.0.1:3"], "d")


def test_check_access_refuses_a_remote_bind_and_names_the_endpoint():
    (local,) = zmq_configs(["bind:tcp://127.0.0.1:5557"], [], "p")            # zmq_configs checks each publisher
    check_access(local)
    with pytest.raises(InvalidArgument, match=r"--kv-events-zmq tcp://0\.0\.0\.0:5557 would bind"):
        zmq_configs(["bind:tcp://0.0.0.0:5557"], [], "p")
    (allowed,) = zmq_configs(["bind:tcp://0.0.0.0:5557"], [], "p", allow_remote=True)
    check_access(allowed)
    with pytest.raises(InvalidArgument, match=r"--kv-events-replay tcp://0\.0\.0\.0:5600 would bind"):
        zmq_configs(["tcp://127.0.0.1:5557"], ["p=tcp://0.0.0.0:5600"], "p")
