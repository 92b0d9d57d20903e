"""The decode entries and their compile-time geometry (kvservice/worker/launch_plan.py) against what ptxas reported
for the .cu sources: docs/KERNELS.md's resource table (nvcc -Xptxas -v, written by tests/kernels/test_nvcc.py), read
here as plain text. On a machine with nvcc, test_nvcc checks the same against a fresh compile."""

from __future__ import annotations

import re
from pathlib import Path

from kvservice.worker import launch_plan

DOC = Path(__file__).resolve().parents[2] / "docs" / "KERNELS.md"
DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _ptxas_table() -> dict[str, int]:
    """function -> static shared memory (bytes) of docs/KERNELS.md's "Resources" table."""
    text = DOC.read_text().split("## Resources", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (kv_\w+) \| \d+ \| \d+ \| (\d+) \|", text, re.M)
    return {name: int(smem) for name, smem in rows}


def test_the_decode_entries_are_the_ones_ptxas_compiled():
    """3 dtypes x (heads per block 1, 4, 8 x head_dim 32..256, plus 1 and 4 at head_dim 512): 42 entries."""
    table = _ptxas_table()
    compiled = sorted(n for n in table if re.fullmatch(r"kv_decode_(f32|f16|bf16)_g\d+_d\d+", n))
    assert len(compiled) == 42
    assert launch_plan.decode_entries() == compiled
    assert launch_plan.kernel_names() == sorted(table)


def test_each_entrys_shared_memory_is_what_ptxas_reported():
    table = _ptxas_table()
    for name, smem in table.items():
        m = re.fullmatch(r"kv_decode_(f32|f16|bf16)_g(\d+)_d(\d+)", name)
        if m is None:
            continue
        geo = launch_plan.decode_geometry(DTYPES[m[1]], int(m[2]), int(m[3]))
        assert geo.smem_bytes == smem, (name, geo)
