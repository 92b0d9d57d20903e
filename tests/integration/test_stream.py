"""StepStream and EchoStream against a real manager process: incremental tables equal full tables on random ops,
errors end a request and not the stream, resends are answered once, across a reconnect and a manager restart."""

import asyncio
import itertools
import json
import queue
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.client import RetryPolicy
from kvservice.client.stream import StepStream
from kvservice.contract.auth import TokenTable
from kvservice.contract.sizing import Sizing
from kvservice.contract.transport import STREAM_ID_KEY
from kvservice.server.app import serve
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from tests.support_stream import MAX_LEN, NUM_SLOTS, SPECS, Driver, assert_same_tables

from .conftest import ROOT, ManagerProcess

pytestmark = pytest.mark.integration
_names = itertools.count()
SIZING = Sizing(num_slots=NUM_SLOTS, max_seq_len=MAX_LEN)


def twin_pools(client, spec_name):
    spec, prefix = SPECS[spec_name]
    a, b = f"sa{next(_names)}", f"sb{next(_names)}"
    for name in (a, b):
        client.create_pool(name, spec, SIZING, prefix_caching=prefix)
    return a, b


def raw_stream(manager, stream_id):
    """A StepStream call that sends and receives raw bytes: (channel, send(bytes), next_reply())."""
    channel = grpc.insecure_channel(manager.target)
    method = channel.stream_stream("/kvservice.v1.BlockManager/StepStream", request_serializer=None,
                                   response_deserializer=pb.StepReply.FromString)
    q = queue.SimpleQueue()
    call = method(iter(q.get, None), metadata=((STREAM_ID_KEY, stream_id),))
    return channel, q.put, lambda: next(call)


def stream_request(pool, seq, **fields):
    return pb.StepRequest(pool=pool, stream_seq=seq, **fields).SerializeToString()


def ids(*xs):
    return cpb.Tensor(dtype=cpb.UINT64, data=np.array(xs, dtype=np.uint64).tobytes())


def counts(*xs):
    return cpb.Tensor(dtype=cpb.INT64, data=np.array(xs, dtype=np.int64).tobytes())


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_stream_deltas_equal_full_tables_on_random_ops(client, spec_name):
    a, b = twin_pools(client, spec_name)
    driver = Driver(np.random.default_rng(11), SPECS[spec_name][1])
    kinds = {"delta": 0, "refused": 0}
    with client.step_stream(a) as stream:
        for i in range(120):
            kw = driver.draw()
            try:
                full = client.step(b, block_table=True, **kw)
            except ClientError as err:
                with pytest.raises(ClientError) as exc:
                    stream.step(**kw)
                assert (exc.value.code, exc.value.message.replace(a, b), exc.value.reason) == \
                    (err.code, err.message, err.reason)
                kinds["refused"] += 1
                continue
            if i % 23 == 22:                 # another client's step on the stream's pool: a full reply follows
                client.step(a, **kw)
            else:
                r = stream.step(block_table=True, **kw)
                assert_same_tables(stream.mirror, full, f"step {i}")
                for sid, st in full.tables.items():        # what a caller reads: the result's own tables
                    assert np.array_equal(r.tables[sid].table.indices, st.table.indices)
                    assert np.array_equal(r.for_layer(0).slot_mapping, full.for_layer(0).slot_mapping)
            driver.update(kw, full.seq_ids)
        assert stream.reused > 3 and stream.reconnects == 0      # steady decode steps reused their bytes
    assert kinds["refused"] > 3


