#!/usr/bin/env python3
"""The crate's module graph, from its `use crate::…`, `crate::…` and `super::…` paths.

Prints one line per edge between top-level modules (`api -> store`), then, per top-level
module, the edges between its submodules (`store: postgres -> flow`). Exits 1, naming
the modules, if any two import each other, directly or around a longer loop: at the
top level, or between sibling submodules (a child's `super::` use of its own parent is
how Rust modules share their items and is not counted); and if a top-level module
imports one from a higher layer than its own. The layers are the list in `src/lib.rs`'s
documentation (`//! - `a`, `b` — …`), bottom up; modules on one line are one layer, and
every top-level module must be on it.

    scripts/module-graph.py            # the edges, then "no cycles" or the cycles
    scripts/module-graph.py --dot      # the same graph for Graphviz
"""
import pathlib
import re
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"


def module_of(path: pathlib.Path) -> tuple:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib"):
        parts.pop()
    return tuple(parts)


def expand(tree: str) -> list:
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = tree.strip()
    if "{" not in tree:
        return [tree]
    head, rest = tree.split("{", 1)
    body = rest[: rest.rindex("}")]
    items, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    items.append(cur)
    return [head + p for item in items if item.strip() for p in expand(item)]


def paths_in(text: str, here: tuple) -> list:
    text = re.sub(r"//[^\n]*", "", text)
    found = []
    for m in re.finditer(r"\buse\s+((?:crate|super|self)::[^;]*);", text, re.S):
        # `x as y` renames the import: the path is `x`.
        tree = re.sub(r"\s+as\s+[A-Za-z_][A-Za-z0-9_]*", "", m.group(1))
        found += expand(re.sub(r"\s+", "", tree))
    text = re.sub(r"\buse\s+[^;]*;", "", text, flags=re.S)
    found += re.findall(r"\b(?:crate|super)(?:::[A-Za-z_][A-Za-z0-9_]*)+", text)
    out = []
    for p in found:
        segs = p.split("::")
        if segs[0] == "crate":
            out.append(tuple(segs[1:]))
        elif segs[0] in ("super", "self"):
            base = list(here)
            while segs and segs[0] in ("super", "self"):
                if segs.pop(0) == "super" and base:
                    base.pop()
            out.append(tuple(base + segs))
    return out


def layers() -> dict:
    """Top-level module -> layer number, from `src/lib.rs`'s documented list."""
    out = {}
    n = 0
    for line in (SRC / "lib.rs").read_text().splitlines():
        m = re.match(r"//! - ((?:`[a-z_]+`(?:, )?)+)\s+—", line)
        if m:
            for name in re.findall(r"`([a-z_]+)`", m.group(1)):
                out[name] = n
            n += 1
    return out


def main() -> int:
    files = [p for p in SRC.rglob("*.rs") if p.parts[len(SRC.parts)] != "bin" and p.name != "main.rs"]
    modules = {module_of(p) for p in files}

    def resolve(path: tuple) -> tuple:
        for n in range(len(path), 0, -1):
            if path[:n] in modules:
                return path[:n]
        return ()

    top, inner = set(), {}
    for f in files:
        here = module_of(f)
        # Code inside a submodule file's own `mod tests` etc. is part of the file.
        for path in paths_in(f.read_text(), here):
            target = resolve(path)
            if not here or not target:
                continue
            if here[0] != target[0]:
                top.add((here[0], target[0]))
            elif len(here) > 1 and len(target) > 1 and here[1] != target[1]:
                inner.setdefault(here[0], set()).add((here[1], target[1]))

    if "--dot" in sys.argv:
        print("digraph mailroom {\n  rankdir=LR;")
        for a, b in sorted(top):
            print(f'  "{a}" -> "{b}";')
        print("}")
        return 0

    for a, b in sorted(top):
        print(f"{a} -> {b}")
    for parent, edges in sorted(inner.items()):
        for a, b in sorted(edges):
            print(f"{parent}: {a} -> {b}")

    order = layers()
    problems = 0
    for name in sorted({m[0] for m in modules if m}):
        if name not in order:
            print(f"module {name} is not in src/lib.rs's layer list")
            problems += 1
    for a, b in sorted(top):
        if a in order and b in order and order[a] < order[b]:
            print(f"layer violation: {a} (layer {order[a]}) imports {b} (layer {order[b]})")
            problems += 1

    cycles = [("crate", c) for c in sccs(top)]
    cycles += [(parent, c) for parent, edges in inner.items() for c in sccs(edges)]
    if not cycles:
        print("no cycles")
        if problems:
            return 1
        print("layers respected")
        return 0
    for where, c in cycles:
        print(f"cycle in {where}: {' <-> '.join(sorted(c))}")
    return 1


def sccs(edges: set) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
