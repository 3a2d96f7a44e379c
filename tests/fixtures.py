"""Access to the shared fixtures (../shared beside the checkout), extracted once and cached: the
benchmarks' own access (bench/roots.py), and what only tests read (hwloc's .test environments)."""

from __future__ import annotations

import shlex
from functools import cache
from pathlib import Path

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
from bench.roots import SYNTHESIZED as SYNTH
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import topology_pb2 as pb

__all__ = ["HWLOC_LINUX", "HWLOC_XML", "LAB_CAPTURES", "REPO", "SHARED", "SYNTH", "discovered", "extracted",
           "hwloc_root", "hwloc_test_env", "lab_root"]


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


@cache
def _discovered(path: Path) -> bytes:
    ctx = ProbeContext.at_root("/", hwloc_xml=path) if path.suffix == ".xml" else ProbeContext.at_root(extracted(path))
    return discover(ctx).SerializeToString()


def discovered(path: Path) -> pb.MemoryTopology:
    """The topology of a fixture (a capture tarball or an hwloc XML export), discovered once per test
    process for every module that reads it; each call returns a copy of its own to change."""
    return pb.MemoryTopology.FromString(_discovered(path))
