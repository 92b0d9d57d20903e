"""Who reaches a pool's ZeroMQ sockets and what they cost the pool's owner (issue 27): binds on loopback unless
asked, CURVE admits only listed client keys, a replay flood gets refusals rather than work, a reset replay is
built outside the pool's lock (a Step goes through while one is being built), and hashes can be published
without token ids. Everything is counted (replies, steps, handshake events), never timed."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.auth

from kvservice.client import BlockManagerClient
from kvservice.contract.errors import InvalidArgument
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.events.zmq import REFUSED, ZmqConfig, zmq_configs
from kvservice.events.zmq_guard import CurveKeys
from kvservice.manager import event_log as hub_module
from kvservice.manager.event_log import EventsConfig
from kvservice.server.app import serve

pytestmark = pytest.mark.integration
PS = 4
SPEC = CacheSpec.uniform(2, 1, 64, page_size=PS)
SIZING = Sizing(num_slots=256, max_seq_len=256)
LOCAL = "tcp://127.0.0.1:*"
END = (-1).to_bytes(8, "big", signed=True)
WAIT_MS = 30_000           # a generous bound on each wait for something that must come (never a speed claim)


def _steps(c: BlockManagerClient, pool: str, first: int, n: int, rng: np.random.Generator) -> None:
    """n steps that each admit a prompt of 3 full pages (random tokens) and free the one before."""
    for k in range(first, first + n):
        tok = rng.integers(1, 30_000, 3 * PS + 1)
        c.step(pool, admit=[k], admit_tokens=[len(tok)], admit_token_ids=tok.tolist(),
               free=[k - 1] if k > first else None)


def _replay(sock: zmq.Socket, start: int) -> list[tuple[int, bytes]]:
    """Send one replay request and read its answer up to the end marker: [(seq, payload)]."""
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while True:
        assert sock.poll(WAIT_MS), "no replay answer"
        _, seq, payload = sock.recv_multipart()
        out.append((int.from_bytes(seq, "big", signed=True), payload))
        if seq == END:
            return out


def _index(answers: list[tuple[int, bytes]]) -> tuple[set[int], list[dict]]:
    """Apply replayed batches as a router does: the hashes it then holds, and every BlockStored seen."""
    index: set[int] = set()
    stored = []
    for seq, payload in answers:
        if seq < 0:
            continue
        for ev in msgspec.msgpack.decode(payload)[1]:
            if ev["type"] == "AllBlocksCleared":
                index.clear()
            elif ev["type"] == "BlockStored":
                index.update(ev["block_hashes"])
                stored.append(ev)
            else:
                index.difference_update(ev["block_hashes"])
    return index, stored


# ---- loopback unless asked ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "bind:tcp://0.0.0.0:5557", "tcp://[::]:5557", "bind:tcp://eth0:5557",
                                      "bind:tcp://10.1.2.3:5557", "bind:tcp://indexer:5557"])
def test_a_bind_off_loopback_needs_allow_remote(endpoint):
    with pytest.raises(InvalidArgument, match="--kv-events-allow-remote"):
        zmq_configs([f"ev={endpoint}"], [], "default")
    assert zmq_configs([f"ev={endpoint}"], [], "default", allow_remote=True)[0].binds


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://127.0.0.2:*", "tcp://[::1]:5557",
                                      "tcp://localhost:5557", "bind:tcp://127.0.0.1:5557", "ipc:///tmp/kv.sock",
                                      "inproc://kv", "tcp://indexer:5557", "connect:tcp://10.1.2.3:5557"])
def test_loopback_binds_and_connections_need_nothing(endpoint):
    zmq_configs([f"ev={endpoint}"], [], "default")        # a connection binds nothing: vLLM's collector does


def test_the_replay_socket_is_held_to_the_same_rule():
    with pytest.raises(InvalidArgument, match="--kv-events-replay tcp://\\*:5558 would bind"):
        zmq_configs(["ev=tcp://127.0.0.1:5557"], ["ev=tcp://*:5558"], "default")


def test_an_allowed_remote_bind_says_so_in_the_log(caplog):
    caplog.set_level(logging.INFO, "kvservice.events")
    zc = ZmqConfig("ev", "tcp://*:*", "tcp://*:*", allow_remote=True)
    running = serve("127.0.0.1:0", events=EventsConfig(zmq=(zc,)))
    running.stop(0)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("reachable from other machines (--kv-events-allow-remote)" in m and "--kv-events-curve-*" in m
               for m in warned), warned


# ---- CURVE -----------------------------------------------------------------------------------------------------
def _keys(tmp_path: Path) -> tuple[CurveKeys, tuple[bytes, bytes], tuple[bytes, bytes]]:
    """The server's keys with one admitted client; returns them, the client's pair and an intruder's pair."""
    made = tmp_path / "made"
    made.mkdir()
    admitted = tmp_path / "admitted"
    admitted.mkdir()
    _, server_secret = zmq.auth.create_certificates(str(made), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(made), "client")
    _, intruder_secret = zmq.auth.create_certificates(str(made), "intruder")
    (admitted / "client.key").write_bytes(Path(client_public).read_bytes())
    return (CurveKeys.load(server_secret, str(admitted)), zmq.auth.load_certificate(client_secret),
            zmq.auth.load_certificate(intruder_secret))


