"""Reading sysfs for a probe: what several probes share (attribute reads, PCI paths, numbered entries)."""

from __future__ import annotations

from collections.abc import Iterable

from memtopo.cpulist import MAX_ID, CpuListError, parse_cpulist, parse_mask
from memtopo.discovery.parts import Ids
from memtopo.discovery.source import StatusBuilder
from memtopo.hostfs import HostDir, HostFS, HostReadError, HostReads, int_value
from memtopo.text import excerpt

PCI_DEVICES = "sys/bus/pci/devices"


class AttrReader:
    """Attribute reads for one probe run: each failure becomes a problem naming the path. Paths are
    relative to the root (``fs``), or to a directory held open under it (``within``)."""

    def __init__(self, fs: HostFS, sb: StatusBuilder, src: HostReads | None = None,
                 cpus: dict[tuple[bool, str], Ids] | None = None) -> None:
        self.fs = fs
        self.sb = sb
        self.src: HostReads = fs if src is None else src
        # Most functions share a handful of local_cpulist values; parse each text once.
        self._cpus: dict[tuple[bool, str], Ids] = {} if cpus is None else cpus

    def within(self, directory: HostDir) -> AttrReader:
        """This run's reader for paths relative to ``directory`` (problems and parsed lists shared)."""
        return AttrReader(self.fs, self.sb, directory, self._cpus)

    def listdir(self, rel: str) -> list[str]:
        try:
            return self.src.listdir(rel)
        except HostReadError as exc:
            self.sb.problem(exc)
            return []

    def int_attr(self, rel: str, base: int, default: int) -> int:
        try:
            return self.src.read_int(rel, base)
        except HostReadError as exc:
            self.sb.problem(exc)
            return default

    def text(self, rel: str) -> str:
        try:
            return self.src.read_attr(rel)
        except HostReadError as exc:
            self.sb.problem(exc)
            return ""

    def link_name(self, rel: str) -> str:
        try:
            return self.src.readlink_name(rel)
        except HostReadError as exc:
            self.sb.problem(exc)
            return ""

    def records(self, directory: HostDir, names: Iterable[str]) -> dict[str, str]:
        """The records of ``names`` in ``directory`` that could be read (the others are problems)."""
        texts: dict[str, str] = {}
        for name in names:
            try:
                texts[name] = directory.read_record(name)
            except HostReadError as exc:
                self.sb.problem(exc)
        return texts

    def int_of(self, rel: str, record: str | None, base: int, default: int) -> int:
        """The integer in ``rel``'s record (read already), else ``default``: a problem unless the
        record is None (absent, or its read already reported)."""
        if record is None:
            return default
        try:
            return int_value(rel, record, base)
        except HostReadError as exc:
            self.sb.problem(exc)
            return default

    def cpus(self, rel: str, mask: bool) -> Ids:
        try:
            text = self.src.read_record(rel)
        except HostReadError as exc:
            self.sb.problem(exc)
            return ()
        return self.cpus_of(self.src.root_relative(rel), text, mask)

    def cpus_of(self, path: str, text: str, mask: bool) -> Ids:
        """The CPUs of the record of ``path`` (root-relative; read already); () and a problem if it
        is not a list."""
        key = (mask, text)
        cpus = self._cpus.get(key)
        if cpus is None:
            try:
                cpus = parse_mask(text) if mask else parse_cpulist(text)
            except CpuListError as exc:
                self.sb.problem(HostReadError(path, str(exc)))
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
