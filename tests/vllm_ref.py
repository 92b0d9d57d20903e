"""vLLM's own code as the reference of the wire format, the block hash and the block pool: a few files
taken from vLLM's wheels at test time (never committed), imported with everything else they import stubbed.

``python -m tests.vllm_ref fetch`` (deploy/ci-install.sh runs it) downloads each wheel of VERSIONS with
``pip download --no-deps``, keeps only FILES and deletes the wheel; the files live in a cache outside the
repository (``$KVSERVICE_VLLM_DIR``, default ``~/.cache/kvservice/vllm``), about 300 KB per version, so a
second run downloads nothing. Tests call :func:`module`, which skips (or fails under CI, tests/ci.py)
when the files are missing.

Loading: :class:`_Finder` serves ``vllm.*`` modules for one version: a module whose file was kept is
executed from it; any other (``vllm.logger``, ``vllm.config``, ``vllm.v1.request``, ...) is a stub whose
every attribute is a permissive placeholder class, so ``from vllm.x import Y`` works and nothing of it
runs. ``init_logger`` is a real logger and ``vllm.envs`` answers vLLM's defaults asked for here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

#: The vLLM versions whose files the tests read: 0.11 (events as arrays) and 0.33 (events as tagged maps).
VERSIONS = ("0.11.0", "0.33.0")
FILES = ("vllm/distributed/kv_events.py", "vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/block_pool.py",
         "vllm/utils/hashing.py", "vllm/utils/__init__.py")
#: Modules executed from the kept files (vllm/utils/__init__.py of 0.11 is read only for sha256_cbor).
EXECUTED = ("vllm.distributed.kv_events", "vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool",
            "vllm.utils.hashing")


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVICE_VLLM_DIR") or Path.home() / ".cache" / "kvservice" / "vllm")


def version_dir(version: str) -> Path:
    return cache_dir() / version


def have(version: str) -> bool:
    return (version_dir(version) / "vllm/distributed/kv_events.py").is_file()


def fetch(version: str, python: str = sys.executable) -> Path:
    """The kept files of one version (downloaded once: the wheel is deleted after extraction)."""
    out = version_dir(version)
    if have(version):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        f"vllm=={version}", "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            for name in FILES:
                if name in names:
                    target = out / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(name))
    return out


class _Placeholder:
    """Stands for anything of vLLM that is not loaded: callable, subclassable, any attribute."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> _Placeholder:
        return _Placeholder()

    def __class_getitem__(cls, item: object) -> type:
        return cls


class _Envs(types.ModuleType):
    """vllm.envs: vLLM's defaults for what the loaded files ask."""

    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = True

    def __getattr__(self, name: str) -> object:
        return None


class _Stub(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "init_logger":
            return logging.getLogger
        cls = type(name, (_Placeholder,), {})
        setattr(self, name, cls)
        return cls


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: Path, extra: dict[str, dict[str, object]]) -> None:
        self.root = root
        self.extra = extra

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        file = self.root / (fullname.replace(".", "/") + ".py")
        if fullname in EXECUTED and file.is_file():
            return importlib.util.spec_from_file_location(fullname, file)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _Envs(spec.name) if spec.name == "vllm.envs" else _Stub(spec.name)
        for k, v in self.extra.get(spec.name, {}).items():
            setattr(mod, k, v)
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _sha256_cbor_of_0_11(root: Path) -> object:
    """vLLM 0.11's sha256_cbor, the function's own source taken from its vllm/utils/__init__.py."""
    src = (root / "vllm/utils/__init__.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "sha256_cbor")
    import hashlib

    import cbor2
    ns: dict[str, object] = {"cbor2": cbor2, "hashlib": hashlib, "Any": object}
    exec(compile(ast.Module([fn], []), "vllm/utils/__init__.py", "exec"), ns)
    return ns["sha256_cbor"]


def load(version: str, name: str) -> types.ModuleType:
    """Module `name` (e.g. "vllm.distributed.kv_events") of vLLM `version`, freshly imported with stubs."""
    root = version_dir(version)
    extra: dict[str, dict[str, object]] = {}
    if not (root / "vllm/utils/hashing.py").is_file() and (root / "vllm/utils/__init__.py").is_file():
        extra["vllm.utils"] = {"sha256_cbor": _sha256_cbor_of_0_11(root), "cdiv": lambda a, b: -(-a // b),
                               "GiB_bytes": 1 << 30}
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in saved:
        del sys.modules[k]
    finder = _Finder(root, extra)
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def module(version: str, name: str) -> types.ModuleType:
    """load(), or skip (fail under CI) when the version's files were not fetched."""
    if not have(version):
        from tests.ci import missing
        missing(f"vLLM {version}'s reference files", "python -m tests.vllm_ref fetch (deploy/ci-install.sh)")
    return load(version, name)


if __name__ == "__main__":
    if sys.argv[1:2] != ["fetch"]:
        sys.exit("usage: python -m tests.vllm_ref fetch [PYTHON]")
    py = sys.argv[2] if len(sys.argv) > 2 else sys.executable
    for v in VERSIONS:
        print(f"vLLM {v}: {fetch(v, py)}")
