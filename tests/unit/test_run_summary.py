"""tests/run_summary.py: a pytest-xdist worker's tallies reach the controller's summary whole (export -> merge)."""

import json

import pytest

from tests import run_summary as rs
from tests.differential import TOTALS, RunStats
from tests.fuzz.support import COUNTS, SAMPLES


class Lines:
    def __init__(self) -> None:
        self.text: list[str] = []

    def write_sep(self, sep: str, title: str) -> None:
        self.text.append(f"== {title}")

    def write_line(self, line: str) -> None:
        self.text.append(line)


def clear_tallies() -> None:
    for tally in (TOTALS, COUNTS, SAMPLES, rs.SOAK):
        tally.clear()


@pytest.fixture
def empty_tallies():
    """This process's real tallies are set aside for the test and put back after it."""
    saved = rs.export()
    clear_tallies()
    yield
    clear_tallies()
    rs.merge(saved)


def test_two_workers_tallies_add_up_in_the_printed_summary(empty_tallies) -> None:
    worker = {"differential": {"in-process uniform": vars(RunStats(steps=7, ops=30, errors=3, stale=11)),
                               "gRPC hybrid": vars(RunStats(steps=5, ops=9, hits=2))},
              "fuzz": [["Worker", "AppendKV", {"OK": 4, "INVALID_ARGUMENT": 1}]],
              "samples": [["Worker", "AppendKV", "INVALID_ARGUMENT", ["bad slot_mapping"]]],
              "soak": {"acknowledged steps": "5063 (337/s)"}}
    rs.merge(json.dumps(worker))
    other = dict(worker, differential={"in-process uniform": vars(RunStats(steps=2, ops=6, errors=1, stale=4))},
                 fuzz=[["Worker", "AppendKV", {"OK": 1}], ["BlockManager", "Step", {"OK": 2}]], soak={})
    rs.merge(json.dumps(other))
    assert vars(TOTALS["in-process uniform"]) == vars(RunStats(steps=9, ops=36, errors=4, stale=15))
    assert COUNTS[("Worker", "AppendKV")] == {"OK": 5, "INVALID_ARGUMENT": 1}
    assert COUNTS[("BlockManager", "Step")] == {"OK": 2}
    assert SAMPLES[("Worker", "AppendKV", "INVALID_ARGUMENT")] == {"bad slot_mapping"}
    tr = Lines()
    rs.write(tr)
    assert tr.text[:2] == ["== soak", "acknowledged steps           5063 (337/s)"]
    assert "== fuzz: 8 hostile cases" in tr.text and "Worker: 6 cases" in tr.text
    assert "== differential: 14 steps (45 ops) over 2 pool kinds and transports" in tr.text
    assert json.loads(rs.export())["differential"]["gRPC hybrid"]["hits"] == 2       # export is what merge reads


def test_nothing_ran_prints_nothing(empty_tallies) -> None:
    tr = Lines()
    rs.write(tr)
    assert tr.text == []