def test_refused_request_ends_the_request_not_the_stream(client):
    a, _ = twin_pools(client, "per_layer")
    with client.step_stream(a) as s:
        s.step(admit=[1, 2], admit_tokens=[5, 9])
        with pytest.raises(ClientError) as exc:
            s.step(admit=[3], admit_tokens=NUM_SLOTS * 4 * 8)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_seq_len" in exc.value.message
        with pytest.raises(ClientError) as exc:
            s.step(admit=np.arange(10, 60), admit_tokens=MAX_LEN)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.value.metadata["free"]
        with pytest.raises(ClientError) as exc:
            s.step(extend=[99], extend_tokens=1)
        assert exc.value.code == grpc.StatusCode.NOT_FOUND
        r = s.step(extend=[1, 2], extend_tokens=1)                 # same stream, still in order
        assert r.num_tokens.tolist() == [6, 10] and s.reconnects == 0
    assert [x.num_tokens for x in client.sequences(a).sequences] == [6, 10]


def test_malformed_and_out_of_order_requests_are_refused_in_stream(manager, client):
    a, _ = twin_pools(client, "per_layer")
    channel, send, reply = raw_stream(manager, "raw-order")
    try:
        send(b"\xff\xff\xff")                                      # not a StepRequest
        r = reply()
        assert r.error.code == 3 and "not a valid kvservice.v1.StepRequest" in r.error.message
        send(stream_request(a, 0, admit_seq_ids=ids(1), admit_num_tokens=counts(3)))
        assert reply().error.reason == "STREAM_SEQ"
        send(stream_request(a, 1, admit_seq_ids=ids(1), admit_num_tokens=counts(3)))
        assert not reply().HasField("error")
        send(stream_request(a, 3, extend_seq_ids=ids(1), extend_num_tokens=counts(1)))     # skips 2
        r = reply()
        assert r.error.reason == "STREAM_SEQ" and r.error.metadata["expected"] == "2"
        send(stream_request(a, 2, extend_seq_ids=ids(1), extend_num_tokens=counts(1), delta_tables=True,
                            include_block_table=True))
        assert "include_block_table" in reply().error.message
        send(stream_request(a, 3, extend_seq_ids=ids(1), extend_num_tokens=counts(1)))
        assert reply().num_tokens.data == np.array([4], np.int64).tobytes()
    finally:
        channel.close()
    assert [x.num_tokens for x in client.sequences(a).sequences] == [4]


def test_resent_request_gets_its_original_reply_once(manager, client):
    """A reply lost with its connection: the client resends the same seq on a new call and the step applies once."""
    a, _ = twin_pools(client, "per_layer")
    sid = f"resend-{next(_names)}"
    first = stream_request(a, 1, admit_seq_ids=ids(1, 2), admit_num_tokens=counts(3, 4), delta_tables=True)
    second = stream_request(a, 2, extend_seq_ids=ids(1, 2), extend_num_tokens=counts(5, 5), delta_tables=True,
                            delta_base=1)
    channel, send, reply = raw_stream(manager, sid)
    send(first)
    r1 = reply()
    send(second)
    r2 = reply()
    channel.close()                                                # "lost" after the server answered
    channel, send, reply = raw_stream(manager, sid)

    def body(r):
        """The reply without its journal position (a retried reply carries the position now)."""
        r = type(r).FromString(r.SerializeToString())
        r.ClearField("position")
        return r.SerializeToString()

    try:
        send(second)                                               # resent: same seq, same bytes
        again = reply()
        assert body(again) == body(r2) and again.HasField("delta")
        assert again.position.seq >= r2.position.seq > 0
        send(first)
        assert body(reply()) == body(r1)
        send(stream_request(a, 3, extend_seq_ids=ids(1), extend_num_tokens=counts(1)))
        assert not reply().HasField("error")
    finally:
        channel.close()
    assert [x.num_tokens for x in client.sequences(a).sequences] == [9, 9]    # 3 + 5 + 1 and 4 + 5: each once
    # A new stream reusing the id from 1 is a different request under a used key: refused, nothing applied.
    channel, send, reply = raw_stream(manager, sid)
    try:
        send(stream_request(a, 1, admit_seq_ids=ids(7), admit_num_tokens=counts(1)))
        assert reply().error.reason == "REQUEST_ID_REUSED"
    finally:
        channel.close()


