"""The probe registry (discovery/probes.py): declarations that schedule, a presence check that never
changes what a source reports, and what a probe gets when the probe it needs failed or overran."""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from memtopo.discovery import discover, sysfs_numa, sysfs_pci
from memtopo.discovery.parts import AcceleratorPart
from memtopo.discovery.probes import ACCELERATORS, PROBES, ProbeSpec, run_alone
from memtopo.discovery.source import DiscoveryScope, ProbeContext, ProbeResult, State
from tests.fixtures import HWLOC_XML, extracted, lab_root

FIXTURES = Path(__file__).parents[1] / "fixtures"


def test_every_need_names_a_probe_declared_before_it() -> None:
    """No cycles and no dangling needs: declaration order is a topological order."""
    seen: set[str] = set()
    for spec in PROBES:
        assert set(spec.needs) <= seen, f"{spec.source} needs {set(spec.needs) - seen} before it is declared"
        seen.add(spec.source)
    assert len(seen) == len(PROBES)


def test_each_declaration_matches_its_module() -> None:
    parts = {s.part for s in PROBES if s.part != ACCELERATORS}
    assert len(parts) == len([s for s in PROBES if s.part != ACCELERATORS])  # one probe per part
    for spec in PROBES:
        module = importlib.import_module(spec.module)
        assert spec.source == module.SOURCE
        assert callable(module.probe)
        assert spec.absent is None or spec.part == ACCELERATORS  # absent: an empty accelerator part


def _fixture(name: str) -> ProbeContext:
    return ProbeContext.at_root(extracted(FIXTURES / name / "root.tar.gz"))


