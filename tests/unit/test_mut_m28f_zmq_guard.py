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
