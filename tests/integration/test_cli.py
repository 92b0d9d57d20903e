"""kvctl and the main job, as a person runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["plan", "--layers", "32", "--kv-heads", "32", "--head-dim", "128", "--dtype", "float16", "--page-size", "16"]


def kvctl(*args, target=None):
    cmd = [sys.executable, "-m", "kvservice.tools.kvctl"] + (["--target", target] if target else []) + list(args)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_plan_human_and_json():
    r = kvctl(*PLAN, "--max-seq-len", "2048", "--max-batch", "8")
    assert r.returncode == 0, r.stderr
    assert "1,024" in r.stdout and "268,435,456" in r.stdout
    r = kvctl("--json", *PLAN, "--max-seq-len", "4096", "--max-batch", "16")
    doc = json.loads(r.stdout)
    assert (doc["num_slots"], doc["bytes_per_layer"]) == (4096, 1_073_741_824)
    r = kvctl(*PLAN, "--max-seq-len", "2048", "--max-batch", "8", "--json")      # --json after the command
    assert json.loads(r.stdout)["num_slots"] == 1024


def test_plan_refuses_flash_attn2_page_size():
    r = kvctl(*PLAN, "--max-seq-len", "2048", "--max-batch", "8", "--backend", "flash-attn2")
    assert r.returncode != 0
    assert "flash-attn 2" in r.stderr and "256" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.integration
def test_kvctl_against_a_server(manager):
    t = manager.target
    r = kvctl("create-pool", "cli", "--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--num-slots", "32",
              target=t)
    assert r.returncode == 0 and "32 slots" in r.stdout, r.stderr
    r = kvctl("pools", target=t)
    assert "cli" in r.stdout and "default" in r.stdout
    assert json.loads(kvctl("--json", "stats", "cli", target=t).stdout)["cli"]["num_free_slots"] == "32"
    assert "0 of 0 shown" in kvctl("seqs", "cli", target=t).stdout
    ok = kvctl("validate", "cli", "--layer", "1", "--indptr", "0,2", "--indices", "3,4", "--last-page-len", "16",
               target=t)
    assert ok.returncode == 0 and ok.stdout.startswith("ok")
    bad = kvctl("--json", "validate", "cli", "--layer", "1", "--indptr", "0,2", "--indices", "3,32",
                "--last-page-len", "16", target=t)
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["violations"][0] | {"detail": ""} == {
        "reason": "out_of_bounds", "row": 0, "position": 1, "value": 32, "detail": ""}
    r = kvctl("seqs", "missing", target=t)
    assert r.returncode == 2 and "NOT_FOUND" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.integration
def test_main_job_completes():
    r = subprocess.run([sys.executable, "-m", "kvservice.examples.main_job", "--requests", "60"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for words in ("sequences served     60", "refused admissions", "step latency p50", "(0 violations)"):
        assert words in r.stdout


def test_kvctl_plan_speaks_vllm(tmp_path):
    """The issue's command line, as a vLLM user types it, on Gemma 3 27B: sliding groups sized to their window."""
    cfg = ROOT / "tests" / "fixtures" / "model_configs" / "gemma-3-27b-it.json"
    r = kvctl("plan", "--block-size", "16", "--max-model-len", "8192", "--max-num-seqs", "8", "--kv-cache-dtype",
              "auto", "--model-config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "9,785,311,232" in r.stdout and "saved_bytes" in r.stdout and "648" in r.stdout
    r = kvctl("plan", "--max-num-seqs", "8", "--model-config", str(cfg))
    assert r.returncode == 2 and "--max-num-seqs alone is not enough" in r.stderr and "Traceback" not in r.stderr


def test_serve_refuses_a_pools_yaml_with_a_misspelt_key(tmp_path):
    f = tmp_path / "pools.yaml"
    f.write_text("pools:\n  - name: chat\n    layers: [{count: 2, kv_heads: 8, head_dim: 128}]\n"
                 "    sizing: {max_batch: 8, max_seq_len: 1024}\n    prefix_cachng: true\n")
    r = subprocess.run([sys.executable, "-m", "kvservice.server.cli", "serve", "--listen", "127.0.0.1:0",
                        "--metrics-port", "-1", "--pools", str(f)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"{f}: pools[0]: unknown key 'prefix_cachng' (line 5); did you mean 'prefix_caching'?" in r.stderr
    assert "Traceback" not in r.stderr and "listening" not in r.stdout
