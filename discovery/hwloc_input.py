"""What hwloc's Linux backend will parse in a captured root, checked against what a kernel can write.

hwloc reads a root (HWLOC_FSROOT) with C parsers that trust the kernel: a node or CPU list is a
bitmap filled to its highest id and its weight is asserted positive (``node/online = -1`` aborts the
process), the online nodes' count squared sizes the distance matrix in 32-bit arithmetic (``0-65535``
wraps it to nothing and corrupts the heap), a directory ``cpu4000000000`` is a 500 MB bitmap. So
before hwloc may load a root, every file of that kind is held to the kernel's own limits here; what
fails keeps hwloc off the root (its source says why) while the kernel-file probes still report.

Checked: the node and CPU lists hwloc reads (``node/online``, ``cpu/online``, the hybrid PMUs'
``cpus``, the cgroup's cpus and mems as hwloc finds them) and the lists that bound them
(``cpu/possible`` gives nr_cpu_ids); the ``nodeN`` and ``cpuN`` directory names hwloc turns into
bitmap indexes; each node's ``cpumap`` (CPUs below nr_cpu_ids), ``meminfo`` (a MemTotal whose
bytes fit in 64 bits) and ``distance`` (a row of byte-sized distances, one per node); the
processors in ``/proc/cpuinfo`` (one record each, at most NR_CPUS); and paths hwloc builds from
file contents (a cgroup name, a CXL region's decoder) that would climb out of the root. The sizes
of the cpumasks hwloc parses are held by the tree check (hostfs.FILE_LIMITS). Lists must be in
the kernel's own form: ascending decimal ids and ranges, nothing else, so that what is checked is
what hwloc's ``strtoul`` will read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from memtopo.cpulist import KERNEL_MAX_CPUS, KERNEL_MAX_NODES, CpuListError, mask_width
from memtopo.hostfs import HostFS, HostReadError
from memtopo.mounts import MOUNTS, unescape
from memtopo.text import excerpt

NODE_DIR = "sys/devices/system/node"
CPU_DIR = "sys/devices/system/cpu"
# Hybrid CPUs: hwloc reads each PMU's CPU list to tell the kinds of core apart.
PMU_LISTS = ("sys/devices/cpu_atom/cpus", "sys/devices/cpu_core/cpus", "sys/devices/cpu_lowpower/cpus")
CXL_DEVICES = "sys/bus/cxl/devices"
# MemTotal in kB, which hwloc turns into bytes with a shift by 10 in 64 bits.
MAX_MEMTOTAL_KB = (1 << 54) - 1
# The problems named in the source's reason; the rest are counted.
KEPT = 5

_ID = r"(?:0|[1-9][0-9]{0,9})"
_KERNEL_LIST = re.compile(rf"{_ID}(?:-{_ID})?(?:,{_ID}(?:-{_ID})?)*")
_CANONICAL_ID = re.compile(_ID)
# What C's strtoul(…, 0) starts to read: blanks, a sign, then a digit.
_STRTOUL_READS = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]")
_MEMTOTAL = re.compile(r"MemTotal:\s*(\S*)")


class _Problems:
    def __init__(self) -> None:
        self.found: list[str] = []
        self.more = 0

    def add(self, rel: str, why: str) -> None:
        if len(self.found) < KEPT:
            self.found.append(f"{rel}: {why}")
        else:
            self.more += 1

    def result(self) -> list[str]:
        return [*self.found, f"and {self.more} more"] if self.more else self.found


def problems(fs: HostFS) -> list[str]:
    """Why hwloc must not load the root ``fs``: the first few offending files, each with its reason,
    and how many more. Empty when every file it will parse is one a kernel could have written."""
    out = _Problems()
    cpu_limit = _nr_cpu_ids(fs, out)
    node_ids = _list(fs, out, f"{NODE_DIR}/online", KERNEL_MAX_NODES, "MAX_NUMNODES")
    if node_ids is not None and not node_ids:
        out.add(f"{NODE_DIR}/online", "no node is online")
    _list(fs, out, f"{NODE_DIR}/possible", KERNEL_MAX_NODES, "MAX_NUMNODES")
    nodes = _dir_ids(fs, out, NODE_DIR, "node", KERNEL_MAX_NODES, "MAX_NUMNODES")
    _dir_ids(fs, out, CPU_DIR, "cpu", cpu_limit, "nr_cpu_ids")
    for name in ("online", "present"):
        _list(fs, out, f"{CPU_DIR}/{name}", cpu_limit, "nr_cpu_ids")
    for rel in PMU_LISTS:
        _list(fs, out, rel, cpu_limit, "nr_cpu_ids")
    for node in nodes:
        _node(fs, out, node, cpu_limit)
    _meminfo(fs, out, "proc/meminfo")
    _cpuinfo(fs, out)
    _cgroup(fs, out, cpu_limit)
    _cxl_targets(fs, out)
    return out.result()


def _read(fs: HostFS, out: _Problems, rel: str) -> str | None:
    """The text hwloc would read (up to its first NUL), or None when there is none to read."""
    try:
        return fs.read_text(rel).split("\0", 1)[0]
    except HostReadError as exc:
        if exc.reason != "missing":
            out.add(rel, exc.reason)
        return None


def kernel_list(text: str) -> list[tuple[int, int]] | None:
    """The ranges of a list in the kernel's ``%*pbl`` form (ascending, decimal, no stray text), or
    None for anything else: hwloc's strtoul would read another number out of "-1", "0x10", "010"."""
    text = text.strip()
    if not text:
        return []
    if not _KERNEL_LIST.fullmatch(text):
        return None
    ranges: list[tuple[int, int]] = []
    for chunk in text.split(","):
        lo, _, hi = chunk.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first or (ranges and first <= ranges[-1][1]):
            return None
        ranges.append((first, last))
    return ranges


