"""The suite itself must not depend on the machine's speed: a busy 2-core box runs it too."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures import REPO

TESTS = sorted((REPO / "tests").glob("*.py"))
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
    found = [f"{path.name}:{n}: {line.strip()}"
             for path in TESTS if path.name != "test_suite_hygiene.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if ELAPSED_UPPER_BOUND.search(line) or A_DEADLINE.search(line)]
    assert found == []
