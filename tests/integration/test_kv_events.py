"""KV events end to end.

1. A ZeroMQ subscriber written against vLLM's published event schema (the structs below: vLLM 0.33's field
   names, order, defaults and encoding, written here from that schema, not imported from kvservice) decodes
   every batch of a random workload driven over gRPC, rebuilds the set of cached block hashes per group, and
   after every step it equals the manager's prefix index. A gap forced by dropping a message is recovered
   through the replay socket; a replay from before the ring comes back as a reset.
2. WatchEvents resumed from an old sequence number after a kill -9 of a durable manager yields exactly the
   batches it missed; after a clean restart (snapshot) the same request gets a reset that says so.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import grpc
import msgspec
import numpy as np
import pytest
import zmq

from kvservice.client import BlockManagerClient, ClientError
from kvservice.contract.auth import TokenTable
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.cache_events import apply_events
from kvservice.events.messages import proto_to_events
from kvservice.events.zmq import ZmqConfig
from kvservice.manager.event_log import EventsConfig
from kvservice.server.app import serve
from tests.kv_workload import PS, Workload, client_step_args

from .test_durability import kill9, start

pytestmark = pytest.mark.integration
SPEC = CacheSpec.uniform(2, 1, 64, page_size=PS)
SIZING = Sizing(num_slots=64, max_seq_len=256)

# ---- vLLM 0.33's KV event schema (vllm/distributed/kv_events.py), as a consumer writes it -------------------
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "group_idx", "kv_cache_spec_kind"]     # window: default, left off; extra_keys with a salt


class VllmSubscriber:
    """What a router does with vLLM's events: SUB for the stream, the replay socket for gaps, a set per group."""

    def __init__(self, pub: str, replay: str, topic: bytes) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.replay = self.ctx.socket(zmq.DEALER)      # a DEALER gets every reply of one request (a REQ only one)
        self.replay.connect(replay)
        self.topic = topic
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.encoder = msgspec.msgpack.Encoder()
        self.last_seq = 0
        self.index: dict[int, set[int]] = {}
        self.dropped = self.gaps = self.silent = self.replayed = self.resets = self.stored = self.removed = 0
        self.drop_next = False

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def decode(self, payload: bytes) -> KVEventBatch:
        batch = self.decoder.decode(payload)
        # Byte-exact: the payload is what vLLM's own structs encode for these values (names, order, defaults).
        assert self.encoder.encode(batch) == payload
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0, raw[:1]   # [ts, events, dp rank]
        for ev, r in zip(batch.events, raw[1], strict=True):
            assert isinstance(r, dict) and r["type"] == type(ev).__name__
            if isinstance(ev, BlockStored):
                keys = [*STORED_KEYS[:8], "extra_keys", *STORED_KEYS[8:]] if ev.extra_keys else STORED_KEYS
                assert list(r) == keys
                assert ev.extra_keys is None or len(ev.extra_keys) == len(ev.block_hashes)
                assert ev.group_idx == 0 and ev.kv_cache_spec_kind == "full_attention"
                assert ev.kv_cache_spec_sliding_window is None and ev.medium == "GPU" and ev.lora_id is None
                assert ev.block_size == PS and len(ev.token_ids) == PS * len(ev.block_hashes)
                assert all(isinstance(h, int) and 0 < h < 2**64 for h in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert list(r) == ["type", "block_hashes", "medium", "group_idx"]
        return batch

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.index.clear()
                self.resets += 1
            elif isinstance(ev, BlockStored):
                self.index.setdefault(ev.group_idx, set()).update(ev.block_hashes)
                self.stored += len(ev.block_hashes)
            else:
                self.index.setdefault(ev.group_idx, set()).difference_update(ev.block_hashes)
                self.removed += len(ev.block_hashes)

    def request_replay(self, start: int) -> None:
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert self.replay.poll(5000), "no replay answer"
            _, seq_b, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == -1:
                return
            batch = self.decode(payload)
            is_reset = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
            if seq > self.last_seq or is_reset:
                self.apply(batch)
                self.last_seq = seq
                self.replayed += 1

    def receive_until(self, seq: int, timeout: float = 10.0) -> None:
        """Read until batch `seq` was applied. Told that the manager is at `seq` (its stats), a subscriber that
        hears nothing for a second asks the replay socket (a lost last message shows no gap by itself)."""
        end = time.monotonic() + timeout
        while self.last_seq < seq:
            assert time.monotonic() < end, f"stuck at {self.last_seq} < {seq}"
            if not self.sub.poll(1000):
                self.silent += 1
                self.request_replay(self.last_seq + 1)
                continue
            topic, seq_b, payload = self.sub.recv_multipart()
            assert topic == self.topic
            n = int.from_bytes(seq_b, "big")
            batch = self.decode(payload)
            if self.drop_next:                    # the forced gap: this message is "lost"
                self.drop_next = False
                self.dropped += 1
                continue
            if n <= self.last_seq:
                continue
            if n > self.last_seq + 1:             # missed some: ask the replay socket, as with vLLM
                self.gaps += 1
                self.request_replay(self.last_seq + 1)
                if n <= self.last_seq:
                    continue
            self.apply(batch)
            self.last_seq = n


def test_vllm_subscriber_rebuilds_the_index_after_every_step():
    zc = ZmqConfig("ev", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv@{pool}")
    running = serve("127.0.0.1:0", events=EventsConfig(ring_batches=20, zmq=(zc,)))
    sub = None
    try:
        pub = running.publishers[0]
        with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=10) as c:
            c.create_pool("ev", SPEC, SIZING, prefix_caching=True)
            sub = VllmSubscriber(pub.bound_endpoint, pub.bound_replay_endpoint, b"kv@ev")
            time.sleep(0.2)                       # ZeroMQ's slow joiner: a missed start is a gap replay fixes
            w = Workload(np.random.default_rng(11))
            pool, lock = running.manager.pool_and_lock("ev")
            for k in range(150):
                kw = w.step()
                try:
                    c.step("ev", **client_step_args(kw))
                except ClientError as err:
                    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                    kw = w.step(pressure=True)
                    c.step("ev", **client_step_args(kw))
                w.applied(kw)
                seq = c.stats("ev")["ev"].event_sequence
                if k % 37 == 20 and seq > sub.last_seq:
                    sub.drop_next = True              # lose this step's batch: the next one shows the gap
                    sub.receive_until(seq - 1)
                    continue
                sub.receive_until(seq)
                with lock:
                    assert sub.index.get(0, set()) == set(pool.prefix.by_hash), f"step {k}"
            counts = {k: v for k, v in vars(sub).items() if isinstance(v, int)}
            assert sub.dropped >= 2 and sub.gaps >= 1 and sub.gaps + sub.silent >= sub.dropped, counts
            assert sub.replayed >= sub.dropped, counts
            assert sub.stored > 100 and sub.removed > 50, counts
            # A subscriber that lost track entirely (older than the ring): the replay starts with a reset.
            resets = sub.resets
            sub.last_seq = 0
            sub.request_replay(1)
            with lock:
                assert sub.resets == resets + 1 and sub.index.get(0, set()) == set(pool.prefix.by_hash)
                assert sub.last_seq == pool.events.seq
            assert pub.replays >= sub.dropped + 1
    finally:
        if sub is not None:
            sub.close()
        running.stop(0)


class Watcher(threading.Thread):
    """Reads WatchEvents into (seq, events) pairs until the stream ends."""

    def __init__(self, target: str, pool: str, from_sequence: int) -> None:
        super().__init__(daemon=True)
        self.client = BlockManagerClient(target, timeout=10)
        self.call = self.client.watch_events(pool, from_sequence)
        self.batches: list[tuple[int, bool, str, list]] = []
        self.error: ClientError | None = None

    def run(self) -> None:
        try:
            for msg in self.call:
                self.batches.append((msg.sequence, msg.reset, msg.reset_reason, proto_to_events(msg)))
        except ClientError as err:
            self.error = err

    def wait_for(self, seq: int, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while not (self.batches and self.batches[-1][0] >= seq):
            assert time.monotonic() < end, f"watcher stuck at {self.batches[-1][0] if self.batches else None}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.call.cancel()
        self.join(5)
        self.client.close()


def canon(events: list) -> list:
    out = []
    for e in events:
        d = {"type": type(e).__name__}
        for f in getattr(e, "__slots__", ()):
            v = getattr(e, f)
            d[f] = v.tolist() if isinstance(v, np.ndarray) else v
        out.append(d)
    return out


def run_steps(c: BlockManagerClient, w: Workload, n: int) -> int:
    for _ in range(n):
        kw = w.step()
        try:
            c.step("ev", **client_step_args(kw))
        except ClientError as err:
            assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            kw = w.step(pressure=True)
            c.step("ev", **client_step_args(kw))
        w.applied(kw)
    return c.stats("ev")["ev"].event_sequence


def test_watch_events_resumes_exactly_after_a_restart(tmp_path):
    state = tmp_path / "state"
    m = start(tmp_path, "run1", state, "--compact-every", "100000")
    w = Workload(np.random.default_rng(5))
    with BlockManagerClient(m.target, timeout=10) as c:
        c.create_pool("ev", SPEC, SIZING, prefix_caching=True)
        full = Watcher(m.target, "ev", 0)                  # from 0: a reset (the empty cache), then everything
        full.start()
        full.wait_for(0)                                   # its reset is the empty cache only if it came before step 1
        k = run_steps(c, w, 25)
        seq2 = run_steps(c, w, 35)
        full.wait_for(seq2)
        with pytest.raises(ClientError) as err:            # bad requests are refused, not streamed
            next(iter(c.watch_events("nope", 1)))
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "pool 'nope' does not exist" in err.value.message
    assert k > 10 and seq2 > k + 10
    kill9(m)                                               # no snapshot: the restart replays the journal
    full.join(10)
    assert full.error is not None and full.error.code == grpc.StatusCode.UNAVAILABLE
    first = full.batches[0]
    assert first[0] == 0 and first[1] and canon(first[3]) == [{"type": "AllBlocksCleared"}]
    live = {s: ev for s, reset, _, ev in full.batches[1:] if not reset}
    assert sorted(live) == list(range(1, seq2 + 1))      # every batch, once, in order

    m = start(tmp_path, "run2", state)
    try:
        resumed = Watcher(m.target, "ev", k + 1)
        resumed.start()
        resumed.wait_for(seq2)
        got = resumed.batches
        assert [s for s, *_ in got] == list(range(k + 1, seq2 + 1)) and not any(r for _, r, *_ in got)
        for s, _, _, events in got:
            assert canon(events) == canon(live[s]), f"batch {s} differs after the restart"
        with BlockManagerClient(m.target, timeout=10) as c:
            seq3 = run_steps(c, w, 5)                      # numbering continues without a gap
        resumed.wait_for(seq3)
        assert [s for s, *_ in resumed.batches] == list(range(k + 1, seq3 + 1))
        resumed.stop()
        view: dict[int, set[int]] = {}
        for s in range(1, seq2 + 1):
            apply_events(view, live[s])
        for _, _, _, events in resumed.batches[seq2 - k:]:
            apply_events(view, events)
    finally:
        m.stop()                                           # clean stop: a snapshot covers everything

    m = start(tmp_path, "run3", state)
    try:
        old = Watcher(m.target, "ev", k + 1)               # older than the snapshot: cannot be regenerated
        old.start()
        old.wait_for(seq3)
        (s, reset, reason, events) = old.batches[0]
        assert s == seq3 and reset and "no longer retained" in reason
        assert canon(events[:1]) == [{"type": "AllBlocksCleared"}]
        rebuilt: dict[int, set[int]] = {}
        apply_events(rebuilt, events)
        assert rebuilt.get(0, set()) == view.get(0, set()) and len(view[0]) > 5
        old.stop()
    finally:
        m.stop()


def test_tokens_scope_watch_events_and_scores_to_their_pools():
    tokens = TokenTable.from_yaml(
        "tokens:\n  - {name: admin, token: admin-0123456789abcdef, pools: ['*'], role: admin}\n"
        "  - {name: sched-a, token: sched-a-0123456789abcdef, pools: [a], role: write}\n")
    running = serve("127.0.0.1:0", tokens=tokens)
    target = f"127.0.0.1:{running.port}"
    try:
        with BlockManagerClient(target, token="admin-0123456789abcdef") as admin:
            for name in ("a", "b"):
                admin.create_pool(name, SPEC, SIZING, prefix_caching=True)
                admin.step(name, admit=[1], admit_tokens=[20], admit_token_ids=np.arange(1, 21))
        with BlockManagerClient(target, token="sched-a-0123456789abcdef") as c:
            with pytest.raises(ClientError) as err:
                next(iter(c.watch_events("b", 0)))
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and "may not use pool 'b'" in err.value.message
            stream = c.watch_events("a", 0)
            first = next(iter(stream))
            stream.cancel()
            assert first.reset and first.sequence == 1
            assert {e.WhichOneof("event") for e in first.events} == {"all_blocks_cleared", "block_stored"}
            scores = c.score_prefix(np.arange(1, 21))
            assert [(s.pool, s.cached_tokens) for s in scores.scores] == [("a", 16)]
            for named in (["a", "b"], ["a", "no-such-pool"]):      # named: refused, whether it exists or not
                with pytest.raises(ClientError) as err:
                    c.score_prefix(np.arange(1, 21), pools=tuple(named))
                assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and f"pool {named[1]!r}" in err.value.message
        with BlockManagerClient(target) as anonymous, pytest.raises(ClientError) as err:
            next(iter(anonymous.watch_events("a", 0)))
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        running.stop(0)


def test_kvctl_score_and_events(capsys, tmp_path):
    from kvservice.tools import kvctl

    running = serve("127.0.0.1:0")
    target = f"127.0.0.1:{running.port}"
    try:
        with BlockManagerClient(target) as c:
            c.create_pool("ev", SPEC, SIZING, prefix_caching=True, model="m1")
            c.step("ev", admit=[1], admit_tokens=[21], admit_token_ids=np.arange(1, 22))
        running.manager.register_worker("w0", "ev", address="10.1.2.3:50061")
        (tmp_path / "prompt.json").write_text(json.dumps(list(range(1, 22))))
        assert kvctl.main(["--target", target, "score", "--tokens-file", str(tmp_path / "prompt.json")]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("ev "))
        assert row.split()[:5] == ["ev", "20", "5", "4", "yes"] and "w0@10.1.2.3:50061" in row
        assert kvctl.main(["--target", target, "--json", "score", "--tokens", "1,2,3,4,5,9,9,9,9", "--model",
                           "m1"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["scores"][0]["pool"] == "ev" and doc["scores"][0]["cached_tokens"] == "4"   # int64 as JSON str
        assert kvctl.main(["--target", target, "score", "--tokens", "1", "--pool", "nope"]) == 2
        assert "NOT_FOUND" in capsys.readouterr().err
        assert kvctl.main(["--target", target, "events", "ev", "--count", "1"]) == 0
        line = capsys.readouterr().out.strip()
        assert line.split()[:3] == ["1", "all_blocks_cleared", "1,"] and "block_stored 5" in line and "RESET" in line
    finally:
        running.stop(0)


@pytest.mark.parametrize(("flags", "message"), [
    (["--kv-events-zmq", "not-an-endpoint"], "kv events for pool 'default': cannot open not-an-endpoint"),
    (["--kv-events-zmq", "a=tcp://127.0.0.1:*", "--kv-events-zmq", "a=tcp://127.0.0.1:*"], "published twice"),
    (["--kv-events-replay", "tcp://127.0.0.1:*"], "pool 'default' has no --kv-events-zmq publisher"),
    (["--kv-events-buffer", "0"], "--kv-events-buffer must be >= 1"),
    (["--kv-events-max-watchers", "8", "--threads", "8"], "would let event streams take every one of the 8"),
    (["--kv-events-zmq", "tcp://*:5557"], "--kv-events-zmq tcp://*:5557 would bind a ZeroMQ socket reachable from "
                                          "other machines"),
    (["--kv-events-zmq", "bind:tcp://10.11.12.13:5557"], "pass --kv-events-allow-remote"),
    (["--kv-events-zmq", "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://0.0.0.0:5558"],
     "--kv-events-replay tcp://0.0.0.0:5558 would bind"),
    (["--kv-events-zmq", "tcp://127.0.0.1:*", "--kv-events-curve-clients", "."],
     "--kv-events-curve-secret and --kv-events-curve-clients go together"),
    (["--kv-events-zmq", "tcp://127.0.0.1:*", "--kv-events-replay-burst", "0"], "--kv-events-replay-burst >= 1"),
    (["--kv-events-max-watchers", "4", "--kv-events-max-watchers-per-tenant", "5"],
     "--kv-events-max-watchers-per-tenant 5 must be between 0 (half of --kv-events-max-watchers) and"),
    (["--tenant-read-share", "-1"], "--tenant-read-share must be >= 0"),
    (["--tenant-read-burst", "0"], "--tenant-read-burst > 0"),
])
def test_serve_refuses_bad_event_flags(capsys, flags, message):       # (and the tenant fairness flags)
    from kvservice.server import cli

    assert cli.main(["serve", "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--no-pools", "--state", "memory",
                     *flags]) == 2
    assert message in capsys.readouterr().err
