"""kvservice/core/invariants.py's remaining documented lines on the busy pool of test_mut_m29k1_invariants.py,
each named exactly: a state of another version (its whole message), a version-2 state (no generation arrays: sound;
with them: unexpected), a state of older snapshots without release stamps or link flags (sound), per-sequence
arrays of different lengths, and a live pool whose allocators do not have the plan's slot counts."""

import numpy as np
import pytest

from kvservice.core.invariants import pool_problems
from kvservice.core.pool import Pool
from tests.unit.test_mut_m29k1_invariants import NUM_SLOTS, broken, busy  # noqa: F401  (busy: the pool fixture)


@pytest.mark.parametrize("version", [1, 4, 99, None])
def test_a_state_of_another_version_is_named_with_the_versions_read_and_written(busy, version):  # noqa: F811
    def change(m, a):
        m["version"] = version
    assert broken(busy, change) == [f"pool state version {version} is not one of (2, 3) (this release writes 3)"]


def test_a_version_2_state_has_no_generations_and_older_snapshots_no_stamps_or_links(busy):  # noqa: F811
    """Version 2 (before page generations) is read without generation arrays, and refused with them; release
    stamps and link flags are optional (absent in older snapshots)."""
    def v2(m, a):
        m["version"] = 2
        for g in (0, 1):
            del a[f"generation/{g}"]

    def v2_with_generations(m, a):
        m["version"] = 2

    def older(m, a):
        for g in (0, 1):
            del a[f"cached_stamp/{g}"], a[f"prefix/{g}/linked"]

    def v3_without_generations(m, a):
        del a["generation/1"]
    assert broken(busy, v2) == []
    assert broken(busy, v2_with_generations) == ["arrays ['generation/0', 'generation/1'] missing or unexpected"]
    assert broken(busy, older) == []
    assert broken(busy, v3_without_generations) == ["arrays ['generation/1'] missing or unexpected"]


@pytest.mark.parametrize("key", ["rows", "num_tokens", "first/0", "first/1"])
def test_per_sequence_arrays_of_another_length_are_named_alone(busy, key):  # noqa: F811
    num = len(busy.export_state().arrays["seq_ids"])

    def change(m, a):
        a[key] = np.append(a[key], a[key][-1]) if key == "first/1" else a[key][:-1]
    assert broken(busy, change) == [f"{num} sequence ids but other per-sequence arrays differ in length"]


def test_allocators_that_do_not_have_the_plans_slot_counts_are_each_named(busy):  # noqa: F811
    pool = Pool.from_state(busy.export_state(), busy.plan)
    assert pool_problems(pool) == []
    pool.allocators[0].num_slots += 1
    pool.allocators[1].num_slots -= 2
    assert pool_problems(pool) == [f"group 0: allocator of {NUM_SLOTS + 1} slots, plan {NUM_SLOTS}",
                                   f"group 1: allocator of {NUM_SLOTS - 2} slots, plan {NUM_SLOTS}"]
