"""The three command lines behave as operators expect (issue 24): --version, every flag with help and its default,
errors that name the flag and the file, streaming output flushed per line, delete-pool, documented exit codes,
JSON logs, and a clean exit when NATS cannot be reached.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import socket
import subprocess
import sys
import time

import pytest

from kvservice.client import BlockManagerClient
from kvservice.contract.cli import all_actions
from kvservice.contract.geometry import CacheSpec
from kvservice.contract.sizing import Sizing
from kvservice.server.cli import build_parser as kvservice_parser
from kvservice.tools.kvctl_parser import build_parser as kvctl_parser
from kvservice.worker.cli import build_parser as kvworker_parser

from .conftest import ROOT

PARSERS = {"kvctl": kvctl_parser, "kvservice": kvservice_parser, "kvworker": kvworker_parser}
MODULES = {"kvctl": "kvservice.tools.kvctl", "kvservice": "kvservice.server.cli", "kvworker": "kvservice.worker.cli"}


def run(prog: str, *args: str, timeout: float = 120, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", MODULES[prog], *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_flag_has_help_and_its_default_shows(prog):
    for parser, action in all_actions(PARSERS[prog]()):
        flag = action.option_strings[-1]
        assert action.help and action.help.strip(), f"{parser.prog} {flag}: no help text"
        d = action.default
        if d is None or isinstance(d, bool) or d == [] or d == "==SUPPRESS==" or action.nargs == 0:
            continue                                  # off, unset, repeatable or a switch: nothing to show
        shown = "none" if d == "" else str(d)
        assert f"(default: {shown})" in " ".join(parser.format_help().split()), f"{parser.prog} {flag}: default"


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_version_and_exit_codes_in_help(prog):
    r = run(prog, "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"{prog} 0.1.0", r
    assert "exit status:" in PARSERS[prog]().format_help()


@pytest.mark.integration
def test_errors_name_the_flag_and_the_file(tmp_path):
    r = run("kvservice", "serve", "--pools", "pools.yaml", "--metrics-port", "-1", cwd=tmp_path)
    assert r.returncode == 2 and "argument --pools: pools.yaml: no such file" in r.stderr, r.stderr
    r = run("kvctl", "--token-file", str(tmp_path / "token"), "pools")
    assert r.returncode == 2 and f"argument --token-file: {tmp_path / 'token'}: no such file" in r.stderr
    r = run("kvworker", "serve", "--tokens-file", str(tmp_path), "--metrics-port", "-1")
    assert r.returncode == 2 and "argument --tokens-file" in r.stderr and "a directory, not a file" in r.stderr
    if importlib.util.find_spec("cupy") is None:              # what a CPU machine says to --backend cuda
        r = run("kvworker", "serve", "--backend", "cuda", "--metrics-port", "-1")
        assert r.returncode == 2 and "--backend cuda needs CuPy" in r.stderr
        assert "--backend cpu" in r.stderr and "gpu extra" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.integration
def test_serve_exits_cleanly_saying_which_nats_call_gave_up_after_how_long():
    port = free_port()                                         # nothing listens there
    r = run("kvservice", "serve", "--state", f"nats://127.0.0.1:{port}", "--listen", "127.0.0.1:0",
            "--metrics-port", "-1", "--no-pools")
    assert r.returncode == 2, r
    assert f"cannot reach NATS at nats://127.0.0.1:{port}: connecting gave up after 10 s" in r.stderr
    assert "Connect call failed" in r.stderr or "ConnectionRefused" in r.stderr
    assert "Task was destroyed" not in r.stderr and "Traceback" not in r.stderr


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line proc writes to its stdout pipe, read as soon as it is there (the process runs on)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line within {timeout} s"
    return proc.stdout.readline()


@pytest.mark.integration
def test_events_prints_each_batch_as_it_arrives_and_stops_when_the_reader_goes(manager):
    with BlockManagerClient(manager.target, timeout=30) as c:
        c.create_pool("ev", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=64, max_seq_len=512),
                      prefix_caching=True)
        c.step("ev", admit=[1], admit_tokens=[40], admit_token_ids=list(range(1, 41)))
    for json_lines in (False, True):
        args = ["--json"] if json_lines else []
        proc = subprocess.Popen([sys.executable, "-m", MODULES["kvctl"], "--target", manager.target, *args,
                                 "events", "ev"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
        try:
            line = _first_line(proc, 60)                      # a pipe, not a terminal: flushed anyway
            assert proc.poll() is None                        # ...while it follows the pool
            if json_lines:
                doc = json.loads(line)
                assert doc["reset"] is True and int(doc["sequence"]) >= 1
            else:
                assert "RESET" in line and "block_stored 2" in line
            proc.stdout.close()                               # the reader goes away (`| head -1`)
            assert proc.wait(60) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
    out = subprocess.run(f"{sys.executable} -m {MODULES['kvctl']} --target {manager.target} events ev | head -1",
                         shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 1 and "RESET" in out.stdout


@pytest.mark.integration
def test_delete_pool_and_decode_admitting_its_own_sequences(manager):
    t = ["--target", manager.target]
    with BlockManagerClient(manager.target, timeout=30) as c:
        c.create_pool("gone", CacheSpec.uniform(2, 1, 64, page_size=16), Sizing(num_slots=32, max_seq_len=256))
        c.step("gone", admit=[7], admit_tokens=[5])
    r = run("kvctl", *t, "delete-pool", "gone")
    assert r.returncode == 2 and "FAILED_PRECONDITION" in r.stderr          # a live sequence, no --force
    r = run("kvctl", *t, "delete-pool", "gone", "--force")
    assert r.returncode == 0 and "deleted pool 'gone'" in r.stdout
    r = run("kvctl", *t, "delete-pool", "gone")
    assert r.returncode == 2 and "NOT_FOUND" in r.stderr
    r = run("kvctl", *t, "decode", "default", "--ids", "901,902", "--steps", "3", "--mode", "unary")
    assert r.returncode == 2 and "pass --admit TOKENS" in r.stderr
    r = run("kvctl", *t, "--json", "decode", "default", "--ids", "901,902", "--admit", "16", "--steps", "3")
    assert r.returncode == 0, r.stderr
    assert [m["mode"] for m in json.loads(r.stdout)] == ["unary", "stream", "deltas"]
    with BlockManagerClient(manager.target, timeout=30) as c:
        assert c.sequences("default").total == 0                              # freed at the end


@pytest.mark.integration
def test_json_logs_are_one_object_a_line(tmp_path):
    ports = tmp_path / "ports"
    proc = subprocess.Popen([sys.executable, "-m", MODULES["kvservice"], "serve", "--listen", "127.0.0.1:0",
                             "--metrics-port", "-1", "--port-file", str(ports), "--log-format", "json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (ports.exists() and len(ports.read_text().split()) == 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    lines = [json.loads(line) for line in err.splitlines()]
    assert lines and all({"ts", "level", "logger", "message"} <= set(doc) for doc in lines)
    warn = next(doc for doc in lines if "state is in memory only" in doc["message"])
    assert warn["level"] == "WARNING" and warn["logger"] == "kvservice" and warn["ts"].endswith("Z")


@pytest.mark.integration
def test_leadership_logs_mean_something(tmp_path):
    """JSON logs of two replicated managers: a takeover is INFO on the new leader, with its epoch and node; the
    old leader, paused past its lease and resumed, logs its lost lease as WARNING under its old epoch."""
    from tests.natsutil import NatsCluster, require_nats_server

    from .ha_harness import ManagerSlot, epoch_of
    require_nats_server()
    nats = NatsCluster(tmp_path / "nats", 1).start()
    extra = ("--leader-ttl", "1.0", "--leader-renew", "0.25", "--log-format", "json")
    slots = [ManagerSlot(tmp_path, name, nats.url, "logs", extra) for name in ("a", "b")]
    try:
        for s in slots:
            s.start(180.0)
        deadline = time.monotonic() + 120
        while not any(epoch_of(s.target) for s in slots):
            assert time.monotonic() < deadline, "no leader"
            time.sleep(0.1)
        old = next(s for s in slots if epoch_of(s.target))
        new = next(s for s in slots if s is not old)
        old.pause()
        try:
            while epoch_of(new.target) is None:               # the standby takes over once the lease lapsed
                assert time.monotonic() < deadline + 120, new.log_tail()
                time.sleep(0.1)
        finally:
            old.resume()
        assert old.proc.wait(120) == 3                        # fail-stop, as docs/HA.md says
        records = {s.name: [json.loads(line) for line in s.log_tail(10**7).splitlines() if line.startswith("{")]
                   for s in slots}
    finally:
        for s in slots:
            s.stop()
        nats.stop()
    took = [r for r in records[new.name] if r["message"].startswith("leader now: epoch 2")]
    assert took and took[0]["level"] == "INFO" and took[0]["epoch"] == 2 and took[0]["node"] == f"{new.name}-1"
    lost = [r for r in records[old.name] if r["message"].startswith("leadership lost (epoch 1)")]
    assert lost and lost[0]["level"] == "WARNING" and lost[0]["epoch"] == 1, records[old.name][-5:]
