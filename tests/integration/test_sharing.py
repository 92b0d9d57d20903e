"""Prefix caching, parallel sampling with copy-on-write, sliding windows and a hybrid model, end to end.

A manager and real worker processes on loopback; the tiny transformer's logits
are compared with runs that share nothing and with a dense float64 reference.
"""

import numpy as np
import pytest

from kvservice.client import BlockManagerClient
from kvservice.contract.sizing import Sizing
from kvservice.examples.generate import Cluster, generate, sample_parallel
from kvservice.examples.tiny_model import TinyConfig, TinyModel

from .conftest import ManagerProcess
from .test_worker import WorkerProcess

pytestmark = pytest.mark.integration
TOL = 1e-4
BASE = TinyConfig(num_layers=2, seed=5)
WINDOWED = TinyConfig(seed=6, layers=((32, 12), (32, 0), (32, 20)))
HYBRID = TinyConfig(seed=7, q_heads=2, kv_heads=1, layers=((256, 24),) * 5 + ((512, 0),))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharing")
    mgr = ManagerProcess(tmp, "--no-pools")
    c = BlockManagerClient(mgr.target, timeout=30)
    c.wait_ready()
    c.create_pool("cached", BASE.cache_spec(), Sizing(num_slots=96, max_seq_len=512), prefix_caching=True)
    c.create_pool("plain", BASE.cache_spec(), Sizing(num_slots=96, max_seq_len=512))
    c.create_pool("windowed", WINDOWED.cache_spec(), Sizing(num_slots=64, max_seq_len=512))
    c.create_pool("hybrid", HYBRID.cache_spec(layout="interleaved"), Sizing(num_slots=48, max_seq_len=512))
    workers = {name: WorkerProcess(tmp, mgr.target, name, f"w-{name}") for name in
               ("cached", "plain", "windowed", "hybrid")}
    clusters = {name: Cluster.of(c, name, [(range(64), w.client)]) for name, w in workers.items()}
    yield c, clusters
    for w in workers.values():
        w.stop()
    c.close()
    mgr.stop()


def reference_check(model, prompts, gen):
    for i, p in enumerate(prompts):
        ref = model.reference_logits(list(p) + gen.tokens[i, :-1].tolist())[len(p) - 1:]
        assert np.abs(ref - gen.logits[i]).max() < TOL


def test_prefix_hit_reuses_pages_and_matches_no_caching(env):
    c, clusters = env
    model = TinyModel(BASE)
    rng = np.random.default_rng(1)
    system = rng.integers(0, BASE.vocab, 48).tolist()              # a shared 3-page system prompt
    prompts = [system + rng.integers(0, BASE.vocab, int(n)).tolist() for n in (5, 9, 17)]
    first = generate(c, "cached", clusters["cached"], model, prompts[:1], 4, 10, prefix=True)
    assert first.cached_tokens.tolist() == [0]
    hits = c.stats("cached")["cached"].prefix_cache_hits
    shared = generate(c, "cached", clusters["cached"], model, prompts, 4, 20, prefix=True)
    assert shared.cached_tokens.tolist() == [48, 48, 48]          # the freed first run's pages, revived
    assert c.stats("cached")["cached"].prefix_cache_hits == hits + 9
    alone = generate(c, "plain", clusters["plain"], model, prompts, 4, 30)
    assert np.abs(shared.logits - alone.logits).max() < TOL
    assert (shared.tokens == alone.tokens).all()
    reference_check(model, prompts, shared)


def test_parallel_sampling_with_copy_on_write_equals_independent_sequences(env):
    c, clusters = env
    model = TinyModel(BASE)
    prompt = np.random.default_rng(2).integers(0, BASE.vocab, 21).tolist()    # last page partly filled
    par = sample_parallel(c, "plain", clusters["plain"], model, prompt, 4, 6, 100)
    assert len(set(par.tokens[:, 0].tolist())) == 4
    for i in range(4):
        solo = generate(c, "plain", clusters["plain"], model, [[*prompt, int(par.tokens[i, 0])]], 5, 200 + i)
        assert np.abs(par.logits[i, 1:] - solo.logits[0]).max() < TOL
        assert (par.tokens[i, 1:] == solo.tokens[0]).all()
    assert c.stats("plain")["plain"].num_sequences == 0
    assert c.stats("plain")["plain"].num_free_slots == 96


def test_sliding_window_pages_released_and_attention_matches_reference(env):
    c, clusters = env
    model = TinyModel(WINDOWED)
    prompts = [np.random.default_rng(3).integers(0, 256, n).tolist() for n in (40, 23)]
    released = []

    def check(step):
        for layer, (_, window) in enumerate(WINDOWED.layers):
            t = step.for_layer(layer).table
            full = -(-step.num_tokens // 16)
            held = np.diff(t.indptr)
            if window:
                released.append(int((full - held).max()))
            else:
                assert (held == full).all()
            assert c.validate("windowed", layer, t).ok

    gen = generate(c, "windowed", clusters["windowed"], model, prompts, 12, 1, on_step=check)
    assert max(released) >= 2
    reference_check(model, prompts, gen)


def test_hybrid_interleaved_model_matches_reference_with_tables_per_layer(env):
    c, clusters = env
    model = TinyModel(HYBRID)
    info = c.get_pool("hybrid")
    assert len({s.scale for s in info.plan.index_spaces}) == 2 and len(info.plan.groups) == 2
    prompts = [np.random.default_rng(4).integers(0, 256, n).tolist() for n in (45, 30, 17)]

    def check(step):
        spaces = step.layer_index_space
        for layer in range(len(HYBRID.layers)):
            t = step.for_layer(layer)
            assert c.validate("hybrid", layer, t.table).ok
            other = next(la for la in range(len(HYBRID.layers)) if spaces[la] != spaces[layer])
            assert not c.validate("hybrid", other, t.table).ok      # another space's layer rejects it

    gen = generate(c, "hybrid", clusters["hybrid"], model, prompts, 6, 1, on_step=check)
    reference_check(model, prompts, gen)
