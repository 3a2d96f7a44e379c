"""What every probe shares: its context (root, runner, hwloc input) and its result (part + status)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from discovery.hostfs import HostFS, HostReadError
from discovery.runner import Runner, SubprocessRunner


class State(Enum):
    OK = "ok"
    DEGRADED = "degraded"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class SourceStatus:
    source: str
    state: State
    reasons: tuple[str, ...] = ()
    duration_s: float = 0.0


@dataclass(frozen=True)
class ProbeContext:
    """Where a probe reads from. ``hwloc_xml`` replaces the root for the hwloc probe."""

    fs: HostFS
    runner: Runner = field(default_factory=SubprocessRunner)
    hwloc_xml: Path | None = None
    # Extra environment for hwloc's load (the `env:` lines of an hwloc .test, HWLOC_PCI_LOCALITY ...).
    hwloc_env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def live(cls) -> ProbeContext:
        return cls(HostFS.at("/"))

    @classmethod
    def at_root(cls, root: str | Path, **kw: object) -> ProbeContext:
        return cls(HostFS.at(root), **kw)  # type: ignore[arg-type]

    @property
    def sysfs_available(self) -> bool:
        """False when the input is only an hwloc XML export (no tree to read)."""
        return self.hwloc_xml is None


@dataclass(frozen=True)
class ProbeResult[T]:
    data: T
    status: SourceStatus


class StatusBuilder:
    """Collects a probe's problems while it runs; ``finish`` turns them into its status.

    A probe calls ``problem`` for every file or call that failed and carries on with the rest:
    one unreadable attribute must not cost the whole source.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.reasons: list[str] = []
        self.unavailable_reason: str | None = None
        self._t0 = time.perf_counter()

    def problem(self, reason: str | HostReadError) -> None:
        self.reasons.append(str(reason))

    def unavailable(self, reason: str) -> None:
        self.unavailable_reason = reason

    def finish(self) -> SourceStatus:
        elapsed = time.perf_counter() - self._t0
        if self.unavailable_reason is not None:
            return SourceStatus(self.source, State.UNAVAILABLE, (self.unavailable_reason,), elapsed)
        state = State.DEGRADED if self.reasons else State.OK
        return SourceStatus(self.source, state, tuple(self.reasons), elapsed)
