"""The house's floors, read from the code's own imports: data flows host → discovery → topology →
planner → plan → apply, the ground floor (``memtopo`` itself: the schema, host reading, shared value
types) imports nothing above it, agent and controller never import each other, and only ``cli``
stands on everything. A failure names the file, the line and the import that crosses a floor."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "memtopo"
GROUND = "ground"
# What each floor may import besides itself and the ground floor.
ALLOWED: dict[str, frozenset[str]] = {
    GROUND: frozenset(),
    "discovery": frozenset(),
    "planner": frozenset(),
    "apply": frozenset(),
    "draw": frozenset(),
    "k8s": frozenset(),
    "agent": frozenset({"discovery", "apply", "k8s"}),
    "controller": frozenset({"planner", "draw", "k8s"}),
    "fleetpage": frozenset({"controller", "planner", "draw"}),
    "cli": frozenset({"discovery", "planner", "apply", "draw", "k8s", "agent", "controller", "fleetpage"}),
}


def floor_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return GROUND


def modules() -> Iterator[tuple[str, Path]]:
    for dirpath, dirnames, filenames in os.walk(PACKAGE, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "v1"))
        rel = Path(dirpath).relative_to(PACKAGE.parent)
        for name in sorted(filenames):
            if name.endswith(".py"):
                stem = [] if name == "__init__.py" else [name[:-3]]
                yield ".".join([*rel.parts, *stem]), Path(dirpath) / name


def imports(module: str, path: Path, top_level_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, imported memtopo module) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                # `from memtopo.cli import plan` imports the module memtopo.cli.plan.
                where = PACKAGE.parent / base.replace(".", "/") / alias.name
                is_module = where.is_dir() or where.with_suffix(".py").is_file()
                yield node.lineno, f"{base}.{alias.name}" if is_module else base


def test_every_floor_imports_only_what_it_stands_on() -> None:
    crossings = []
    for module, path in modules():
        floor = floor_of(module)
        for line, target in imports(module, path):
            if not target.startswith("memtopo.") and target != "memtopo":
                continue
            to = floor_of(target)
            if to not in (floor, GROUND) and to not in ALLOWED[floor]:
                crossings.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {floor} imports {target}")
    assert not crossings, "\n".join(crossings)


def test_no_import_loop_at_load_time() -> None:
    graph: dict[str, set[str]] = {}
    for module, path in modules():
        graph[module] = {t for _, t in imports(module, path, top_level_only=True) if t.startswith("memtopo.")}
    seen: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                loop = [*path[path.index(nxt):], nxt] if nxt in path else [node, nxt]
                pytest.fail("import loop: " + " -> ".join(loop))
            if nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])


def test_the_floors_are_found() -> None:
    """The walk follows memtopo/'s links to the top-level folders (a silent empty walk passes anything)."""
    floors = {floor_of(m) for m, _ in modules()}
    assert floors == set(ALLOWED)


def test_the_controller_composes_no_routes_of_other_rooms() -> None:
    """What the controller's HTTP listener serves is put together by the entry point that starts it
    (cli/controller.py): no controller module but the extender itself imports the extender (the
    fleet page, a room above, is held by ALLOWED)."""
    extender = "memtopo.controller.extender"
    crossings = [f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {target}"
                 for module, path in modules() if floor_of(module) == "controller" and module != extender
                 for line, target in imports(module, path) if target == extender]
    assert not crossings, "\n".join(crossings)


def test_no_probe_imports_another_probe() -> None:
    """Probes are independent: what one needs from another comes in as an argument, scheduled from
    the registry's declarations (discovery/probes.py), never by importing the other probe."""
    from memtopo.discovery.probes import PROBES

    probes = {spec.module for spec in PROBES}
    paths = {module: path for module, path in modules() if module in probes}
    assert set(paths) == probes  # every declared probe is a module of the package
    crossings = [f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports the probe {target}"
                 for module, path in sorted(paths.items()) for line, target in imports(module, path)
                 if target in probes - {module}]
    assert not crossings, "\n".join(crossings)
