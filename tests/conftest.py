"""The suite reads real captured machines from ../shared; without them it would prove nothing."""

from __future__ import annotations

import pytest

from tests.fixtures import HWLOC_LINUX, LAB_CAPTURES, SHARED


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "lab_capture: reads the numa-vm lab's real captures")
    missing = [p for p in (HWLOC_LINUX, LAB_CAPTURES) if not p.is_dir()]
    if missing:
        raise pytest.UsageError(
            f"shared fixtures not found under {SHARED} (missing {', '.join(map(str, missing))}); "
            "check out shared/ beside the repository or set MEMTOPO_SHARED")
