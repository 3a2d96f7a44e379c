"""Partial rescans (discovery/changes.py, ``reached`` in discovery/probes.py, ``Rescanner`` in
discovery/discover.py): after a change, rerunning only the probes the change reaches gives the
topology a full discovery gives, on every captured root — the numa-vm lab's captures and the
synthesized hosts of tests/fixtures — and what cannot be classified rescans everything.

Each change is made to a private copy of the root, as the kernel would show it: a memory block
onlined (the node's MemTotal and MemFree grow by 1 GiB), a PCI function removed (its device
directory and bus link gone; the rescan is told its vendor, as the uevent's PCI_ID does)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from memtopo.discovery import changes
from memtopo.discovery.changes import Change
from memtopo.discovery.discover import Rescanner, discover
from memtopo.discovery.probes import PROBES, ProbeSpec, reached
from memtopo.discovery.source import ProbeContext, ProbeResult
from tests.fixtures import LAB_CAPTURES, extracted

FIXTURES = Path(__file__).parents[1] / "fixtures"
ROOTS = sorted([f"lab:{p.name.removesuffix('.tar.gz')}" for p in LAB_CAPTURES.glob("*.tar.gz")]
               + [f"synth:{p.parent.name}" for p in FIXTURES.glob("*/root.tar.gz")])
ALL = frozenset(s.source for s in PROBES)


def _copy(spec: str, tmp: Path) -> Path:
    kind, _, name = spec.partition(":")
    tarball = LAB_CAPTURES / f"{name}.tar.gz" if kind == "lab" else FIXTURES / name / "root.tar.gz"
    root = tmp / "root"
    shutil.copytree(extracted(tarball), root, symlinks=True)
    return root


def online_memory(root: Path) -> Change:
    """A 1 GiB memory block onlined on the first node with memory."""
    for meminfo in sorted((root / "sys/devices/system/node").glob("node*/meminfo")):
        lines = meminfo.read_text().splitlines()
        if not any(" MemTotal:" in ln for ln in lines):
            continue
        out = []
        for ln in lines:
            if " MemTotal:" in ln or " MemFree:" in ln:
                head, value, unit = ln.rsplit(None, 2)
                ln = f"{head} {int(value) + (1 << 20)} {unit}"
            out.append(ln)
        meminfo.write_text("\n".join(out) + "\n")
        return changes.of_uevent("memory", reason="udev:memory:online")
    pytest.skip("no node meminfo to change")


def remove_pci_function(root: Path) -> Change:
    """The last PCI endpoint (not a bridge, nothing below it) removed, as a hot-unplug leaves sysfs."""
    bus = root / "sys/bus/pci/devices"
    for link in sorted(bus.iterdir(), reverse=True):
        device = link.resolve()
        if not device.is_dir() or not str(device).startswith(str(root)):
            continue
        klass = (device / "class").read_text().strip() if (device / "class").is_file() else ""
        below = [d for d in device.iterdir() if d.is_dir() and d.name.count(":") == 2]
        if klass.startswith("0x0604") or below:
            continue
        vendor = (device / "vendor").read_text().strip() if (device / "vendor").is_file() else ""
        link.unlink()
        shutil.rmtree(device)
        pci_id = f"{vendor.removeprefix('0x').upper()}:0000" if vendor else None
        return changes.of_uevent("pci", pci_id, reason="udev:pci:remove")
    pytest.skip("no PCI endpoint to remove")


CHANGES: dict[str, Callable[[Path], Change]] = {"memory": online_memory, "pci": remove_pci_function}


@pytest.mark.parametrize("what", sorted(CHANGES))
@pytest.mark.parametrize("spec", ROOTS)
def test_a_partial_rescan_finds_what_a_full_one_finds(spec: str, what: str, tmp_path: Path) -> None:
    root = _copy(spec, tmp_path)
    rescanner = Rescanner(ProbeContext.at_root(root))
    before = rescanner.discover(node_name="n")
    change = CHANGES[what](root)
    partial = rescanner.discover(change, node_name="n")
    full = discover(ProbeContext.at_root(root), node_name="n")
    assert rescanner.ran == reached(change) < ALL  # it did keep something
    assert partial.fingerprint == full.fingerprint, f"{spec}: after a {what} change"
    if what == "memory":  # the change was seen (free bytes are outside the fingerprint)
        assert before.fingerprint != full.fingerprint


def test_what_each_change_reruns() -> None:
    memory = reached(changes.of_uevent("memory"))
    assert memory == {"hwloc", "sysfs.numa", "sysfs.memory_tiers", "sysfs.cxl", "nvidia"}  # nvidia needs numa
    pci = {"hwloc", "sysfs.pci", "sysfs.cxl", "xpu-smi"}  # kunlunxin needs the PCI part
    assert reached(changes.of_uevent("pci", "10DE:2330")) == pci | {"nvidia"}
    assert reached(changes.of_uevent("pci", "1002:74A1")) == pci | {"amd.kfd"}
    every_vendor = pci | {"amd.kfd", "npu-smi", "nvidia"}
    assert reached(changes.of_uevent("pci", None)) == every_vendor  # no PCI_ID: any vendor's
    assert reached(changes.of_uevent("pci", "zz:12")) == every_vendor
    assert reached(changes.of_uevent("cpu")) == {"hwloc", "sysfs.numa", "proc.allowed", "nvidia"}
    assert reached(changes.of_uevent("memory") | changes.of_uevent("cxl")) == memory


@pytest.mark.parametrize("subsystem", ["usb", "block", "", "net"])
def test_an_event_that_cannot_be_classified_rescans_everything(subsystem: str) -> None:
    change = changes.of_uevent(subsystem, reason=f"udev:{subsystem}:add")
    assert change.everything
    assert reached(change) == ALL
    assert (changes.of_uevent("memory") | change).everything  # and absorbs what it is folded with


def test_a_full_rescan_runs_every_probe_and_keeps_nothing(tmp_path: Path) -> None:
    root = _copy("lab:single", tmp_path)
    rescanner = Rescanner(ProbeContext.at_root(root))
    rescanner.discover()
    first = dict(rescanner.results)
    rescanner.discover(changes.full("sighup"))
    assert rescanner.ran == ALL
    assert all(rescanner.results[s] is not first[s] for s in first)  # every result is new


def test_every_probe_declares_only_known_subsystems() -> None:
    for spec in PROBES:
        assert spec.follows <= changes.SUBSYSTEMS, spec.source
        assert not spec.pci_vendors or changes.PCI in spec.follows, spec.source


def test_a_probe_that_gave_nothing_runs_again_whatever_the_change(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """A probe that raised has no result to keep: the next rescan runs it, reached or not."""
    root = _copy("lab:single", tmp_path)
    calls: list[int] = []
    real = ProbeSpec.function

    def function(self: ProbeSpec) -> Callable[..., ProbeResult[object]]:
        probe = real(self)
        if self.source != "host.identity":
            return probe

        def flaky(*args: object) -> ProbeResult[object]:
            calls.append(1)
            if len(calls) == 1:
                raise OSError("transient")
            return probe(*args)
        return flaky

    monkeypatch.setattr(ProbeSpec, "function", function)
    rescanner = Rescanner(ProbeContext.at_root(root))
    first = rescanner.discover()
    assert "host.identity" not in rescanner.results
    assert any(s.source == "host.identity" and "transient" in " ".join(s.reasons) for s in first.sources)
    rescanner.discover(changes.of_uevent("memory"))  # identity follows no subsystem
    assert len(calls) == 2 and "host.identity" in rescanner.ran and "host.identity" in rescanner.results
    rescanner.discover(changes.of_uevent("memory"))
    assert len(calls) == 2 and "host.identity" not in rescanner.ran  # kept from now on

