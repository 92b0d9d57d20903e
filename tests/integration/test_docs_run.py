"""Docs that run (issue 24): every fenced ```sh and ```python block of README.md and docs/operations.md is executed,
in document order, against one manager on loopback, so a newcomer's copy-paste works.

- The block marked ``<!-- doc-test: manager ... -->`` (README's `kvservice serve`) is that manager: run in the
  background once, for every block after it.
- A block marked ``<!-- not-run: why -->`` is not executed (a cluster, a GPU, a server that runs until stopped)
  and must say why; every kvctl / kvservice / kvworker command line in it is still parsed by that command's own
  argparse parser, so a misspelt or removed flag fails here too.
- What the test changes, and only that: the docs' manager address 127.0.0.1:50051 (kvctl's default --target)
  and metrics port 9400 become free ports; `.venv/bin/X` becomes X of this checkout (small wrappers running this
  interpreter, so the code tested is the tree's). Shell blocks run from the repository root under
  ``bash -e -o pipefail``; Python blocks with this interpreter.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvservice.contract.cli import all_actions, existing_file, existing_path
from kvservice.server.cli import build_parser as kvservice_parser
from kvservice.tools.kvctl_parser import build_parser as kvctl_parser
from kvservice.worker.cli import build_parser as kvworker_parser

from .conftest import ROOT

pytestmark = pytest.mark.integration
DOCS = ("README.md", "docs/operations.md")
RUNS = ("sh", "python")
MODULES = {"kvctl": "kvservice.tools.kvctl", "kvservice": "kvservice.server.cli", "kvworker": "kvservice.worker.cli"}
PARSERS = {"kvctl": kvctl_parser, "kvservice": kvservice_parser, "kvworker": kvworker_parser}
OPERATORS = ("|", "||", "&&", ";", "&", ">", "<", ">>", "2>", "(", ")")
MARK = re.compile(r"^<!--\s*(not-run|doc-test):\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int           # of the opening fence, 1-based
    lang: str
    text: str
    mark: str           # "", "not-run" or "doc-test"
    why: str

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(doc: str) -> list[Block]:
    """The fenced blocks of `doc` whose language is sh or python, with the marker on the line before each."""
    lines = (ROOT / doc).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        mark = MARK.match(lines[i - 1].strip()) if i else None
        if m.group(1) in RUNS:
            out.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                             mark.group(1) if mark else "", mark.group(2) if mark else ""))
        i = end + 1
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]
RUN = [b for b in ALL if b.mark != "not-run"]


def command_lines(text: str) -> list[list[str]]:
    """The kvctl / kvservice / kvworker invocations of a shell block, as argv lists (comments and `\\`-joined lines
    handled, a `kubectl exec ... -- kvservice ...` included; each ends at a shell operator)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(re.sub(r"<[\w .-]+>", "PLACEHOLDER", line), posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters = True, "#"
        words = list(lex)
        first = 0                                  # where the current command starts (after NAME=value words)
        for k, w in enumerate(words):
            if w in OPERATORS or w == "--" or (k == first and re.match(r"^\w+=", w)):
                first = k + 1
                continue
            if k == first and Path(w).name in PARSERS:
                end = next((j for j in range(k, len(words)) if words[j] in OPERATORS), len(words))
                out.append([Path(w).name, *words[k + 1:end]])
    return out


def parse_only(argv: list[str]) -> None:
    """Parse argv with its command's parser, file flags taken as plain strings (the files are the reader's)."""
    parser = PARSERS[argv[0]]()
    for _, action in all_actions(parser):
        if action.type in (existing_file, existing_path):
            action.type = None
    try:
        parser.parse_args(argv[1:])
    except SystemExit as exit_:
        raise AssertionError(f"{shlex.join(argv)}: {argv[0]} refuses these arguments (exit {exit_.code})") from None


def test_every_block_runs_or_says_why_not():
    assert len(ALL) >= 10, [b.name for b in ALL]
    managers = [b for b in ALL if b.mark == "doc-test"]
    assert len(managers) == 1 and "kvservice serve" in managers[0].text, "one block is the manager of the others"
    parsed = 0
    for b in ALL:
        if b.mark == "not-run":
            assert len(b.why) > 15, f"{b.name}: a not-run block must say why"
            assert b.lang == "sh", f"{b.name}: Python snippets must run"
            for argv in command_lines(b.text):
                parse_only(argv)
                parsed += 1
    assert parsed >= 10                            # README's other serve commands, the worker's, kubectl exec's ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Wrappers for .venv/bin's commands, the environment and the port of the docs' manager."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, module in (*MODULES.items(), ("python", None)):
        target = f'"{sys.executable}"' + (f" -m {module}" if module else "")
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        path.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("KVSERVICE_ADDR", "KVSERVICE_TOKEN")}
    port = free_port()
    environ.update(PATH=f"{bin_dir}:{environ.get('PATH', '')}", PYTHONPATH=str(ROOT),
                   KVSERVICE_ADDR=f"127.0.0.1:{port}")          # kvctl's default --target, as the docs' 50051
    return {"env": environ, "port": port}


def localize(text: str, port: int) -> str:
    return (text.replace("127.0.0.1:50051", f"127.0.0.1:{port}").replace("--metrics-port 9400", "--metrics-port 0")
            .replace(".venv/bin/", ""))


@pytest.fixture(scope="module")
def manager(env, tmp_path_factory):
    (block,) = [b for b in ALL if b.mark == "doc-test"]
    log = tmp_path_factory.mktemp("docs-manager") / "manager.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-e", "-c", localize(block.text, env["port"])], cwd=ROOT, env=env["env"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{env['port']}") as ch:
            grpc.channel_ready_future(ch).result(timeout=180)          # a loaded CI machine starts slowly
    except grpc.FutureTimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{block.name} did not start a manager:\n{log.read_text()[-3000:]}") from None
    yield proc
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("block", [b for b in RUN if b.mark != "doc-test"], ids=lambda b: b.name)
def test_block_runs(block, env, manager):
    code = localize(block.text, env["port"])
    cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if block.lang == "sh" else [sys.executable, "-c", code]
    r = subprocess.run(cmd, cwd=ROOT, env=env["env"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{block.name} failed (exit {r.returncode}):\n{code}\n--- stdout\n{r.stdout[-3000:]}" \
                              f"\n--- stderr\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr
    assert manager.poll() is None, "the manager stopped"
