"""Hostile input on every Worker RPC, over gRPC, against in-process workers (CPU backend) of two pools.

Each case must get OK or a caller-mistake status with a message (never UNKNOWN or INTERNAL),
the worker must keep answering, and the canary bytes around every cache buffer must stay
intact: no fuzzed kernel call may write outside its cache (CorruptGuard, the test hook, is
fuzzed separately and its damage undone). Kernel requests carry a pool_incarnation that is
mostly the worker's own or 0 and sometimes another: those are refused and write nothing.

UpdateTables gets real StepStream replies of its pool, mutated (tests/fuzz/hostile_tables.py), after
replaying the stream up to them; whatever it accepts, the kernels then read through it, checked. A real
worker process then takes the issue's hostile tables and hundreds of mutations while its peak resident
set (VmHWM) is watched: it never grows past the pool's table size (UpdateTablesReply.max_table_bytes)
plus the request and a constant, nor, over 64 table ids, past the tenant's quota plus that.
"""

import os
import random
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.server.app import serve
from kvservice.v1 import block_manager_pb2 as pb
from kvservice.v1 import common_pb2 as cpb
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker.caches import CacheSet
from kvservice.worker.server import serve_worker

from .hostile_tables import mutate
from .support import call, float_tensor, fuzz_settings, garbage_tensor, int_tensor, maybe, mostly, names, small_or_huge

pytestmark = pytest.mark.integration
SVC = "Worker"
NUM_SLOTS = 32
POOLS = {
    "wf": CacheSpec.uniform(2, 2, 32, "float16", 16),
    "wh": CacheSpec((LayerSpec(2, 32, "bfloat16"), LayerSpec(1, 64, "bfloat16"),
                     LayerSpec(2, 32, "bfloat16", sliding_window=32)), 16, "interleaved"),
}


@dataclass
class Worker:
    stub: wpb_grpc.WorkerStub
    channel: grpc.Channel
    caches: CacheSet
    spec: CacheSpec
    incarnation: int
    target: str = ""


@pytest.fixture(scope="module")
def workers():
    manager = serve()
    target = f"127.0.0.1:{manager.port}"
    from kvservice.client import BlockManagerClient
    with BlockManagerClient(target) as c:
        for name, spec in POOLS.items():
            c.create_pool(name, spec, Sizing(num_slots=NUM_SLOTS, max_seq_len=256))
    running, out = [], {}
    for name, spec in POOLS.items():
        w = serve_worker(target, name, f"fuzz-{name}", backend="cpu", test_hooks=True)
        ch = grpc.insecure_channel(f"127.0.0.1:{w.port}")
        running.append(w)
        out[name] = Worker(wpb_grpc.WorkerStub(ch), ch, w.servicer.caches, spec, w.identity["incarnation"], target)
    yield out
    for w in out.values():
        w.channel.close()
    for r in running:
        r.stop()
    manager.stop()


def intact(w: Worker) -> None:
    """The worker answers and no byte around any cache buffer changed."""
    rep = w.stub.CheckGuards(wpb.CheckGuardsRequest(), timeout=30)
    assert rep.ok, [b for b in rep.buffers if b.corrupted_bytes]
    assert w.stub.Info(wpb.WorkerInfoRequest(), timeout=30).worker_id.startswith("fuzz-")


# ---- strategies ---------------------------------------------------------------------------
policies = mostly(st.sampled_from([0, 1, 2]), st.integers(3, 2**31 - 1), 8)
layers = mostly(st.integers(0, 2), small_or_huge)


def incarnations(w: Worker):
    """The worker's own pool incarnation or 0 (unchecked), and about one draw in six another one."""
    return mostly(st.sampled_from([w.incarnation, 0]), st.one_of(st.integers(1, 2**64 - 1),
                                                                 st.just(w.incarnation + 1)), 6)


