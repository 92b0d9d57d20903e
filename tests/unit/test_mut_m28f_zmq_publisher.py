"""ZmqPublisher beyond its happy path, in process: publishers of one pool that differ in format, medium, data
parallel rank or token ids each send their own encoding of the same batch (decoded by vLLM's own structs,
tests/vllm_ref.py), although the batch caches encodings; and the start-up warning about sockets reachable from
other machines (events/zmq.py's access rules)."""

from __future__ import annotations

import itertools
import logging

import msgspec
import numpy as np
import pytest
import zmq
import zmq.auth as zmq_auth

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.events.zmq import ZmqConfig, ZmqPublisher
from kvservice.events.zmq_guard import CurveKeys
from kvservice.manager.pools import BlockManager
from tests.vllm_ref import module

PS = 4
_names = itertools.count()


def _manager() -> BlockManager:
    m = BlockManager()
    m.create_pool("p", CacheSpec.uniform(2, 1, 64, page_size=PS), Sizing(num_slots=32, max_seq_len=64),
                  prefix_caching=True)
    return m


def _close(pub: ZmqPublisher) -> None:
    if pub._sub is not None:
        pub._sub.close()
    pub._close_sockets()


def test_publishers_of_one_pool_each_send_their_own_encoding():
    """Five publishers of pool p: (0.33, GPU, rank 0, tokens), then each differing from it in one setting only:
    format 0.11, medium CPU, rank 3, no tokens. The batch they share caches each encoding; every subscriber still
    gets exactly its publisher's format, medium, rank and tokens, under its topic."""
    m = _manager()
    cfgs = [dict(), dict(fmt="vllm-0.11"), dict(medium="CPU"), dict(data_parallel_rank=3), dict(token_ids=False)]
    pubs, subs = [], []
    try:
        for i, kw in enumerate(cfgs):
            pub = ZmqPublisher(m.events, ZmqConfig("p", f"inproc://kv-pub-m28f-enc-{next(_names)}",
                                                   topic=f"t{i}/{{pool}}", **kw))
            pubs.append(pub)
            s = zmq.Context.instance().socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(pub.bound_endpoint)
            subs.append(s)
            pub._step()                                          # subscribed from the next batch on
        tokens = np.random.default_rng(31).integers(1, 30_000, 2 * PS + 3)
        pool, lock = m.pool_and_lock("p")
        with lock:
            pool.step(admit_ids=[7], admit_token_ids=tokens, admit_tokens=[len(tokens)])
            m.events.after_step(pool, [len(tokens)], True)
        for i, (pub, s, kw) in enumerate(zip(pubs, subs, cfgs, strict=True)):
            pub._step()
            assert pub.published == 1 and s.poll(5000)
            topic, seq, payload = s.recv_multipart()
            assert (topic, seq) == (f"t{i}/p".encode(), (1).to_bytes(8, "big"))
            fmt = kw.get("fmt", "vllm-0.33")
            kv = module("0.33.0" if fmt == "vllm-0.33" else "0.11.0", "vllm.distributed.kv_events")
            batch = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(payload)
            (stored,) = batch.events
            assert batch.data_parallel_rank == kw.get("data_parallel_rank", 0)
            assert stored.medium == kw.get("medium", "GPU") and stored.block_size == PS
            assert stored.token_ids == (tokens[:2 * PS].tolist() if kw.get("token_ids", True) else [])
            assert len(stored.block_hashes) == 2
            assert (stored.lora_id, stored.parent_block_hash) == (None, None)
            if fmt == "vllm-0.33":                              # no LoRA: null on the wire, as vLLM sends it
                assert (stored.lora_name, stored.extra_keys, stored.kv_cache_spec_sliding_window) == (None, None, None)
            assert hasattr(stored, "group_idx") is (fmt == "vllm-0.33")
    finally:
        for s in subs:
            s.close(linger=0)
        for p in pubs:
            _close(p)


def _remote_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "reachable from other machines" in r.getMessage()]


def test_sockets_bound_off_loopback_are_warned_about_with_what_to_do(caplog):
    """allow_remote with plaintext: one warning naming each bound socket off loopback and the CURVE flags; a PUB
    that connects (to a remote collector, which binds) is not named; loopback sockets: no warning."""
    m = _manager()
    with caplog.at_level(logging.INFO, logger="kvservice.events"):
        pub = ZmqPublisher(m.events, ZmqConfig("p", "tcp://0.0.0.0:*", replay_endpoint="tcp://0.0.0.0:*",
                                               allow_remote=True))
    try:
        for e in (pub.bound_endpoint, pub.bound_replay_endpoint):        # the "*" port resolved
            assert e.startswith("tcp://0.0.0.0:") and 0 < int(e.rsplit(":", 1)[1]) < 65536
        assert pub.bound_replay_endpoint != pub.bound_endpoint
        assert _remote_lines(caplog) == [
            f"kv events of pool 'p': {pub.bound_endpoint} and {pub.bound_replay_endpoint} reachable from other "
            "machines (--kv-events-allow-remote); anyone who reaches them reads the pool's cache; use "
            "--kv-events-curve-*"]
    finally:
        _close(pub)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvservice.events"):
        pub = ZmqPublisher(m.events, ZmqConfig("p", "tcp://192.0.2.1:5557", mode="connect",
                                               replay_endpoint="tcp://0.0.0.0:*", allow_remote=True))
    try:
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv events of pool 'p' (")] == [
            "kv events of pool 'p' (vllm-0.33): PUB connecting to tcp://192.0.2.1:5557, topic '', plaintext"]
        assert _remote_lines(caplog) == [
            f"kv events of pool 'p': {pub.bound_replay_endpoint} reachable from other machines "
            "(--kv-events-allow-remote); anyone who reaches them reads the pool's cache; use --kv-events-curve-*"]
    finally:
        _close(pub)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvservice.events"):
        pub = ZmqPublisher(m.events, ZmqConfig("p", "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                               allow_remote=True))
    try:
        assert _remote_lines(caplog) == []
    finally:
        _close(pub)


@pytest.mark.parametrize("token_ids", [True, False])
def test_curve_sockets_off_loopback_are_named_without_the_plaintext_advice(caplog, tmp_path, token_ids):
    """With CURVE the start-up lines say which client keys are admitted, and the remote warning names the socket
    but gives no CURVE advice."""
    _, secret_file = zmq_auth.create_certificates(str(tmp_path), "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    zmq_auth.create_certificates(str(clients), "sub")
    keys = CurveKeys.load(secret_file, str(clients))
    m = _manager()
    with caplog.at_level(logging.INFO, logger="kvservice.events"):
        pub = ZmqPublisher(m.events, ZmqConfig("p", "tcp://0.0.0.0:*", allow_remote=True, curve=keys,
                                               token_ids=token_ids, topic="x"))
    try:
        access = f"CURVE, {clients} admitted" + ("" if token_ids else ", hashes only (no token ids)")
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv events of pool")] == [
            f"kv events of pool 'p' (vllm-0.33): PUB bound to {pub.bound_endpoint}, topic 'x', {access}",
            f"kv events of pool 'p': {pub.bound_endpoint} reachable from other machines (--kv-events-allow-remote)"]
        assert [r.levelno for r in caplog.records if r.getMessage().startswith("kv events of pool")] == [
            logging.INFO, logging.WARNING]
    finally:
        _close(pub)
