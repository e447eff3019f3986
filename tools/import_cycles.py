"""Import cycles between the package's modules.

Every ``import`` counts: at module level, inside a function (a lazy import
is still a dependency a reader must follow) and under ``if TYPE_CHECKING:``
(a type a module names is a module a reader must know). The one import left
out is a module's import of its own ancestor packages (see ``graph``).
Prints each strongly connected group of modules and exits 1 when there is
one.

    python tools/import_cycles.py [package_dir]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(tree: ast.AST, name: str, is_package: bool, known: set[str]):
    package = name if is_package else name.rpartition(".")[0]
    stack = [tree]
    while stack:
        node = stack.pop()
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _resolve(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield from (_resolve(full, known) if full in known
                            else _resolve(base, known))


def _resolve(name: str, known: set[str]):
    while name and name not in known:
        name = name.rpartition(".")[0]
    if name:
        yield name


def _ancestor_or_self(package: str, name: str) -> bool:
    return name == package or name.startswith(package + ".")


def graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(root, p): p for p in root.rglob("*.py")}
    known = set(files)
    edges = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        # a module's import of its own ancestor packages (``from . import x``
        # where x is no module, a package's name for itself) is left out:
        # importing ``a.b.c`` imports ``a.b`` anyway, so that edge says nothing
        # a reader does not already follow, and counting it would make a cycle
        # of every module its package's __init__ imports
        edges[name] = {m for m in imports(tree, name, is_package, known)
                       if not _ancestor_or_self(m, name)}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "jupyter_triton").resolve()
    found = cycles(graph(root))
    for group in found:
        print("cycle:", " <-> ".join(group))
    print(f"{len(found)} import cycle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
