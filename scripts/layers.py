#!/usr/bin/env python3
"""Fails when a crate's modules (the core's by default) import each other in a circle.

Reads every `crate::...` path in crates/capture-arena/src (the lines before a file's first
`#[cfg(test)]`: unit tests may reach anywhere), resolves each to the file that defines the named
module (the longest module path that exists: `crate::memory::shm::random_nonce` is
memory/shm.rs, `crate::memory::Region` is memory/mod.rs), and looks for strongly connected
components in that graph of files. lib.rs and main.rs (crate roots: they declare and re-export) are left out.
Prints every circle with the imports that tie it, and exits 1 if there is one.

Usage: python3 scripts/layers.py [SRC_DIR]     (the test command runs it)
"""

from __future__ import annotations

import pathlib
import re
import sys

SRC = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent / "crates/capture-arena/src")
PATH = re.compile(r"\bcrate((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
GROUP = re.compile(r"\bcrate::((?:[a-z_][a-z0-9_]*::)*)\{([^}]*)\}")


def module_of(path: pathlib.Path) -> tuple[str, ...]:
    """The module path of a source file (memory/cuda/mod.rs -> ("memory", "cuda"))."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "mod":
        parts.pop()
    return tuple(parts)


def main() -> int:
    files = {module_of(p): p for p in SRC.rglob("*.rs") if p.name not in ("lib.rs", "main.rs")}

    def resolve(segments: list[str]) -> tuple[str, ...] | None:
        for n in range(len(segments), 0, -1):
            if tuple(segments[:n]) in files:
                return tuple(segments[:n])
        return None

    edges: dict[tuple[str, ...], dict[tuple[str, ...], set[str]]] = {m: {} for m in files}
    for mod, path in files.items():
        text = path.read_text()
        text = text.split("#[cfg(test)]", 1)[0]
        code = "\n".join(line.split("//", 1)[0] for line in text.splitlines())
        found: list[list[str]] = []
        for m in GROUP.finditer(code):
            prefix = [s for s in m.group(1).split("::") if s]
            for item in m.group(2).split(","):
                item = item.strip().split(" as ")[0].strip()
                if item and item != "self":
                    found.append(prefix + [s for s in item.split("::") if s])
                elif item == "self":
                    found.append(prefix)
        for m in PATH.finditer(code):
            found.append([s for s in m.group(1).split("::") if s])
        for segments in found:
            target = resolve(segments)
            if target is None or target == mod:
                continue
            # A parent module's file declaring its children is not an import of them.
            edges[mod].setdefault(target, set()).add("::".join(segments[len(target):]) or "(module)")

    # Tarjan's strongly connected components.
    index: dict[tuple[str, ...], int] = {}
    low: dict[tuple[str, ...], int] = {}
    stack: list[tuple[str, ...]] = []
    on: set[tuple[str, ...]] = set()
    circles: list[list[tuple[str, ...]]] = []

    def visit(v: tuple[str, ...]) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                circles.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(files):
        if v not in index:
            visit(v)
    name = lambda m: "::".join(m)  # noqa: E731
    if not circles:
        print(f"layers: no import circle among the {len(files)} modules of {SRC}")
        return 0
    for c in circles:
        print(f"layers: an import circle among {len(c)} modules: {', '.join(name(m) for m in c)}")
        for a in c:
            for b, items in sorted(edges[a].items()):
                if b in c:
                    print(f"  {name(a)} -> {name(b)}: {', '.join(sorted(items))}")
    print("layers: modules import only downward (lib.rs's module table); move what ties the circle to a module below both")
    return 1


if __name__ == "__main__":
    sys.exit(main())