# Built when a test asks (extracting a root is not for collection time).
CONTEXTS: dict[str, Callable[[], ProbeContext]] = {
    "lab capture": lambda: ProbeContext.at_root(lab_root("single")),
    "xml export": lambda: ProbeContext(ProbeContext.live().fs, hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml"),
    "live host": ProbeContext.live,
    "gh200": lambda: _fixture("gh200"),
    "kunlunxin": lambda: _fixture("kunlunxin-p800-8xpu"),
    "mi300a": lambda: _fixture("mi300a-4apu"),
}


@pytest.mark.parametrize("where", sorted(CONTEXTS))
def test_a_vendor_reported_absent_reads_exactly_as_its_probe_reports_it(where: str) -> None:
    ctx = CONTEXTS[where]()
    for spec in PROBES:
        if spec.absent is None:
            continue
        needed = tuple(run_alone(n, ctx) for n in spec.needs)
        absent = spec.absent_result(ctx, needed)
        ran = spec.function()(ctx, *needed)
        if absent is not None:
            assert (absent.data, absent.status.state, absent.status.reasons) == \
                (ran.data, ran.status.state, ran.status.reasons), spec.source
        else:
            assert where != "lab capture" and where != "xml export", f"{spec.source} not found absent on {where}"


@pytest.mark.parametrize(("where", "source"), [("kunlunxin", "xpu-smi"), ("mi300a", "amd.kfd")])
def test_a_host_with_the_vendors_devices_runs_its_probe(where: str, source: str) -> None:
    ctx = CONTEXTS[where]()
    spec = next(s for s in PROBES if s.source == source)
    needed = tuple(run_alone(n, ctx) for n in spec.needs)
    assert spec.absent_result(ctx, needed) is None
    assert run_alone(source, ctx).data.devices


@pytest.mark.parametrize("recorded", [True, False])
def test_the_nvidia_probe_is_asked_where_nvml_was_recorded_or_procfs_lists_gpus(recorded: bool) -> None:
    root = extracted(FIXTURES / "gh200" / "root.tar.gz")
    ctx = ProbeContext.at_root(root) if recorded else ProbeContext(ProbeContext.at_root(root).fs)
    assert (ctx.nvml_replay is not None) is recorded
    spec = next(s for s in PROBES if s.source == "nvidia")
    assert spec.absent_result(ctx, (None,)) is None
    assert run_alone("nvidia", ctx).data.devices  # without the recording: from numa_status alone


def test_a_probe_whose_upstream_raised_runs_with_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia needs sysfs.numa to attribute MIG placeholder nodes: with that probe broken, nvidia
    still reports its GPUs and says what it could not do."""
    ctx = ProbeContext.at_root(extracted(FIXTURES / "gh200" / "root.tar.gz"))  # its NVML recorded inside

    def broken(ctx: ProbeContext) -> object:
        raise RuntimeError("bug")

    monkeypatch.setattr(sysfs_numa, "probe", broken)
    with DiscoveryScope() as scope:
        parts = discover.collect(ctx, scope)
    assert parts.numa is None
    nv = parts.accelerators["nvidia"]
    assert nv.status.state is State.DEGRADED and nv.data.devices
    assert any("MIG placeholder nodes not attributed" in r for r in nv.status.reasons)
    assert not any("mig_placeholder_nodes" in d.attributes for d in nv.data.devices)


def test_a_threaded_probe_past_its_deadline_hands_none_to_what_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in registry: an upstream probe in its own thread that hangs, and a downstream probe that
    needs it. The upstream is reported overdue; the downstream runs with None and is not held up."""
    release = threading.Event()
    got: list[object] = []

    def stuck(ctx: ProbeContext) -> ProbeResult[AcceleratorPart]:
        release.wait(30)
        raise AssertionError("read after its deadline")

    def downstream(ctx: ProbeContext, up: ProbeResult[Any] | None) -> ProbeResult[AcceleratorPart]:
        got.append(up)
        return run_alone("amd.kfd", ctx)

    monkeypatch.setattr(sysfs_pci, "probe", stuck)
    monkeypatch.setattr(sysfs_numa, "probe", downstream)
    probes = (ProbeSpec("sysfs.pci", "pci", sysfs_pci.__name__, own_thread=lambda ctx: True),
              ProbeSpec("sysfs.numa", ACCELERATORS, sysfs_numa.__name__, needs=("sysfs.pci",)))
    # The stuck probe overruns any deadline; the downstream one gets the same, generous enough that a
    # busy machine still finishes a presence check in it.
    ctx = ProbeContext.at_root(lab_root("single"), deadline_s=5.0)
    try:
        with DiscoveryScope() as scope:
            parts = discover.collect(ctx, scope, probes)
    finally:
        release.set()
    assert got == [None]
    assert parts.pci is None and "sysfs.numa" in parts.accelerators
    (overdue,) = parts.extra_statuses
    assert overdue.source == "sysfs.pci" and overdue.state is State.UNAVAILABLE
    assert "did not finish within its deadline of 5 s" in overdue.reasons[0]


def test_the_live_nvml_absence_is_worded_as_the_nvml_side_words_it() -> None:
    from memtopo.discovery import presence
    from memtopo.discovery.nvml import CALLS, NvmlCallError

    assert str(NvmlCallError(CALLS["init"], "LibraryNotFound")) == presence.NO_LIBNVML


def test_live_vendor_threads_get_the_lane_parts_they_need() -> None:
    """With live libraries the vendor probes run in threads of their own: kunlunxin's thread waits
    for sysfs.pci from the shared lane and reports the same devices as the inline run."""
    ctx = CONTEXTS["kunlunxin"]()
    with DiscoveryScope() as scope:
        inline = discover.collect(ctx, scope)
    with DiscoveryScope() as scope:
        threaded = discover.collect(dataclasses.replace(ctx, libraries_live=True), scope)
    assert inline.pci is not None and threaded.pci is not None
    assert len(threaded.accelerators["xpu-smi"].data.devices) == 8
    assert threaded.accelerators["xpu-smi"].data == inline.accelerators["xpu-smi"].data
    assert list(threaded.accelerators) == [s.source for s in PROBES if s.part == ACCELERATORS]
