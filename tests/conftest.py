"""Prints what the differential tests covered (steps, ops, pool kinds) at the end of the run."""

from tests.differential import TOTALS


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not TOTALS:
        return
    tr = terminalreporter
    steps = sum(t.steps for t in TOTALS.values())
    ops = sum(t.ops for t in TOTALS.values())
    tr.write_sep("-", f"differential: {steps} steps ({ops} ops) over {len(TOTALS)} pool kinds and transports")
    for label, t in sorted(TOTALS.items()):
        tr.write_line(f"  {label:<32} {t.steps:>6} steps {t.ops:>7} ops  errors {t.errors} (exhausted {t.exhausted})"
                      f"  copies {t.copies}  released {t.released}  hits {t.hits}  evictions {t.evictions}"
                      f"  fast {t.fast_steps}  recreated {t.recreated}  stale {t.stale}")
