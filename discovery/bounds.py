"""Integers the schema cannot carry: found in the probes' parts, and their sources degraded.

A captured root, a recorded tool or an hwloc export can hold any number (a MemTotal of 2^80, a
NUMA node of 2^40, a recorded NVML answer of 2^128, an XML ``local_memory`` of 1e26). The protobuf
assembly refuses those with a ValueError, which would sink the whole discovery. The parts are
checked here instead, at one place for every source, only when the assembly refused them (a sound
host costs nothing): each value outside its field's range is replaced by the field's "unknown"
and its source degraded with the reason.

A field's range comes from its name, following the schema's conventions: sizes, bandwidths,
latencies, addresses and serials are uint64; sizes at most 8 PiB; ids of nodes, tiers, CPUs, packages and devices are
small (-1 is "none"); the rest are 32-bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from memtopo.cpulist import MAX_ID
from memtopo.text import excerpt

_U64 = (0, (1 << 64) - 1)
# A size: 8 PiB per node or device is beyond any machine, and keeps the sums the assembly makes of
# them (a domain's capacity, the machine's) inside uint64 for up to 2048 of them.
_SIZE = (0, 1 << 53)
_ID = (-1, MAX_ID - 1)
_DEFAULT = (-1, (1 << 31) - 1)
_U64_NAMES = frozenset({"serial", "start", "resource", "value"})
_U64_SUFFIXES = ("_mbps", "_ns")
_SIZE_NAMES = frozenset({"size", "local_memory", "memory"})
_SIZE_SUFFIXES = ("_bytes", "_size")
_ID_NAMES = frozenset({"id", "os_index", "index", "level", "access_class", "domain", "numa_node", "target_node",
                       "memory_tier", "package", "a", "b", "kernel_tier", "memory_tiers_nr"})
_ID_SUFFIXES = ("_node", "_tier", "_nodes", "_cpus", "cpus", "nodes", "initiators", "members", "pus", "cpuset",
                "nodeset", "msi_irqs", "groups")


def field_range(name: str) -> tuple[int, int]:
    if name in _SIZE_NAMES or name.endswith(_SIZE_SUFFIXES):
        return _SIZE
    if name in _U64_NAMES or name.endswith(_U64_SUFFIXES):
        return _U64
    if name in _ID_NAMES or name.endswith(_ID_SUFFIXES):
        return _ID
    return _DEFAULT


def sanitize[T](value: T, where: str, report: Callable[[str], None]) -> T:
    """``value`` with every out-of-range integer replaced (a scalar by -1 or 0, a list element
    dropped), each one reported as ``where.path = value: …``; the same object when nothing was."""
    return _walk(value, where, "", report)  # type: ignore[no-any-return]


def _walk(value: Any, path: str, name: str, report: Callable[[str], None]) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str | float | bytes):
        return value
    if isinstance(value, int):
        lo, hi = field_range(name)
        if lo <= value <= hi:
            return value
        replacement = -1 if lo < 0 else 0
        report(f"{path} = {excerpt(str(value))}: out of range {lo}..{hi}; read as {replacement}")
        return replacement
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            old = getattr(value, f.name)
            new = _walk(old, f"{path}.{f.name}", f.name, report)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        named: Any = value
        changes = {}
        for fname in named._fields:
            old = getattr(named, fname)
            new = _walk(old, f"{path}.{fname}", fname, report)
            if new is not old:
                changes[fname] = new
        return named._replace(**changes) if changes else named
    if isinstance(value, tuple | list):
        out = []
        changed = False
        for i, item in enumerate(value):
            if isinstance(item, int) and not isinstance(item, bool):
                lo, hi = field_range(name)
                if not lo <= item <= hi:
                    changed = True
                    if (lo, hi) == _ID:  # a set of ids: one that cannot be is left out
                        report(f"{path}[{i}] = {excerpt(str(item))}: out of range {lo}..{hi}; left out")
                        continue
                    # a row: keep the positions, the value is unknown
                    report(f"{path}[{i}] = {excerpt(str(item))}: out of range {lo}..{hi}; read as 0")
                    item = 0
                out.append(item)
                continue
            new = _walk(item, f"{path}[{i}]", name, report)
            changed |= new is not item
            out.append(new)
        return (tuple(out) if isinstance(value, tuple) else out) if changed else value
    if isinstance(value, Mapping):
        changes = {k: new for k, v in value.items() if (new := _walk(v, f"{path}[{k!r}]", str(k), report)) is not v}
        return {**value, **changes} if changes else value
    return value
