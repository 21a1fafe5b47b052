#!/usr/bin/env python3
"""Fails when the Python package's modules import each other in a circle, when an engine adapter
imports another adapter, or when ``__init__.py`` holds code rather than re-exports.

Reads every module of ``capture_arena`` (a file, or a sub-package's ``__init__.py`` /
``__main__.py``) with ``ast``: ``import capture_arena.x``, ``from . import x`` (a submodule, or a
name of the package's ``__init__``), ``from .x import y``, ``from .. import x`` and
``importlib.import_module("capture_arena.x")`` with a literal name, at any depth (a function's
import is a dependency too). A module imports its parent packages implicitly; those edges are
not counted (Python runs a package's ``__init__`` before its children either way).

The adapters (``ADAPTERS``) sit side by side over the core: none imports another.

Usage: python3 scripts/py_layers.py [PACKAGE_DIR]     (the test command runs it)
"""

from __future__ import annotations

import ast
import pathlib
import sys

PKG = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent / "crates/capture-arena-py/python/capture_arena")
ROOT = PKG.name
#: The engine adapters: siblings over the core.
ADAPTERS = ("sglang", "specforge", "vllm", "speculators")


def module_of(path: pathlib.Path) -> str:
    parts = [ROOT, *path.relative_to(PKG).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    """The absolute module of a relative import ``from {'.' * level}{name} import ...``."""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, name] if name else base)


def imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    mod = module_of(path)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def add(target: str) -> None:
        # The longest known module the name starts with (``capture_arena._store.X`` -> _store).
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != mod and not mod.startswith(target + "."):
            out.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == ROOT:
                    add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = resolve(mod, is_pkg, node.level, node.module)
            elif node.module and node.module.split(".")[0] == ROOT:
                base = node.module
            else:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                add(sub if sub in modules else base)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.split(".")[0] == ROOT
        ):
            add(node.args[0].value)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    files = sorted(PKG.rglob("*.py"))
    modules = {module_of(p) for p in files}
    graph = {module_of(p): imports(p, modules) for p in files}
    bad = 0
    for comp in cycles(graph):
        bad += 1
        print(f"import circle: {' <-> '.join(comp)}")
        for m in comp:
            print(f"  {m} imports {', '.join(sorted(graph[m] & set(comp)))}")
    adapters = {f"{ROOT}.{a}" for a in ADAPTERS}
    for m, deps in sorted(graph.items()):
        own = next((a for a in adapters if m == a or m.startswith(a + ".")), None)
        for d in sorted(deps):
            other = next((a for a in adapters if d == a or d.startswith(a + ".")), None)
            if own and other and other != own:
                bad += 1
                print(f"adapter {own} imports adapter {other} ({m} -> {d}): adapters are siblings over the core")
    init = ast.parse((PKG / "__init__.py").read_text())
    for node in init.body:
        reexport = isinstance(node, (ast.Import, ast.ImportFrom)) or (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        ) or (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"])
        if not reexport:
            bad += 1
            print(f"{PKG / '__init__.py'}:{node.lineno}: {type(node).__name__}: __init__.py only re-exports")
    print(f"{len(modules)} modules, {sum(map(len, graph.values()))} imports: {'FAILED' if bad else 'no circle, adapters apart, __init__ re-exports'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
