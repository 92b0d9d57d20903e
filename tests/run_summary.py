"""What the differential, fuzz and soak tests covered, printed at the end of the pytest run.

The tests add to the three tallies below as they run. Under pytest-xdist (`make test` runs two workers)
each worker keeps its own: it hands them to the controller as JSON when its session ends
(``export``/``merge``, wired in tests/conftest.py), and the controller prints the sums.
"""

from __future__ import annotations

import json

from tests.differential import TOTALS, RunStats
from tests.fuzz.support import COUNTS, SAMPLES, VERBOSE

#: the soak test's figures, label -> formatted value (tests/soak/test_soak.py fills it).
SOAK: dict[str, str] = {}


def export() -> str:
    """This process's tallies as JSON."""
    return json.dumps({
        "differential": {label: vars(t) for label, t in TOTALS.items()},
        "fuzz": [[service, rpc, dict(c)] for (service, rpc), c in COUNTS.items()],
        "samples": [[*key, sorted(msgs)] for key, msgs in SAMPLES.items()],
        "soak": SOAK,
    })


def merge(text: str) -> None:
    """Add another process's ``export`` to this one's tallies."""
    data = json.loads(text)
    for label, fields in data["differential"].items():
        TOTALS.setdefault(label, RunStats()).add(RunStats(**fields))
    for service, rpc, counts in data["fuzz"]:
        COUNTS[(service, rpc)].update(counts)
    for service, rpc, code, msgs in data["samples"]:
        SAMPLES[(service, rpc, code)].update(msgs)
    SOAK.update(data["soak"])


def write(tr) -> None:
    """The three sections, each only when its tests ran."""
    if SOAK:
        tr.write_sep("-", "soak")
        for key, value in SOAK.items():
            tr.write_line(f"{key:<28} {value}")
    if COUNTS:
        tr.write_sep("-", f"fuzz: {sum(sum(c.values()) for c in COUNTS.values())} hostile cases")
        for service in sorted({s for s, _ in COUNTS}):
            rows = [(rpc, c) for (s, rpc), c in sorted(COUNTS.items()) if s == service]
            tr.write_line(f"{service}: {sum(sum(c.values()) for _, c in rows)} cases")
            for rpc, c in rows:
                codes = ", ".join(f"{k} {v}" for k, v in c.most_common())
                tr.write_line(f"  {rpc:<18} {sum(c.values()):>5}  ({codes})")
        if VERBOSE:
            for (service, rpc, code), msgs in sorted(SAMPLES.items()):
                for msg in sorted(msgs):
                    tr.write_line(f"    {service}.{rpc} {code}: {msg}")
    if TOTALS:
        steps = sum(t.steps for t in TOTALS.values())
        ops = sum(t.ops for t in TOTALS.values())
        tr.write_sep("-", f"differential: {steps} steps ({ops} ops) over {len(TOTALS)} pool kinds and transports")
        for label, t in sorted(TOTALS.items()):
            tr.write_line(f"  {label:<32} {t.steps:>6} steps {t.ops:>7} ops  errors {t.errors}"
                          f" (exhausted {t.exhausted})  copies {t.copies}  released {t.released}  hits {t.hits}"
                          f"  evictions {t.evictions}"
                          f"  fast {t.fast_steps}  lean {t.lean_steps}  recreated {t.recreated}  stale {t.stale}")