@st.composite
def page_values(draw, w: Worker, layer: int, n: int, per_page: int = 1) -> np.ndarray:
    """n page-ish values around the layer's bounds: valid, off-lattice, negative, past the end, huge."""
    lay = w.caches.layouts.get(layer) or next(iter(w.caches.layouts.values()))
    ub = lay.upper_bound * per_page
    return np.asarray(draw(st.lists(st.one_of(st.integers(0, max(0, ub - 1)), st.integers(0, max(0, ub - 1)),
                                              st.integers(-3, ub + 5), st.sampled_from([-1, ub, 2**31 - 1])),
                                    min_size=n, max_size=n)), np.int64)


def layer_shape(w: Worker, layer: int) -> tuple[int, int, str]:
    ls = w.spec.layers[layer] if layer < len(w.spec.layers) else w.spec.layers[0]
    return ls.kv_heads, ls.head_dim, ls.dtype


@st.composite
def csr(draw, w: Worker, layer: int, msg) -> None:
    """indptr / indices / last_page_len: a CSR table with bad entries, or garbage, or missing."""
    if draw(st.integers(0, 3)):
        lens = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
        ip = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
        if draw(st.integers(0, 5)) == 0:
            ip[draw(st.integers(0, len(ip) - 1))] = draw(st.sampled_from([-1, 10**6, 2**31 - 1]))
        msg.indptr.CopyFrom(cpb.Tensor(dtype=cpb.INT32, data=ip.tobytes()))
        idx = draw(page_values(w, layer, int(max(0, ip[-1])) if ip[-1] < 64 else 3)).astype(np.int32)
        msg.indices.CopyFrom(cpb.Tensor(dtype=cpb.INT32, data=idx.tobytes()))
        lpl = np.asarray(draw(st.lists(mostly(st.integers(1, 16), st.integers(-1, 20)), min_size=len(lens),
                                       max_size=len(lens))), np.int32)
        msg.last_page_len.CopyFrom(cpb.Tensor(dtype=cpb.INT32, data=lpl.tobytes()))
        return len(lens)
    for f in ("indptr", "indices", "last_page_len"):
        t = draw(maybe(st.one_of(int_tensor(dtype=np.int32, hi=40), garbage_tensor())))
        if t is not None:
            getattr(msg, f).CopyFrom(t)
    return draw(st.integers(0, 3))


@st.composite
def append_requests(draw, w: Worker) -> wpb.AppendKVRequest:
    layer = draw(layers)
    kv, hd, dtype = layer_shape(w, layer)
    n = draw(st.integers(0, 5))
    r = wpb.AppendKVRequest(layer=layer, policy=draw(policies), pool_incarnation=draw(incarnations(w)))
    ps = w.spec.page_size
    r.slot_mapping.CopyFrom(cpb.Tensor(dtype=cpb.INT64, data=draw(page_values(w, layer, n, ps)).tobytes()))
    shape = draw(mostly(st.just((n, kv, hd)), st.sampled_from([(n, kv + 1, hd), (n + 1, kv, hd), (n, hd)])))
    for f in ("k", "v"):
        if draw(st.integers(0, 7)):
            getattr(r, f).CopyFrom(draw(float_tensor(shape, draw(mostly(st.just(dtype), st.just("float32"))))))
        else:
            getattr(r, f).CopyFrom(draw(garbage_tensor()))
    if draw(st.integers(0, 7)) == 0:
        r.slot_mapping.CopyFrom(draw(st.one_of(garbage_tensor(), int_tensor(dtype=np.int32))))
    return r


@st.composite
def decode_requests(draw, w: Worker) -> wpb.DecodeAttentionRequest:
    layer = draw(layers)
    kv, hd, dtype = layer_shape(w, layer)
    r = wpb.DecodeAttentionRequest(layer=layer, policy=draw(policies), pool_incarnation=draw(incarnations(w)),
                                   sm_scale=draw(st.one_of(st.just(0.0), st.floats(width=32))))
    b = draw(csr(w, layer, r))
    qh = draw(mostly(st.sampled_from([kv, 2 * kv]), st.sampled_from([kv + 1, 0])))
    shape = draw(mostly(st.just((b, qh, hd)), st.sampled_from([(b + 1, qh, hd), (b, qh, hd + 1)])))
    r.q.CopyFrom(draw(float_tensor(shape, draw(mostly(st.just(dtype), st.just("float16")))))
                 if draw(st.integers(0, 7)) else draw(garbage_tensor()))
    return r


