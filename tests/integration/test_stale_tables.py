"""Issue 26's held-out scenario: a table that was right once and is stale now never passes silently.

A real manager (`kvservice serve` with bearer tokens and 1 s worker leases) and real workers (`kvworker serve`,
CPU backend, tokens too) on loopback. Each case is something a scheduler does without any attacker: it keeps
using its tables after the pool was deleted and created again under the same name and geometry, or re-planned
to another page size; a second scheduler of the same pool picks the same table or stream id; a scheduler
reconnects after the pool was created again; a table outlives the sequence whose pages it names. Every case
must end in a refusal (STALE_TABLE, STALE_INCARNATION) or in stale_page violations (NaN rows, counted in
kvworker_bounds_violations_total), and the K/V of every live sequence must still decode to the float64
reference of what its own scheduler wrote: never a changed K/V, never a wrong decode.
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import numpy as np
import pytest

from kvservice.client import BlockManagerClient, ClientError
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.worker.reference import TOLERANCE

from .conftest import ManagerProcess, WorkerProcess

pytestmark = pytest.mark.integration
TOKENS = {"admin": "admin-0123456789abcdef", "ta": "tenant-a-0123456789abcdef", "tb": "tenant-b-0123456789abcdef",
          "wk": "worker-0123456789abcdef"}
ROLES = {"admin": "admin", "ta": "write", "tb": "write", "wk": "write"}
KH, D, HQ = 1, 32, 2
SPEC16 = CacheSpec.uniform(1, KH, D, "float32", 16)
SPEC32 = CacheSpec.uniform(1, KH, D, "float32", 32)
SIZING = Sizing(num_slots=16, max_seq_len=128)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stale")
    tokens = tmp / "tokens.yaml"
    tokens.write_text("tokens:\n" + "".join(f"  - {{name: {n}, token: {t}, pools: ['*'], role: {ROLES[n]}}}\n"
                                            for n, t in TOKENS.items()))
    (tmp / "worker.token").write_text(TOKENS["wk"])
    mgr = ManagerProcess(tmp, "--no-pools", "--tokens-file", str(tokens), "--lease-seconds", "1")
    clients = {n: BlockManagerClient(mgr.target, timeout=20, token=t) for n, t in TOKENS.items()}
    clients["admin"].wait_ready()
    workers: list[WorkerProcess] = []

    def worker(pool: str) -> WorkerProcess:
        w = WorkerProcess(tmp, mgr.target, pool, f"w-{pool}", "", "--tokens-file", str(tokens),
                          "--manager-token-file", str(tmp / "worker.token"))
        workers.append(w)
        return w

    yield {"mgr": mgr, "c": clients, "worker": worker}
    for w in workers:
        w.stop()
    for c in clients.values():
        c.close()
    mgr.stop()


def refused(fn, reason: str, code=grpc.StatusCode.FAILED_PRECONDITION) -> ClientError:
    with pytest.raises(ClientError) as exc:
        fn()
    assert (exc.value.code, exc.value.reason) == (code, reason), exc.value
    return exc.value


def wait_for(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def recreate(system, pool: str, spec: CacheSpec, w: WorkerProcess) -> int:
    """Delete the pool and create it again under the same name; wait until the worker re-planned for it."""
    admin = system["c"]["admin"]
    old = admin.get_pool(pool).incarnation
    admin.delete_pool(pool, force=True)
    new = admin.create_pool(pool, spec, SIZING).incarnation
    assert new not in (0, old)
    probe = WorkerClient(w.address, token=TOKENS["admin"])
    wait_for(lambda: probe.info().pool_incarnation == new, f"worker {w.worker_id} to re-plan for incarnation {new}")
    probe.close()
    return new


def kv(rng: np.random.Generator, n: int, value: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """K random, V random (or all `value`: every decode of the sequence is then exactly that value)."""
    k = rng.standard_normal((n, KH, D)).astype(np.float32)
    v = np.full((n, KH, D), value, np.float32) if value is not None else rng.standard_normal((n, KH, D)) \
        .astype(np.float32)
    return k, v


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Float64 decode of one row: q [HQ, D] over all n tokens of k, v [n, KH, D] (GQA)."""
    qf, kf, vf = (x.astype(np.float64) for x in (q, k, v))
    rep = HQ // KH
    s = np.einsum("hd,thd->ht", qf, np.repeat(kf, rep, axis=1)) / np.sqrt(D)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return np.einsum("ht,thd->hd", p / p.sum(axis=1, keepdims=True), np.repeat(vf, rep, axis=1))


