#!/usr/bin/env python3
"""Fails when a crate's modules (the core's by default) import each other in a circle, or, where
the crate's lib.rs has a layer table, import against it.

Reads every `crate::...` path in crates/capture-arena/src (the lines before a file's first
`#[cfg(test)]`: unit tests may reach anywhere), resolves each to the file that defines the named
module (the longest module path that exists: `crate::memory::shm::random_nonce` is
memory/shm.rs, `crate::memory::Region` is memory/mod.rs), and looks for strongly connected
components in that graph of files. lib.rs and main.rs (crate roots: they declare and re-export) are left out.
Prints every circle with the imports that tie it, and exits 1 if there is one.

The layer table (lib.rs's `//! | layer | module | noun |` rows, from the bottom up): a top-level
module may import modules of its own row and of earlier rows; a row labelled `name (beside
other)` shares `other`'s place and neither imports it nor is imported by it. Every top-level
module must be in the table.

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
    against = check_table(files, edges)
    if not circles and not against:
        print(f"layers: no import circle among the {len(files)} modules of {SRC}" + (", none against lib.rs's layer table" if table(SRC) else ""))
        return 0
    for line in against:
        print(f"layers: {line}")
    for c in circles:
        print(f"layers: an import circle among {len(c)} modules: {', '.join(name(m) for m in c)}")
        for a in c:
            for b, items in sorted(edges[a].items()):
                if b in c:
                    print(f"  {name(a)} -> {name(b)}: {', '.join(sorted(items))}")
    print("layers: modules import only downward (lib.rs's module table); move what ties the circle, or the import against the table, to a module below both")
    return 1


ROW = re.compile(r"^//! \| ([^|]+?) \| ([^|]+?) \| .*\|\s*$")
NAME = re.compile(r"`([a-z_][a-z0-9_]*)`")


def table(src: pathlib.Path) -> list[tuple[str, str | None, list[str]]]:
    """lib.rs's layer table rows: (label, the row it is beside or None, top-level modules)."""
    lib = src / "lib.rs"
    if not lib.exists():
        return []
    rows = []
    for line in lib.read_text().splitlines():
        m = ROW.match(line)
        if not m or m.group(1) in ("layer", "---"):
            continue
        label = m.group(1).strip()
        beside = re.search(r"\(beside ([^)]+)\)", label)
        mods = NAME.findall(m.group(2))
        if mods:
            rows.append((re.sub(r"\s*\(beside [^)]+\)", "", label), beside.group(1).strip() if beside else None, mods))
    return rows


def check_table(files: dict[tuple[str, ...], pathlib.Path], edges: dict[tuple[str, ...], dict[tuple[str, ...], set[str]]]) -> list[str]:
    """Imports against lib.rs's layer table, and top-level modules it does not list."""
    rows = table(SRC)
    if not rows:
        return []
    place: dict[str, tuple[int, int]] = {}  # module -> (rank, row)
    ranks: dict[str, int] = {}
    rank = -1
    for i, (label, beside, mods) in enumerate(rows):
        if beside is not None:
            if beside not in ranks:
                return [f"lib.rs's layer table: row {label!r} is beside {beside!r}, which no earlier row is"]
            r = ranks[beside]
        else:
            if label not in ranks or rows[i - 1][0] != label:
                rank += 1
            r = rank
        ranks[label] = r
        for m in mods:
            place[m] = (r, i)
    out = []
    tops = sorted({m[0] for m in files})
    for t in tops:
        if t not in place:
            out.append(f"module {t} is not in lib.rs's layer table")
    for a, targets in sorted(edges.items()):
        for b, items in sorted(targets.items()):
            if a[0] == b[0] or a[0] not in place or b[0] not in place:
                continue
            (ra, ia), (rb, ib) = place[a[0]], place[b[0]]
            what = ", ".join(sorted(items))
            if rb > ra:
                out.append(f"{'::'.join(a)} imports {'::'.join(b)} ({what}), a layer above its own ({rows[ib][0]} over {rows[ia][0]})")
            elif rb == ra and rows[ia][0] != rows[ib][0]:
                out.append(f"{'::'.join(a)} imports {'::'.join(b)} ({what}), a layer beside its own ({rows[ib][0]} beside {rows[ia][0]})")
    return out


if __name__ == "__main__":
    sys.exit(main())
