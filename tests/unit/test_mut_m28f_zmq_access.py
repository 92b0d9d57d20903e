"""CurveKeys.load's refusals and check_access's whole messages (events/zmq_guard.py, events/zmq.py): each names
the flag and the file or endpoint, and says what to do."""

from __future__ import annotations

import pytest
import zmq.auth as zmq_auth

from kvservice.contract.errors import InvalidArgument
from kvservice.events.zmq import ZmqConfig, check_access
from kvservice.events.zmq_guard import CurveKeys


@pytest.fixture
def certs(tmp_path):
    public_file, secret_file = zmq_auth.create_certificates(str(tmp_path), "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    zmq_auth.create_certificates(str(clients), "sub")
    return public_file, secret_file, str(clients)


@pytest.mark.parametrize("which", ["secret", "clients", "both"])
def test_the_two_curve_flags_go_together(certs, which):
    _, secret_file, clients = certs
    args = {"secret": ("", clients), "clients": (secret_file, ""), "both": ("", "")}[which]
    with pytest.raises(InvalidArgument) as err:
        CurveKeys.load(*args)
    assert str(err.value) == "--kv-events-curve-secret and --kv-events-curve-clients go together"


def test_an_unreadable_secret_file_is_named_with_how_to_make_one(certs, tmp_path):
    _, _, clients = certs
    for bad in (str(tmp_path / "missing.key_secret"), str(tmp_path / "garbage.key_secret")):
        if "garbage" in bad:
            (tmp_path / "garbage.key_secret").write_bytes(b"\xff\xfe not a certificate \x00")
        with pytest.raises(InvalidArgument) as err:
            CurveKeys.load(bad, clients)
        msg = str(err.value)
        assert msg.startswith(f"--kv-events-curve-secret {bad}: not a readable CURVE certificate (")
        assert msg.endswith("); make one with python -c \"import zmq.auth; "
                            "zmq.auth.create_certificates('DIR', 'server')\"")
        assert err.value.__cause__ is None and err.value.__suppress_context__


def test_a_public_key_file_given_as_the_secret_is_refused(certs):
    public_file, _, clients = certs
    with pytest.raises(InvalidArgument) as err:
        CurveKeys.load(public_file, clients)
    assert str(err.value) == (f"--kv-events-curve-secret {public_file} holds no secret key (a public .key file?): "
                              "give the server's .key_secret file")


def test_the_loaded_keys_are_the_certificate_files(certs):
    public_file, secret_file, clients = certs
    keys = CurveKeys.load(secret_file, clients)
    public, secret = zmq_auth.load_certificate(secret_file)
    assert (keys.public, keys.secret, keys.clients_dir) == (public, secret, clients)
    assert zmq_auth.load_certificate(public_file) == (public, None)


def test_curve_on_a_connecting_pub_is_refused_with_the_whole_fix(certs):
    _, secret_file, clients = certs
    keys = CurveKeys.load(secret_file, clients)
    with pytest.raises(InvalidArgument) as err:
        check_access(ZmqConfig("p", "tcp://127.0.0.1:5557", curve=keys))
    assert str(err.value) == (
        "--kv-events-zmq tcp://127.0.0.1:5557 connects to a collector; --kv-events-curve-* secures the sockets this "
        "manager binds: bind the PUB (bind:ENDPOINT) for subscribers to connect with CURVE, or drop the CURVE flags")
    check_access(ZmqConfig("p", "tcp://127.0.0.1:5557", mode="bind", curve=keys))       # bound: fine


@pytest.mark.parametrize(("cfg", "flag", "endpoint"), [
    (ZmqConfig("p", "tcp://*:5557"), "--kv-events-zmq", "tcp://*:5557"),
    (ZmqConfig("p", "tcp://10.0.0.1:5557", mode="bind"), "--kv-events-zmq", "tcp://10.0.0.1:5557"),
    (ZmqConfig("p", "tcp://10.0.0.1:5557", replay_endpoint="tcp://0.0.0.0:5558"), "--kv-events-replay",
     "tcp://0.0.0.0:5558"),
])
def test_a_remote_bind_names_its_flag_and_endpoint(cfg, flag, endpoint):
    """The PUB is checked when bound (a connecting one is the collector's choice); the replay socket always."""
    with pytest.raises(InvalidArgument) as err:
        check_access(cfg)
    assert str(err.value).startswith(f"{flag} {endpoint} would bind a ZeroMQ socket reachable from other machines")
    check_access(ZmqConfig(**{**{f: getattr(cfg, f) for f in ("pool", "endpoint", "replay_endpoint", "mode")},
                              "allow_remote": True}))


def test_a_clients_dir_without_public_keys_is_refused_with_what_to_copy(certs, tmp_path):
    _, secret_file, _ = certs
    empty = tmp_path / "empty"
    empty.mkdir()
    for d in (str(empty), str(tmp_path / "absent")):
        with pytest.raises(InvalidArgument) as err:
            CurveKeys.load(secret_file, d)
        assert str(err.value) == (f"--kv-events-curve-clients {d}: a directory with at least one client public key "
                                  "(*.key) is needed; copy each subscriber's NAME.key there")


@pytest.mark.parametrize(("rate", "burst"), [(-0.5, 3), (1.0, 0), (-1.0, -2)])
def test_bad_replay_limits_are_refused_with_both_values(rate, burst):
    from kvservice.events.zmq_guard import ReplayLimiter
    with pytest.raises(InvalidArgument) as err:
        ReplayLimiter(rate, burst)
    assert str(err.value) == (f"--kv-events-replay-rate must be >= 0 and --kv-events-replay-burst >= 1, got {rate} "
                              f"and {burst}")