def _list(fs: HostFS, out: _Problems, rel: str, limit: int, limit_name: str) -> list[tuple[int, int]] | None:
    text = _read(fs, out, rel)
    if text is None:
        return None
    ranges = kernel_list(text)
    if ranges is None:
        out.add(rel, f"not a list the kernel writes: {excerpt(text.strip())}")
        return None
    if ranges and ranges[-1][1] >= limit:
        out.add(rel, f"id {ranges[-1][1]} beyond what a kernel has ({limit_name} {limit})")
        return None
    return ranges


def _nr_cpu_ids(fs: HostFS, out: _Problems) -> int:
    """One past the highest possible CPU (what the kernel sizes every cpumask by), where
    ``cpu/possible`` says; else the most any kernel has."""
    ranges = _list(fs, out, f"{CPU_DIR}/possible", KERNEL_MAX_CPUS, "NR_CPUS")
    return ranges[-1][1] + 1 if ranges else KERNEL_MAX_CPUS


def _dir_ids(fs: HostFS, out: _Problems, rel: str, prefix: str, limit: int, limit_name: str) -> list[int]:
    """The ids of ``<prefix>N`` entries as hwloc reads them (strtoul after the prefix: "cpu0x10" is
    CPU 16 to it), each of which must be a plain decimal id below ``limit``."""
    try:
        entries = fs.listdir(rel)
    except HostReadError as exc:
        out.add(rel, exc.reason)
        return []
    ids: list[int] = []
    for entry in entries:
        rest = entry[len(prefix):]
        if not entry.startswith(prefix) or not _STRTOUL_READS.match(rest):
            continue
        if not _CANONICAL_ID.fullmatch(rest):
            out.add(f"{rel}/{excerpt(entry)}", "not a name the kernel gives")
        elif int(rest) >= limit:
            out.add(f"{rel}/{entry}", f"id beyond what a kernel has ({limit_name} {limit})")
        else:
            ids.append(int(rest))
    return sorted(ids)


def _node(fs: HostFS, out: _Problems, node: int, cpu_limit: int) -> None:
    base = f"{NODE_DIR}/node{node}"
    text = _read(fs, out, f"{base}/cpumap")
    if text is not None:
        try:
            highest = mask_width(text) - 1
        except CpuListError as exc:
            out.add(f"{base}/cpumap", str(exc))
        else:
            if highest >= cpu_limit:
                out.add(f"{base}/cpumap", f"CPU {highest} beyond nr_cpu_ids {cpu_limit}")
    _meminfo(fs, out, f"{base}/meminfo")
    _distances(fs, out, f"{base}/distance")