def decodes_to(wc: WorkerClient, q: np.ndarray, want: np.ndarray, **table) -> None:
    """One-row decode through `table` (table_id=... or table=..., generations=...) equals the reference."""
    got = wc.decode_attention(0, q[None], **table)
    assert got.violation.count == 0, got.violation
    err = np.abs(got.out[0] - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= TOLERANCE["float32"], err


def stale_pages_counted(w: WorkerProcess) -> float:
    text = urllib.request.urlopen(w.metrics_url, timeout=5).read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("kvworker_bounds_violations_total{") and 'reason="stale_page"' in ln)


def test_delete_and_recreate_under_the_same_name_and_geometry(system):
    """The issue's first report: after the pool was created again and a new sequence took the pages, AppendKV
    through the old table moved the new sequence's decode from 2.0 to 9.0. Now: refused, and it stays 2.0."""
    c, rng = system["c"], np.random.default_rng(1)
    c["admin"].create_pool("p1", SPEC16, SIZING)
    w = system["worker"]("p1")
    inc1 = c["admin"].get_pool("p1").incarnation
    wa = WorkerClient(w.address, token=TOKENS["ta"], pool_incarnation=inc1)
    with c["ta"].step_stream("p1") as s:
        old = s.step(admit=[1], admit_tokens=[20])
        old_reply = s.last_reply
        wa.update_tables("t1", old_reply)
        k1, v1 = kv(rng, 20, 2.0)
        assert wa.append_kv(0, k1, v1, table_id="t1").violations == []
        q = rng.standard_normal((HQ, D)).astype(np.float32)
        decodes_to(wa, q, reference(q, k1, v1), table_id="t1")
    inc2 = recreate(system, "p1", SPEC16, w)
    wa.pool_incarnation = inc2                      # the scheduler learned the new incarnation (GetPool)
    with c["ta"].step_stream("p1") as s2:
        new = s2.step(admit=[7], admit_tokens=[20])
        assert new.for_layer(0).table.indices.tolist() == old.for_layer(0).table.indices.tolist()  # the same pages
        assert (new.for_layer(0).generations != old.for_layer(0).generations).all()      # of another incarnation
        wa.update_tables("t2", s2.last_reply)
        k7, v7 = kv(rng, 20, 2.0)
        wa.append_kv(0, k7, v7, table_id="t2")
    want = reference(q, k7, v7)
    decodes_to(wa, q, want, table_id="t2")
    # The old table, used under the new incarnation: refused before any memory is touched, naming both.
    k9, v9 = kv(rng, 20, 9.0)
    err = refused(lambda: wa.append_kv(0, k9, v9, table_id="t1"), "STALE_TABLE")
    assert str(inc1) in err.message and str(inc2) in err.message
    assert err.metadata["table_incarnation"] == str(inc1) and err.metadata["pool_incarnation"] == str(inc2)
    refused(lambda: wa.decode_attention(0, q[None], table_id="t1"), "STALE_TABLE")
    # The old reply's own tables sent raw, stamped with the new incarnation: every page is stale_page (the
    # generations of another incarnation), nothing is written, the row is NaN.
    before = stale_pages_counted(w)
    st = old.for_layer(0)
    rep = wa.append_kv(0, k9, v9, st.slot_mapping, slot_generations=st.slot_generations)
    assert (rep.violations[0].count, rep.violations[0].reason) == (20, "stale_page")
    got = wa.decode_attention(0, q[None], st.table, generations=st.generations)
    assert (got.violation.count, got.violation.reason) == (2, "stale_page") and np.isnan(got.out).all()
    assert stale_pages_counted(w) == before + 22
    # Stamped with the old incarnation, the same call is refused outright.
    stale = WorkerClient(w.address, token=TOKENS["ta"], pool_incarnation=inc1)
    refused(lambda: stale.append_kv(0, k9, v9, st.slot_mapping), "STALE_INCARNATION")
    stale.close()
    decodes_to(wa, q, want, table_id="t2")           # still 2.0: the new sequence's K/V never changed
    wa.close()