def _curve_client(ctx: zmq.Context, kind: int, server_public: bytes, pair: tuple[bytes, bytes]) -> zmq.Socket:
    s = ctx.socket(kind)
    s.curve_publickey, s.curve_secretkey = pair
    s.curve_serverkey = server_public
    return s


def _handshake_events(sock: zmq.Socket, endpoint: str) -> int:
    """Connect `sock` and return the first handshake outcome its monitor reports (succeeded or a failure)."""
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    sock.connect(endpoint)
    try:
        assert mon.poll(WAIT_MS), "no handshake outcome"
        from zmq.utils.monitor import recv_monitor_message
        return recv_monitor_message(mon)["event"]
    finally:
        sock.disable_monitor()
        mon.close(linger=0)


def test_curve_admits_listed_client_keys_only(tmp_path):
    curve, client, intruder = _keys(tmp_path)
    zc = ZmqConfig("ev", LOCAL, LOCAL, topic="kv", curve=curve)
    running = serve("127.0.0.1:0", events=EventsConfig(zmq=(zc,)))
    ctx = zmq.Context()
    try:
        pub = running.publishers[0]
        with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=10) as c:
            c.create_pool("ev", SPEC, SIZING, prefix_caching=True)
            _steps(c, "ev", 1, 4, np.random.default_rng(1))
            seq = c.stats("ev")["ev"].event_sequence
            bad = _curve_client(ctx, zmq.DEALER, curve.public, intruder)
            assert _handshake_events(bad, pub.bound_replay_endpoint) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            plain = ctx.socket(zmq.DEALER)                   # no CURVE at all: no handshake either
            assert _handshake_events(plain, pub.bound_replay_endpoint) != zmq.EVENT_HANDSHAKE_SUCCEEDED
            for s in (bad, plain):                           # a DEALER with no admitted connection queues nothing
                with contextlib.suppress(zmq.Again):
                    s.send_multipart((b"", (1).to_bytes(8, "big")), zmq.NOBLOCK)
            good = _curve_client(ctx, zmq.DEALER, curve.public, client)
            assert _handshake_events(good, pub.bound_replay_endpoint) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            answers = _replay(good, 1)
            assert [a[0] for a in answers] == [*range(1, seq + 1), -1]
            assert pub.replays == 1                           # the refused clients' requests never arrived
            assert not bad.poll(0) and not plain.poll(0)
            # the PUB socket: the admitted subscriber gets the next batches, the intruder's handshake fails
            sub = _curve_client(ctx, zmq.SUB, curve.public, client)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            assert _handshake_events(sub, pub.bound_endpoint) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            spy = _curve_client(ctx, zmq.SUB, curve.public, intruder)
            spy.setsockopt(zmq.SUBSCRIBE, b"")
            assert _handshake_events(spy, pub.bound_endpoint) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            for k in range(100):                              # a subscription takes effect some time after
                _steps(c, "ev", 100 + 10 * k, 1, np.random.default_rng(k))
                if sub.poll(100):
                    break
            topic, _, payload = sub.recv_multipart()
            assert topic == b"kv" and msgspec.msgpack.decode(payload)[1]
            assert not spy.poll(0)
    finally:
        ctx.destroy(linger=0)
        running.stop(0)


