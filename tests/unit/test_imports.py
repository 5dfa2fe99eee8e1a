"""Every module of ditserve.cluster, ditserve.replica and ditserve.kernels imports on its own (no import cycle
can hide behind the order other modules happen to be imported in), and the import graph of those three
folders, read from the source (top-level imports and imports inside functions), has no cycle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"cluster": "ditserve.cluster", "replica": "ditserve.replica", "kernels": "ditserve.kernels"}


def our_modules() -> dict[str, Path]:
    """Dotted name → source file of every module of the three folders."""
    mods = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module → the modules of ours it imports anywhere in its source (`from pkg import mod` counts as mod)."""

    def ours(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(ours(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in mods else ours(base))
        deps.discard(None)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_import_graph_has_no_cycle():
    graph = import_graph(our_modules())
    assert len(graph) > 50, sorted(graph)  # the walk found the three folders
    assert cycles(graph) == []


def test_cycle_finder_sees_a_cycle_behind_a_late_import():
    """What the check above relies on: an import inside a function closes a cycle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def third_party(mods: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) for every import of another distribution in our modules."""
    found: dict[str, set[str]] = {}
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if not a.name.startswith("ditserve"):
                        found.setdefault(a.name, set())
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if not node.module.startswith("ditserve"):
                    found.setdefault(node.module, set()).update(a.name for a in node.names)
    return sorted((m, sorted(names)) for m, names in found.items())


# Run in a fresh interpreter: every third-party module ours import is imported once (and the names taken from
# it read, which loads lazy submodules such as diffusers' models), then a forked child per module of ours
# imports just that module (none of ours is imported before the fork); failures come back as JSON.
_ZYGOTE = textwrap.dedent(
    """
    import importlib, json, os, sys, traceback
    libs, names = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    for lib, attrs in libs:
        try:
            mod = importlib.import_module(lib)
            for attr in attrs:
                getattr(mod, attr, None)
        except BaseException:
            pass
    assert not [m for m in sys.modules if m.startswith("ditserve.")], "imported ours before the fork"
    failures, running = {}, {}

    def reap():
        pid, status = os.wait()
        name, r = running.pop(pid)
        with os.fdopen(r, "rb") as f:
            err = f.read().decode()
        if status != 0:
            failures[name] = err or f"exit status {status}"

    for name in names:
        if len(running) >= 4:
            reap()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                importlib.import_module(name)
                code = 0
            except BaseException:
                os.write(w, traceback.format_exc()[-2000:].encode())
                code = 1
            os._exit(code)
        os.close(w)
        running[pid] = (name, r)
    while running:
        reap()
    print(json.dumps(failures))
    """
)


def test_every_module_imports_on_its_own():
    mods = our_modules()
    proc = subprocess.run(
        [sys.executable, "-c", _ZYGOTE, json.dumps(third_party(mods)), json.dumps(sorted(mods))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