def test_echo_stream_and_async_step_stream(manager, client):
    with client.echo_stream() as e:
        assert [e.echo(bytes([i]) * i) for i in range(4)] == [b"", b"\x01", b"\x02\x02", b"\x03\x03\x03"]
    a, b = twin_pools(client, "hybrid")

    async def go():
        async with AsyncBlockManagerClient(manager.target, timeout=10) as ac:
            async with await ac.step_stream(a) as s:
                for kw in ({"admit": [1, 2], "admit_tokens": [9, 3]}, {"extend": [1, 2], "extend_tokens": 1},
                           {"extend": [1, 2], "extend_tokens": [7, 2]},
                           {"free": [2], "extend": [1], "extend_tokens": 1}):
                    r = await s.step(block_table=True, **kw)
                    full = client.step(b, block_table=True, **kw)
                    assert_same_tables(s.mirror, full, str(kw))
                    assert np.array_equal(r.for_layer(2).block_table, full.for_layer(2).block_table)
                with pytest.raises(ClientError) as exc:
                    await s.step(extend=[5], extend_tokens=1)
                assert exc.value.code == grpc.StatusCode.NOT_FOUND
                assert (await s.step(extend=[1], extend_tokens=1)).num_tokens.tolist() == [19]
    asyncio.run(go())


