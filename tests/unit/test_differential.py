"""The real in-process pool against the reference model (tests/refmodel.py) over long random op sequences.

Each test runs fixed seeds of one pool kind through tests/differential.py: random
Steps mixing frees, forks, extensions by 1 and by chunks, admissions (with
prompts and tenants on prefix-caching pools), repeated-batch decode loops,
over-capacity and invalid steps, and random table reads. After every op the
whole reply, the pool's state (through the model-slot <-> real-slot bijection)
and its stats must match the model. A failing seed is shrunk to a minimal op
list, printed as code to paste into a test.

The seed set covers 9 pool kinds (prefix caching on hybrid and sliding-only
pools among them) and more than 70,000 Steps per run (see PLAN); the totals are
printed at the end of the pytest run.
"""

import os

import pytest

from kvservice.core.planner import plan as plan_pool
from tests.differential import KINDS, TOTALS, InProcess, RunStats, repro, run_ops, run_random, shrink
from tests.refmodel import Step

# (profile, fast path on, seeds, steps per seed) per kind. "mix": every op in every combination;
# "forks_alone": forks never share a Step with extensions or admissions; "no_forks": the pool keeps
# its decode fast path (sharing switches it off), run with the fast path on and off.
MIX = ("mix", True, (0, 1, 2), 2000)
PLAN = {name: [MIX, ("forks_alone", False, (0,), 1500)] for name in KINDS}
FAST = {name: [("no_forks", True, (0,), 2000), ("no_forks", False, (0,), 2000)]
        for name in ("uniform", "interleaved")}
SHRINK_SECONDS = 30.0
#: KV_DIFF_SCALE < 1 shortens every run (make mutation runs it per mutant); CI runs the full plan.
SCALE = float(os.environ.get("KV_DIFF_SCALE", "1"))


def run_plan(name, plan):
    """Every seed of the plan; on failures, the shortest one shrunk and all of them listed."""
    kind = KINDS[name]
    total = RunStats()
    failures = []
    for profile, fast, seeds, steps in plan:
        steps = max(100, int(steps * SCALE))
        for seed in seeds:
            stats, failure = run_random(kind, lambda fast=fast: InProcess(kind, fast), seed, steps, profile=profile)
            total.add(stats)
            if failure is not None:
                failures.append((failure, profile, fast, steps))
            else:
                assert stats.steps + stats.queries + stats.recreated == steps, "the run stopped early"
    TOTALS.setdefault(f"in-process {name}", RunStats()).add(total)
    if failures:
        failure, profile, fast, steps = min(failures, key=lambda f: f[0].at)
        small = shrink(kind, lambda: InProcess(kind, fast), failure, seconds=SHRINK_SECONDS)
        listing = "\n".join(f"  profile {p}, fast path {fa}, seed {f.seed}: op {f.at} of {n}: {f.message}"
                             for f, p, fa, n in failures)
        pytest.fail(f"kind {name}: {len(failures)} failing seeds\n{listing}\n\nminimal repro of seed {failure.seed} "
                    f"({profile}, {len(small.ops)} ops):\n{repro(small, fast)}", pytrace=False)
    return total


@pytest.mark.parametrize("name", list(KINDS))
def test_pool_matches_reference_model(name):
    total = run_plan(name, PLAN[name])
    kind = KINDS[name]
    # The runs really exercised what they claim to (thresholds shrink with KV_DIFF_SCALE).
    def n(x):
        return max(1, int(x * min(SCALE, 1.0)))

    assert total.mixed > n(100) and total.copies > n(100) and total.exhausted > n(50)
    assert total.errors - total.exhausted > n(200)               # invalid steps, all refused cleanly
    assert total.queries > n(100)
    assert total.stale > n(100)                                   # pages of old tables whose slot was reused
    assert total.recreated >= (5 if SCALE >= 1 else 0)            # pools re-created (~1 in 350 ops: none in short runs)
    if any(la.sliding_window for la in kind.spec.layers):
        assert total.released > n(500)
    if len(plan_pool(kind.spec, kind.sizing).geometry.groups) == 1 and not kind.spec.layers[0].sliding_window:
        assert total.lean_steps > n(1000)                         # Pool._full_group_step answered these
    if kind.prefix_caching:
        assert total.hits > n(100) and total.evictions > n(100)
        if any(la.sliding_window for la in kind.spec.layers):
            assert total.limited > n(50) // 2                     # the windows' own caches cut hits short


@pytest.mark.parametrize("name", list(FAST))
def test_decode_fast_path_matches_reference_model(name):
    total = run_plan(name, FAST[name])
    assert total.fast_steps > max(1, int(500 * min(SCALE, 1.0)))    # the fast path answered these steps


def test_cached_tokens_a_window_does_not_hold_name_no_page():
    # Seq 3 takes 5 cached pages (20 tokens) of seq 1's prompt; the window-6 group keeps pages 3.. of
    # it, so tokens 0..11 have no page there. Seq 2's segment lay just before seq 3's in that group's
    # arena, and tokens 0..11 of seq 3 were once mapped to seq 2's pages 1..3: a client appending every
    # token of the slot mapping would have overwritten seq 2's K/V. They map to -1 (SKIP_SLOT) now,
    # and CHECK_UNHELD keeps the check on in every random run.
    kind = KINDS["prefix_hybrid"]
    prompt = list(range(1, 22))
    ops = [Step(adm=[(1, 21)], token_ids=prompt), Step(adm=[(2, 4)]), Step(ext=[(2, 12)]),
           Step(adm=[(3, 21)], token_ids=prompt)]
    assert run_ops(kind, InProcess(kind), ops, check_unheld=False) is None      # all else agrees
    failure = run_ops(kind, InProcess(kind), ops, check_unheld=True)
    assert failure is None, failure.message


class Faulty(InProcess):
    """The real pool with one planted bug: the last new token of a Step with an extension and two or
    more admissions is mapped one page too far."""

    def step(self, st):
        r = super().step(st)
        if st.ext and len(st.adm) >= 2:
            for sp in r.spaces:
                sp.slot_mapping = sp.slot_mapping.copy()
                sp.slot_mapping[-1] += self.pool.page_size
        return r


def test_a_planted_bug_is_found_and_shrunk_to_a_replayable_repro():
    from tests.differential import run_ops
    from tests.refmodel import Step  # noqa: F401  (the repro's names)

    kind = KINDS["interleaved"]
    _stats, failure = run_random(kind, lambda: Faulty(kind), seed=3, steps=2000, profile="forks_alone")
    assert failure is not None and failure.at > 0 and "new token" in failure.message
    small = shrink(kind, lambda: Faulty(kind), failure, seconds=SHRINK_SECONDS)
    assert len(small.ops) < len(failure.ops) and len(small.ops) <= 3
    last = small.ops[-1]
    assert last.ext and len(last.adm) >= 2
    assert run_ops(kind, Faulty(kind), small.ops) is not None          # the repro still fails ...
    for i in range(len(small.ops)):                                    # ... and every op of it is needed
        assert run_ops(kind, Faulty(kind), small.ops[:i] + small.ops[i + 1:]) is None
    code = repro(small)
    compile(code, "repro", "exec")
    ops = eval(code[code.index("ops = [") + 6:code.index("\nreplay(")])  # our own literal
    assert ops == small.ops
