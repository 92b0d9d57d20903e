"""tests/ci.py: a missing tool skips a test on a developer's machine and fails it under CI=true."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import ci

PROBE = textwrap.dedent("""
    from tests.ci import need_tool, need_module

    def test_tool():
        need_tool("surely-not-a-tool-kvservice", "nowhere")

    def test_module():
        need_module("surely_not_a_module_kvservice", "nowhere")
""")


@pytest.mark.parametrize(("env", "outcome"), [({"CI": "true"}, "2 failed"), ({"CI": ""}, "2 skipped"),
                                              ({"CI": "false"}, "2 skipped")])
def test_missing_tool_fails_only_under_ci(tmp_path, env, outcome):
    (tmp_path / "test_probe.py").write_text(PROBE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=Path(ci.__file__).parents[1],
                          env={**os.environ, **env})
    assert outcome in proc.stdout, proc.stdout[-2000:]
    if env["CI"] == "true":
        assert "CI installs it, so this is a CI setup error" in proc.stdout
