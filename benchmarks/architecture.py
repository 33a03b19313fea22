"""The package's module structure, measured from its source: what the layering rules hold.

- import cycles: strongly connected groups of dpverify modules, counting every import
  statement (at module level, under ``TYPE_CHECKING`` and inside functions alike);
- private names imported across subpackages (``from dpverify.ddp.rank import _on`` in
  ``dpverify/sharded``): a name meant for its own subpackage used as shared code;
- engine imports of front ends: a module of the engine (``core``, ``checks``, ``ranked``,
  ``ddp``, ``sharded``, ``models``) importing ``cli``, ``figures`` or ``explain``;
- modules and lines of ``dpverify/``.

Usage: python benchmarks/architecture.py [--root dpverify]
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ENGINE = ("core", "exact", "checks", "ranked", "ddp", "sharded", "data", "models")
FRONT_ENDS = ("cli", "figures", "explain", "hf")


@dataclass(frozen=True)
class Structure:
    """The measured structure of one package."""

    #: module name -> the dpverify modules it imports
    imports: dict[str, frozenset[str]]
    #: (importer, imported module, name) for each private name crossing subpackages
    private: tuple[tuple[str, str, str], ...]
    lines: int

    @property
    def cycles(self) -> list[list[str]]:
        return strongly_connected(self.imports)

    @property
    def engine_to_front_ends(self) -> list[tuple[str, str]]:
        return sorted(
            (importer, imported)
            for importer, targets in self.imports.items()
            for imported in targets
            if _subpackage(importer) in ENGINE and _subpackage(imported) in FRONT_ENDS
        )


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, str | None]]:
    """(imported module, imported name or None) for every dpverify import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(module, path.name == "__init__.py", node.level, node.module)
            if target.split(".")[0] != module.split(".")[0]:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                yield (submodule, None) if submodule in known else (target, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, None


def measure(root: Path) -> Structure:
    known = _modules(root)
    imports: dict[str, frozenset[str]] = {}
    private: set[tuple[str, str, str]] = set()
    for module, path in known.items():
        targets = set()
        for target, name in _imports(module, path, known):
            if target in known and target != module:
                targets.add(target)
            if name and name.startswith("_") and not name.startswith("__") and _subpackage(module) != _subpackage(target):
                private.add((module, target, name))
        imports[module] = frozenset(targets)
    lines = sum(len(path.read_text(encoding="utf-8").splitlines()) for path in known.values())
    return Structure(imports, tuple(sorted(private)), lines)


def strongly_connected(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The groups of two or more modules that import each other, directly or not (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent / "dpverify")
    structure = measure(parser.parse_args().root)
    cycles = structure.cycles
    print(f"modules: {len(structure.imports)}, lines: {structure.lines}")
    print(f"import cycles (lazy imports included): {len(cycles)}")
    for group in cycles:
        print(f"  {len(group)} modules: {', '.join(group)}")
    print(f"private names imported across subpackages: {len(structure.private)}")
    for importer, imported, name in structure.private:
        print(f"  {importer} imports {name} from {imported}")
    print(f"engine modules importing a front end: {len(structure.engine_to_front_ends)}")
    for importer, imported in structure.engine_to_front_ends:
        print(f"  {importer} -> {imported}")


if __name__ == "__main__":
    main()