@st.composite
def copy_requests(draw, w: Worker) -> wpb.CopyBlocksRequest:
    r = wpb.CopyBlocksRequest(group=draw(mostly(st.integers(0, 1), small_or_huge)), policy=draw(policies),
                              pool_incarnation=draw(incarnations(w)))
    if draw(st.integers(0, 4)):
        n = draw(st.integers(0, 4))
        vals = draw(st.lists(st.one_of(st.integers(0, NUM_SLOTS - 1), st.integers(-2, NUM_SLOTS + 2),
                                       st.sampled_from([2**62, -(2**62)])), min_size=2 * n, max_size=2 * n))
        shape = draw(st.sampled_from([[n, 2], [n, 2], [2 * n], [2, n], [n, 2, 1]]))
        r.pairs.CopyFrom(cpb.Tensor(dtype=draw(st.sampled_from([cpb.INT64, cpb.INT64, cpb.INT32])), shape=shape,
                                    data=np.asarray(vals, np.int64).tobytes()))
    elif draw(st.booleans()):
        r.pairs.CopyFrom(draw(garbage_tensor()))
    return r


@st.composite
def validate_requests(draw, w: Worker) -> wpb.WorkerValidateRequest:
    r = wpb.WorkerValidateRequest(layer=draw(layers), pool_incarnation=draw(incarnations(w)))
    draw(csr(w, r.layer if r.layer < 3 else 0, r))
    return r


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool", sorted(POOLS))
@fuzz_settings(100)
@given(data=st.data())
def test_append_kv(workers, pool, data):
    w = workers[pool]
    request = data.draw(append_requests(w))
    stale = request.pool_incarnation not in (0, w.incarnation)
    before = [b.raw.copy() for b in w.caches.buffers.values()] if stale else None
    call(SVC, "AppendKV", w.stub.AppendKV, request)
    if stale:          # refused before any kernel: not one byte of the caches changed
        assert all(np.array_equal(a, b.raw) for a, b in zip(before, w.caches.buffers.values(), strict=True))
    intact(w)


@pytest.mark.parametrize("pool", sorted(POOLS))
@fuzz_settings(100)
@given(data=st.data())
def test_decode_attention(workers, pool, data):
    w = workers[pool]
    call(SVC, "DecodeAttention", w.stub.DecodeAttention, data.draw(decode_requests(w)))
    intact(w)


@pytest.mark.parametrize("pool", sorted(POOLS))
@fuzz_settings(60)
@given(data=st.data())
def test_copy_blocks(workers, pool, data):
    w = workers[pool]
    call(SVC, "CopyBlocks", w.stub.CopyBlocks, data.draw(copy_requests(w)))
    intact(w)


@pytest.mark.parametrize("pool", sorted(POOLS))
@fuzz_settings(60)
@given(data=st.data())
def test_validate_page_table(workers, pool, data):
    w = workers[pool]
    call(SVC, "ValidatePageTable", w.stub.ValidatePageTable, data.draw(validate_requests(w)))
    intact(w)


@fuzz_settings(20)
@given(st.sampled_from(sorted(POOLS)))
def test_info_and_check_guards(workers, pool):
    w = workers[pool]
    call(SVC, "Info", w.stub.Info, wpb.WorkerInfoRequest())
    call(SVC, "CheckGuards", w.stub.CheckGuards, wpb.CheckGuardsRequest())


@fuzz_settings(60)
@given(st.sampled_from(sorted(POOLS)), st.one_of(st.sampled_from(["layer0", "layer1", "group0", "group1", ""]),
                                                  st.text(max_size=12)),
       st.booleans(), st.one_of(st.integers(0, 64), small_or_huge))
def test_corrupt_guard_is_caught_and_undone(workers, pool, buffer, after, offset):
    w = workers[pool]
    req = wpb.CorruptGuardRequest(buffer=buffer, after=after, offset=offset)
    if call(SVC, "CorruptGuard", w.stub.CorruptGuard, req) is not None:
        rep = w.stub.CheckGuards(wpb.CheckGuardsRequest(), timeout=30)
        assert not rep.ok and [b.buffer for b in rep.buffers if b.corrupted_bytes] == [buffer]
        w.stub.CorruptGuard(req, timeout=30)             # the hook flips the byte: flipping again restores it
    intact(w)