def test_replan_to_another_page_size(system):
    """The issue's second report: after a re-plan to page size 32, a freshly loaded table decoded wrongly (the
    worker kept page size 16 for its tables). Now it decodes to the reference; the old table is refused."""
    c, rng = system["c"], np.random.default_rng(2)
    c["admin"].create_pool("p2", SPEC16, SIZING)
    w = system["worker"]("p2")
    wa = WorkerClient(w.address, token=TOKENS["ta"])
    with c["ta"].step_stream("p2") as s:
        s.step(admit=[1], admit_tokens=[40])
        wa.update_tables("old", s.last_reply)
        wa.append_kv(0, *kv(rng, 40), table_id="old")
    recreate(system, "p2", SPEC32, w)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    with c["ta"].step_stream("p2") as s:
        r = s.step(admit=[2], admit_tokens=[40])
        assert r.for_layer(0).table.last_page_len.tolist() == [8]                    # 40 = 32 + 8
        up = wa.update_tables("fresh", s.last_reply)
        assert (up.batch_size, up.pages_held) == (1, 2)
        k, v = kv(rng, 40)
        wa.append_kv(0, k, v, table_id="fresh")
        decodes_to(wa, q, reference(q, k, v), table_id="fresh")
        for _ in range(30):                      # decode steps: deltas of the new geometry, a page opened at 64
            s.step(extend=[2], extend_tokens=1)
            wa.update_tables("fresh", s.last_reply)
            k1, v1 = kv(rng, 1)
            wa.append_kv(0, k1, v1, table_id="fresh")
            k, v = np.concatenate((k, k1)), np.concatenate((v, v1))
        assert s.last_reply.HasField("delta")
        decodes_to(wa, q, reference(q, k, v), table_id="fresh")
    refused(lambda: wa.decode_attention(0, q[None], table_id="old"), "STALE_TABLE")
    wa.close()


def test_a_second_scheduler_of_the_same_pool(system):
    """Two tenants pick the same stream id and the same table id: two streams and two tables. Neither changes
    the other's K/V, and the first one's next request goes through (never REQUEST_ID_REUSED, never the other's
    journal position). A second stream of the same tenant cannot take a table over without saying so."""
    c, rng = system["c"], np.random.default_rng(3)
    c["admin"].create_pool("p3", SPEC16, SIZING)
    w = system["worker"]("p3")
    wa = WorkerClient(w.address, token=TOKENS["ta"])
    wb = WorkerClient(w.address, token=TOKENS["tb"])
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    with c["ta"].step_stream("p3", stream_id="sched") as sa, c["tb"].step_stream("p3", stream_id="sched") as sb:
        sa.step(admit=[1], admit_tokens=[18])
        wa.update_tables("t1", sa.last_reply)
        ka, va = kv(rng, 18, 2.0)
        wa.append_kv(0, ka, va, table_id="t1")
        sb.step(admit=[2], admit_tokens=[18])       # stream_seq 1 of "sched" again: tenant b's own stream
        assert sb.last_reply.stream_id == "sched"
        wb.update_tables("t1", sb.last_reply)       # table id "t1" again: tenant b's own table
        kb, vb = kv(rng, 18, 9.0)
        wb.append_kv(0, kb, vb, table_id="t1")
        decodes_to(wa, q, reference(q, ka, va), table_id="t1")          # still 2.0
        decodes_to(wb, q, reference(q, kb, vb), table_id="t1")          # 9.0, its own
        for _ in range(3):                          # both streams go on: no REQUEST_ID_REUSED on either
            sa.step(extend=[1], extend_tokens=1)
            sb.step(extend=[2], extend_tokens=1)
        # A second scheduler of tenant a (another stream) cannot take a's table over by accident.
        with c["ta"].step_stream("p3") as other:
            other.step(admit=[3], admit_tokens=[5])
            err = refused(lambda: wa.update_tables("t1", other.last_reply), "STALE_TABLE")
            assert "belong to stream 'sched'" in err.message
            assert wa.update_tables("t3", other.last_reply).batch_size == 1     # under its own id it may
    # Unary request ids are scoped by tenant too: b reusing a's id gets its own Step applied, and no error
    # ever shows a journal position (not even b's own: docs/DURABILITY.md, rolled-back state).
    ra = c["ta"].step("p3", admit=[10], admit_tokens=[3], request_id="rid-1")
    rb = c["tb"].step("p3", admit=[11], admit_tokens=[4], request_id="rid-1")
    assert (ra.seq_ids.tolist(), rb.seq_ids.tolist()) == ([10], [11]) and ra.position[1] != rb.position[1]
    again = c["ta"].step("p3", admit=[10], admit_tokens=[3], request_id="rid-1")      # a's retry: its own reply
    assert again.seq_ids.tolist() == [10]             # recognised as a retry (else ALREADY_EXISTS: 10 is live)
    err = refused(lambda: c["tb"].step("p3", admit=[12], admit_tokens=[4], request_id="rid-1"), "REQUEST_ID_REUSED",
                  grpc.StatusCode.INVALID_ARGUMENT)
    assert "rid-1" in err.message and "position" not in err.message
    wa.close()
    wb.close()