def test_curve_keys_are_checked_at_start(tmp_path):
    curve, _, _ = _keys(tmp_path)
    with pytest.raises(InvalidArgument, match="holds no secret key"):
        CurveKeys.load(str(tmp_path / "made" / "server.key"), curve.clients_dir)
    with pytest.raises(InvalidArgument, match="at least one client public key"):
        CurveKeys.load(str(tmp_path / "made" / "server.key_secret"), str(tmp_path))
    with pytest.raises(InvalidArgument, match="connects to a collector"):
        zmq_configs(["ev=tcp://indexer:5557"], [], "default", curve=curve)


# ---- replay flood ---------------------------------------------------------------------------------------------
def test_a_replay_flood_gets_refusals_not_work():
    zc = ZmqConfig("ev", LOCAL, LOCAL, replay_rate=0.0, replay_burst=3)   # 3 requests, ever, per peer
    running = serve("127.0.0.1:0", events=EventsConfig(zmq=(zc,)))
    ctx = zmq.Context()
    try:
        pub = running.publishers[0]
        with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=10) as c:
            c.create_pool("ev", SPEC, SIZING, prefix_caching=True)
            _steps(c, "ev", 1, 3, np.random.default_rng(2))
            flood = ctx.socket(zmq.DEALER)
            flood.connect(pub.bound_replay_endpoint)
            for _ in range(50):
                flood.send_multipart((b"", (1).to_bytes(8, "big")))
            ends, batches, refused = 0, 0, 0
            while ends < 50:
                assert flood.poll(WAIT_MS), f"{ends} of 50 answers"
                _, seq, payload = flood.recv_multipart()
                if seq == END:
                    ends += 1
                    refused += payload == REFUSED
                else:
                    batches += 1
            assert (refused, batches) == (47, 3 * 3)          # 3 served requests of 3 batches each
            assert pub.replays == 3 and pub.limiter.refused == 47
            # another socket of the same peer (same address) shares its bucket
            again = ctx.socket(zmq.DEALER)
            again.connect(pub.bound_replay_endpoint)
            assert _replay(again, 1) == [(-1, REFUSED)]
    finally:
        ctx.destroy(linger=0)
        running.stop(0)


# ---- never under the pool lock -----------------------------------------------------------------------------------
def test_steps_go_through_while_a_reset_replay_is_built(monkeypatch):
    building, release = threading.Event(), threading.Event()
    built = []
    real = hub_module.stored_events

    def held_open(copies):                # the replay thread stops here, inside the build, until released
        building.set()
        assert release.wait(WAIT_MS / 1000)
        built.append(len(copies))
        return real(copies)

    monkeypatch.setattr(hub_module, "stored_events", held_open)
    zc = ZmqConfig("ev", LOCAL, LOCAL)
    running = serve("127.0.0.1:0", events=EventsConfig(ring_batches=2, zmq=(zc,)))   # seq 1 is soon a reset
    ctx = zmq.Context()
    try:
        pub = running.publishers[0]
        with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=30) as c:
            c.create_pool("ev", SPEC, SIZING, prefix_caching=True)
            rng = np.random.default_rng(3)
            _steps(c, "ev", 1, 6, rng)
            pool, lock = running.manager.pool_and_lock("ev")
            with lock:
                at_request = (pool.events.seq, set(pool.prefix.by_hash))
            replay = ctx.socket(zmq.DEALER)
            replay.connect(pub.bound_replay_endpoint)
            replay.send_multipart((b"", (1).to_bytes(8, "big")))
            assert building.wait(WAIT_MS / 1000), "the replay never started building its reset"
            done = []

            def owner() -> None:             # the pool's owner: 5 Steps while the reset is being built
                for k in range(5):
                    _steps(c, "ev", 50 + 10 * k, 1, rng)
                    done.append(k)

            t = threading.Thread(target=owner, daemon=True)
            t.start()
            t.join(WAIT_MS / 1000)
            assert len(done) == 5 and not release.is_set() and not built, done   # all 5 while the build waited
            release.set()
            answers = []
            while not answers or answers[-1][0] != -1:
                assert replay.poll(WAIT_MS), "no replay answer"
                _, seq, payload = replay.recv_multipart()
                answers.append((int.from_bytes(seq, "big", signed=True), payload))
            with lock:
                now = pool.events.seq
            # the replay answers what the pool held when it was asked: a reset as of the copy (taken before the
            # owner's 5 steps, which all changed the cache), then the end
            assert at_request[0] == 6 and now == 11 and [a[0] for a in answers] == [6, -1]
            assert msgspec.msgpack.decode(answers[0][1])[1][0]["type"] == "AllBlocksCleared"
            assert _index(answers)[0] == at_request[1] and built == [1]
    finally:
        release.set()
        ctx.destroy(linger=0)
        running.stop(0)