def _distances(fs: HostFS, out: _Problems, rel: str) -> None:
    """A SLIT row as the kernel prints it: one distance of at most 255 (a byte) per online node, at
    most MAX_NUMNODES of them, space-separated decimals (hwloc reads them with strtoul)."""
    text = _read(fs, out, rel)
    if text is None:
        return
    values = text.split()
    if len(values) > KERNEL_MAX_NODES or not all(v.isdigit() and v.isascii() and len(v) <= 3 for v in values):
        out.add(rel, f"not a row of distances the kernel writes: {excerpt(text.strip())}")


def _meminfo(fs: HostFS, out: _Problems, rel: str) -> None:
    text = _read(fs, out, rel)
    found = _MEMTOTAL.search(text) if text is not None else None
    if found is None:
        return  # hwloc then has no size for it: nothing to overflow
    value = found.group(1)
    if not (value.isdigit() and value.isascii()) or int(value) > MAX_MEMTOTAL_KB:
        out.add(rel, f"MemTotal {excerpt(value)} kB is not a size in 64 bits")


def _cpuinfo(fs: HostFS, out: _Problems) -> None:
    """hwloc keeps a record per processor entry of /proc/cpuinfo."""
    try:
        data = fs.read_bytes("proc/cpuinfo", 64 << 20)
    except HostReadError as exc:
        if exc.reason != "missing":
            out.add("proc/cpuinfo", exc.reason)
        return
    entries = data.count(b"\nprocessor") + data.startswith(b"processor")
    if entries > KERNEL_MAX_CPUS:
        out.add("proc/cpuinfo", f"{entries} processor entries, more than a kernel has (NR_CPUS {KERNEL_MAX_CPUS})")


def _cgroup_files(fs: HostFS, out: _Problems) -> Iterator[tuple[str, str]]:
    """The cpuset files hwloc may read, (path, "cpus" or "mems"), for every cpuset mount and both
    ways hwloc names the process's cpuset; a mount point or name that climbs out of the root by
    ``..`` is a problem instead."""
    text = _read(fs, out, MOUNTS)
    mounts = []
    for line in (text or "").split("\n"):
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup2", "cpuset", "cgroup"):
            mounts.append((unescape(fields[1]), fields[2]))
    if not mounts:
        return
    # hwloc reads the name into fixed buffers: the first line, cut at 127 or 255 bytes.
    names = []
    cpuset = _read(fs, out, "proc/self/cpuset")
    if cpuset:
        names.append(cpuset.split("\n", 1)[0][:127])
    for line in (_read(fs, out, "proc/self/cgroup") or "").split("\n"):
        _, colon, rest = line[:255].partition(":")
        if colon and (rest.startswith("cpuset:") or rest.startswith(":")):
            names.append(rest.partition(":")[2])
            break
    for mount, kind in mounts:
        for name in names:
            where = f"{mount}{name}"
            if ".." in where.split("/"):
                out.add(MOUNTS if ".." in mount.split("/") else "proc/self/cgroup",
                        f"cgroup path {excerpt(where)} climbs out of the root")
                continue
            for attr in ("cpus", "mems"):
                leaves = (f"cpuset.{attr}.effective",) if kind == "cgroup2" else (f"cpuset.{attr}", attr)
                for leaf in leaves:
                    yield f"{where}/{leaf}".lstrip("/"), attr


def _cgroup(fs: HostFS, out: _Problems, cpu_limit: int) -> None:
    for rel, attr in _cgroup_files(fs, out):
        if fs.is_file(rel):
            if attr == "cpus":
                _list(fs, out, rel, cpu_limit, "nr_cpu_ids")
            else:
                _list(fs, out, rel, KERNEL_MAX_NODES, "MAX_NUMNODES")


def _cxl_targets(fs: HostFS, out: _Problems) -> None:
    """hwloc follows ``regionN/targetM``'s decoder name as a path under the CXL bus."""
    try:
        regions = [e for e in fs.listdir(CXL_DEVICES) if e.startswith("region")]
    except HostReadError:
        return
    for region in regions:
        base = f"{CXL_DEVICES}/{region}"
        try:
            targets = [e for e in fs.listdir(base) if e.startswith("target")]
        except HostReadError:
            continue
        for target in targets:
            text = _read(fs, out, f"{base}/{target}")
            if text is not None and "/" in text.split("\n", 1)[0]:
                out.add(f"{base}/{target}", f"decoder name {excerpt(text.strip())} is a path")
