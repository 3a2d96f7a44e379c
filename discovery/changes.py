"""What may have changed on the host since the last discovery, as a rescan is told it.

A kernel uevent names its subsystem: onlining a memory block is a ``memory`` event, a node coming
online a ``node`` event, a hot-added GPU a ``pci`` event carrying the device's ``PCI_ID``. Each probe
declares the subsystems whose events may change what it reads (discovery/probes.py ``follows``),
so a rescan for a change reruns only the probes that follow it, and keeps the others' last results.
Anything that cannot be classified (SIGHUP, the periodic rescan, an unknown subsystem) is
``EVERYTHING``: a full rescan.
"""

from __future__ import annotations

import string
from dataclasses import field

from memtopo.model import frozen

MEMORY = "memory"  # memory blocks online/offline (/sys/devices/system/memory)
NODE = "node"  # NUMA nodes coming and going
CPU = "cpu"  # CPU hotplug
PCI = "pci"  # PCI devices added, removed, rebound
CXL = "cxl"  # CXL ports, decoders, regions
DAX = "dax"  # DAX devices (a CXL or pmem region handed to the kernel as memory)
SUBSYSTEMS = frozenset({MEMORY, NODE, CPU, PCI, CXL, DAX})


@frozen
class Change:
    """The union of the events since the last rescan. ``pci_vendors``: the vendors of the PCI
    devices those events named; ``pci_vendor_unknown``: an event named none that could be read."""

    subsystems: frozenset[str] = frozenset()
    pci_vendors: frozenset[int] = frozenset()
    pci_vendor_unknown: bool = False
    everything: bool = False
    # Why: the triggers folded into it, for logs.
    reasons: tuple[str, ...] = field(default=(), compare=False)

    def __or__(self, other: Change) -> Change:
        if self.everything or other.everything:
            return Change(everything=True, reasons=(*self.reasons, *other.reasons))
        return Change(self.subsystems | other.subsystems, self.pci_vendors | other.pci_vendors,
                      self.pci_vendor_unknown or other.pci_vendor_unknown, reasons=(*self.reasons, *other.reasons))

    def reaches_pci_vendor(self, vendors: frozenset[int]) -> bool:
        """Whether a PCI event of this change may concern a device of one of ``vendors``."""
        return self.everything or (PCI in self.subsystems
                                   and (self.pci_vendor_unknown or bool(self.pci_vendors & vendors)))


EVERYTHING = Change(everything=True)
NOTHING = Change()


def full(reason: str) -> Change:
    return Change(everything=True, reasons=(reason,))


def of_uevent(subsystem: str, pci_id: str | None = None, reason: str = "") -> Change:
    """The change a kernel uevent announces. ``pci_id``: its ``PCI_ID`` property (``10DE:2330``),
    for a pci event. A subsystem outside SUBSYSTEMS is a full rescan."""
    reasons = (reason,) if reason else ()
    if subsystem not in SUBSYSTEMS:
        return Change(everything=True, reasons=reasons)
    if subsystem != PCI:
        return Change(frozenset({subsystem}), reasons=reasons)
    vendor = _pci_vendor(pci_id)
    return Change(frozenset({PCI}), frozenset({vendor}) if vendor is not None else frozenset(),
                  pci_vendor_unknown=vendor is None, reasons=reasons)


def _pci_vendor(pci_id: str | None) -> int | None:
    head = (pci_id or "").partition(":")[0]
    if len(head) != 4 or not all(c in string.hexdigits for c in head):
        return None
    return int(head, 16)
