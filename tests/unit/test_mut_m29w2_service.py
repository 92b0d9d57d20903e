"""The worker's gRPC service in process (NumPy kernels, a server on 127.0.0.1): every series docs/DESIGN.md names is
exported at 0 from the first scrape for exactly the layers and buffers served, again after a re-plan; the leader
epoch fence of docs/HA.md on the four fenced RPCs, every refusal counted by reason in the worker's metrics."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvservice.contract.geometry import CacheSpec
from kvservice.contract.serving import grpc_server
from kvservice.contract.transport import EPOCH_METADATA
from kvservice.v1 import worker_pb2 as wpb
from kvservice.v1 import worker_pb2_grpc as wpb_grpc
from kvservice.worker import ops_numpy
from kvservice.worker.caches import CacheSet
from kvservice.worker.metrics import WorkerMetrics
from kvservice.worker.server import SERVICE_NAME
from kvservice.worker.service import WorkerServicer

PS, LAYERS, HEADS, DIM = 4, 4, 2, 32
# docs/DESIGN.md "Kernel contract" and docs/KERNELS.md: the kernels and every reason a worker counts
KERNEL_NAMES = ("append_kv", "decode_attention", "copy_blocks", "validate_page_table")
REASON_NAMES = ("out_of_bounds", "off_lattice", "bad_last_page_len", "bad_indptr", "wrong_index_space", "stale_page")


def _caches(slots: int, begin: int, end: int) -> CacheSet:
    return CacheSet(CacheSpec.uniform(LAYERS, HEADS, DIM, "float32", PS), slots, begin, end, ops_numpy,
                    max_seq_len=64)


def _samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    fams = text_string_to_metric_families(generate_latest(metrics.registry).decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams for s in f.samples}


def _expected_zero_series(pool: str, layers: range, slots: int) -> dict[tuple[str, tuple], float]:
    """The series a worker of `layers` (per-layer buffers of float32 K and V) exports before any call."""
    page_bytes = 2 * PS * HEADS * DIM * 4
    out: dict[tuple[str, tuple], float] = {
        ("kvworker_cache_bytes", (("pool", pool),)): len(layers) * slots * page_bytes,
        ("kvworker_state_rollbacks_total", ()): 0, ("kvworker_kernels_stopped_total", ()): 0}
    for k in KERNEL_NAMES:
        for layer in layers:
            for r in REASON_NAMES:
                out[("kvworker_bounds_violations_total", (("kernel", k), ("layer", str(layer)), ("reason", r)))] = 0
        out[("kvworker_kernel_duration_seconds_count", (("kernel", k),))] = 0
        out[("kvworker_kernel_duration_seconds_sum", (("kernel", k),))] = 0
    for layer in layers:
        out[("kvworker_guard_corruptions_total", (("buffer", f"layer{layer}"),))] = 0
    for r in ("STALE_LEADER_EPOCH", "LEADER_EPOCH_REQUIRED"):
        out[("kvworker_leader_epoch_refusals_total", (("reason", r),))] = 0
    return out


def _without_buckets_and_created(s: dict) -> dict:
    return {k: v for k, v in s.items() if not k[0].endswith(("_bucket", "_created"))}


def test_every_series_starts_at_zero_for_the_layers_served_and_again_after_a_replan():
    """A worker of layers [1, 3): each kernel x served layer x reason, each buffer, each refusal reason and each
    kernel's duration at 0 and nothing of layers 0 or 3; the cache bytes hand-computed. Re-planned onto
    layers [1, 4) of a pool with other slots: the new layer's series appear at 0 and the cache bytes follow."""
    rng = np.random.default_rng(77)
    slots = int(rng.integers(8, 40))
    pool = f"pool-{int(rng.integers(1000))}"
    metrics = WorkerMetrics(pool)
    servicer = WorkerServicer(_caches(slots, 1, 3), metrics, {"worker_id": "w", "pool": pool, "epoch": 1,
                                                                "incarnation": 5, "backend": "cpu"})
    assert _without_buckets_and_created(_samples(metrics)) == _expected_zero_series(pool, range(1, 3), slots)
    more = slots + int(rng.integers(1, 9))
    servicer.replan(_caches(more, 1, 4), 6)
    want = _expected_zero_series(pool, range(1, 4), more)
    assert _without_buckets_and_created(_samples(metrics)) == want


