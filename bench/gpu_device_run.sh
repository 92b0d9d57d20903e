#!/usr/bin/env bash
# The first command on a lent GPU machine (docs/KERNELS.md, "First call on a GPU"): the image's own
# python3 and packages (numpy, torch, cupy-cuda13x; no make, no installs), results under $OUT (the
# only folder that comes back), at most 8 files. Exit status: gpu_check's (0 all passed, 1 a check
# failed, 2 cannot run).
#
#   device run: command "bash bench/gpu_device_run.sh", timeout_s 420
set -u
OUT="${OUT:-bench/results}"
BUDGET_S="${BUDGET_S:-300}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/kvk-cupy}"
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu \
    --format=csv 2>&1
  python3 -c "import sys, numpy, torch, cupy; print(sys.version.split()[0], 'numpy', numpy.__version__, 'torch', \
torch.__version__, 'cupy', cupy.__version__, 'cuda', torch.version.cuda)" 2>&1
  command -v compute-sanitizer nvcc cuobjdump 2>&1
} > "$OUT/device-env.txt"
timeout -k 10 $((BUDGET_S + 60)) python3 bench/gpu_check.py --out "$OUT" --budget-s "$BUDGET_S"
rc=$?
echo "gpu_check exit $rc" >> "$OUT/device-env.txt"
exit $rc
