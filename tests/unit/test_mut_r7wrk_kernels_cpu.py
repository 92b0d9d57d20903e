"""kernels_cpu.build's temporary library: g++ writes into a temporary file created INSIDE the build's own directory,
then it is renamed over the library's path, so the rename is atomic (one filesystem: a concurrent reader sees no
library or the whole one) and nothing is left in the system's temporary directory, on success or failure. A probe
source (tests/unit/test_mut_m29w1_kernels_cpu.py's) is built into a temporary build directory while the system
temporary directory is one this test watches."""

from __future__ import annotations

import os
import tempfile

import pytest

from kvservice.worker import kernels_cpu
from tests.unit.test_mut_m29w1_kernels_cpu import _call, _probe_dir


def test_the_temporary_library_lives_beside_the_library_and_nowhere_else(tmp_path, monkeypatch):
    systmp = tmp_path / "systmp"
    systmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(systmp))        # where a mkstemp without dir= would go
    monkeypatch.setattr(kernels_cpu, "BUILD_DIR", tmp_path / "out")
    made = []
    real = tempfile.mkstemp

    def mkstemp(*args, **kw):
        fd, name = real(*args, **kw)
        made.append(name)
        return fd, name

    monkeypatch.setattr(kernels_cpu.tempfile, "mkstemp", mkstemp)
    src = _probe_dir(tmp_path)
    lib = kernels_cpu.build("plain", kernel_dir=src)
    assert _call(lib, 4) == 13
    (tmp,) = made
    assert os.path.dirname(tmp) == str(lib.parent)
    assert list(systmp.iterdir()) == []
    assert kernels_cpu.build(kernel_dir=src) == lib and len(made) == 1      # the default variant is plain
    (src / "broken.cu").write_text("extern \"C\" int kv_broken( { return 0; }\n")
    with pytest.raises(RuntimeError, match=r"^g\+\+ failed"):
        kernels_cpu.build("plain", kernel_dir=src)
    assert len(made) == 2 and os.path.dirname(made[1]) != str(lib.parent)
    assert os.path.dirname(os.path.dirname(made[1])) == str(tmp_path / "out")
    assert list(systmp.iterdir()) == []