@pytest.fixture
def fenced():
    """A worker whose manager client has seen leader epoch seen[0] (0: an unreplicated manager)."""
    seen = [0]
    metrics = WorkerMetrics("p")
    servicer = WorkerServicer(_caches(16, 0, 2), metrics, {"worker_id": "w-5", "pool": "p", "epoch": 1,
                                                           "incarnation": 0, "backend": "cpu"},
                              leader_epoch=lambda: seen[0])
    server, port, _ = grpc_server(SERVICE_NAME, servicer, "127.0.0.1:0", max_workers=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield wpb_grpc.WorkerStub(channel), seen, metrics
    finally:
        channel.close()
        server.stop(None)


def test_the_leader_epoch_fence_refuses_and_counts_by_the_documented_rule(fenced):
    """docs/HA.md on random epochs and stamps: of AppendKV, DecodeAttention, CopyBlocks and UpdateTables a call
    stamped below the epoch seen is refused STALE_LEADER_EPOCH, an unstamped one LEADER_EPOCH_REQUIRED once an
    epoch was seen, anything else passes the fence (and meets the request's own checks: INVALID_ARGUMENT for
    these empty requests); ValidatePageTable and Info are never fenced. Each refusal counts once by reason."""
    stub, seen, metrics = fenced
    rng = np.random.default_rng(505)
    calls = {"AppendKV": (stub.AppendKV, wpb.AppendKVRequest(layer=1)),
             "DecodeAttention": (stub.DecodeAttention, wpb.DecodeAttentionRequest(layer=0)),
             "CopyBlocks": (stub.CopyBlocks, wpb.CopyBlocksRequest(group=0)),
             "UpdateTables": (stub.UpdateTables, wpb.UpdateTablesRequest(table_id="bad id!")),
             "ValidatePageTable": (stub.ValidatePageTable, wpb.WorkerValidateRequest(layer=0))}
    want = {"STALE_LEADER_EPOCH": 0, "LEADER_EPOCH_REQUIRED": 0}
    for _ in range(40):
        seen[0] = int(rng.choice([0, int(rng.integers(1, 30))]))
        stamp = None if rng.random() < 0.3 else int(rng.integers(1, 35))
        name = str(rng.choice(sorted(calls)))
        method, request = calls[name]
        md = [] if stamp is None else [(EPOCH_METADATA, str(stamp))]
        fenced_call = name != "ValidatePageTable"
        reason = None
        if fenced_call and seen[0]:
            reason = "LEADER_EPOCH_REQUIRED" if stamp is None else "STALE_LEADER_EPOCH" if stamp < seen[0] else None
        with pytest.raises(grpc.RpcError) as err:
            method(request, metadata=md, timeout=30)
        if reason is None:
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, seen, stamp, err.value.details())
            continue
        want[reason] += 1
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (name, seen, stamp)
        text = err.value.details()
        assert text.startswith(f"{name}: worker w-5 of pool 'p' ")
        if reason == "LEADER_EPOCH_REQUIRED":
            assert f"(leader epoch {seen[0]}) and this call names no leader epoch" in text
        else:
            assert f"has seen leader epoch {seen[0]}, but this call's tables come from epoch {stamp}" in text
        assert stub.Info(wpb.WorkerInfoRequest(), timeout=30).worker_id == "w-5"
    s = _samples(metrics)
    assert min(want.values()) >= 2
    assert {r: s[("kvworker_leader_epoch_refusals_total", (("reason", r),))] for r in want} == want


def test_every_series_the_dashboards_and_alerts_query_is_exported_with_its_type_and_help():
    """Each kvworker_* name deploy/ (Grafana, Prometheus rules) and docs/ query is a sample of a fresh worker; each
    family has its Prometheus type, and its HELP says what it counts (as /metrics shows it); the duration
    histogram's buckets run from 10 us to 5 s."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    text = " ".join(p.read_text(errors="replace") for d in ("deploy", "docs") for p in (root / d).rglob("*")
                    if p.is_file() and p.suffix in (".json", ".yaml", ".yml", ".md"))
    queried = set(re.findall(r"kvworker_[a-z_]+", text))
    assert {"kvworker_bounds_violations_total", "kvworker_guard_corruptions_total"} <= queried
    metrics = WorkerMetrics("p")
    WorkerServicer(_caches(8, 0, 2), metrics, {"worker_id": "w", "pool": "p", "epoch": 1, "backend": "cpu"})
    fams = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    names = {s.name for f in fams for s in f.samples} | {f.name for f in fams}
    assert queried <= names, queried - names
    kinds = {f.name: (f.type, f.documentation) for f in fams if not f.name.endswith("_created")}
    assert kinds == {
        "kvworker_bounds_violations": ("counter", "Page-table entries a kernel refused to follow (never read or "
                                                  "written)."),
        "kvworker_guard_corruptions": ("counter", "Corrupted canary bytes found around a cache buffer."),
        "kvworker_kernel_duration_seconds": ("histogram", "Time per kernel call."),
        "kvworker_leader_epoch_refusals": ("counter", "Kernel calls refused for naming a deposed leader's epoch or "
                                                      "none (replicated managers, docs/HA.md)."),
        "kvworker_state_rollbacks": ("counter", "Manager replies (registration, heartbeats, pool reads) this worker "
                                                "refused because the manager's state was behind what it had already "
                                                "seen in the same lineage (STATE_ROLLED_BACK, docs/DURABILITY.md)."),
        "kvworker_kernels_stopped": ("counter", "Kernel calls stopped part-way because their deadline passed or their "
                                                "caller went away (CPU kernels; kvservice/worker/cancel.py)."),
        "kvworker_cache_bytes": ("gauge", "Bytes of KV cache this worker holds."),
    }
    les = sorted({float(s.labels["le"]) for f in fams for s in f.samples
                  if s.name == "kvworker_kernel_duration_seconds_bucket"})
    assert les == [1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, float("inf")]


def test_metrics_go_to_the_registry_given():
    """WorkerMetrics(pool, registry): its series are that registry's (a process serving several workers' metrics
    from one endpoint), none in another worker's."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    mine, other = WorkerMetrics("p", reg), WorkerMetrics("q")
    assert mine.registry is reg and other.registry is not reg
    mine.cache_bytes.labels("p").set(12345)
    assert reg.get_sample_value("kvworker_cache_bytes", {"pool": "p"}) == 12345
    assert other.registry.get_sample_value("kvworker_cache_bytes", {"pool": "p"}) is None
