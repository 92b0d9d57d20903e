"""Replication settings refuse bad input with a clear message (no NATS server needed)."""

import subprocess
import sys

import pytest

from kvservice.client.ha import LeaderClient, leader_epoch
from kvservice.contract.errors import InvalidArgument
from kvservice.state.nats.journal import NatsConfig, parse_state_url
from kvservice.state.nats.leader import Holder, LeaseConfig

from ..integration.conftest import ROOT


def test_state_urls():
    c = parse_state_url("nats://a.example:4222,b.example:4223,nats://10.0.0.3:4222/", name="prod", replicas=3)
    assert c.servers == ("nats://a.example:4222", "nats://b.example:4223", "nats://10.0.0.3:4222")
    assert (c.stream, c.subject, c.snapshot_bucket, c.leader_bucket) == (
        "KVS_prod", "kvs.prod.journal", "KVS_prod_snapshots", "KVS_prod_leader")
    # host names are case-insensitive (RFC 4343): upper case, Kubernetes' service names, IPv6 in brackets
    c = parse_state_url("nats://NATS-0.KV.Svc:4222,Nats_1:4223,nats://[fd00::A1]:4222")
    assert c.servers == ("nats://NATS-0.KV.Svc:4222", "nats://Nats_1:4223", "nats://[fd00::A1]:4222")
    for bad, words in [("http://a:4222", "expected 'memory' or nats://"), ("nats://a", "is not nats://HOST:PORT"),
                       ("nats://a:4222,b c:1", "is not nats://HOST:PORT"), ("nats://,", "is not nats://HOST:PORT")]:
        with pytest.raises(InvalidArgument, match=words):
            parse_state_url(bad)


def test_nats_config_limits():
    with pytest.raises(InvalidArgument, match="at least one NATS server"):
        NatsConfig(())
    with pytest.raises(InvalidArgument, match="must match"):
        NatsConfig(("nats://a:1",), name="has.dot")
    with pytest.raises(InvalidArgument, match="odd size"):
        NatsConfig(("nats://a:1",), replicas=2)
    with pytest.raises(InvalidArgument, match="append_seconds"):
        NatsConfig(("nats://a:1",), request_seconds=5, append_seconds=1)


def test_lease_config_limits():
    LeaseConfig()                                              # the defaults hold
    with pytest.raises(InvalidArgument, match="miss two renewals"):
        LeaseConfig(ttl_seconds=2.0, renew_seconds=1.0)
    with pytest.raises(InvalidArgument, match="margin_seconds"):
        LeaseConfig(ttl_seconds=2.0, margin_seconds=0.6)
    with pytest.raises(InvalidArgument, match="poll_seconds"):
        LeaseConfig(poll_seconds=0)


def test_a_leader_key_that_is_not_ours_is_read_as_unknown():
    assert Holder.parse(b'{"node": "m0", "address": "10.0.0.1:50051", "epoch": 7}', 12) == \
        Holder("m0", "10.0.0.1:50051", 7, 12)
    assert Holder.parse(b"\xff not json", 3) == Holder("?", "", 0, 3)


def test_leader_client_arguments_and_epoch_metadata():
    with pytest.raises(ValueError, match="at least one"):
        LeaderClient(" , ")
    assert leader_epoch((("kvservice-leader-epoch", "12"), ("x", "y"))) == 12
    assert leader_epoch((("kvservice-leader-epoch", "twelve"),)) is None
    assert leader_epoch(()) is None


@pytest.mark.parametrize("args, words", [
    (["--state", "s3://bucket"], "expected 'memory' or nats://"),
    (["--state", "nats://a:4222", "--state-dir", "/tmp/x"], "exclude each other"),
])
def test_serve_refuses_bad_state_flags(args, words):
    out = subprocess.run([sys.executable, "-m", "kvservice.server.cli", "serve", "--metrics-port", "-1", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and words in out.stderr, out.stderr


def test_wait_ready_names_the_addresses_and_the_timeout_when_none_answers():
    """Two addresses bound but not listening: no connection is ever accepted, so wait_ready gives up with UNAVAILABLE
    naming both and its timeout (the socket is held, so no other process answers on that port meanwhile)."""
    import socket

    import grpc

    from kvservice.client.codec import ClientError
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(2)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        target = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in socks)
        c = LeaderClient(target)
        try:
            with pytest.raises(ClientError) as err:
                c.wait_ready(timeout=0.4)
        finally:
            c.close()
    finally:
        for s in socks:
            s.close()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.message == f"no manager answered at {target} within 0 s"
