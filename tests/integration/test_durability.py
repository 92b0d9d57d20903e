"""Crash safety: kill -9 under load loses no acknowledged step; a client rides through restarts applying each call
once; retries are answered once; leases survive restarts."""

import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.client import RetryPolicy, new_request_id
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import assert_invariants
from kvservice.server.app import serve
from kvservice.state.journal import Journal, JournalConfig
from kvservice.tools.launch import wait_for_ports

from .conftest import ROOT, ManagerProcess

pytestmark = pytest.mark.integration
POOL = "dur"
SPEC = CacheSpec.uniform(2, 1, 64, page_size=16)       # per_layer: page index == slot
SLOTS = 1024
SEQ_BASE = 1_000_000                                    # loader i owns seq ids [i * SEQ_BASE, (i + 1) * SEQ_BASE)


class Loader(threading.Thread):
    """A scheduler-like client: random frees, extensions and admissions, every acknowledged reply checked.

    model: seq -> (tokens, pages) as acknowledged; inflight: the one unacknowledged step, if any.
    """

    def __init__(self, idx: int, target: str, stop: threading.Event, client: BlockManagerClient | None = None) -> None:
        super().__init__(daemon=True, name=f"loader{idx}")
        self.idx, self.stop = idx, stop
        self.client = client or BlockManagerClient(target, timeout=5, retry=RetryPolicy(    # rides manager restarts
            attempts=100, initial_backoff=0.05, max_backoff=0.25, failover=60))
        self.hold = threading.Event()      # set: finish the step in flight, then wait (idle is set meanwhile)
        self.idle = threading.Event()
        self.model: dict[int, tuple[int, list[int]]] = {}
        self.inflight: tuple[list[int], dict[int, int], dict[int, int]] | None = None
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.acked = 0

    def run(self) -> None:
        rng = np.random.default_rng(self.idx)
        next_id, preempt = self.idx * SEQ_BASE + 1, False
        while not self.stop.is_set():
            if self.hold.is_set():
                self.idle.set()
                time.sleep(0.005)
                continue
            self.idle.clear()
            live = list(self.model)
            free = [i for i in live if preempt or rng.random() < 0.1]
            ext = [i for i in live if i not in free and self.model[i][0] < 900 and rng.random() < 0.8]
            k = int(rng.integers(1, 17))
            admit = [] if preempt or len(live) > 12 else list(range(next_id, next_id + int(rng.integers(0, 3))))
            next_id += len(admit)
            n = rng.integers(1, 200, len(admit))
            preempt = False
            if not (free or ext or admit):
                continue
            with self.lock:
                self.inflight = (free, dict.fromkeys(ext, k), dict(zip(admit, n.tolist(), strict=True)))
            try:
                r = self.client.step(POOL, free=free or None, extend=ext or None, extend_tokens=k, admit=admit or None,
                                     admit_tokens=n if admit else None, request_id=new_request_id())
            except ClientError as err:
                with self.lock:
                    self.inflight = None
                if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    preempt = True
                else:
                    self.errors.append(str(err))
                    return
                continue
            with self.lock:
                self._acknowledge(r, free, ext, k)
                self.inflight = None

    def _acknowledge(self, r, free, ext, k) -> None:
        for i in free:
            del self.model[i]
        table = r.for_layer(0).table
        for b, seq in enumerate(r.seq_ids.tolist()):
            tokens, pages = int(r.num_tokens[b]), table.row(b).tolist()
            if seq in self.model:
                old_tokens, old_pages = self.model[seq]
                if tokens != old_tokens + k or pages[:len(old_pages)] != old_pages:
                    self.errors.append(f"seq {seq}: acknowledged {old_tokens} tokens {old_pages}, now {tokens} "
                                       f"tokens {pages}")
            self.model[seq] = (tokens, pages)
        self.acked += 1


def recovered(state_dir) -> dict[int, tuple[int, list[int]]]:
    """The pool as a restart would rebuild it (read-only), after checking every invariant."""
    return recovered_from(Journal.open(state_dir, readonly=True))


