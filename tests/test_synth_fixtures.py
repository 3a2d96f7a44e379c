"""Every synthesized host's checked-in tree is what its host.py builds (no hand edits, no drift)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.synth import fixture_files, tarball_bytes

FIXTURES = Path(__file__).parent / "fixtures"
HOSTS = sorted(p.parent for p in FIXTURES.glob("*/host.py"))


@pytest.mark.parametrize("fixture", HOSTS, ids=[p.name for p in HOSTS])
def test_tarball_is_current(fixture: Path) -> None:
    built = tarball_bytes(fixture_files(fixture))
    assert (fixture / "root.tar.gz").read_bytes() == built, \
        f"stale: run python -m tests.synth {fixture.relative_to(FIXTURES.parent.parent)}"


@pytest.mark.parametrize("fixture", HOSTS, ids=[p.name for p in HOSTS])
def test_marked_synthesized(fixture: Path) -> None:
    assert "synthesized" in (fixture / "README.md").read_text().lower()
