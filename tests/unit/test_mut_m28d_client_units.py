"""kvservice/client/client.py's channel and call pieces without a server, against written-out expectations: the
channel options (message limit 256 MiB, reconnect backoff 100 ms .. 2 s, the TLS name override, the retry service
config last), bearer metadata, request ids, and the RetryPolicy a client builds from its arguments.
"""

from __future__ import annotations

import json

import grpc

from kvservice.client import client as cl
from kvservice.client.client import BlockManagerClient, TLSOptions
from kvservice.client.deadline import RetryPolicy

BASE = [("grpc.max_receive_message_length", 256 * 1024 * 1024), ("grpc.max_send_message_length", 256 * 1024 * 1024),
        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000)]


def test_channel_options_list_limits_then_the_tls_name_then_the_service_config():
    assert cl.channel_options() == BASE
    assert cl.channel_options(TLSOptions()) == BASE
    assert cl.channel_options(TLSOptions(server_name="")) == BASE
    named = TLSOptions(server_name="mgr.internal")
    assert cl.channel_options(named) == [*BASE, ("grpc.ssl_target_name_override", "mgr.internal")]
    cfg = '{"methodConfig": []}'
    assert cl.channel_options(named, cfg) == [*BASE, ("grpc.ssl_target_name_override", "mgr.internal"),
                                              ("grpc.service_config", cfg)]
    assert cl.channel_options(None, cfg) == [*BASE, ("grpc.service_config", cfg)]
    assert cl.channel_options(None, "") == BASE
    cl.channel_options(named, cfg).append("x")
    assert cl.CHANNEL_OPTIONS == BASE                                         # a fresh list each time


def test_bearer_metadata_and_request_ids():
    assert cl.auth_metadata(None) is None and cl.auth_metadata("") is None
    assert cl.auth_metadata("tok-1") == (("authorization", "Bearer tok-1"),)
    ids = {cl.new_request_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_a_client_builds_its_policy_from_retries_retry_and_failover():
    def policy(**kw) -> RetryPolicy:
        with BlockManagerClient("127.0.0.1:1", **kw) as c:
            assert c.target == "127.0.0.1:1"
            return c.retry
    assert policy() == RetryPolicy()
    assert policy(retries=0) == RetryPolicy(attempts=1)
    assert policy(retries=3) == RetryPolicy(attempts=4)
    assert policy(retries=3, failover=7.0) == RetryPolicy(attempts=4, failover=7.0)
    mine = RetryPolicy(attempts=2, initial_backoff=0.5)
    assert policy(retry=mine, retries=9) is mine
    assert policy(retry=mine, failover=1.5) == RetryPolicy(attempts=2, initial_backoff=0.5, failover=1.5)
    with BlockManagerClient("127.0.0.1:1", timeout=4.5, token="t") as c:
        assert c.timeout == 4.5 and c._metadata == (("authorization", "Bearer t"),)


def test_make_channel_carries_the_service_config_a_grpc_client_can_parse():
    cfg = RetryPolicy(grpc_attempts=2).service_config(cl.SERVICE)
    ch = cl.make_channel("127.0.0.1:1", None, cfg)
    try:
        assert isinstance(ch, grpc.Channel)
    finally:
        ch.close()
    assert json.loads(cfg)["methodConfig"][0]["retryPolicy"]["maxAttempts"] == 2
    sec = cl.make_channel("127.0.0.1:1", TLSOptions(server_name="n"), cfg)
    sec.close()
