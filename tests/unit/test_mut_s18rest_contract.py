"""Plan.summary (what `kvctl plan --json` prints): the end of the pool's page numbering, `pool_pages`, against
docs/ARCHITECTURE.md's numbering computed by hand: index spaces are consecutive page ranges from 0
(base_0 = 0, base_{s+1} = upper_bound_s), per_layer spaces take one page per slot of their group (scale 1), and an
interleaved group of L layers gives each of its L layers a space of num_slots * L pages (scale L)."""

from __future__ import annotations

import json
import random

import pytest

from kvservice.contract.geometry import CacheSpec, LayerSpec
from kvservice.contract.sizing import Sizing
from kvservice.core.planner import plan


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_summary_pool_pages_is_the_end_of_the_page_numbering_interleaved(seed):
    rng = random.Random(1800 + seed)
    layers, slots, heads = rng.randint(2, 5), rng.randint(3, 90), rng.randint(1, 4)
    spec = CacheSpec(tuple(LayerSpec(heads, 32, "float16") for _ in range(layers)), 16, "interleaved")
    s = json.loads(json.dumps(plan(spec, Sizing(num_slots=slots, max_seq_len=256)).summary()))
    assert s["pool_pages"] == layers * slots * layers                 # L spaces of num_slots * L pages each
    ends = [0] + [sp["upper_bound"] for sp in s["index_spaces"]]
    assert [sp["base"] for sp in s["index_spaces"]] == ends[:-1]      # consecutive ranges from 0
    assert s["pool_pages"] == ends[-1]
    page = 2 * 16 * heads * 32 * 2                                    # K and V x tokens x heads x dim x 2 B
    assert s["index_spaces"] == [{"id": i, "group": 0, "scale": layers, "offset": i, "base": i * slots * layers,
                                  "upper_bound": (i + 1) * slots * layers, "layers": [i], "index_dtype": "int32"}
                                 for i in range(layers)]
    assert s["groups"] == [{"group": 0, "sliding_window": 0, "layers": list(range(layers)), "num_slots": slots,
                            "slot_bytes": layers * page, "bytes": slots * layers * page,
                            "buffer_bytes": slots * layers * page}]
    assert (s["num_slots"], s["page_size"], s["layout"], s["num_layers"], s["max_seq_len"]) == \
        (slots, 16, "interleaved", layers, 256)
    assert (s["max_pages_per_seq"], s["group_slots"], s["total_bytes"]) == (256 // 16, [slots], slots * layers * page)
    assert (s["offsets_exceed_int32"], s["offsets_exceed_uint32"], s["indices_need_int64"]) == (False, False, False)


def test_summary_pool_pages_sums_the_per_layer_groups_slots():
    spec = CacheSpec((LayerSpec(2, 64, "float16"), LayerSpec(2, 64, "float16", 64)) * 2, 16)
    s = plan(spec, Sizing(max_batch=4, max_seq_len=256)).summary()
    full = 4 * 256 // 16                                              # the full group: batch x pages
    assert s["group_slots"][0] == full and len(s["groups"]) == 2
    assert s["pool_pages"] == sum(g["num_slots"] for g in s["groups"]) == full + s["group_slots"][1]
    page = 2 * 16 * 2 * 64 * 2                                        # K and V x tokens x heads x dim x 2 B
    for g in s["groups"]:                                             # per_layer: one buffer per layer
        assert g["layers"] == ([0, 2] if g["sliding_window"] == 0 else [1, 3])
        assert (g["slot_bytes"], g["bytes"], g["buffer_bytes"]) == (2 * page, g["num_slots"] * 2 * page,
                                                                    g["num_slots"] * page)
