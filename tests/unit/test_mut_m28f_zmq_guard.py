"""zmq_guard.peer_of on frames real sockets received (events/zmq_guard.py: a peer is its CURVE key, else its IP
address, else its routing id), and the replay limiter keyed by it: each peer its own bucket."""

from __future__ import annotations

import itertools

import pytest
import zmq
import zmq.auth as zmq_auth
from zmq.utils import z85

from kvservice.events.zmq_guard import CurveKeys, peer_of

_names = itertools.count()


def _exchange(router: zmq.Socket, dealer: zmq.Socket) -> tuple[bytes, zmq.Frame]:
    dealer.send_multipart([b"", b"12345678"])
    assert router.poll(5000)
    frames = router.recv_multipart(copy=False)
    assert len(frames) == 3
    return frames[0].bytes, frames[2]


def test_a_loopback_tcp_peer_is_its_ip_address():
    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind("tcp://127.0.0.1:*")
        dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
        ident, frame = _exchange(router, dealer)
        assert peer_of(frame, ident) == b"Peer-Address:127.0.0.1"
    finally:
        router.close(linger=0)
        dealer.close(linger=0)


def test_an_inproc_peer_is_its_routing_id_and_a_local_frame_too():
    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"dealer-\x07")
    try:
        router.bind(f"inproc://m28f-peer-{next(_names)}")
        dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
        ident, frame = _exchange(router, dealer)
        assert ident == b"dealer-\x07"
        assert peer_of(frame, ident) == b"id:dealer-\x07"
        assert peer_of(zmq.Frame(b"never received"), b"r1") == b"id:r1"
    finally:
        router.close(linger=0)
        dealer.close(linger=0)


@pytest.mark.parametrize("client", ["alice", "bob"])
def test_a_curve_peer_is_its_client_key(tmp_path, client):
    """Under CURVE the ZAP handler names the client by its public key (z85): two clients are two peers, whatever
    address they share."""
    _, secret_file = zmq_auth.create_certificates(str(tmp_path), "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    pub_files = {n: zmq_auth.create_certificates(str(clients), n) for n in ("alice", "bob")}
    keys = CurveKeys.load(secret_file, str(clients))
    ctx = zmq.Context()
    auth = keys.authenticator(ctx)
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        keys.serve(router)
        router.bind("tcp://127.0.0.1:*")
        c_public, c_secret = zmq_auth.load_certificate(pub_files[client][1])
        dealer.curve_secretkey, dealer.curve_publickey, dealer.curve_serverkey = c_secret, c_public, keys.public
        dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
        ident, frame = _exchange(router, dealer)
        assert peer_of(frame, ident) == b"User-Id:" + c_public
        assert len(z85.decode(c_public)) == 32
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        auth.stop()
        ctx.term()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_default_limits_are_the_documented_ones():
    """docs/operations.md: 2 requests/s and bursts of 10 per peer, 8 x that for all peers, 4,096 peers
    remembered (numbers written out here, not read from the module)."""
    from kvservice.events.zmq_guard import ReplayLimiter
    clock = _Clock()
    lim = ReplayLimiter(clock=clock)
    assert [lim.allow(b"a") for _ in range(11)] == [True] * 10 + [False]
    clock.now += 0.5                                                  # 2/s: one back
    assert [lim.allow(b"a") for _ in range(2)] == [True, False]
    clock.now += 100.0                                                # everything full again
    got = [lim.allow(f"10.1.{i}".encode()) for i in range(200)]       # 200 peers: the shared 8 x 10 = 80 first
    assert got.count(True) == 80 and got[:8] == [True] * 8 and not any(got[80:])
    clock.now += 1.0                                                  # shared: 8 x 2 = 16 back
    assert [lim.allow(f"10.2.{i}".encode()) for i in range(40)].count(True) == 16
    assert (lim.allowed, lim.refused) == (10 + 1 + 80 + 16, 1 + 1 + 120 + 24)
    for i in range(4100):                                             # each second: shared refilled
        clock.now += 1.0
        assert lim.allow(f"p{i}".encode())
    assert len(lim._buckets) == 4096 and b"p3" not in lim._buckets and b"p4" in lim._buckets


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://10.1.2.3:*", "tcp://*:5557"])
def test_a_remote_bind_is_refused_with_what_to_do(endpoint):
    from kvservice.contract.errors import InvalidArgument
    from kvservice.events.zmq_guard import check_bind
    with pytest.raises(InvalidArgument) as err:
        check_bind(endpoint, "--some-flag", False)
    assert str(err.value) == (
        f"--some-flag {endpoint} would bind a ZeroMQ socket reachable from other machines, and KV events carry "
        "users' prompt tokens; bind a loopback address (tcp://127.0.0.1:PORT) or ipc://, or pass "
        "--kv-events-allow-remote (with --kv-events-curve-secret and --kv-events-curve-clients to authenticate "
        "subscribers, or --kv-events-no-token-ids to publish hashes only)")
    check_bind(endpoint, "--some-flag", True)                          # asked for: no error
    check_bind("tcp://127.0.0.1:5557", "--some-flag", False)
