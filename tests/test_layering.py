"""The house's floors, read from the code's own imports: data flows host → discovery → topology →
planner → plan → apply, the ground floor (``memtopo`` itself: the schema, host reading, shared value
types) imports nothing above it, agent and controller never import each other, nor controller and
extender, and only ``cli`` stands on everything. Beside the floors, four rules the imports alone do not show:

- no import loop, not even through an import inside a function (a lazy import only hides the loop
  until the first call);
- ``bench/`` stands on the public package (``memtopo…`` without ``_private`` names) and its own
  helpers, never on the tests;
- a test seam lives in the tests: every environment variable production code reads is documented
  for operators (README.md or docs/), so an undocumented switch that only a test sets shows up;
- ``planner/`` and ``draw/`` never reach the host: they import only the ground floor's pure modules
  and a list of pure standard modules, and call no ``open``/``exec``-style builtin.

A failure names the file, the line and what crosses. Each rule has a test that plants a violation
and checks that the rule catches it."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "memtopo"
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
    "extender": frozenset({"planner", "k8s"}),
    "fleetpage": frozenset({"controller", "planner", "draw"}),
    "cli": frozenset({"discovery", "planner", "apply", "draw", "k8s", "agent", "controller", "extender",
                      "fleetpage"}),
}

# ---- KNOWN VIOLATIONS ------------------------------------------------------------------------------
# Violations that other branches are fixing now. The lead empties each entry when merging its fix;
# an entry that no longer occurs fails the test too, so the list only ever shrinks. Nothing is added
# here to make a new violation pass.
#
KNOWN_LOOP_EDGES: frozenset[tuple[str, str]] = frozenset()
# bench/ reaching into the tests' helpers and into private names.
KNOWN_BENCH_IMPORTS: frozenset[str] = frozenset({
    "bench/hostile_roots.py imports tests.synth",
})
KNOWN_TEST_SEAMS: frozenset[str] = frozenset()


# ---- reading the code ------------------------------------------------------------------------------
def floor_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return GROUND


def modules(package: Path = PACKAGE) -> Iterator[tuple[str, Path]]:
    for dirpath, dirnames, filenames in os.walk(package, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "v1"))
        rel = Path(dirpath).relative_to(package.parent)
        for name in sorted(filenames):
            if name.endswith(".py"):
                stem = [] if name == "__init__.py" else [name[:-3]]
                yield ".".join([*rel.parts, *stem]), Path(dirpath) / name


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``: they never run, so they close no loop."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return hidden


def imports(module: str, path: Path, top_level_only: bool = False, *, runtime_only: bool = False,
            source: str | None = None) -> Iterator[tuple[int, str]]:
    """(line, imported module) of every import in ``path`` (or ``source``), relative ones resolved;
    ``from a import b`` gives ``a.b`` where b is a module beside ``path``'s package."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    depth = len(module.split(".")) - (path.name != "__init__.py")
    root = path.parents[depth]  # the folder that holds the top package
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    hidden = _type_checking_only(tree) if runtime_only else set()
    for node in nodes:
        if id(node) in hidden:
            continue
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
                where = root / base.replace(".", "/") / alias.name
                is_module = where.is_dir() or where.with_suffix(".py").is_file()
                yield node.lineno, f"{base}.{alias.name}" if is_module else base


def import_graph(package: Path = PACKAGE, *, top_level_only: bool = False) -> dict[str, set[str]]:
    """Which package modules each module imports, at load time or (by default) at any time."""
    name = package.name
    return {module: {t for _, t in imports(module, path, top_level_only, runtime_only=True)
                     if t == name or t.startswith(name + ".")}
            for module, path in modules(package)}


