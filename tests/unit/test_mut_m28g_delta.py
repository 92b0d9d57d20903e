"""Incremental tables where copy-on-write meets a sliding window, swept over every small prompt length and
extension: a parent whose partly filled last page a fork child shares is extended in the same step, so its last
page is copied while its window may release that very position. The client's mirror (contract.mirror, built
from docs/DESIGN.md's delta format) must equal the full tables a unary Step of a twin pool returns, every time;
and the replaced page is announced exactly when its position is still held (position ceil(n_before / page) - 1
at or past the first kept page: hand-computed here from the window), with the first kept page moved exactly when
the window released a page."""

import numpy as np
import pytest

from kvservice.client import codec
from tests.support_stream import PAGE, assert_same_tables
from tests.unit.test_delta_mirror import Twin

WINDOW = 6          # the "hybrid" spec's sliding group (group 1)


def _first_kept_page(n_before):
    """The first page position a sliding window of WINDOW tokens keeps in a row of n_before tokens that is
    extended: the first new token (position n_before) attends to positions n_before - WINDOW + 1 on."""
    return max(0, n_before + 1 - WINDOW) // PAGE


def _delta_step(twin, kw):
    """The step on both pools: a delta on the stream's, full tables from the twin's unary Step; the mirror
    after the delta must hold those tables. Returns the delta's replaced rows per layer group."""
    full = codec.parse_step(twin.api.Step(codec.step_request("b", block_table=True, **kw)))
    ra = codec.step_request("a", **kw)
    twin.seq += 1
    ra.stream_seq, ra.delta_tables, ra.accept_tokens_added, ra.delta_base = twin.seq, True, True, twin.mirror.seq
    reply = twin.session.apply(twin.api, ra)
    assert reply.HasField("delta")
    groups = {gd.group: np.frombuffer(gd.replaced_rows.data, np.int32).tolist() for gd in reply.delta.groups}
    twin.first = {gd.group: (np.frombuffer(gd.first_rows.data, np.int32).tolist(),
                             np.frombuffer(gd.first_pages.data, np.int64).tolist()) for gd in reply.delta.groups}
    twin.mirror.apply(reply)
    assert_same_tables(twin.mirror, full, str(kw))
    return groups


@pytest.mark.parametrize("spec_name", ["hybrid", "per_layer"])
def test_copy_on_write_under_a_window_in_one_step(spec_name):
    checked = announced = 0
    for n in range(1, 13):
        for k in (1, 2, 3, 5, 6, 9, 14):
            twin = Twin(spec_name)
            assert twin.step({"admit": [1], "admit_tokens": [n]}) is not None
            reply_groups = _delta_step(twin, {"fork": [(1, 2)], "extend": [1], "extend_tokens": k})
            checked += 1
            if n % PAGE == 0:
                continue                               # the shared last page is full: nothing is copied
            if spec_name == "hybrid":
                first = _first_kept_page(n)
                assert twin.first.get(1, ([], [])) == (([0], [first]) if first else ([], [])), (n, k, twin.first)
            groups = {g: r for g, r in reply_groups.items() if r}
            want = {0: [0]}
            if spec_name == "hybrid":
                held_before = -(-n // PAGE)
                if held_before - 1 >= _first_kept_page(n):
                    want[1] = [0]
            assert groups == want, (n, k, groups)
            announced += len(want)
    assert checked == 84 and announced > 40
