"""A multi-head latent attention pool end to end: planned from DeepSeek-V2-Lite's published config (4 of its layers),
stepped by the manager's Pool, its latents appended through a worker's RPCs with the Step's slot mappings, every
table validated on the worker with 0 violations, the stored latents read back exactly; a table of another index
space is rejected as for any pool (wrong_index_space, counted), and decode attention refuses the layer naming MLA."""

import json
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvservice.client import ClientError
from kvservice.client.worker_client import WorkerClient
from kvservice.contract.sizing import Sizing
from kvservice.core.invariants import assert_invariants
from kvservice.core.model_config import model_cache
from kvservice.core.planner import plan
from kvservice.core.pool import Pool
from kvservice.server.app import grpc_server
from kvservice.worker import ops_numpy
from kvservice.worker.caches import CacheSet
from kvservice.worker.metrics import WorkerMetrics
from kvservice.worker.server import SERVICE_NAME
from kvservice.worker.service import WorkerServicer

pytestmark = pytest.mark.integration
CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs" / "heldout" / "deepseek-v2-lite.json"
PS, LATENT = 16, 512 + 64


@pytest.fixture(params=["per_layer", "interleaved"])
def mla(request):
    cfg = {**json.loads(CONFIG.read_text()), "num_hidden_layers": 4}
    spec = model_cache(cfg, page_size=PS, layout=request.param).spec
    assert {(la.kv_heads, la.head_dim, la.k_only) for la in spec.layers} == {(1, LATENT, True)}
    p = plan(spec, Sizing(max_batch=4, max_seq_len=256))
    caches = CacheSet(spec, list(p.group_slots), 0, len(spec.layers), ops_numpy)
    servicer = WorkerServicer(caches, WorkerMetrics("mla"), {"worker_id": "mla", "pool": "mla", "backend": "cpu"})
    server, port, _ = grpc_server(SERVICE_NAME, servicer, "127.0.0.1:0")
    server.start()
    client = WorkerClient(f"127.0.0.1:{port}", "mla", timeout=20)
    yield Pool("mla", p), client, servicer
    client.close()
    server.stop(0)


