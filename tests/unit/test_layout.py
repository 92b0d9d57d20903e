"""The package layout is the architecture: layers import only downward, no import loops, the client and the
worker load nothing of the manager, small modules and functions, and docs/ARCHITECTURE.md's module map is
the tree.

Each rule has a KNOWN list of today's exceptions. A rule fails on a new exception AND on a listed one that
is gone (remove it from the list), so the lists are always exact and can only shrink.
"""

from __future__ import annotations

import ast
import collections
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci import need_module

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kvservice"

#: Which packages of kvservice each package may import (besides itself and the generated kvservice.v1).
ALLOWED = {
    "": set(),                                                   # kvservice/__init__.py
    "contract": set(),
    "core": {"contract"},
    "manager": {"core", "contract"},
    "events": {"manager", "core", "contract"},
    "state": {"manager", "events", "core", "contract"},
    "server": {"state", "events", "manager", "core", "contract"},
    "client": {"contract"},
    "worker": {"client", "contract"},                            # a worker registers through the client library
    "tools": {"client", "core", "contract"},
    "examples": {"tools", "client", "worker", "server", "manager", "core", "contract"},
}

#: Imports across layers that today's code still has (module -> module), to be removed.
KNOWN_LAYER_EXCEPTIONS: set[tuple[str, str]] = set()
#: Import loops today's code still has (each a set of modules), to be removed.
KNOWN_CYCLES: list[set[str]] = []
#: Modules the client library and the worker still load from the manager's layers (entry point -> modules),
#: to be removed.
KNOWN_LOADS: dict[str, set[str]] = {}
#: The manager's layers: what a client or a worker process must not load.
MANAGER_PACKAGES = ("core", "manager", "events", "state", "server")

MAX_MODULE_LINES = 500
MAX_COMPLEXITY = 25
#: Modules over MAX_MODULE_LINES today, with their line count then, to be split.
KNOWN_LONG_MODULES: dict[str, int] = {}
#: Functions over MAX_COMPLEXITY today (module, qualified name), to be split.
KNOWN_COMPLEX: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[1] == "v1":
            continue
        name = ".".join(rel.with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the kvservice modules it imports, wherever the import statement stands (functions too)."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import; use absolute kvservice.* imports")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvservice"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    graph[name].add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name.startswith("kvservice"))
    return graph


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_layers_import_only_downward():
    mods = _modules()
    found = set()
    for src, targets in _imports(mods).items():
        for dst in targets:
            a, b = _package(src), _package(dst)
            if b in ("v1", a) or dst == "kvservice":
                continue
            assert a in ALLOWED, f"{src}: package {a!r} has no rule in ALLOWED"
            if b not in ALLOWED[a]:
                found.add((src, dst))
    new, gone = found - KNOWN_LAYER_EXCEPTIONS, KNOWN_LAYER_EXCEPTIONS - found
    assert not new, f"imports against the layers (see ALLOWED): {sorted(new)}"
    assert not gone, f"fixed, remove from KNOWN_LAYER_EXCEPTIONS: {sorted(gone)}"


def _cycles(graph: dict[str, set[str]], nodes: set[str]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, set()) & nodes)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, set()) & nodes))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_cycle_finder_finds_a_planted_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph, set(graph)) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}, {"a", "b"}) == []


def test_no_import_loops():
    mods = _modules()
    found = _cycles(_imports(mods), set(mods))
    new = [c for c in found if c not in KNOWN_CYCLES]
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not new, f"import loops: {new}"
    assert not gone, f"fixed, remove from KNOWN_CYCLES: {gone}"


@pytest.mark.parametrize("entry", ["kvservice.client", "kvservice.client.aio", "kvservice.client.ha",
                                   "kvservice.client.aio_ha",
                                   "kvservice.client.worker_client", "kvservice.worker.server",
                                   "kvservice.worker.cli", "kvservice.worker.service"])
def test_client_and_worker_load_nothing_of_the_manager(entry):
    """A fresh interpreter imports `entry`; the manager's layers it loads are only the known ones."""
    code = f"import sys, {entry}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    names = out.stdout.split()
    loaded = {m for m in names if m.startswith("kvservice.") and _package(m) in MANAGER_PACKAGES}
    known = KNOWN_LOADS.get("kvservice.worker.server" if entry.startswith("kvservice.worker") else "kvservice.client",
                            set())
    assert not loaded - known, f"import {entry} loads the manager's {sorted(loaded - known)}"
    if entry in KNOWN_LOADS:
        assert not known - loaded, f"no longer loaded, remove from KNOWN_LOADS[{entry!r}]: {sorted(known - loaded)}"
    if entry.startswith("kvservice.client"):
        metrics = [m for m in names if m.startswith("prometheus_client")]
        assert not metrics, f"import {entry} loads the server's metrics library: {metrics}"


def _complexity(path: Path) -> list[tuple[str, int]]:
    from radon.complexity import cc_visit

    out = {}
    for block in cc_visit(path.read_text()):
        for b in [block, *getattr(block, "methods", [])]:
            out[(b.lineno, b.name)] = b.complexity
    return [(name, c) for (_, name), c in out.items()]


def test_modules_and_functions_stay_small():
    need_module("radon", "pip install -e '.[dev]'")
    long_now, complex_now = {}, set()
    for path in _modules().values():
        rel = str(path.relative_to(ROOT))
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            long_now[rel] = n
        complex_now |= {(rel, name) for name, c in _complexity(path) if c > MAX_COMPLEXITY}
    grown = {m: n for m, n in long_now.items() if n > KNOWN_LONG_MODULES.get(m, MAX_MODULE_LINES)}
    assert not grown, f"modules over {MAX_MODULE_LINES} lines (or longer than when listed): {grown}"
    assert not set(KNOWN_LONG_MODULES) - set(long_now), \
        f"now short enough, remove from KNOWN_LONG_MODULES: {set(KNOWN_LONG_MODULES) - set(long_now)}"
    new_complex = complex_now - KNOWN_COMPLEX
    assert not new_complex, f"cyclomatic complexity over {MAX_COMPLEXITY}: {new_complex}"
    assert not KNOWN_COMPLEX - complex_now, f"simpler now, remove from KNOWN_COMPLEX: {KNOWN_COMPLEX - complex_now}"


def _module_map() -> list[str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    m = re.search(r"<!-- module-map -->(.*?)<!-- /module-map -->", text, re.S)
    assert m, "docs/ARCHITECTURE.md lost its <!-- module-map --> section"
    return re.findall(r"^\| `(kvservice/[\w/]+\.py)` \|", m.group(1), re.M)


def test_architecture_module_map_is_the_tree():
    listed = _module_map()
    tree = sorted(str(p.relative_to(ROOT)) for p in _modules().values() if p.name != "__init__.py")
    dup = sorted({x for x in listed if listed.count(x) > 1})
    assert not dup, f"listed twice in the module map: {dup}"
    assert not set(tree) - set(listed), f"modules missing from docs/ARCHITECTURE.md's map: {set(tree) - set(listed)}"
    assert not set(listed) - set(tree), f"the map lists modules that do not exist: {set(listed) - set(tree)}"
