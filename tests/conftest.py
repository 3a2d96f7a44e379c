"""The suite reads real captured machines from ../shared; without them it would prove nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

from tests.fixtures import HWLOC_LINUX, LAB_CAPTURES, SHARED

if TYPE_CHECKING:
    from bench.containerd import Containerd

# A test must not depend on the machine's speed: hypothesis' default 200 ms deadline per example and
# its too_slow health check fail on a busy 2-core box (a parser that takes 309 ms under load is not
# wrong). Loaded here, before any test module builds its @settings, so every test inherits it.
settings.register_profile("memtopo", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("memtopo")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "lab_capture: reads the numa-vm lab's real captures")
    missing = [p for p in (HWLOC_LINUX, LAB_CAPTURES) if not p.is_dir()]
    if missing:
        raise pytest.UsageError(
            f"shared fixtures not found under {SHARED} (missing {', '.join(map(str, missing))}); "
            "check out shared/ beside the repository or set MEMTOPO_SHARED")


@pytest.fixture(scope="session")
def containerd() -> Iterator[Containerd]:
    """One real containerd for the session (see bench/containerd.py). Where it cannot run (not root,
    not installed) its tests skip and say why; under CI (``CI=true``) as root that is a failure, since
    tools/setup.sh installs it there."""
    from bench.containerd import Containerd, unavailable_reason

    why = unavailable_reason()
    if why is not None:
        if os.environ.get("CI") == "true" and os.geteuid() == 0:
            pytest.fail(f"containerd tests cannot run under CI: {why}")
        pytest.skip(why)
    ctrd = Containerd.start()
    try:
        yield ctrd
    finally:
        ctrd.stop()
