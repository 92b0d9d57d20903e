"""Rolled-back state with real processes: never served silently (issue 26, item 4).

- A manager killed -9 whose write-ahead log then lost its tail after the last snapshot, with acknowledged Steps
  past the cut, refuses to start (the acknowledged high-water mark names them); `check-state --repair` accepts the
  loss only as a new lineage, which its clients accept and report.
- A manager restarted from an older copy of its state dir (a restored backup: consistent, so it starts) is
  refused by the first call of every client: the sync and asyncio clients, StepStream, and the worker's manager
  client (kvworker_state_rollbacks_total on its /metrics).
- Red team: a tenant cannot make a reply carry another position, and errors never show another request's
  journal position.
"""

import asyncio
import re
import shutil
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.aio import AsyncBlockManagerClient
from kvservice.client.client import RetryPolicy
from kvservice.client.position import StateRolledBack
from kvservice.contract.auth import TokenTable
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.contract.wire import to_tensor
from kvservice.server.app import serve
from kvservice.state.journal import Journal, JournalConfig
from kvservice.state.sqlite.store import read_manifest
from kvservice.state.sqlite.wal import db_header
from kvservice.v1 import block_manager_pb2 as pb

from .conftest import ROOT
from .test_durability import kill9, start
from .test_worker import WorkerProcess

pytestmark = pytest.mark.integration
POOL = "rb"
SPEC = CacheSpec.uniform(2, 1, 32, "float32", 16)
SIZING = Sizing(num_slots=256, max_seq_len=1024)
RETRY = RetryPolicy(deadline=60, attempts=240, max_backoff=0.25)    # attempts: StepStream reconnects too


