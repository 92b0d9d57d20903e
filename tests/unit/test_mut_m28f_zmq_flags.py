"""zmq_configs' reading of ``[POOL=][bind:|connect:]ENDPOINT`` flags where the endpoint itself holds "=" or ":"
(events/zmq.py): only a plain name before "=" is a pool; only "bind:" / "connect:" in front is a mode."""

from __future__ import annotations

import pytest

from kvservice.events.zmq import ZmqConfig, zmq_configs


@pytest.mark.parametrize(("flag", "want"), [
    ("ipc:///run/kv=1.sock", ("dflt", "ipc:///run/kv=1.sock", "auto")),
    ("bind:ipc:///run/kv=2.sock", ("dflt", "ipc:///run/kv=2.sock", "bind")),
    ("pool-a=connect:tcp://127.0.0.1:5557", ("pool-a", "tcp://127.0.0.1:5557", "connect")),
    ("pool-b=ipc:///run/x=y", ("pool-b", "ipc:///run/x=y", "auto")),
    ("tcp://127.0.0.1:5557", ("dflt", "tcp://127.0.0.1:5557", "auto")),
    ("inproc://a:b=c", ("dflt", "inproc://a:b=c", "auto")),
    ("x:y=tcp://127.0.0.1:5557", ("dflt", "x:y=tcp://127.0.0.1:5557", "auto")),   # "x:y" is no pool name
])
def test_a_flag_is_split_into_pool_endpoint_and_mode(flag, want):
    (c,) = zmq_configs([flag], [], "dflt")
    assert (c.pool, c.endpoint, c.mode) == want
    assert c == ZmqConfig(want[0], want[1], mode=want[2])             # every other field its default


def test_a_replay_endpoint_with_an_equals_sign_goes_to_the_default_pool():
    a, b = zmq_configs(["ipc:///run/p.sock", "q=ipc:///run/q.sock"], ["ipc:///run/r=1.sock", "q=ipc:///run/s"],
                       "p", topic="kv", medium="CPU", fmt="vllm-0.11", token_ids=False, replay_burst=3)
    assert a == ZmqConfig("p", "ipc:///run/p.sock", "ipc:///run/r=1.sock", "kv", "CPU", fmt="vllm-0.11",
                          token_ids=False, replay_burst=3)
    assert b == ZmqConfig("q", "ipc:///run/q.sock", "ipc:///run/s", "kv", "CPU", fmt="vllm-0.11", token_ids=False,
                          replay_burst=3)
