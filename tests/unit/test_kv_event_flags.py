"""The --kv-events-zmq / --kv-events-replay flags, parsed by their documented grammar ``[POOL=][bind:|connect:]
ENDPOINT`` (no POOL = the default pool, no mode = vLLM's rule), and the bind check on what they would open; without
starting a socket. The sockets themselves are tests/integration/test_kv_events_access.py."""

from __future__ import annotations

import pytest

from kvservice.contract.errors import InvalidArgument
from kvservice.events.zmq import ZmqConfig, check_access, zmq_configs
from kvservice.events.zmq_guard import CurveKeys


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


@pytest.mark.parametrize("endpoint, binds", [
    ("tcp://*:5557", True), ("tcp://[::]:5557", True), ("ipc:///tmp/kv.sock", True), ("inproc://kv", True),
    ("tcp://127.0.0.1:5557", False), ("tcp://collector.example:5557", False)])
def test_auto_mode_follows_vllms_bind_or_connect_rule(endpoint, binds):
    # vLLM's ZmqEventPublisher binds an endpoint holding "*" or "::", or an ipc:// / inproc:// one; else connects
    assert ZmqConfig("p", endpoint, allow_remote=True).binds is binds
    assert ZmqConfig("p", endpoint, mode="connect").binds is False
    assert ZmqConfig("p", endpoint, mode="bind").binds is True


def test_curve_on_a_pub_that_connects_is_refused_with_the_fix(tmp_path):
    zmq_auth = pytest.importorskip("zmq.auth")
    _, secret_file = zmq_auth.create_certificates(str(tmp_path), "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    zmq_auth.create_certificates(str(clients), "sub")
    keys = CurveKeys.load(secret_file, str(clients))
    text = open(secret_file).read()
    assert keys.public.decode() in text and keys.secret.decode() in text and len(keys.secret) == 40   # z85 of 32 B
    with pytest.raises(InvalidArgument, match=r"--kv-events-zmq tcp://127\.0\.0\.1:5557 connects to a collector; "
                       r".*connect with CURVE, or drop the CURVE flags"):
        check_access(ZmqConfig("p", "tcp://127.0.0.1:5557", curve=keys))


def test_curve_clients_dir_needs_a_public_key_file(tmp_path):
    zmq_auth = pytest.importorskip("zmq.auth")
    _, secret_file = zmq_auth.create_certificates(str(tmp_path), "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "sub.key_secret").write_text("not a public key file")
    with pytest.raises(InvalidArgument, match=r"--kv-events-curve-clients .*clients: a directory with at least one"):
        CurveKeys.load(secret_file, str(clients))
    (clients / "sub.key").write_text("")
    assert CurveKeys.load(secret_file, str(clients)).clients_dir == str(clients)
