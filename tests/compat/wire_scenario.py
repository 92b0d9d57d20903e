"""One scheduler's session through the public client, checking every answer: run by either client version.

    python tests/compat/wire_scenario.py HOST:PORT [--old]

The same file runs with today's client (kvservice.client) and, with --old, with the client of commit
a063a55, the last one before the package layout changed (`clients`, from
tests/fixtures/compat/kvservice-a063a55.zip on PYTHONPATH; every module it loads must come from the zip),
against a server of either version (tests/integration/test_wire_compat.py). It exits 0 only if every call
was answered as the contract says: plans, pool life cycle, unary Steps (admit with token ids, extend, fork
with copy-on-write, free), refusals with their status codes, page tables that the server's own validator
accepts, stream Steps with incremental tables, prefix scores, echo.
"""

from __future__ import annotations

import sys

import numpy as np

OLD = "--old" in sys.argv       # the client of a063a55, from the zip on PYTHONPATH
if OLD:
    # An editable install of today's kvservice answers imports the zip's packages lack (its finder comes
    # after the path): without it gone, "import kvservice.client" would mix today's client into the old one.
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    from clients import BlockManagerClient, ClientError
    from kvservice.geometry import CacheSpec, LayerSpec
    from kvservice.planner import Sizing
else:
    from kvservice.client import BlockManagerClient, ClientError
    from kvservice.contract.geometry import CacheSpec, LayerSpec
    from kvservice.contract.sizing import Sizing

PAGE = 16
POOL = "compat"


def _spec() -> CacheSpec:
    layers = [LayerSpec(kv_heads=2, head_dim=64), LayerSpec(kv_heads=2, head_dim=64, sliding_window=64),
              LayerSpec(kv_heads=2, head_dim=64)]
    return CacheSpec(layers=tuple(layers), page_size=PAGE)


def _check_tables(c: BlockManagerClient, r: object, num_layers: int, where: str) -> None:
    """Every layer's table is accepted by the server's validator, and full-attention rows hold every page."""
    for layer in range(num_layers):
        t = r.for_layer(layer).table
        report = c.validate(POOL, layer, t)
        assert report.ok, f"{where}: layer {layer}'s table refused by ValidatePageTable: {report}"
        if layer != 1:                  # full attention: ceil(n / page_size) pages per row
            held = np.diff(np.asarray(t.indptr))
            need = -(-np.asarray(r.num_tokens) // PAGE)
            assert held.tolist() == need.tolist(), f"{where}: layer {layer} holds {held}, needs {need}"


def _refused(code: str, call: object) -> None:
    try:
        call()
    except ClientError as err:
        assert err.code.name == code, f"expected {code}, got {err.code.name}: {err}"
        return
    raise AssertionError(f"expected {code}, the call succeeded")


def main(target: str) -> int:
    rng = np.random.default_rng(7)
    prompt = rng.integers(1, 50_000, 300).astype(np.int64)
    with BlockManagerClient(target, timeout=20) as c:
        c.wait_ready()
        spec, sizing = _spec(), Sizing(max_batch=4, max_seq_len=512)
        plan = c.plan(spec, sizing)
        assert plan.num_slots >= 4 * (512 // PAGE), plan
        info = c.create_pool(POOL, spec, sizing, prefix_caching=True)
        assert info.name == POOL and info.incarnation > 0, info

        r = c.step(POOL, admit=[1, 2], admit_tokens=[300, 17], admit_token_ids=np.concatenate([prompt, prompt[:17]]))
        assert r.seq_ids.tolist() == [1, 2] and r.num_tokens.tolist() == [300, 17], r
        assert len(r.for_layer(0).slot_mapping) == 317
        _check_tables(c, r, 3, "admit")
        r = c.step(POOL, extend=[1, 2], extend_tokens=1)
        assert r.num_tokens.tolist() == [301, 18] and len(r.for_layer(2).slot_mapping) == 2
        _check_tables(c, r, 3, "extend")
        r = c.step(POOL, fork=[(1, 3)])
        assert 3 in r.seq_ids.tolist(), r
        r = c.step(POOL, extend=[1, 3], extend_tokens=1)
        assert r.copies, "extending a forked sequence's shared partial page must copy it"
        _check_tables(c, r, 3, "copy-on-write")
        c.step(POOL, free=[2])

        _refused("ALREADY_EXISTS", lambda: c.step(POOL, admit=[1], admit_tokens=[4]))
        _refused("NOT_FOUND", lambda: c.step(POOL, extend=[99], extend_tokens=1))
        _refused("INVALID_ARGUMENT", lambda: c.step(POOL, admit=[5], admit_tokens=[10_000]))
        _refused("NOT_FOUND", lambda: c.get_pool("no-such-pool"))

        assert POOL in [p.name for p in c.list_pools()]
        assert c.stats(POOL)[POOL].num_sequences == 2
        seqs = c.sequences(POOL)
        assert sorted((q.seq_id, q.num_tokens) for q in seqs.sequences) == [(1, 302), (3, 302)], seqs
        cached = {x.pool: x.cached_tokens for x in c.score_prefix(prompt).scores}
        assert cached.get(POOL, 0) >= 18 * PAGE, f"prompt of 300 tokens: 18 full pages cached, got {cached}"

        with c.step_stream(POOL, stream_id="compat-stream") as s:
            r = s.step(admit=[10], admit_tokens=[40])
            _check_tables(c, r, 3, "stream admit")
            for i in range(3):
                r = s.step(extend=[10], extend_tokens=1)
                assert r.num_tokens.tolist() == [41 + i]
                _check_tables(c, r, 3, f"stream extend {i}")
        assert c.echo(b"compat") == b"compat"
        c.delete_pool(POOL, force=True)
        _refused("NOT_FOUND", lambda: c.get_pool(POOL))
    if OLD:
        mixed = sorted(name for name, m in list(sys.modules.items()) if name.split(".")[0] in ("kvservice", "clients")
                       and ".zip" not in str(getattr(m, "__file__", "")))
        assert not mixed, f"the old client loaded modules from outside its zip: {mixed}"
    print("wire scenario: every answer as the contract says")
    return 0


if __name__ == "__main__":
    sys.exit(main(next(a for a in sys.argv[1:] if a != "--old")))