def reachable(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def loops(graph: Mapping[str, Iterable[str]], ignored: frozenset[tuple[str, str]] = frozenset()) -> list[list[str]]:
    """One loop (a → … → a) per group of modules that import each other, ``ignored`` edges left out."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if (node, nxt) in ignored or nxt not in graph:
                continue
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


# ---- the floors ------------------------------------------------------------------------------------
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


def test_the_floors_are_found() -> None:
    """The walk follows memtopo/'s links to the top-level folders (a silent empty walk passes anything)."""
    floors = {floor_of(m) for m, _ in modules()}
    assert floors == set(ALLOWED)


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


# ---- import loops, lazy ones included --------------------------------------------------------------
def test_no_import_loop_at_load_time() -> None:
    assert loops(import_graph(top_level_only=True)) == []


def test_no_import_loop_through_lazy_imports_either() -> None:
    graph = import_graph()
    found = [" -> ".join(loop) for loop in loops(graph, KNOWN_LOOP_EDGES)]
    assert not found, "import loops:\n" + "\n".join(found)
    stale = sorted((a, b) for a, b in KNOWN_LOOP_EDGES if b not in graph.get(a, ()) or a not in reachable(graph, b))
    assert not stale, f"KNOWN_LOOP_EDGES entries that close no loop any more; remove them: {stale}"


def _plant(root: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / rel.split("/")[0]


def test_a_planted_lazy_loop_is_caught_and_a_type_checking_import_is_not_one(tmp_path: Path) -> None:
    package = _plant(tmp_path, {
        "plant/__init__.py": "",
        "plant/cmd.py": "from plant import errors\n\ndef run() -> None:\n    from plant import engine\n",
        "plant/engine.py": "from plant.cmd import run\n",
        "plant/errors.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from plant import engine\n",
    })
    assert loops(import_graph(package, top_level_only=True)) == []  # invisible at load time
    assert loops(import_graph(package)) == [["plant.cmd", "plant.engine", "plant.cmd"]]
    assert loops(import_graph(package), frozenset({("plant.cmd", "plant.engine")})) == []


# ---- bench stands on the public package ------------------------------------------------------------
def bench_violations(name: str, source: str) -> list[str]:
    """What ``bench/<name>`` imports besides the public package, bench's own helpers and libraries:
    the tests, or a ``_private`` name of memtopo (imported, or read off an imported module)."""
    tree = ast.parse(source, name)
    found: list[str] = []
    memtopo_names: set[str] = set()  # local names bound to memtopo modules

    def private(dotted: str) -> bool:
        return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))

    for node in ast.walk(tree):
        pairs: list[tuple[str, str]] = []  # (imported thing, local name)
        if isinstance(node, ast.Import):
            pairs = [(a.name, a.asname or a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            pairs = [(f"{node.module}.{a.name}", a.asname or a.name) for a in node.names]
        for thing, local in pairs:
            top = thing.split(".")[0]
            if top == "tests":
                module = thing.rpartition(".")[0] if isinstance(node, ast.ImportFrom) else thing
                found.append(f"bench/{name} imports {module}")
            elif top == "memtopo":
                if private(thing):
                    found.append(f"bench/{name} imports the private {thing}")
                memtopo_names.add(local)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in memtopo_names
                and private(node.attr)):
            found.append(f"bench/{name} reads the private {node.value.id}.{node.attr}")
    return sorted(set(found))


def test_bench_imports_only_the_public_package_and_its_own_helpers() -> None:
    found = {v for path in sorted((REPO / "bench").glob("*.py"))
             for v in bench_violations(path.name, path.read_text())}
    assert sorted(found - KNOWN_BENCH_IMPORTS) == []
    stale = sorted(KNOWN_BENCH_IMPORTS - found)
    assert not stale, f"KNOWN_BENCH_IMPORTS entries that no longer occur; remove them: {stale}"


def test_a_planted_bench_import_of_a_test_module_or_a_private_name_is_caught() -> None:
    planted = ("from bench.agentproc import start\nfrom memtopo.cli.main import main\nimport grpc\n"
               "from tests.agent.test_agent_e2e import set_node_memory\nimport tests.fixtures\n"
               "from memtopo.discovery.hwloc import _api\nfrom memtopo.agent import daemon\n"
               "daemon._private_loop()\ndaemon.__name__\n")
    assert bench_violations("x.py", planted) == [
        "bench/x.py imports tests.agent.test_agent_e2e",
        "bench/x.py imports tests.fixtures",
        "bench/x.py imports the private memtopo.discovery.hwloc._api",
        "bench/x.py reads the private daemon._private_loop",
    ]


# ---- test seams stay in the tests ------------------------------------------------------------------
PRODUCTION_FLOORS = ("memtopo", "discovery", "planner", "apply", "agent", "controller", "cli", "draw", "k8s")
OPERATOR_DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))


def environment_reads(source: str, filename: str = "<source>") -> list[tuple[int, str | None]]:
    """(line, variable) for each read of the process environment: ``os.environ[...]``,
    ``os.environ.get(...)``, ``os.getenv(...)``, ``... in os.environ``, also through a local name
    bound to ``os.environ``. The name is a literal or a module-level string constant; None when the
    code computes it (which hides it from this check, so it counts as undocumented)."""
    tree = ast.parse(source, filename)
    constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}

    def is_environ(expr: ast.expr) -> bool:
        return ast.unparse(expr) in ("os.environ", "environ") or (isinstance(expr, ast.Name) and expr.id in aliases)

    aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and "os.environ" in ast.unparse(node.value) and not isinstance(node.value, ast.Call | ast.Dict)
               for t in node.targets if isinstance(t, ast.Name)}

    def name_of(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value
        if isinstance(expr, ast.Name):
            return constants.get(expr.id)
        return None

    found: list[tuple[int, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "get" and is_environ(f.value)) or \
                    ast.unparse(f) in ("os.getenv", "getenv"):
                found.append((node.lineno, name_of(node.args[0])))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            found.append((node.lineno, name_of(node.slice)))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In | ast.NotIn) \
                and is_environ(node.comparators[0]):
            found.append((node.lineno, name_of(node.left)))
    return sorted(found, key=lambda x: (x[0], x[1] or ""))


def production_sources() -> Iterator[Path]:
    for floor in PRODUCTION_FLOORS:
        for dirpath, dirnames, filenames in os.walk(REPO / floor):  # not following memtopo/'s links
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "v1", "api"))
            yield from (Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))


