"""Reading sysfs for a probe: what several probes share (attribute reads, PCI paths, numbered entries)."""

from __future__ import annotations

from memtopo.cpulist import MAX_ID, CpuListError, parse_cpulist, parse_mask
from memtopo.discovery.parts import Ids
from memtopo.discovery.source import StatusBuilder
from memtopo.hostfs import HostFS, HostReadError
from memtopo.text import excerpt

PCI_DEVICES = "sys/bus/pci/devices"


class AttrReader:
    """Attribute reads for one probe run: each failure becomes a problem naming the path."""

    def __init__(self, fs: HostFS, sb: StatusBuilder) -> None:
        self.fs = fs
        self.sb = sb
        # Most functions share a handful of local_cpulist values; parse each text once.
        self._cpus: dict[tuple[bool, str], Ids] = {}

    def listdir(self, rel: str) -> list[str]:
        try:
            return self.fs.listdir(rel)
        except HostReadError as exc:
            self.sb.problem(exc)
            return []

    def int_attr(self, rel: str, base: int, default: int) -> int:
        try:
            return self.fs.read_int(rel, base)
        except HostReadError as exc:
            self.sb.problem(exc)
            return default

    def text(self, rel: str) -> str:
        try:
            return self.fs.read_attr(rel)
        except HostReadError as exc:
            self.sb.problem(exc)
            return ""

    def link_name(self, rel: str) -> str:
        try:
            return self.fs.readlink_name(rel)
        except HostReadError as exc:
            self.sb.problem(exc)
            return ""

    def cpus(self, rel: str, mask: bool) -> Ids:
        try:
            text = self.fs.read_record(rel)
        except HostReadError as exc:
            self.sb.problem(exc)
            return ()
        key = (mask, text)
        cpus = self._cpus.get(key)
        if cpus is None:
            try:
                cpus = parse_mask(text) if mask else parse_cpulist(text)
            except CpuListError as exc:
                self.sb.problem(HostReadError(rel, str(exc)))
                return ()
            self._cpus[key] = cpus
        return cpus


def dir_ids(sb: StatusBuilder, rel: str, entries: list[str], prefix: str, limit: int = MAX_ID) -> list[int]:
    """The ids of ``<prefix>N`` entries of a directory, sorted; one at or beyond ``limit`` (what the
    kernel can give: cpulist.MAX_ID, or its own limit for nodes and CPUs) is a problem and left out."""
    ids = []
    for e in entries:
        digits = e[len(prefix):]
        if e.startswith(prefix) and digits.isdigit() and digits.isascii():
            if len(digits) > 6 or int(digits) >= limit:
                sb.problem(f"{rel}/{excerpt(e)}: id out of range (at most {limit - 1}); left out")
                continue
            ids.append(int(digits))
    return sorted(ids)