def serve_cmd(state, *extra: str) -> subprocess.CompletedProcess:
    """`kvservice serve` on a state dir that must not start: its exit and output."""
    return subprocess.run([sys.executable, "-m", "kvservice.server.cli", "serve", "--state-dir", str(state),
                           "--no-pools", "--listen", "127.0.0.1:0", "--metrics-port", "-1", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def check_state_cmd(state, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvservice.server.cli", "check-state", str(state), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_wal_that_lost_acknowledged_steps_after_the_last_snapshot_is_refused_at_start(tmp_path):
    """The issue's case: the WAL cut right after the newest snapshot, Steps acknowledged past the cut, kill -9."""
    state = tmp_path / "state"
    m = start(tmp_path, "run1", state, "--compact-every", "20")
    port = m.target.rsplit(":", 1)[1]
    wal = state / "state.db-wal"
    c = BlockManagerClient(m.target, retry=RETRY)            # one scheduler, alive through the whole story
    try:
        c.wait_ready()
        c.create_pool(POOL, SPEC, SIZING)
        c.step(POOL, admit=[1], admit_tokens=[1])
        while read_manifest(state)["snapshot_seq"] == 0:    # decode Steps until the manager wrote a snapshot
            c.step(POOL, extend=[1], extend_tokens=1)
        snapshot = read_manifest(state)["snapshot_seq"]
        cut = wal.stat().st_size                             # the log as it stood right after that snapshot
        # acknowledged: the client holds every reply (fewer than the 3/4 x compact_every after which the next
        # snapshot is captured, so the cut still lies past the newest snapshot)
        for _ in range(10):
            r = c.step(POOL, extend=[1], extend_tokens=1)
        acked, lineage = c.position.seq, c.position.lineage
        assert r.position[1] == acked and read_manifest(state)["snapshot_seq"] == snapshot >= 1
        assert acked >= snapshot + 10
        kill9(m)
        page = db_header(state / "state.db")[0]
        frame = 24 + page
        cut = 32 + (cut - 32) // frame * frame
        for where, size in (("boundary", cut), ("mid-frame", cut + frame + 100)):
            d = shutil.copytree(state, tmp_path / where)
            with open(d / "state.db-wal", "r+b") as f:
                f.truncate(size)
            before = (d / "state.db-wal").read_bytes()
            out = serve_cmd(d)
            text = out.stdout + out.stderr
            assert out.returncode == 2 and "Traceback" not in text, text
            # kill -9 right after the last reply: the mark's writer thread may not have written that one yet
            said = re.search(r"high-water mark \(ACKED\) says position (\d+) was acknowledged", text)
            assert said and acked - 1 <= int(said[1]) <= acked and int(said[1]) > snapshot + 2, text
            assert "are lost" in text and "never acknowledged" not in text, text     # the false log line
            assert (d / "state.db-wal").read_bytes() == before                       # the refusal kept the evidence
            checked = check_state_cmd(d)
            assert checked.returncode == 2 and f"says position {said[1]} was acknowledged" in checked.stderr
        repaired = tmp_path / "boundary"
        fixed = check_state_cmd(repaired, "--repair")
        assert fixed.returncode == 0 and "new lineage" in fixed.stdout, fixed.stdout + fixed.stderr
        m = start(tmp_path, "run2", repaired, "--listen", f"127.0.0.1:{port}")
        r = c.step(POOL, extend=[1], extend_tokens=1)        # the repaired state: a new lineage, accepted, reported
        assert r.lineage not in (0, lineage) and r.position[1] < acked
        assert (c.position.lineage_changes, c.position.rollbacks) == (1, 0)
    finally:
        c.close()
        m.stop()


def _stream_step(stream, ids):
    return stream.step(extend=ids, extend_tokens=1)


def test_a_manager_restored_from_an_older_copy_is_refused_by_every_client_and_its_worker(tmp_path):
    state = tmp_path / "state"
    m = start(tmp_path, "run1", state, "--lease-seconds", "1.5")
    port = m.target.rsplit(":", 1)[1]
    registry = CollectorRegistry()
    client = BlockManagerClient(m.target, timeout=5, retry=RETRY, registry=registry)
    loop = asyncio.new_event_loop()
    aio = loop.run_until_complete(_aio_client(m.target))
    worker = None
    try:
        client.wait_ready()
        client.create_pool(POOL, SPEC, SIZING)
        worker = WorkerProcess(tmp_path, m.target, POOL, "w-rb")
        client.step(POOL, admit=[1, 2], admit_tokens=[8, 8])
        stream = client.step_stream(POOL, timeout=5)
        stream.step(admit=[100], admit_tokens=[4])
        m.stop()                                             # a clean stop; the operator copies the dir: a backup
        backup = shutil.copytree(state, tmp_path / "backup")
        m = start(tmp_path, "run2", state, "--lease-seconds", "1.5", "--listen", f"127.0.0.1:{port}")
        for _ in range(10):                                  # acknowledged after the backup
            client.step(POOL, extend=[1, 2], extend_tokens=1)
            _stream_step(stream, [100])
        seen = client.position.seq
        assert loop.run_until_complete(aio.get_pool(POOL)).position.seq == seen == aio.position.seq
        after = time.monotonic()                             # the worker heartbeats once more: it saw those positions
        assert _wait_for(lambda: client.workers(POOL)[0].seconds_since_heartbeat < time.monotonic() - after, 60)
        assert worker.metrics()["kvworker_state_rollbacks_total"] == 0
        seen = client.position.seq                           # (ListWorkers carries the position too)
        kill9(m)
        shutil.rmtree(state)
        shutil.copytree(backup, state)                       # restored: consistent, so the manager starts
        m = start(tmp_path, "run3", state, "--lease-seconds", "1.5", "--listen", f"127.0.0.1:{port}")

        with pytest.raises(StateRolledBack) as exc:          # the first call after the restart
            client.step(POOL, extend=[1, 2], extend_tokens=1)
        err = exc.value
        assert err.reason == "STATE_ROLLED_BACK" and err.code == grpc.StatusCode.DATA_LOSS
        assert int(err.metadata["seq"]) < int(err.metadata["seen_seq"]) == seen
        assert registry.get_sample_value("kvservice_client_state_rollbacks_total") == 1
        with pytest.raises(StateRolledBack):                 # StepStream: its reconnect resends, the reply is refused
            _stream_step(stream, [100])
        with pytest.raises(StateRolledBack):                 # the asyncio client's first call
            loop.run_until_complete(aio.get_pool(POOL))
        assert _wait_for(lambda: worker.metrics().get("kvworker_state_rollbacks_total", 0) >= 1, 60), \
            (tmp_path / "w-rb.log").read_text()[-2000:]      # the worker: its heartbeat replies refused, counted
        assert "rolled back" in (tmp_path / "w-rb.log").read_text()
    finally:
        client.close()
        loop.run_until_complete(aio.close())
        loop.close()
        if worker is not None:
            worker.stop()
        m.stop()


async def _aio_client(target: str) -> AsyncBlockManagerClient:
    return AsyncBlockManagerClient(target, retry=RETRY)


def _wait_for(ok, seconds: float):
    """True once ok() holds, False after `seconds` (progress is polled, never timed)."""
    deadline = time.monotonic() + seconds
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_the_asyncio_step_stream_refuses_a_rolled_back_manager(tmp_path):
    d = tmp_path / "state"
    running = serve(journal=Journal.open(d, config=JournalConfig(sync="normal")))
    with BlockManagerClient(f"127.0.0.1:{running.port}") as c:
        c.create_pool(POOL, SPEC, SIZING)
        c.step(POOL, admit=[7], admit_tokens=[3])
    running.stop(0)
    backup = shutil.copytree(d, tmp_path / "backup")
    running = serve(journal=Journal.open(d, config=JournalConfig(sync="normal")))
    port = running.port

    async def go() -> None:
        async with AsyncBlockManagerClient(f"127.0.0.1:{port}", retry=RetryPolicy(attempts=40, max_backoff=0.25)) \
                as ac:
            stream = await ac.step_stream(POOL, timeout=5)
            later = await ac.step_stream(POOL, timeout=5)     # its call opens with its first step
            for _ in range(5):
                r = await stream.step(extend=[7], extend_tokens=1)
            assert r.position[1] == ac.position.seq and r.lineage == ac.position.lineage
            await stream.close()
            running.stop(0)
            shutil.rmtree(d)
            shutil.copytree(backup, d)
            again = serve(listen=f"127.0.0.1:{port}", journal=Journal.open(d, config=JournalConfig(sync="normal")))
            try:
                with pytest.raises(StateRolledBack) as exc:
                    await later.step(extend=[7], extend_tokens=1)
                assert exc.value.request_id == f"{later.stream_id}#1" and ac.position.rollbacks == 1
            finally:
                await later.close()
                again.stop(0)
    asyncio.run(go())


# ---- red team ------------------------------------------------------------------------------------------
TENANTS = {"alice": "alice-0123456789abcdef", "bob": "bob-0123456789abcdef0"}
TOKENS = TokenTable.from_yaml("tokens:\n" + "".join(
    f"  - {{name: {n}, token: {t}, pools: [{n}], role: write}}\n" for n, t in TENANTS.items()) +
    "  - {name: admin, token: admin-0123456789abcdef, pools: ['*'], role: admin}\n")


def test_a_tenant_cannot_make_a_reply_look_newer_nor_learn_another_tenants_position(tmp_path):
    running = serve(tokens=TOKENS, journal=Journal.open(tmp_path / "s", config=JournalConfig(
        sync="normal", reply_cache_bytes=1)))                # replies dropped at once: REQUEST_ALREADY_APPLIED too
    target = f"127.0.0.1:{running.port}"
    try:
        with BlockManagerClient(target, token="admin-0123456789abcdef") as admin:
            for name in TENANTS:
                admin.create_pool(name, SPEC, SIZING)
        alice = BlockManagerClient(target, token=TENANTS["alice"], retry=RetryPolicy(attempts=1))
        bob = BlockManagerClient(target, token=TENANTS["bob"], retry=RetryPolicy(attempts=1))
        for i in range(30):
            r = alice.step("alice", admit=[i + 1], admit_tokens=[5], request_id=f"alice-{i}")
        alice_seq = r.position[1]

        # 1. Forged position bytes in a request (field 15 is StepReply.position's number) never reach the reply.
        forged = pb.StepRequest(pool="bob", request_id="bob-forged")
        forged.admit_seq_ids.CopyFrom(to_tensor(np.asarray([1], np.uint64)))
        forged.admit_num_tokens.CopyFrom(to_tensor(np.asarray([4], np.int64)))
        raw = forged.SerializeToString() + pb.StepReply(position=pb.JournalPosition(
            lineage=0xDEADBEEF, incarnation=99, seq=10**12)).SerializeToString()
        call = grpc.insecure_channel(target).unary_unary("/kvservice.v1.BlockManager/Step", request_serializer=None,
                                                         response_deserializer=pb.StepReply.FromString)
        reply = call(raw, metadata=(("authorization", f"Bearer {TENANTS['bob']}"),), timeout=10)
        assert reply.position.seq == alice_seq + 1 and reply.position.lineage == r.lineage != 0xDEADBEEF
        assert reply.position.incarnation == 1

        # 2. Bob replays Alice's request ids (learned somehow) on his own pool: refused or applied as his own,
        #    never Alice's reply, and no error shows the position of Alice's request.
        for i in (0, 17, 29):
            try:
                got = bob.step("bob", admit=[1000 + i], admit_tokens=[2], request_id=f"alice-{i}")
            except ClientError as err:
                text = err.message + repr(err.metadata)
                assert err.reason in ("REQUEST_ID_REUSED", "REQUEST_ALREADY_APPLIED"), text
                assert "position" not in text and str(1 + 2 + i) not in err.message, text
            else:
                assert got.seq_ids.tolist() == [1000 + i]
        with pytest.raises(ClientError) as exc:              # Alice retries her own dropped reply: still no position
            alice.step("alice", admit=[1], admit_tokens=[5], request_id="alice-0")
        assert exc.value.reason == "REQUEST_ALREADY_APPLIED" and "position" not in exc.value.message
        assert "position" not in exc.value.metadata
        alice.close()
        bob.close()
    finally:
        running.stop(0)