def bf16(rng, shape):
    x = rng.uniform(0.1, 1.0, shape).astype(np.float32) * rng.choice([-1.0, 1.0], shape).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def test_mla_pool_steps_append_and_validate_with_no_violation(mla):
    pool, client, servicer = mla
    rng = np.random.default_rng(41)
    spaces = pool.plan.geometry.index_spaces
    written: dict[tuple[int, int, int], np.ndarray] = {}      # (layer, seq, token) -> latent appended
    live: dict[int, int] = {}
    copied = 0
    steps = [dict(admit_ids=[1, 2, 3], admit_tokens=[37, 16, 5]), dict(extend_ids=[1, 2, 3], extend_tokens=[1, 1, 20]),
             dict(fork_parents=[2], fork_children=[4]), dict(extend_ids=[1, 2, 3], extend_tokens=[1, 1, 1]),
             dict(free_ids=[1], extend_ids=[4], extend_tokens=[3], admit_ids=[5], admit_tokens=[70]),
             *[dict(extend_ids=[2, 3, 4, 5], extend_tokens=[1, 1, 1, 1]) for _ in range(20)]]
    for kw in steps:
        r = pool.step(**{k: np.asarray(v, dtype=np.int64) for k, v in kw.items()})
        assert_invariants(pool)
        for g, pairs in enumerate(r.copies):            # copy-on-write of shared last pages, before the appends
            if len(pairs):
                copied += len(pairs)
                rep = client.copy_blocks(g, pairs)
                assert not rep.violations, rep
        for c in kw.get("fork_children", ()):
            live[c] = live[kw["fork_parents"][0]]
            for (layer, s, t), v in list(written.items()):
                if s == kw["fork_parents"][0]:
                    written[(layer, c, t)] = v
        for i in kw.get("free_ids", ()):
            del live[i]
        ids, n_after, indptr = r.seq_ids.tolist(), r.num_tokens.tolist(), r.new_token_indptr
        for layer in range(len(pool.plan.geometry.spec.layers)):
            st = r.tables[pool.plan.geometry.layers[layer].index_space]
            k = bf16(rng, (len(st.slot_mapping), 1, LATENT))
            if len(k):
                rep = client.append_kv(layer, k, None, st.slot_mapping, dtype="bfloat16")
                assert not rep.violations, rep
            for b, sid in enumerate(ids):                  # the appended rows, by (sequence, token position)
                lo, hi = int(indptr[b]), int(indptr[b + 1])
                for j in range(lo, hi):
                    written[(layer, sid, n_after[b] - (hi - lo) + j - lo)] = k[j, 0]
            rep = client.validate(layer, st.table)
            assert rep.ok and rep.violation.count == 0
            # each row of the table holds exactly the latents appended for its sequence, in order
            buf = servicer.caches.cache(layer)
            space = spaces[pool.plan.geometry.layers[layer].index_space]
            tbl = st.table
            for b, sid in enumerate(ids):
                pages = tbl.indices[tbl.indptr[b]:tbl.indptr[b + 1]].astype(np.int64)
                for t in range(n_after[b]):
                    at = (int(pages[t // PS]) - space.base) * PS * LATENT + (t % PS) * LATENT
                    want = written[(layer, sid, t)]
                    assert np.array_equal(buf[at:at + LATENT], want), (layer, sid, t)
        live.update(dict(zip(ids, n_after, strict=True)))
    total = servicer.metrics.registry.get_sample_value
    for layer in range(4):
        for kernel in ("append_kv", "validate_page_table"):
            assert not total("kvworker_bounds_violations_total",
                             {"kernel": kernel, "layer": str(layer), "reason": "out_of_bounds"})
    assert pool.num_sequences == 4 and copied > 0


def test_mla_wrong_space_table_is_rejected_and_decode_refused(mla):
    pool, client, servicer = mla
    r = pool.step(admit_ids=np.array([7, 8]), admit_tokens=np.array([40, 9]))
    geo = pool.plan.geometry
    if len(geo.index_spaces) == 1:                   # per_layer, one group: every layer shares the one space
        table = r.tables[0].table
        assert all(client.validate(layer, table).ok for layer in range(4))
        bad = type(table)(table.indptr, table.indices + geo.pool_pages, table.last_page_len)
        rep = client.validate(1, bad)
        assert not rep.ok and dict(rep.violation.counts_by_reason) == {"out_of_bounds": len(table.indices)}
    else:                                            # interleaved: each layer its own space (scale 4, offset l)
        table = r.tables[geo.layers[0].index_space].table
        assert client.validate(0, table).ok
        before = servicer.metrics.registry.get_sample_value(
            "kvworker_bounds_violations_total", {"kernel": "validate_page_table", "layer": "1",
                                                 "reason": "wrong_index_space"})
        rep = client.validate(1, table)
        assert not rep.ok and dict(rep.violation.counts_by_reason) == {"wrong_index_space": len(table.indices)}
        assert servicer.metrics.registry.get_sample_value(
            "kvworker_bounds_violations_total", {"kernel": "validate_page_table", "layer": "1",
                                                 "reason": "wrong_index_space"}) - before == len(table.indices)
    # a latent of the wrong width, a v where there is none: refused before anything is written
    sm = r.tables[geo.layers[0].index_space].slot_mapping
    k = bf16(np.random.default_rng(3), (len(sm), 1, LATENT))
    with pytest.raises(ClientError) as err:
        client.append_kv(0, k, k, sm, dtype="bfloat16")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "(MLA) latents (K only)" in err.value.message
    with pytest.raises(ClientError) as err:
        client.decode_attention(0, bf16(np.random.default_rng(4), (2, 16, LATENT)), table, dtype="bfloat16")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "multi-head latent attention (MLA)" in \
        err.value.message