# ---- hashes without token ids ------------------------------------------------------------------------------------
def test_no_token_ids_publishes_hashes_only(caplog):
    caplog.set_level(logging.INFO, "kvservice.events")
    zc = ZmqConfig("ev", LOCAL, LOCAL, topic="kv", token_ids=False)
    running = serve("127.0.0.1:0", events=EventsConfig(ring_batches=3, zmq=(zc,)))
    ctx = zmq.Context()
    try:
        pub = running.publishers[0]
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.bound_endpoint)
        with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=10) as c:
            c.create_pool("ev", SPEC, SIZING, prefix_caching=True)
            live = []
            for k in range(200):                              # until the subscription is up and batches arrive
                _steps(c, "ev", 1 + 10 * k, 1, np.random.default_rng(k))
                while sub.poll(20):
                    _, seq, payload = sub.recv_multipart()
                    live.append((int.from_bytes(seq, "big"), payload))
                if len(live) >= 3:
                    break
            replay = ctx.socket(zmq.DEALER)
            replay.connect(pub.bound_replay_endpoint)
            answers = _replay(replay, 1)                      # older than the ring of 3: a reset
            pool, lock = running.manager.pool_and_lock("ev")
            with lock:
                want = set(pool.prefix.by_hash)
        index, stored = _index(answers)
        assert index == want and len(stored) == len(want) > 0
        assert all(ev["token_ids"] == [] and ev["block_size"] == PS for ev in stored)
        live_stored = _index(live)[1]
        assert len(live) >= 3 and live_stored and all(ev["token_ids"] == [] for ev in live_stored)
        assert any("hashes only (no token ids)" in r.getMessage() for r in caplog.records)
    finally:
        ctx.destroy(linger=0)
        running.stop(0)


def test_the_flags_reach_the_publishers(tmp_path):
    from kvservice.server import cli

    curve, _, _ = _keys(tmp_path)
    args = cli.build_parser().parse_args([
        "serve", "--kv-events-zmq", "ev=tcp://*:5557", "--kv-events-replay", "ev=tcp://*:5558",
        "--kv-events-allow-remote", "--kv-events-no-token-ids", "--kv-events-replay-rate", "0.5",
        "--kv-events-replay-burst", "4", "--kv-events-curve-secret", str(tmp_path / "made" / "server.key_secret"),
        "--kv-events-curve-clients", curve.clients_dir])
    (zc,) = cli.events_config(args).zmq
    assert (zc.allow_remote, zc.token_ids, zc.replay_rate, zc.replay_burst) == (True, False, 0.5, 4)
    assert zc.curve == curve
    plain = cli.events_config(cli.build_parser().parse_args(["serve", "--kv-events-zmq", "tcp://127.0.0.1:5557"]))
    assert plain.zmq[0].curve is None and plain.zmq[0].token_ids and not plain.zmq[0].allow_remote


def test_an_oversized_request_disconnects_its_sender_and_nothing_else():
    zc = ZmqConfig("ev", LOCAL, LOCAL)
    running = serve("127.0.0.1:0", events=EventsConfig(zmq=(zc,)))
    ctx = zmq.Context()
    try:
        pub = running.publishers[0]
        with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=10) as c:
            c.create_pool("ev", SPEC, SIZING, prefix_caching=True)
            _steps(c, "ev", 1, 2, np.random.default_rng(5))
            hostile = ctx.socket(zmq.DEALER)
            mon = hostile.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            hostile.connect(pub.bound_replay_endpoint)
            hostile.send_multipart((b"", b"x" * (64 << 20)))     # 64 MiB: never buffered by the manager
            assert mon.poll(WAIT_MS), "the oversized sender was not disconnected"
            hostile.disable_monitor()
            mon.close(linger=0)
            good = ctx.socket(zmq.DEALER)
            good.connect(pub.bound_replay_endpoint)
            assert [a[0] for a in _replay(good, 1)] == [1, 2, -1]
            assert pub.replays == 1
    finally:
        ctx.destroy(linger=0)
        running.stop(0)
