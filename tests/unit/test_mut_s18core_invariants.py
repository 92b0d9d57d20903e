"""check_pool_state's release-stamp rule on the busy pool of tests/unit/test_mut_m29k1_invariants.py: a stamp
is an allocator clock value, which starts at 0 (kvservice/core/allocator.py) and only grows, so 0 is a sound
stamp and only a negative one (or a count that differs from the cached slots') is named, per group."""

import numpy as np

from tests.unit.test_mut_m29k1_invariants import broken, busy  # noqa: F401  (busy: the module's pool fixture)


def stamp_problem(g: int, stamps: int, cached: int) -> str:
    return f"group {g}: {stamps} release stamps for {cached} cached slots, or a negative one"


def test_zero_stamps_are_sound_negative_or_miscounted_ones_are_named(busy):  # noqa: F811
    a = busy.export_state().arrays
    rng = np.random.default_rng(18)
    groups = [g for g in (0, 1) if len(a[f"cached/{g}"])]
    assert groups == [0, 1], "both groups of the busy pool hold cached free slots"
    for g in groups:
        key, c = f"cached_stamp/{g}", len(a[f"cached/{g}"])

        def zero(m, a, key=key):
            a[key] = np.zeros_like(a[key])
        assert broken(busy, zero) == []

        i = int(rng.integers(0, c))

        def one_zero(m, a, key=key, i=i):
            a[key] = a[key].copy()
            a[key][: i + 1] = 0                          # some at clock 0, the others as they were
        assert broken(busy, one_zero) == []

        j = int(rng.integers(0, c))

        def negative(m, a, key=key, i=j):
            a[key] = np.minimum(a[key], 0)
            a[key][: i + 1] = -1
        assert broken(busy, negative) == [stamp_problem(g, c, c)]

        def short(m, a, key=key):
            a[key] = a[key][1:]
        assert broken(busy, short) == [stamp_problem(g, c - 1, c)]

        def missing(m, a, key=key):
            del a[key]                                   # an older state without stamps: nothing to check
        assert broken(busy, missing) == []