def test_stream_resumes_across_a_manager_restart(tmp_path):
    """Durable manager killed and restarted on the same port: the stream reconnects by itself, resent requests
    get the journal's replies, and the mirror is exact again (a full reply follows the lost session)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ("--state-dir", str(tmp_path / "state"), "--no-pools", "--listen", f"127.0.0.1:{port}")
    m = ManagerProcess(tmp_path, *args)
    try:
        with BlockManagerClient(m.target, timeout=10, retry=RetryPolicy(attempts=60, max_backoff=0.5)) as c:
            c.wait_ready()
            a, b = twin_pools(c, "per_layer")
            s = c.step_stream(a)
            ops = [{"admit": [1, 2, 3], "admit_tokens": [5, 9, 2]}] + [{"extend": [1, 2, 3], "extend_tokens": 1}] * 3
            for kw in ops:
                s.step(**kw)
                full = c.step(b, block_table=True, **kw)
            assert_same_tables(s.mirror, full, "before restart")
            m.proc.kill()
            m.proc.wait(10)
            m.stop()
            m = ManagerProcess(tmp_path, *args)
            r = s.step(extend=[1, 2, 3], extend_tokens=2)            # reconnects, the server lost the session
            full = c.step(b, block_table=True, extend=[1, 2, 3], extend_tokens=2)
            assert s.reconnects >= 1 and r.num_tokens.tolist() == [10, 14, 7]
            assert_same_tables(s.mirror, full, "after restart")
            r = s.step(extend=[1, 2, 3], extend_tokens=1)             # and deltas again
            full = c.step(b, block_table=True, extend=[1, 2, 3], extend_tokens=1)
            assert_same_tables(s.mirror, full, "delta after restart")
            s.close()
        channel, send, reply = raw_stream(m, s.stream_id)         # the last request, resent after the restart
        try:
            def int32(*xs):                       # the client sends ids and counts that fit as INT32
                return cpb.Tensor(dtype=cpb.INT32, data=np.array(xs, np.int32).tobytes())

            last = {"extend_seq_ids": int32(1, 2, 3), "extend_num_tokens": int32(1, 1, 1), "delta_tables": True,
                    "accept_tokens_added": True}
            send(stream_request(a, s.seq, delta_base=s.seq - 1, **last))
            first = reply()                       # its original reply: +1 token on each of [10, 14, 7]
            assert first.stream_seq == s.seq and first.delta.tokens_added == 1
            assert not first.HasField("num_tokens") and not first.HasField("new_token_indptr")
            send(stream_request(a, 4, delta_base=3, **last))             # answered before the crash: the
            again = reply()                                               # journal replayed it, full tables
            assert again.stream_seq == 4 and not again.HasField("delta") and again.tables[0].HasField("indptr")
            assert again.num_tokens.data == np.array([8, 12, 5], np.int64).tobytes()
        finally:
            channel.close()
        with BlockManagerClient(m.target, timeout=10) as c:
            assert [x.num_tokens for x in c.sequences(a).sequences] == [11, 15, 8]
    finally:
        m.stop()


def test_stream_token_scoped_to_its_pools():
    tokens = TokenTable.from_yaml("tokens:\n  - {name: admin, token: admin-0123456789abcdef, pools: ['*'], "
                                  "role: admin}\n  - {name: sched, token: sched-0123456789abcdef, pools: [mine]}\n")
    running = serve("127.0.0.1:0", tokens=tokens)
    target = f"127.0.0.1:{running.port}"
    try:
        with BlockManagerClient(target, token="admin-0123456789abcdef") as admin:
            for name in ("mine", "theirs"):
                admin.create_pool(name, *(SPECS["per_layer"][0], SIZING))
        with BlockManagerClient(target, token="sched-0123456789abcdef", retries=0) as c:
            with c.step_stream("mine") as s:
                assert s.step(admit=[1], admit_tokens=3).num_tokens.tolist() == [3]
            with StepStream(c, "theirs", page_size=16) as s:        # a pool outside the grant
                with pytest.raises(ClientError) as exc:
                    s.step(admit=[1], admit_tokens=3)
                assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED and "may not use pool 'theirs'" in \
                    exc.value.message
                assert s.pending is None and "was not applied" in exc.value.message   # refused: nothing to resend
        with BlockManagerClient(target, token="admin-0123456789abcdef") as admin:
            assert admin.stats("theirs")["theirs"].num_sequences == 0
    finally:
        running.stop()


def test_open_streams_are_capped_and_unary_calls_still_served():
    running = serve("127.0.0.1:0", max_streams=2, max_workers=2)
    try:
        with BlockManagerClient(f"127.0.0.1:{running.port}", timeout=5, retries=0) as c:
            c.create_pool("p", SPECS["per_layer"][0], SIZING)
            one, two = c.step_stream("p"), c.echo_stream()
            one.step(admit=[1], admit_tokens=3)
            assert two.echo(b"x") == b"x"
            with pytest.raises(ClientError) as exc:
                c.step_stream("p").step(admit=[2], admit_tokens=3)
            assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams" in exc.value.message
            assert c.echo(b"unary") == b"unary" and c.stats("p")["p"].num_sequences == 1
            two.close()
            for _ in range(50):                      # the server notices the closed stream
                try:
                    c.step_stream("p").step(admit=[2], admit_tokens=3)
                    break
                except ClientError:
                    time.sleep(0.1)
            assert c.stats("p")["p"].num_sequences == 2
            one.close()
    finally:
        running.stop()


def test_kvctl_ping_and_decode(manager, client):
    def kvctl(*args):
        return subprocess.run([sys.executable, "-m", "kvservice.tools.kvctl", "--target", manager.target, "--json",
                               *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)

    r = kvctl("ping", "--count", "20")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["echo_p50_us"] > 0 and doc["echo_stream_p50_us"] > 0
    a, _ = twin_pools(client, "per_layer")
    client.step(a, admit=[1, 2, 3], admit_tokens=[4, 30, 9])
    r = kvctl("decode", a, "--ids", "1,2,3", "--steps", "5")
    assert r.returncode == 0, r.stderr
    rows = {row["mode"]: row for row in json.loads(r.stdout)}
    assert set(rows) == {"unary", "stream", "deltas"}
    assert rows["deltas"]["reply_bytes"] < rows["stream"]["reply_bytes"]
    assert [x.num_tokens for x in client.sequences(a).sequences] == [19, 45, 24]      # 3 modes x 5 steps each
    r = kvctl("decode", a, "--ids", "1,99", "--steps", "1", "--mode", "deltas")
    assert r.returncode == 2 and "NOT_FOUND" in r.stderr and "Traceback" not in r.stderr
