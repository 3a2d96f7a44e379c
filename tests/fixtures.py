"""Access to the shared fixtures (../shared beside the checkout), extracted once and cached: the
benchmarks' own access (bench/roots.py), and what only tests read (hwloc's .test environments)."""

from __future__ import annotations

import shlex

from bench.roots import (
    HWLOC_LINUX,
    HWLOC_XML,
    LAB_CAPTURES,
    REPO,
    SHARED,
    extracted,
    hwloc_root,
    lab_root,
)

__all__ = ["HWLOC_LINUX", "HWLOC_XML", "LAB_CAPTURES", "REPO", "SHARED", "extracted", "hwloc_root", "hwloc_test_env",
           "lab_root"]


def hwloc_test_env(test_name: str) -> dict[str, str]:
    """The ``env:`` lines of an hwloc ``.test`` file (``export X`` lines are no-ops)."""
    env: dict[str, str] = {}
    for line in (HWLOC_LINUX / f"{test_name}.test").read_text().splitlines():
        if not line.startswith("env:"):
            continue
        body = line[4:].strip()
        if body.startswith("export "):
            continue
        key, _, value = body.partition("=")
        (val,) = shlex.split(value) or [""]
        env[key.strip()] = val
    return env
