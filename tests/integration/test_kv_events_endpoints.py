"""KV event endpoints as collectors deploy them: a collector that binds one endpoint with every manager's
publisher connecting to it (vLLM's rule for a non-wildcard endpoint; llm-d's indexer works this way), and
our publisher binding a given address. Every socket opened is logged."""

from __future__ import annotations

import logging
import socket

import msgspec
import numpy as np
import pytest
import zmq

from kvservice.client import BlockManagerClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.events.zmq import zmq_configs
from kvservice.manager.event_log import EventsConfig
from kvservice.server.app import serve

pytestmark = pytest.mark.integration
PS = 4
SPEC = CacheSpec.uniform(2, 1, 64, page_size=PS)
SIZING = Sizing(num_slots=64, max_seq_len=256)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drive_until(c: BlockManagerClient, pools: list[str], sub: zmq.Socket, want: set[bytes],
                 max_steps: int = 400) -> dict[bytes, list[int]]:
    """Admit and free prompts in every pool, one step at a time, until `sub` got a batch of each topic in
    `want` (ZeroMQ drops what is sent before a connection is up: progress is counted, not timed)."""
    got: dict[bytes, list[int]] = {}
    rng = np.random.default_rng(4)
    for k in range(max_steps):
        for pool in pools:
            tok = rng.integers(1, 30_000, 3 * PS + 1)
            c.step(pool, admit=[k + 1], admit_tokens=[len(tok)], admit_token_ids=tok.tolist(),
                   free=[k] if k else None)
        while sub.poll(20):
            topic, seq, payload = sub.recv_multipart()
            batch = msgspec.msgpack.decode(payload)
            assert isinstance(batch, list) and batch[1][0]["type"] in ("BlockStored", "BlockRemoved")
            got.setdefault(topic, []).append(int.from_bytes(seq, "big"))
        if want <= set(got):
            return got
    raise AssertionError(f"after {max_steps} steps the collector got batches of {sorted(got)}, not {sorted(want)}")


def test_a_collector_that_binds_receives_every_connecting_publisher(caplog):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = _free_port()
    sub.bind(f"tcp://127.0.0.1:{port}")
    caplog.set_level(logging.INFO, logger="kvservice.events")
    # pool a: vLLM's rule (a non-wildcard endpoint is connected); pool b says so explicitly
    flags = [f"a=tcp://127.0.0.1:{port}", f"b=connect:tcp://127.0.0.1:{port}"]
    running = serve("127.0.0.1:0", events=EventsConfig(zmq=zmq_configs(flags, [], "default", "kv@{pool}")))
    try:
        assert all(not p.config.binds for p in running.publishers)
        with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=10) as c:
            for name in ("a", "b"):
                c.create_pool(name, SPEC, SIZING, prefix_caching=True)
            got = _drive_until(c, ["a", "b"], sub, {b"kv@a", b"kv@b"})
        for seqs in got.values():
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)       # each pool's own numbering, in order
        logged = [r.getMessage() for r in caplog.records]
        for pool in ("a", "b"):
            assert any(f"kv events of pool '{pool}'" in m and f"connecting to tcp://127.0.0.1:{port}" in m
                       for m in logged), logged
    finally:
        running.stop(0)
        ctx.destroy(linger=0)


def test_our_publisher_binds_a_given_address_and_subscribers_connect(caplog):
    port = _free_port()
    caplog.set_level(logging.INFO, logger="kvservice.events")
    running = serve("127.0.0.1:0", events=EventsConfig(
        zmq=zmq_configs([f"ev=bind:tcp://127.0.0.1:{port}"], ["ev=tcp://127.0.0.1:*"], "default", "kv@{pool}")))
    ctx = zmq.Context()
    try:
        pub = running.publishers[0]
        assert pub.config.binds and pub.bound_endpoint == f"tcp://127.0.0.1:{port}"
        subs = []
        for _ in range(2):                                  # several subscribers connect to the one bound endpoint
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"kv@ev")
            s.connect(f"tcp://127.0.0.1:{port}")
            subs.append(s)
        with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=10) as c:
            c.create_pool("ev", SPEC, SIZING, prefix_caching=True)
            for s in subs:
                assert b"kv@ev" in _drive_until(c, ["ev"], s, {b"kv@ev"})
        logged = " | ".join(r.getMessage() for r in caplog.records)
        assert f"PUB bound to tcp://127.0.0.1:{port}" in logged and "replay ROUTER bound to tcp://127.0.0.1:" in logged
    finally:
        running.stop(0)
        ctx.destroy(linger=0)


def test_a_publisher_for_a_pool_that_does_not_exist_is_warned_about(caplog):
    caplog.set_level(logging.WARNING, logger="kvservice")
    running = serve("127.0.0.1:0", events=EventsConfig(zmq=zmq_configs(["typo=tcp://127.0.0.1:*"], [], "default")))
    try:
        assert any("--kv-events-zmq names pool 'typo', which does not exist" in r.getMessage()
                   for r in caplog.records)
    finally:
        running.stop(0)


def test_unknown_format_is_refused():
    from kvservice.contract.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"use one of vllm-0\.33, vllm-0\.11"):
        zmq_configs(["tcp://*:1"], [], "default", fmt="vllm-0.2")
