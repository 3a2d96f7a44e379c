"""The suite itself must not depend on the machine's speed: a busy 2-core box runs it too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures import REPO

# Every test and helper module (the synthesized hosts under tests/fixtures/ are data, not tests).
TESTS = sorted(p for p in (REPO / "tests").rglob("*.py") if (REPO / "tests" / "fixtures") not in p.parents)
# Test modules by room: tests/<floor>/ for each floor of the package (the README's Layout), plus
# tests/deploy/ (systemd unit, Kubernetes manifests). At the top of tests/: the tests of the
# repository as a whole, and the helpers that several rooms share.
ROOMS = ("ground", "discovery", "planner", "apply", "draw", "k8s", "agent", "controller", "extender", "cli", "deploy")
HOUSE_TESTS = ("test_layering.py", "test_suite_hygiene.py", "test_tools_scripts.py", "test_synth_fixtures.py")
# `assert <clock>() - t0 < X`: an upper bound on elapsed time, which a loaded machine misses.
ELAPSED_UPPER_BOUND = re.compile(r"assert\b.*\b(perf_counter|monotonic|time)\(\)\s*-\s*\w+\s*<")
A_DEADLINE = re.compile(r"\bsettings\(.*\bdeadline\s*=\s*(?!None\b)")


def test_hypothesis_has_no_wall_clock_deadline_by_default() -> None:
    assert settings.default is not None and settings.default.deadline is None


@settings(max_examples=3)
@given(st.integers())
def test_a_test_with_its_own_settings_inherits_no_deadline(n: int) -> None:
    own = vars(test_a_test_with_its_own_settings_inherits_no_deadline)["_hypothesis_internal_use_settings"]
    assert own.max_examples == 3 and own.deadline is None


def test_no_test_sets_a_deadline_or_bounds_elapsed_time() -> None:
    assert REPO / "tests" / "agent" / "test_agent_e2e.py" in TESTS  # the rooms are read too
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for path in TESTS if path.name != "test_suite_hygiene.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if ELAPSED_UPPER_BOUND.search(line) or A_DEADLINE.search(line)]
    assert found == []


# Comments and messages state the fact itself, not where it was read: a citation of a reference
# design by number, of an issue, or of a research-notes section means nothing to a reader of the
# code. The words are assembled from parts so that this file's own source does not match.
_SEED, _ISSUE, _NOTES, _SECTION = "se" + "ed", "iss" + "ue", "no" + "tes", "\u00a7"
CITATION = re.compile(
    "|".join((
        rf"\b{_SEED}s? 0\d{{0,2}}\b",  # a reference design by its number
        rf"\b{_ISSUE}s? \d+\b",  # a project issue (an upstream "#N" reference is a public source)
        rf"{_SECTION}\s?[A-Z0-9]",  # a section of a document
        rf"\bsee (the )?{_NOTES}\b|\bfrom the {_NOTES}\b|shared/({_NOTES}|{_SEED}s)/",
    )),
    re.IGNORECASE,
)
PACKAGE_FOLDERS = ("discovery", "planner", "apply", "agent", "controller", "fleetpage", "cli", "draw", "k8s", "bench",
                   "tools", "tests", "memtopo", "proto")
SOURCE_SUFFIXES = (".py", ".pyi", ".proto")


def _source_files() -> list[Path]:
    # os.walk does not follow symlinks, so memtopo/'s links to the other floors are not read twice.
    found = []
    for folder in PACKAGE_FOLDERS:
        for dirpath, dirnames, filenames in os.walk(REPO / folder):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            found += [Path(dirpath, f) for f in filenames if f.endswith(SOURCE_SUFFIXES)]
    return sorted(found)


@pytest.mark.parametrize("text", [
    f"# {_SEED.capitalize()} 001: two rings of four.",
    f'"{_SEED} 003 rule 1: only 1, 2, 4 or 8"',
    f"(the {_SEED}s 000 and 002)",
    f"# {_ISSUE.capitalize()} 6: capacity defaults to the number available",
    f"speed ({_ISSUE} 6)",
    f"({_NOTES} {_SECTION}1.4)",
    f"(cpu_binding.md {_SECTION}A.12)",
    f"# see {_NOTES} for the vectors",
    f"``../shared/{_NOTES}/cpu_binding.md``",
])
def test_citation_pattern_flags_citations(text: str) -> None:
    assert CITATION.search(text)


@pytest.mark.parametrize("text", [
    "# NPUs on different HCCS rings cannot exchange gradients",
    f"random {_SEED} 42 for hypothesis",
    f"derive({_SEED}=0)",
    f"(public nvtop {_ISSUE} #421)",
    "kubernetes/kubernetes#135581",
    f"``../shared/fixtures/ascend910`` and the {_NOTES} on the format",
])
def test_citation_pattern_leaves_facts_and_public_sources(text: str) -> None:
    assert not CITATION.search(text)


def test_source_files_state_facts_not_citations() -> None:
    files = _source_files()
    assert REPO / "planner" / "hccs.py" in files and REPO / "memtopo" / "runner.py" in files
    assert REPO / "tests" / "test_suite_hygiene.py" in files  # this file is checked too
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for path in files
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if CITATION.search(line)]
    assert found == []


def test_every_test_module_is_in_its_room() -> None:
    """A new test module goes into the room of the floor it tests (tests/README.md)."""
    tests = REPO / "tests"
    misplaced = sorted(str(p.relative_to(REPO)) for p in TESTS if p.name.startswith("test_")
                       and not (p.parent == tests and p.name in HOUSE_TESTS)
                       and not (p.parent.parent == tests and p.parent.name in ROOMS))
    assert misplaced == []
    assert all((tests / room / "__init__.py").is_file() for room in ROOMS)


GROUPED = """
import pytest

pytestmark = pytest.mark.xdist_group("one-at-a-time")


@pytest.mark.parametrize("n", range(6))
def test_grouped(n: int) -> None:
    pass
"""


def test_xdist_groups_hold(tmp_path: Path) -> None:
    """What cannot run twice at once (the lab's boots, writes to one real IRQ, setup.sh against the
    one .venv) relies on --dist loadgroup keeping an xdist_group on one worker. A pytest or
    pytest-xdist release that breaks that breaks it silently: here it shows."""
    (tmp_path / "test_planted.py").write_text(GROUPED)
    (tmp_path / "test_alone.py").write_text("def test_a() -> None:\n    pass\n\n\ndef test_b() -> None:\n    pass\n")
    # xdist alone: the other plugins (hypothesis …) only cost each worker its start-up.
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "xdist.plugin", "-n", "2",
                          "--dist", "loadgroup", "-v", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, check=False, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert res.returncode == 0, res.stdout[-3000:]
    workers = {m.group(1) for m in re.finditer(r"\[(gw\d+)\].*PASSED .*test_grouped", res.stdout)}
    assert len(re.findall(r"PASSED .*test_grouped\[\d\]@one-at-a-time", res.stdout)) == 6, res.stdout[-3000:]
    assert len(workers) == 1, res.stdout[-3000:]


def test_every_module_that_boots_the_lab_is_in_its_xdist_group() -> None:
    """A lab guest takes a core for minutes: every module that boots one carries the lab's marks (its
    xdist group), so its module-scoped boot runs once, on one worker, after the other boots."""
    booting = [p for p in TESTS if p.name.startswith("test_") and '"run", "--profile"' in p.read_text()]
    assert len(booting) >= 3  # the discovery, apply and enforcement lab tests
    ungrouped = sorted(str(p.relative_to(REPO)) for p in booting if "pytestmark = lab_marks" not in p.read_text())
    assert ungrouped == []