@fuzz_settings(40)
@given(st.sampled_from(sorted(POOLS)), st.sampled_from(sorted(wpb.DESCRIPTOR.services_by_name[SVC].methods_by_name)),
       st.binary(max_size=48))
def test_undecodable_bytes(workers, pool, method, payload):
    w = workers[pool]
    raw = w.channel.unary_unary(f"/kvservice.v1.Worker/{method}", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    call(SVC, f"{method} (raw)", raw, payload)      # never INTERNAL: the worker registers lenient handlers
    intact(w)


# ---- UpdateTables ------------------------------------------------------------------------------
def stream_replies(target: str, pool: str) -> list[pb.StepReply]:
    """A real stream's replies on `pool`, in order: full tables, then deltas of decode, prefill chunks, a free and
    an admission, a fork with copy-on-write."""
    from kvservice.client import BlockManagerClient

    out = []
    with BlockManagerClient(target) as c, c.step_stream(pool) as s:
        steps = [dict(admit=[1, 2], admit_tokens=[5, 40])] + [dict(extend=[1, 2])] * 3 + \
            [dict(extend=[1, 2], extend_tokens=[17, 1]), dict(free=[1], admit=[3], admit_tokens=[20]),
             dict(fork=[(2, 4)]), dict(extend=[2, 4]), dict(free=[2, 3, 4])]
        for kw in steps:
            if "extend" in kw:
                kw.setdefault("extend_tokens", 1)
            s.step(**kw)
            out.append(s.last_reply)
    return out


def ones(shape: tuple[int, ...], dtype: str) -> cpb.Tensor:
    """A tensor of 1.0 in a cache dtype."""
    if dtype == "bfloat16":
        return cpb.Tensor(dtype=cpb.BFLOAT16, shape=list(shape), data=np.full(shape, 0x3F80, np.uint16).tobytes())
    return cpb.Tensor(dtype={"float16": cpb.FLOAT16, "float32": cpb.FLOAT32}[dtype], shape=list(shape),
                      data=np.ones(shape, np.dtype(dtype)).tobytes())


@pytest.fixture(scope="module")
def corpus(workers):
    return {name: stream_replies(w.target, name) for name, w in workers.items()}


@pytest.mark.parametrize("pool", sorted(POOLS))
@fuzz_settings(150)
@given(data=st.data())
def test_update_tables(workers, corpus, pool, data):
    w = workers[pool]
    rnd = data.draw(st.randoms(use_true_random=False))
    replies = corpus[pool]
    at = rnd.randrange(len(replies))
    table_id = data.draw(mostly(st.sampled_from(["f1", "f2"]), names))
    if rnd.random() < 0.6:                     # the stream up to this reply first, so that its delta applies
        for r in replies[:at]:
            call(SVC, "UpdateTables", w.stub.UpdateTables, wpb.UpdateTablesRequest(table_id="base", step=r))
        table_id = "base"
    reply = mutate(rnd, replies[at], rnd.choice([0, 1, 1, 2, 3]))
    up = call(SVC, "UpdateTables", w.stub.UpdateTables,
              wpb.UpdateTablesRequest(table_id=table_id, step=reply, replace=rnd.random() < 0.2))
    if up is not None:                         # accepted: the kernels read and write through it, checked
        kv, hd, dtype = layer_shape(w, 0)
        r = wpb.DecodeAttentionRequest(layer=0, table_id=table_id)
        r.q.CopyFrom(ones((up.batch_size, 2 * kv, hd), dtype))
        call(SVC, "DecodeAttention", w.stub.DecodeAttention, r)
        a = wpb.AppendKVRequest(layer=0, table_id=table_id)
        n = up.batch_size if rnd.random() < 0.5 else 1
        for f in ("k", "v"):
            getattr(a, f).CopyFrom(ones((n, kv, hd), dtype))
        call(SVC, "AppendKV", w.stub.AppendKV, a)
    intact(w)


def vm_hwm(pid: int) -> int:
    """Peak resident set of a process so far, bytes (VmHWM of /proc/<pid>/status)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc")


MEM_SPEC = CacheSpec.uniform(1, 1, 32, "float16", 16)
MEM_SLOTS, MEM_SEQ = 512, 8192
SLACK = 48 << 20          # Python, gRPC and NumPy allocator slack: a constant, whatever the requests claim
IN_TRANSIT = 3            # a request's own bytes are held about 3 times while it is read: gRPC's buffer, the
                          # parsed message, one bytes object per array field read (bounded by the message limit)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM needs Linux /proc")
def test_update_tables_peak_memory_is_bounded(tmp_path):
    """A real worker process takes the issue's hostile tables (one claimed 512 MiB in 123 bytes, one took a worker
    to 3.1 GiB) and 400 mutations of real replies: 0 INTERNAL, and its peak resident set grows by at most the
    pool's table size + the largest request (3 times: in transit) + a constant; over 64 table ids of the largest
    acceptable table, by at most the tenant's quota + that."""
    from kvservice.client import BlockManagerClient
    from tests.integration.conftest import ManagerProcess, WorkerProcess

    from .hostile_tables import full_reply, issue_cases

    m = ManagerProcess(tmp_path, "--no-pools")
    w = None
    try:
        with BlockManagerClient(m.target, timeout=30) as c:
            c.wait_ready()
            c.create_pool("mem", MEM_SPEC, Sizing(num_slots=MEM_SLOTS, max_seq_len=MEM_SEQ))
        w = WorkerProcess(tmp_path, m.target, "mem", "w-mem")
        stub = wpb_grpc.WorkerStub(w.client._channel)
        replies = stream_replies(m.target, "mem")
        first = call(SVC, "UpdateTables", stub.UpdateTables, wpb.UpdateTablesRequest(table_id="warm", step=replies[0]))
        table_size, quota = first.max_table_bytes, first.tenant_quota_bytes
        max_rows, max_pages = min(1024, MEM_SLOTS), MEM_SEQ // 16
        assert table_size == max_rows * max_pages * (4 + 4 + 8) + max_rows * (32 + 8)     # cells, gens, index, rows
        baseline = vm_hwm(w.proc.pid)
        largest = 0
        rnd = random.Random(26)
        cases = [r for _, r in issue_cases(16, MEM_SLOTS, max_rows, max_pages)]
        cases += [wpb.UpdateTablesRequest(table_id=rnd.choice(["h", "base"]), step=mutate(rnd, rnd.choice(replies),
                                                                                           rnd.randint(1, 3)))
                  for _ in range(400)]
        codes = set()
        for req in cases:
            largest = max(largest, req.ByteSize())
            codes.add(call(SVC, "UpdateTables", stub.UpdateTables, req) is None)
        single = vm_hwm(w.proc.pid) - baseline
        assert single <= table_size + IN_TRANSIT * largest + SLACK, (single, table_size, largest)
        big = full_reply(max_rows, max_pages * 16, 16, MEM_SLOTS, new_tokens=False)
        for i in range(64):                          # one tenant fills 64 ids with the largest acceptable table
            up = call(SVC, "UpdateTables", stub.UpdateTables, wpb.UpdateTablesRequest(table_id=f"max{i}", step=big))
            assert up is not None and up.tenant_bytes <= quota
        many = vm_hwm(w.proc.pid) - baseline
        assert many <= quota + table_size + IN_TRANSIT * max(largest, big.ByteSize()) + SLACK, (many, quota)
        print(f"\nworker peak growth: {single / 2**20:.1f} MiB over {len(cases)} hostile UpdateTables "
              f"(table size {table_size / 2**20:.1f} MiB, largest request {largest / 2**20:.1f} MiB); "
              f"{many / 2**20:.1f} MiB with 64 ids of the largest table (quota {quota / 2**20:.1f} MiB)")
    finally:
        if w is not None:
            w.stop()
        m.stop()
