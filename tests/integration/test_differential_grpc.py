"""The real server over gRPC against the reference model (tests/refmodel.py): the same random op sequences
as tests/unit/test_differential.py, sent by clients.BlockManagerClient to a `kvservice serve` process.

Every reply (batch order, token counts, new-token indptr, slot mappings, every index space's CSR and
block table, copy-on-write pairs, cached tokens, free count) and the pool's GetStats must match the
model after each Step; a refused Step must carry the status of the model's error. A failing seed is
shrunk (each replay on a fresh pool of the same server) and printed as a ready-to-paste repro.
"""

import itertools

import pytest

from kvservice.client import BlockManagerClient
from tests.differential import (
    KINDS,
    TOTALS,
    InProcess,
    OverGrpc,
    RunStats,
    repro,
    run_ops,
    run_random,
    shrink,
    signature,
)

from .conftest import ManagerProcess

pytestmark = pytest.mark.integration
RUNS = (("mix", 800), ("forks_alone", 400))      # 10,800 Steps over the nine kinds
SHRINK_SECONDS = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    m = ManagerProcess(tmp_path_factory.mktemp("differential"), "--no-pools", "--state", "memory")
    with BlockManagerClient(m.target, timeout=30) as c:
        c.wait_ready()
        yield c
    m.stop()


@pytest.mark.parametrize("name", list(KINDS))
def test_server_matches_reference_model(server, name):
    kind = KINDS[name]
    fresh = itertools.count()

    def new_pool():                       # the previous one goes: the server holds at most 256 pools
        n = next(fresh)
        if n:
            server.delete_pool(f"{name}-{n - 1}", force=True)
        server.create_pool(f"{name}-{n}", kind.spec, kind.sizing, prefix_caching=kind.prefix_caching)
        return OverGrpc(server, f"{name}-{n}", kind)

    total = TOTALS.setdefault(f"gRPC {name}", RunStats())
    mine = RunStats()
    for profile, steps in RUNS:
        stats, failure = run_random(kind, new_pool, seed=100, steps=steps, profile=profile)
        total.add(stats)
        mine.add(stats)
        if failure is not None:
            # Shrink in-process when the mismatch shows there too (ten times faster), else over gRPC.
            again = run_ops(kind, InProcess(kind), failure.ops)
            local = again is not None and signature(again.message) == signature(failure.message)
            small = shrink(kind, (lambda: InProcess(kind)) if local else new_pool, again if local else failure,
                           seconds=SHRINK_SECONDS)
            where = "in-process and over gRPC" if local else "over gRPC only"
            pytest.fail(f"kind {name} over gRPC, profile {profile}: op {failure.at} of {steps}: {failure.message}"
                        f"\n\nminimal repro ({len(small.ops)} ops, fails {where}):\n{repro(small)}",
                        pytrace=False)
        assert stats.steps + stats.recreated == steps
    assert mine.errors - mine.exhausted > 50 and mine.copies > 20 and mine.mixed > 20
    if kind.prefix_caching:
        assert mine.hits > 50 and mine.evictions > 50