def test_a_scheduler_that_reconnects_after_the_pool_was_created_again(system):
    """Its stream resumes (same stream id) on a new incarnation: its old table and old deltas are refused, the
    full reply of the new pool loads it afresh, and the K/V it writes then decode right."""
    c, rng = system["c"], np.random.default_rng(4)
    c["admin"].create_pool("p4", SPEC16, SIZING)
    w = system["worker"]("p4")
    wa = WorkerClient(w.address, token=TOKENS["ta"])
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    s = c["ta"].step_stream("p4", stream_id="resume-me")
    s.step(admit=[1], admit_tokens=[30])
    wa.update_tables("t1", s.last_reply)
    wa.append_kv(0, *kv(rng, 30, 2.0), table_id="t1")
    s.step(extend=[1], extend_tokens=1)
    old_delta = s.last_reply
    assert old_delta.HasField("delta")
    s.close()
    recreate(system, "p4", SPEC16, w)
    seq = s.seq
    s = c["ta"].step_stream("p4", stream_id="resume-me")           # reconnects: the same stream id, and
    s.seq = seq                                                     # its numbering goes on (as a resume does)
    with pytest.raises(ClientError) as exc:                         # its sequence went with the old pool
        s.step(extend=[1], extend_tokens=1)
    assert exc.value.code == grpc.StatusCode.NOT_FOUND
    refused(lambda: wa.append_kv(0, *kv(rng, 1, 9.0), table_id="t1"), "STALE_TABLE")
    refused(lambda: wa.update_tables("t1", old_delta), "STALE_TABLE")  # a delta built on the old incarnation
    s.step(admit=[1], admit_tokens=[30])                            # admitted again in the new pool
    assert s.last_reply.stream_id == "resume-me" and not s.last_reply.HasField("delta")
    wa.update_tables("t1", s.last_reply)                            # the full reply of the new pool loads it
    k, v = kv(rng, 30, 5.0)
    wa.append_kv(0, k, v, table_id="t1")
    decodes_to(wa, q, reference(q, k, v), table_id="t1")
    s.close()
    wa.close()


def test_a_table_that_outlived_its_sequence_is_stale_page(system):
    """Same incarnation: a scheduler stops forwarding replies to one of its tables, its sequence is freed and
    another sequence takes the pages. Reading the old table is stale_page (NaN), never the other's K/V."""
    c, rng = system["c"], np.random.default_rng(5)
    c["admin"].create_pool("p5", SPEC16, SIZING)
    w = system["worker"]("p5")
    wa = WorkerClient(w.address, token=TOKENS["ta"])
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    with c["ta"].step_stream("p5") as s:
        s.step(admit=[1], admit_tokens=[20])
        wa.update_tables("frozen", s.last_reply)
        wa.update_tables("live", s.last_reply)
        wa.append_kv(0, *kv(rng, 20, 2.0), table_id="live")
        s.step(free=[1], admit=[2], admit_tokens=[20])              # seq 2 takes seq 1's slots
        wa.update_tables("live", s.last_reply)
        k, v = kv(rng, 20, 9.0)
        wa.append_kv(0, k, v, table_id="live")
        decodes_to(wa, q, reference(q, k, v), table_id="live")
        got = wa.decode_attention(0, q[None], table_id="frozen")
        assert (got.violation.count, got.violation.reason) == (2, "stale_page") and np.isnan(got.out).all()
        rep = wa.append_kv(0, *kv(rng, 20, 7.0), table_id="frozen")
        assert rep.violations[0].reason == "stale_page" and rep.violations[0].count == 20
        decodes_to(wa, q, reference(q, k, v), table_id="live")      # seq 2's K/V unchanged
    wa.close()