# Files that read variables by a computed name for a reason other than configuration.
COMPUTED_READS = {"discovery/hwloc.py": "saves hwloc's input variables around one load and restores them"}


def undocumented_environment(sources: Iterable[tuple[str, str]], docs: str) -> dict[str, list[str]]:
    """variable → where production code reads it, for every variable the operator docs never name."""
    out: dict[str, list[str]] = {}
    for where, text in sources:
        for line, var in environment_reads(text, where):
            if var is None and where in COMPUTED_READS:
                continue
            if var is None or not re.search(rf"\b{re.escape(var)}\b", docs):
                out.setdefault(var or "<computed name>", []).append(f"{where}:{line}")
    return out


def test_production_code_reads_only_documented_environment_variables() -> None:
    """A switch in the environment that no operator is told about is a test seam in production
    code: it belongs in the tests (a fake, a fixture), or in the docs as configuration."""
    docs = "\n".join(p.read_text() for p in OPERATOR_DOCS)
    sources = [(str(p.relative_to(REPO)), p.read_text()) for p in production_sources()]
    assert any(environment_reads(text) for _, text in sources)  # the scan sees the reads there are
    found = undocumented_environment(sources, docs)
    assert {k: v for k, v in found.items() if k not in KNOWN_TEST_SEAMS} == {}
    stale = sorted(KNOWN_TEST_SEAMS - set(found))
    assert not stale, f"KNOWN_TEST_SEAMS entries no longer read (or now documented); remove them: {stale}"


def test_a_planted_environment_hook_is_caught() -> None:
    planted = ('import os\nHOOK = "MEMTOPO_SECRET_TEST_HOOK"\nDOC = "MEMTOPO_STATE_DIR"\n'
               "def f(name: str) -> object:\n"
               "    env = os.environ\n"
               '    return (os.environ.get(HOOK), os.getenv("MEMTOPO_OTHER_HOOK"), env["MEMTOPO_THIRD"],\n'
               '            "MEMTOPO_FOURTH" in os.environ, os.environ[name], os.environ.get(DOC),\n'
               "            dict(os.environ), {**os.environ})\n")
    assert [v for _, v in environment_reads(planted)] == [
        "MEMTOPO_OTHER_HOOK", "MEMTOPO_SECRET_TEST_HOOK", "MEMTOPO_THIRD", None, "MEMTOPO_FOURTH", "MEMTOPO_STATE_DIR"]
    found = undocumented_environment([("cli/x.py", planted)], "`MEMTOPO_STATE_DIR`: the state directory")
    assert sorted(found) == ["<computed name>", "MEMTOPO_FOURTH", "MEMTOPO_OTHER_HOOK", "MEMTOPO_SECRET_TEST_HOOK",
                             "MEMTOPO_THIRD"]
    assert found["MEMTOPO_SECRET_TEST_HOOK"] == ["cli/x.py:6"]


# ---- planner and draw never reach the host ---------------------------------------------------------
# Every ground-floor module is one or the other; a new one must be placed (and the check below proves
# the pure ones pure and the host ones really reaching the host).
HOST_GROUND: dict[str, str] = {
    "memtopo.hostfs": "reads files under a root",
    "memtopo.runner": "runs external tools",
    "memtopo.mounts": "reads the mount table and /proc/PID/cgroup",
    "memtopo.hostinfo": "reads the host name and /proc/self/status",
    "memtopo.tls": "loads certificate and key files",
    "memtopo.grpcserve": "opens gRPC servers",
    "memtopo.httpserve": "opens HTTP servers",
    "memtopo.ports": "binds sockets to learn whether a server could listen",
    "memtopo.logs": "configures the process's logging and writes events to stdout",
}
PURE_GROUND = frozenset({"memtopo", "memtopo.addresses", "memtopo.backoff", "memtopo.cpulist", "memtopo.links",
                         "memtopo.model", "memtopo.pci", "memtopo.protojson", "memtopo.text", "memtopo.wire"})
