"""What every probe shares: its context (root, runner, hwloc input) and its result (part + status)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from memtopo.hostfs import HostFS, HostReadError
from memtopo.runner import RECORDED_TOOLS_DIR, RecordedRunner, Runner, SubprocessRunner

# NVML answers recorded with a captured root (JSON; format in discovery/nvml_replay.py).
RECORDED_NVML = ".memtopo/nvml.json"


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


class DiscoveryScope:
    """What waits until a discovery's message is built: freeing hwloc's topology. The free unloads
    hwloc's plugins (dlclose of libcudart and the rest), which evicts the interpreter's working set
    from this core's cache; done after the assembly instead of before it, the assembly runs warm
    (measured in bench/discovery.py).

    One per discovery; a probe run on its own has none and frees at once."""

    def __init__(self) -> None:
        self._deferred: list[Callable[[], None]] = []

    def defer(self, release: Callable[[], None]) -> None:
        """Run ``release`` when the discovery closes (list.append: safe from a probe's thread)."""
        self._deferred.append(release)

    def close(self) -> None:
        """Run what was deferred, newest first; every one runs even if an earlier one raises."""
        errors: list[Exception] = []
        while self._deferred:
            try:
                self._deferred.pop()()
            except Exception as exc:  # the others must still be released
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> DiscoveryScope:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class ProbeContext:
    """Where a probe reads from. ``hwloc_xml`` replaces the root for the hwloc probe.

    Vendor libraries (NVML, amdsmi) are queried only for the live host (``libraries_live``); for a
    captured root they are replayed from ``nvml_replay`` when the capture has one, else unavailable:
    a capture is not this host, and mixing the two would report someone else's GPUs.
    """

    fs: HostFS
    runner: Runner = field(default_factory=SubprocessRunner)
    hwloc_xml: Path | None = None
    # Extra environment for hwloc's load (the `env:` lines of an hwloc .test, HWLOC_PCI_LOCALITY ...).
    hwloc_env: Mapping[str, str] = field(default_factory=dict)
    libraries_live: bool = False
    nvml_replay: Path | None = None
    scope: DiscoveryScope | None = None
    # How long one probe may run before its source is reported unavailable and discovery goes on
    # without it. Generous: a vendor probe may wait out several tool timeouts (runner.py).
    deadline_s: float = 60.0
    # Sources not to run, each with the reason its status gives (a probe the discovery process
    # died in: discovery/isolated.py).
    leave_out: Mapping[str, str] = field(default_factory=dict)
    # Told (source, True) as a probe starts and (source, False) as it ends, on the probe's thread.
    on_probe: Callable[[str, bool], None] | None = None

    @classmethod
    def live(cls) -> ProbeContext:
        return cls(HostFS.at("/"), libraries_live=True)

    @classmethod
    def at_root(cls, root: str | Path, **kw: object) -> ProbeContext:
        """A captured root: its tools and NVML are replayed from what was recorded with it."""
        fs = HostFS.at(root)
        kw.setdefault("runner", RecordedRunner.from_fs(fs, RECORDED_TOOLS_DIR))
        if "nvml_replay" not in kw and fs.is_file(RECORDED_NVML):
            kw["nvml_replay"] = fs.path(RECORDED_NVML)  # read through fs (nvidia.load_nvml_replay)
        return cls(fs, **kw)  # type: ignore[arg-type]

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

    # A source's reasons are for a person: a tree of 100,000 broken entries gets the first of them
    # and a count, not a status message the size of the tree.
    MAX_REASONS = 50
    MAX_REASON_CHARS = 400

    def __init__(self, source: str) -> None:
        self.source = source
        self.reasons: list[str] = []
        self.more = 0
        self.unavailable_reason: str | None = None
        self._t0 = time.perf_counter()

    def problem(self, reason: str | HostReadError) -> None:
        if len(self.reasons) >= self.MAX_REASONS:
            self.more += 1
            return
        text = str(reason)
        self.reasons.append(text if len(text) <= self.MAX_REASON_CHARS else text[:self.MAX_REASON_CHARS] + "…")

    def unavailable(self, reason: str) -> None:
        self.unavailable_reason = reason

    def finish(self) -> SourceStatus:
        elapsed = time.perf_counter() - self._t0
        if self.unavailable_reason is not None:
            return SourceStatus(self.source, State.UNAVAILABLE, (self.unavailable_reason,), elapsed)
        state = State.DEGRADED if self.reasons else State.OK
        more = (f"and {self.more} more problems",) if self.more else ()
        return SourceStatus(self.source, state, (*self.reasons, *more), elapsed)
