"""The probes of a discovery, each declared once: its source, the part it fills, the parts it needs.

The collector (discovery/discover.py) schedules them from these declarations: a probe starts once
every part it ``needs`` is done and gets those parts as positional arguments after its context, in
the order named. No probe imports another; what one needs from another comes in as an argument.

A probe whose upstream probe raised or overran its deadline still runs, with None for that part,
and does what it can alone (kunlunxin scans the PCI bus itself; nvidia reports that it could not
attribute MIG placeholder nodes). Its own status then says what it missed, not the upstream's.

Each probe also declares the host changes that may alter what it reads (``follows``: uevent
subsystems, discovery/changes.py; ``pci_vendors``: a vendor probe reruns for PCI events of its own
vendor's devices only). A rescan for a change reruns the probes it reaches (``reached``): those that
follow it and, transitively, those that need one of them; every other probe's last result stands.

Probes are named by module path and imported when they run. A vendor probe may declare ``absent``,
a cheap check (discovery/presence.py) that the probe itself starts with: where it reports the vendor
absent, the source gets that status without the probe's module being imported at all.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memtopo.discovery import presence
from memtopo.discovery.changes import CPU, CXL, DAX, MEMORY, NODE, PCI, SUBSYSTEMS, Change
from memtopo.discovery.parts import AcceleratorPart
from memtopo.discovery.pci_ids import VENDOR_AMD, VENDOR_HUAWEI, VENDOR_KUNLUNXIN, VENDOR_NVIDIA
from memtopo.discovery.source import ProbeContext, ProbeResult, SourceStatus, State

ACCELERATORS = "accelerators"


def _never(ctx: ProbeContext) -> bool:
    return False


def _beside_the_tree(ctx: ProbeContext) -> bool:
    """hwloc's load is C code that releases the GIL: with a tree to read, the sysfs probes run beside
    it on another core (an XML export leaves nothing to overlap)."""
    return ctx.sysfs_available


def _live(ctx: ProbeContext) -> bool:
    """Live tools and libraries can take seconds (or hang until their timeout); that wait should
    overlap everything else. Replayed ones answer at once."""
    return ctx.libraries_live


@dataclass(frozen=True)
class ProbeSpec:
    source: str  # the source name its status carries (the module's SOURCE)
    part: str  # the Parts field it fills, or ACCELERATORS (keyed by source)
    module: str  # where its ``probe(ctx, *needed)`` lives, imported when it runs
    needs: tuple[str, ...] = ()  # sources whose results it is passed, in this order
    own_thread: Callable[[ProbeContext], bool] = _never  # else it runs in the shared probe lane
    # (ctx, *needed) → the reason the vendor is certainly absent, or None: the probe must run.
    absent: Callable[..., str | None] | None = None
    # Uevent subsystems whose events may change what it reads (a full rescan runs it regardless).
    follows: frozenset[str] = SUBSYSTEMS
    # With PCI in ``follows``: the vendors whose devices it reports; a PCI event naming only other
    # vendors' devices leaves its result standing. Empty: every PCI event reaches it.
    pci_vendors: frozenset[int] = frozenset()

    def reached_by(self, change: Change) -> bool:
        """Whether ``change`` may alter what this probe reads (not counting what it needs)."""
        if change.everything:
            return True
        if self.pci_vendors and PCI in self.follows and change.reaches_pci_vendor(self.pci_vendors):
            return True
        own = self.follows - {PCI} if self.pci_vendors else self.follows
        return bool(own & change.subsystems)

    def function(self) -> Callable[..., ProbeResult[Any]]:
        """The probe, looked up when asked (so a test's replacement of ``module.probe`` is the one run)."""
        probe: Callable[..., ProbeResult[Any]] = importlib.import_module(self.module).probe
        return probe

    def absent_result(self, ctx: ProbeContext, needed: tuple[ProbeResult[Any] | None, ...]) -> ProbeResult[Any] | None:
        """The unavailable result the probe would give, when ``absent`` can tell without it."""
        if self.absent is None:
            return None
        reason = self.absent(ctx, *needed)
        if reason is None:
            return None
        return ProbeResult(AcceleratorPart(), SourceStatus(self.source, State.UNAVAILABLE, (reason,)))


_D = "memtopo.discovery."

# In the order the shared lane runs them: the parts others need first. What each follows: hwloc
# reads the whole tree; NUMA nodes carry their CPUs, memory and HMAT figures; tiers and CXL regions
# change as memory (often a DAX device's) comes online, and a CXL memory device is read through the
# PCI function it is; the process's allowed lists grow with new nodes and CPUs; identity (host name,
# machine and boot id) changes with no uevent at all.
PROBES: tuple[ProbeSpec, ...] = (
    ProbeSpec("hwloc", "hwloc", _D + "hwloc", own_thread=_beside_the_tree),
    ProbeSpec("sysfs.numa", "numa", _D + "sysfs_numa", follows=frozenset({MEMORY, NODE, CPU})),
    ProbeSpec("sysfs.pci", "pci", _D + "sysfs_pci", follows=frozenset({PCI})),
    ProbeSpec("host.identity", "identity", _D + "identity", follows=frozenset()),
    ProbeSpec("sysfs.memory_tiers", "tiers", _D + "sysfs_tiers", follows=frozenset({MEMORY, NODE, DAX})),
    ProbeSpec("sysfs.cxl", "cxl", _D + "sysfs_cxl", follows=frozenset({CXL, DAX, MEMORY, PCI})),
    ProbeSpec("proc.allowed", "allowed", _D + "proc_allowed", follows=frozenset({NODE, CPU})),
    ProbeSpec("amd.kfd", ACCELERATORS, _D + "amd", own_thread=_live, absent=presence.amd,
              follows=frozenset({PCI}), pci_vendors=frozenset({VENDOR_AMD})),
    ProbeSpec("npu-smi", ACCELERATORS, _D + "ascend", own_thread=_live, absent=presence.ascend,
              follows=frozenset({PCI}), pci_vendors=frozenset({VENDOR_HUAWEI})),
    ProbeSpec("xpu-smi", ACCELERATORS, _D + "kunlunxin", needs=("sysfs.pci",), own_thread=_live,
              absent=presence.kunlunxin, follows=frozenset({PCI}), pci_vendors=frozenset({VENDOR_KUNLUNXIN})),
    ProbeSpec("nvidia", ACCELERATORS, _D + "nvidia", needs=("sysfs.numa",), own_thread=_live,
              absent=presence.nvidia, follows=frozenset({PCI}), pci_vendors=frozenset({VENDOR_NVIDIA})),
)


def spec(source: str, probes: tuple[ProbeSpec, ...] = PROBES) -> ProbeSpec:
    for s in probes:
        if s.source == source:
            return s
    raise KeyError(source)


def reached(change: Change, probes: tuple[ProbeSpec, ...] = PROBES) -> frozenset[str]:
    """The sources a rescan for ``change`` must run again: those it reaches, and every probe that
    needs one of them (its input changes with theirs)."""
    out = {s.source for s in probes if s.reached_by(change)}
    grew = True
    while grew:
        grew = False
        for s in probes:
            if s.source not in out and any(n in out for n in s.needs):
                out.add(s.source)
                grew = True
    return frozenset(out)


def run_alone(source: str, ctx: ProbeContext, probes: tuple[ProbeSpec, ...] = PROBES,
              **kw: Any) -> ProbeResult[Any]:
    """One probe outside a discovery, its needs run first (in this thread, unguarded: for tests and
    tools). ``kw`` goes to the probe (nvidia's ``api``)."""
    s = spec(source, probes)
    needed = tuple(run_alone(n, ctx, probes) for n in s.needs)
    return s.function()(ctx, *needed, **kw)