PURE_FLOORS = ("planner", "draw")
# Standard modules that compute and touch nothing outside the process (their few functions that do
# are in HOST_FUNCTIONS).
PURE_STDLIB = frozenset({
    "__future__", "abc", "bisect", "collections", "collections.abc", "copy", "dataclasses", "decimal", "enum",
    "fractions", "functools", "heapq", "ipaddress", "itertools", "json", "math", "numbers", "operator",
    "random", "re", "reprlib", "statistics", "string", "textwrap", "types", "typing", "uuid", "xml.etree.ElementTree",
    "xml.sax.saxutils",
})
# The schema's runtime (messages in memory) and the generated message modules (not their gRPC stubs).
PURE_LIBRARIES = ("google.protobuf",)
HOST_BUILTINS = frozenset({"open", "exec", "eval", "compile", "__import__", "breakpoint", "input"})
# Functions of pure modules that still read a file or the machine.
HOST_FUNCTIONS = frozenset({"json.load", "json.dump", "ET.parse", "ET.iterparse", "ElementTree.parse",
                            "random.SystemRandom", "uuid.uuid1", "uuid.getnode"})


def is_pure_module(target: str, floor: str) -> bool:
    if target in PURE_GROUND or target in PURE_STDLIB or floor_of(target) == floor != GROUND:
        return True
    if target.startswith("memtopo.v1.") and target.endswith("_pb2"):
        return True
    return any(target == lib or target.startswith(lib + ".") for lib in PURE_LIBRARIES)


def host_access(module: str, path: Path, source: str | None = None) -> list[str]:
    """How ``module`` could reach the host: an import outside the pure set, a host builtin called."""
    text = path.read_text() if source is None else source
    floor = floor_of(module)
    found = [f"{module}:{line}: imports {target}" for line, target in imports(module, path, source=text)
             if not is_pure_module(target, floor)]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called in HOST_BUILTINS or called in HOST_FUNCTIONS:
                found.append(f"{module}:{node.lineno}: calls {called}")
        elif isinstance(node, ast.Name) and node.id in ("__builtins__", "globals"):
            found.append(f"{module}:{node.lineno}: uses {node.id}")
    return found


def test_every_ground_module_is_declared_pure_or_host_reading() -> None:
    ground = {m for m, _ in modules() if floor_of(m) == GROUND}
    assert not PURE_GROUND & set(HOST_GROUND)
    assert ground == PURE_GROUND | set(HOST_GROUND)


def test_planner_and_draw_never_reach_the_host() -> None:
    checked = [(m, p) for m, p in modules() if floor_of(m) in PURE_FLOORS or m in PURE_GROUND]
    assert {floor_of(m) for m, _ in checked} == {*PURE_FLOORS, GROUND}
    found = [v for m, p in checked for v in host_access(m, p)]
    assert not found, "\n".join(found)


def test_the_host_reading_ground_modules_do_reach_the_host() -> None:
    """The declaration is honest: a module declared host-reading fails the purity check."""
    paths = dict(modules())
    assert {m: bool(host_access(m, paths[m])) for m in HOST_GROUND} == dict.fromkeys(HOST_GROUND, True)


@pytest.mark.parametrize(("source", "caught"), [
    ("import os\n", "imports os"),
    ("def f() -> str:\n    with open('/proc/meminfo') as f:\n        return f.read()\n", "calls open"),
    ("from memtopo.hostfs import HostFS\n", "imports memtopo.hostfs"),
    ("from memtopo import runner\n", "imports memtopo.runner"),
    ("def f() -> None:\n    import subprocess\n", "imports subprocess"),
    ("import socket as s\n", "imports socket"),
    ("from pathlib import Path\n", "imports pathlib"),
    ("from memtopo.discovery.discover import discover\n", "imports memtopo.discovery.discover"),
    ("from memtopo.v1 import agent_pb2_grpc\n", "imports memtopo.v1.agent_pb2_grpc"),
    ("import json\n\ndef f(p: str) -> object:\n    return json.load(p)\n", "calls json.load"),
    ("x = eval('1')\n", "calls eval"),
])
def test_a_planted_host_read_in_planner_is_caught(source: str, caught: str) -> None:
    path = PACKAGE / "planner" / "planted.py"  # never written: the source is given
    found = host_access("memtopo.planner.planted", path, source)
    assert len(found) == 1 and found[0].endswith(caught), found


def test_pure_code_passes_the_purity_check() -> None:
    source = ("from __future__ import annotations\nimport re\nfrom memtopo.cpulist import parse_cpulist\n"
              "from memtopo.v1 import topology_pb2 as pb\nfrom memtopo.planner.errors import PlanError\n"
              "from google.protobuf import json_format\n")
    assert host_access("memtopo.planner.planted", PACKAGE / "planner" / "planted.py", source) == []