def recovered_from(j) -> dict[int, tuple[int, list[int]]]:
    """seq_id -> (tokens, group-0 slots) of POOL in a recovered journal (closed after), invariants checked."""
    try:
        with j.manager.locked(POOL) as pool:
            assert_invariants(pool)
            ids, tokens = pool.sequences()
            seqs = {int(i): (int(n), pool.sequence_slots(i, 0).tolist()) for i, n in zip(ids, tokens, strict=True)}
    finally:
        j.close(snapshot=False)
    owned = [s for _, pages in seqs.values() for s in pages]
    assert len(owned) == len(set(owned)), "a slot has two owners"
    return seqs


def check_against(seqs, loaders, exact=False) -> None:
    """Each loader's sequences are exactly what it acknowledged, or that plus its one in-flight step."""
    for ld in loaders:
        with ld.lock:
            model, inflight = dict(ld.model), ld.inflight
        mine = {s: v for s, v in seqs.items() if s // SEQ_BASE == ld.idx}
        if mine == model:
            continue
        assert not exact and inflight is not None, f"loader {ld.idx}: recovered {mine} != acknowledged {model}"
        free, ext, admit = inflight
        assert set(mine) == (set(model) - set(free)) | set(admit), f"loader {ld.idx}: {sorted(mine)} vs {model}"
        for s, (tokens, pages) in mine.items():
            if s in ext:
                assert tokens == model[s][0] + ext[s] and pages[:len(model[s][1])] == model[s][1]
            elif s in admit:
                assert tokens == admit[s]
            else:
                assert (tokens, pages) == model[s], f"seq {s} changed without being in the in-flight step"


def start(tmp_path, run: str, state, *extra: str) -> ManagerProcess:
    d = tmp_path / run
    d.mkdir()
    return ManagerProcess(d, "--no-pools", "--state-dir", str(state), *extra)


def kill9(m: ManagerProcess) -> None:
    m.proc.kill()
    m.proc.wait(10)
    m.log.close()


def wait_for_progress(loaders: list, steps: int, bound: float = 180.0) -> None:
    """Until every loader has acknowledged `steps` more Steps (or one has failed, or `bound` s passed: then the
    count assertions below say how far each got)."""
    want = [ld.acked + steps for ld in loaders]
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and not any(ld.errors for ld in loaders):
        if all(ld.acked >= w for ld, w in zip(loaders, want, strict=True)):
            return
        time.sleep(0.05)


def test_kill9_under_load_keeps_every_acknowledged_step(tmp_path):
    state = tmp_path / "state"
    m = start(tmp_path, "run1", state, "--compact-every", "50")
    port = m.target.rsplit(":", 1)[1]
    with BlockManagerClient(m.target) as c:
        c.wait_ready()
        c.create_pool(POOL, SPEC, Sizing(num_slots=SLOTS, max_seq_len=1024))
    stop = threading.Event()
    loaders = [Loader(i, m.target, stop) for i in range(4)]
    for ld in loaders:
        ld.start()
    try:
        for run in ("run2", "run3"):
            wait_for_progress(loaders, 10)                 # progress counted, not timed (a loaded machine is slow)
            kill9(m)                                       # mid-load: steps in flight, maybe mid-snapshot
            check_against(recovered(state), loaders)
            m = start(tmp_path, run, state, "--compact-every", "50", "--listen", f"127.0.0.1:{port}")
        wait_for_progress(loaders, 10)
    finally:
        stop.set()
        for ld in loaders:
            ld.join(30)
    assert not [e for ld in loaders for e in ld.errors], [ld.errors for ld in loaders]
    assert all(ld.acked > 20 for ld in loaders), [ld.acked for ld in loaders]
    with BlockManagerClient(m.target) as c:                # over gRPC: the live sequences are the acknowledged ones
        live = {s.seq_id: s.num_tokens for s in c.sequences(POOL).sequences}
    assert live == {s: t for ld in loaders for s, (t, _) in ld.model.items()}
    m.stop()                                               # clean stop: snapshot
    check_against(recovered(state), loaders, exact=True)
    out = subprocess.run([sys.executable, "-m", "kvservice.server.cli", "check-state", str(state)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "invariants ok" in out.stdout, out.stdout + out.stderr


def test_a_client_rides_through_manager_restarts_applying_each_step_once(tmp_path):
    """Issue 11, report 4: a manager killed and restarted (down ~1 s) while one client keeps extending a sequence.

    Every acknowledged Step adds exactly one token (each reply says so: a step applied twice would show +2),
    and at the end the sequence holds one token per acknowledged step (none lost) and the pool counted one
    step per call (none applied twice).
    """
    state = tmp_path / "state"
    m = start(tmp_path, "run0", state, "--compact-every", "25")
    port = m.target.rsplit(":", 1)[1]
    with BlockManagerClient(m.target) as c:
        c.wait_ready()
        c.create_pool(POOL, SPEC, Sizing(num_slots=64, max_seq_len=1024))
        c.step(POOL, admit=[1], admit_tokens=[1])
    client = BlockManagerClient(m.target, timeout=2, retry=RetryPolicy(failover=60, max_backoff=0.25))
    acked, errors, done = [0], [], threading.Event()

    def extend() -> None:
        try:
            while acked[0] < 90:
                r = client.step(POOL, extend=[1], extend_tokens=1)
                if r.num_tokens.tolist() != [acked[0] + 2]:
                    errors.append(f"after {acked[0]} acknowledged steps the sequence holds {r.num_tokens.tolist()}")
                    return
                acked[0] += 1
        except ClientError as err:
            errors.append(str(err))
        finally:
            done.set()

    worker = threading.Thread(target=extend, daemon=True)
    worker.start()
    try:
        for restart in range(1, 4):
            while acked[0] < 20 * restart and not done.is_set():
                time.sleep(0.005)
            kill9(m)                                       # maybe mid-call: the client retries the same request_id
            time.sleep(1.0)                                # down longer than the old client's whole retry budget
            m = start(tmp_path, f"run{restart}", state, "--compact-every", "25", "--listen", f"127.0.0.1:{port}")
        assert done.wait(120), "the client did not finish"
        assert not errors, errors
        with BlockManagerClient(m.target) as c:
            (seq,) = c.sequences(POOL).sequences
            stats = c.stats(POOL)[POOL]
        assert (seq.seq_id, seq.num_tokens) == (1, 1 + acked[0]) and acked[0] == 90
        assert stats.steps == 1 + acked[0]                 # one applied step per acknowledged call
        assert client.position.incarnation == 4 and client.position.seq == 2 + acked[0]
    finally:
        client.close()
        m.stop()


def test_retry_after_a_restart_gets_the_original_reply(tmp_path):
    state = tmp_path / "state"
    m = start(tmp_path, "run1", state)
    with BlockManagerClient(m.target) as c:
        c.wait_ready()
        c.create_pool(POOL, SPEC, Sizing(num_slots=64, max_seq_len=512))
        first = c.step(POOL, admit=[1, 2], admit_tokens=[100, 20], request_id="lost-reply")
        before = c.stats(POOL)[POOL]
    kill9(m)                                               # the reply "was lost": the client retries later
    m = start(tmp_path, "run2", state)
    try:
        with BlockManagerClient(m.target) as c:
            c.wait_ready()
            again = c.step(POOL, admit=[1, 2], admit_tokens=[100, 20], request_id="lost-reply")
            after = c.stats(POOL)[POOL]
    finally:
        m.stop()
    assert again.seq_ids.tolist() == first.seq_ids.tolist()
    assert again.for_layer(0).slot_mapping.tolist() == first.for_layer(0).slot_mapping.tolist()
    assert (after.num_free_slots, after.steps, after.num_sequences) == \
        (before.num_free_slots, before.steps, before.num_sequences)


class _LostReply(grpc.RpcError):
    """What a client sees when the server answered but the reply never arrived."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection reset (injected: reply dropped)"

    def trailing_metadata(self):
        return ()

    def initial_metadata(self):
        return ()

    def result(self, timeout=None):
        raise self


class DropReplies(grpc.UnaryUnaryClientInterceptor):
    """Lets the server apply the first `n` Steps, then drops their replies."""

    def __init__(self, n: int) -> None:
        self.n, self.ids = n, []

    def intercept_unary_unary(self, continuation, details, request):
        outcome = continuation(details, request)
        if details.method.endswith("/Step"):
            self.ids.append(request.request_id)
            if self.n > 0:
                outcome.result()                          # the server did apply it
                self.n -= 1
                return _LostReply()
        return outcome


def test_retried_step_after_a_dropped_reply_allocates_nothing(tmp_path):
    journal = Journal.open(tmp_path / "state", config=JournalConfig(sync="normal"))
    running = serve(journal=journal)
    target = f"127.0.0.1:{running.port}"
    try:
        with BlockManagerClient(target) as c:
            c.create_pool(POOL, SPEC, Sizing(num_slots=64, max_seq_len=512))
            c.step(POOL, admit=[1], admit_tokens=[40])
            free = c.stats(POOL)[POOL].num_free_slots
        drop = DropReplies(2)
        channel = grpc.intercept_channel(grpc.insecure_channel(target), drop)
        with BlockManagerClient(target, channel=channel, retries=3) as c:
            r = c.step(POOL, extend=[1], extend_tokens=40, admit=[2], admit_tokens=[17])
            stats = c.stats(POOL)[POOL]
        assert len(drop.ids) == 3 and len(set(drop.ids)) == 1       # three tries, one request id
        assert r.num_tokens.tolist() == [80, 17]
        assert stats.num_free_slots == free - 2 - 2 and stats.steps == 2   # applied once: 3 -> 5 pages, +2 pages
        assert journal.window.hits == 2
        with running.manager.locked(POOL) as pool:
            assert_invariants(pool)
    finally:
        running.stop()


def test_journal_failure_stops_the_server(tmp_path):
    journal = Journal.open(tmp_path / "state", config=JournalConfig(sync="normal"))
    running = serve(journal=journal)
    try:
        with BlockManagerClient(f"127.0.0.1:{running.port}", retries=0) as c:
            c.create_pool(POOL, SPEC, Sizing(num_slots=64, max_seq_len=512))

            def disk_full(*_a):
                raise OSError(28, "No space left on device")
            journal.store.append = disk_full
            with pytest.raises(ClientError) as exc:
                c.step(POOL, admit=[1], admit_tokens=[40])
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE and "not made durable" in exc.value.message
            assert running.failed.wait(1)
            with pytest.raises(ClientError) as exc:                  # no reads of a state ahead of the disk
                c.get_pool(POOL)
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop()
    j = Journal.open(tmp_path / "state", readonly=True)
    with j.manager.locked(POOL) as pool:
        assert pool.num_sequences == 0                             # the refused step never happened
    j.close(snapshot=False)


def test_workers_keep_their_lease_and_epoch_across_a_manager_restart(tmp_path):
    state = tmp_path / "state"
    lease = 4.0            # heartbeats every lease / 3: long enough that a loaded 2-core CI box keeps up
    m = start(tmp_path, "run1", state, "--lease-seconds", str(lease))
    port = m.target.rsplit(":", 1)[1]
    with BlockManagerClient(m.target) as c:
        c.wait_ready()
        c.create_pool("w", CacheSpec.uniform(2, 1, 32, "float32", 16), Sizing(num_slots=16, max_seq_len=128))
    ports = tmp_path / "worker.ports"
    log = open(tmp_path / "worker.log", "w+")
    worker = subprocess.Popen([sys.executable, "-m", "kvservice.worker.cli", "serve", "--manager", m.target,
                               "--pool", "w",
                               "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--port-file", str(ports),
                               "--worker-id", "w0"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_ports(worker, ports, 60, tmp_path / "worker.log", "worker w0")
        with BlockManagerClient(m.target) as c:
            (w,) = c.workers("w")
        kill9(m)
        time.sleep(0.5)
        m = start(tmp_path, "run2", state, "--lease-seconds", str(lease), "--listen", f"127.0.0.1:{port}")
        time.sleep(2 * lease + 0.2)                        # two leases: a worker that stopped beating would be dead
        with BlockManagerClient(m.target) as c:
            (w2,) = c.workers("w")
        assert (w2.worker_id, w2.epoch, w2.alive) == ("w0", w.epoch, True)
        assert w2.seconds_since_heartbeat < lease
    finally:
        worker.terminate()
        worker.wait(10)
        log.close()
        m.stop()
