"""Run the decode sweep (bench/decode_cases.py) on one CPU-emulation build and
save each case's outputs, for test_decode_sweep.py. Started in a subprocess
(LD_PRELOAD of libasan/libubsan for the ``asan`` build); imports no torch.

Usage: sweep_driver.py VARIANT OUTDIR [full]
Writes OUTDIR/<case name>.npz (out, lse) and prints one JSON line per case
(name, record, error).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from bench import decode_cases as dc
from kvservice.worker import kernels_cpu


def main() -> None:
    variant, outdir = sys.argv[1], Path(sys.argv[2])
    full = len(sys.argv) > 3 and sys.argv[3] == "full"
    be = kernels_cpu.backend(variant)
    for case in dc.cases(full):
        got = dc.run_case(be, case, dc.make_inputs(case))
        np.savez(outdir / f"{case.name}.npz", out=got.out, lse=got.lse)
        print(json.dumps({"name": case.name, "record": list(got.record), "error": got.error}), flush=True)


if __name__ == "__main__":
    main()
