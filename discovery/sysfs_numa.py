"""NUMA nodes as the kernel reports them under /sys/devices/system/node (and the CPU masks).

Per node: CPUs, MemTotal/MemFree, the SLIT row, HMAT ``accessK`` figures, memory-side caches and
huge pages. Per-CPU topology is hwloc's job; nothing here reads ``cpuN/`` directories.
"""

from __future__ import annotations

import dataclasses

from memtopo.cpulist import KERNEL_MAX_CPUS, KERNEL_MAX_NODES, format_cpulist
from memtopo.discovery.parts import HmatAccess, Ids, SideCache, SysNode, SysNuma
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.discovery.sysfs_read import dir_ids
from memtopo.hostfs import HostReadError
from memtopo.text import excerpt

SOURCE = "sysfs.numa"

NODE_DIR = "sys/devices/system/node"
CPU_DIR = "sys/devices/system/cpu"
_MASKS = ("possible", "online", "has_cpu", "has_memory", "has_normal_memory", "has_generic_initiator")
_PERF_FILES = ("read_bandwidth", "write_bandwidth", "read_latency", "write_latency")

EMPTY = SysNuma(
    possible=None, online=None, has_cpu=None, has_memory=None, has_normal_memory=None,
    has_generic_initiator=None, nodes=(), distance_nodes=(), cpus_online=(), cpus_possible=(),
    cpus_present=(),
)


def probe(ctx: ProbeContext) -> ProbeResult[SysNuma]:
    sb = StatusBuilder(SOURCE)
    if not ctx.sysfs_available:
        sb.unavailable("input is an hwloc XML export")
        return ProbeResult(EMPTY, sb.finish())
    fs = ctx.fs
    has_node_dir = fs.is_dir(NODE_DIR)
    if not has_node_dir and not fs.is_dir(CPU_DIR):
        sb.unavailable(f"no {NODE_DIR} and no {CPU_DIR} under the root")
        return ProbeResult(EMPTY, sb.finish())

    cpus_online, cpus_possible, cpus_present = _cpu_masks(ctx, sb)
    if not has_node_dir:
        return ProbeResult(_single_node(ctx, sb, cpus_online, cpus_possible, cpus_present), sb.finish())

    masks: dict[str, Ids | None] = {name: _node_list(ctx, sb, name) for name in _MASKS}
    try:
        entries = fs.listdir(NODE_DIR)
    except HostReadError as exc:
        sb.problem(exc)
        entries = []
    node_ids = dir_ids(sb, NODE_DIR, entries, "node", KERNEL_MAX_NODES)
    online = masks["online"]
    if online is not None:
        # An online node always has its directory: one without is no node (node/online = 0-1023
        # in a one-node capture).
        known = set(node_ids)
        missing = [n for n in online if n not in known]
        if missing:
            sb.problem(f"{NODE_DIR}/online: nodes {format_cpulist(missing)} have no nodeN directory; left out")
            online = tuple(n for n in online if n in known)
    # The kernel prints one column per online node; without `online` (old kernels) the node
    # directories present are the best guess at what was online.
    distance_nodes = online if online is not None else tuple(node_ids)

    nodes = _one_node_per_cpu(ctx, sb, tuple(_node(ctx, sb, nid, len(distance_nodes)) for nid in node_ids),
                              cpus_online)
    data = SysNuma(
        possible=masks["possible"], online=online, has_cpu=masks["has_cpu"],
        has_memory=masks["has_memory"], has_normal_memory=masks["has_normal_memory"],
        has_generic_initiator=masks["has_generic_initiator"], nodes=nodes,
        distance_nodes=distance_nodes, cpus_online=cpus_online, cpus_possible=cpus_possible,
        cpus_present=cpus_present,
    )
    return ProbeResult(data, sb.finish())


def _read_uint(ctx: ProbeContext, rel: str) -> int:
    """A decimal attribute. Stricter than int(), which also takes "+1", "1_0" and non-ASCII digits."""
    text = ctx.fs.read_attr(rel)
    if not (text.isdigit() and text.isascii()):
        raise HostReadError(rel, f"not an unsigned integer: {excerpt(text)}")
    return int(text)


def _node_list(ctx: ProbeContext, sb: StatusBuilder, name: str) -> Ids | None:
    """A node list; ids at or beyond the kernel's MAX_NUMNODES are a problem and left out."""
    rel = f"{NODE_DIR}/{name}"
    ids = _optional_list(ctx, sb, rel)
    if ids and ids[-1] >= KERNEL_MAX_NODES:
        beyond = [n for n in ids if n >= KERNEL_MAX_NODES]
        sb.problem(f"{rel}: nodes {format_cpulist(beyond)} beyond the kernel's MAX_NUMNODES "
                   f"({KERNEL_MAX_NODES}); left out")
        ids = tuple(n for n in ids if n < KERNEL_MAX_NODES)
    return ids


def _optional_list(ctx: ProbeContext, sb: StatusBuilder, rel: str) -> Ids | None:
    """A list-format file; None when it is absent (not a problem) or unparseable (a problem)."""
    try:
        return ctx.fs.read_cpulist(rel)
    except HostReadError as exc:
        if exc.reason != "missing":
            sb.problem(exc)
        return None


def _cpu_masks(ctx: ProbeContext, sb: StatusBuilder) -> tuple[Ids, Ids, Ids]:
    online = _optional_list(ctx, sb, f"{CPU_DIR}/online")
    possible = _optional_list(ctx, sb, f"{CPU_DIR}/possible")
    present = _optional_list(ctx, sb, f"{CPU_DIR}/present")
    # Kernels too old for these masks (the ia64 dumps) still list one cpuN directory per
    # registered CPU, and every kernel does: it also tells a mask naming CPUs no directory has
    # (cpu/online = 0-65535 in a two-CPU capture) for what it is.
    try:
        listed = tuple(dir_ids(sb, CPU_DIR, ctx.fs.listdir(CPU_DIR), "cpu", KERNEL_MAX_CPUS))
    except HostReadError as exc:
        sb.problem(exc)
        listed = ()
    if online is None:
        # Without the mask, each CPU says for itself (cpuN/online; the boot CPU often has none).
        online = tuple(c for c in listed if _cpu_online(ctx, sb, c))
    possible = listed if possible is None else possible
    present = listed if present is None else present
    if listed:
        known = set(listed)
        for name, mask in (("online", online), ("present", present)):
            extra = [c for c in mask if c not in known]
            if extra:
                sb.problem(f"{CPU_DIR}/{name}: CPUs {format_cpulist(extra)} have no cpuN directory; left out")
        online = tuple(c for c in online if c in known)
        present = tuple(c for c in present if c in known)
    return online, possible, present


def _cpu_online(ctx: ProbeContext, sb: StatusBuilder, cpu: int) -> bool:
    rel = f"{CPU_DIR}/cpu{cpu}/online"
    try:
        text = ctx.fs.read_attr(rel)
    except HostReadError as exc:
        if exc.reason != "missing":
            sb.problem(exc)
        return True  # no file: a CPU that cannot be taken offline
    if text == "":
        return True  # captures (hwloc's) keep some attributes as empty files: nothing said
    if text not in ("0", "1"):
        sb.problem(HostReadError(rel, f"not 0 or 1: {excerpt(text)}"))
        return True
    return text == "1"


def _one_node_per_cpu(ctx: ProbeContext, sb: StatusBuilder, nodes: tuple[SysNode, ...],
                      cpus_online: Ids) -> tuple[SysNode, ...]:
    """Each CPU in one node, and only online CPUs in a node.

    The kernel maps a CPU to exactly one node and takes it out of its node when it goes offline; a
    tree that lists a CPU in several nodes (firmware that put every CPU in every node, a bad
    capture) is reported as a problem, and the CPU is kept in the node its own ``cpuN/nodeM`` link
    names, else in the lowest of them. hwloc, which reads the same lists, merges such nodes
    instead; memtopo keeps the nodes (their memory is real) and gives each CPU one home, because
    every consumer of the topology (placement, CPU binding) needs a partition of the CPUs."""
    online = set(cpus_online)
    owners: dict[int, list[int]] = {}
    for node in nodes:
        for c in node.cpus:
            owners.setdefault(c, []).append(node.id)
    shared = {c: ns for c, ns in owners.items() if len(ns) > 1}
    home: dict[int, int] = {}
    if shared:
        for c, ns in sorted(shared.items()):
            links = [n for n in ns if ctx.fs.exists(f"{CPU_DIR}/cpu{c}/node{n}")]
            home[c] = links[0] if len(links) == 1 else ns[0]
        by_nodes: dict[tuple[int, ...], list[int]] = {}
        for c, ns in shared.items():
            by_nodes.setdefault(tuple(ns), []).append(c)
        for listed_in, cpus in sorted(by_nodes.items()):
            sb.problem(f"{NODE_DIR}: CPUs {format_cpulist(cpus)} are listed in nodes {format_cpulist(listed_in)}; "
                       f"each kept in one node ({_homes(cpus, home)})")
    out = []
    for node in nodes:
        keep = tuple(c for c in node.cpus if (not online or c in online) and home.get(c, node.id) == node.id)
        out.append(node if keep == node.cpus else dataclasses.replace(node, cpus=keep))
    return tuple(out)


def _homes(cpus: list[int], home: dict[int, int]) -> str:
    by_home: dict[int, list[int]] = {}
    for c in cpus:
        by_home.setdefault(home[c], []).append(c)
    return ", ".join(f"{format_cpulist(cs)} in node {n}" for n, cs in sorted(by_home.items()))


def _single_node(ctx: ProbeContext, sb: StatusBuilder, cpus_online: Ids, cpus_possible: Ids,
                 cpus_present: Ids) -> SysNuma:
    """A kernel built without NUMA: one node 0 holding all memory and every online CPU."""
    total, free = _parse_meminfo(ctx, sb, "proc/meminfo", node_prefix=False)
    node = SysNode(id=0, cpus=cpus_online, mem_total_bytes=total, mem_free_bytes=free, distances=(10,))
    return SysNuma(
        possible=None, online=None, has_cpu=None, has_memory=None, has_normal_memory=None,
        has_generic_initiator=None, nodes=(node,), distance_nodes=(0,), cpus_online=cpus_online,
        cpus_possible=cpus_possible, cpus_present=cpus_present, synthesized_single_node=True,
    )


def _node(ctx: ProbeContext, sb: StatusBuilder, nid: int, ncols: int) -> SysNode:
    fs = ctx.fs
    base = f"{NODE_DIR}/node{nid}"
    # One listing per node answers every "is it there" question at once (cheaper than a stat each).
    try:
        entries = set(fs.listdir(base))
    except HostReadError as exc:
        sb.problem(exc)
        entries = set()
    cpus: Ids = ()
    try:
        # Old kernels (the ia64 dumps) only have the hex cpumap.
        cpus = fs.read_mask(f"{base}/cpumap") if "cpulist" not in entries and "cpumap" in entries \
            else ctx.fs.read_cpulist(f"{base}/cpulist")
    except HostReadError as exc:
        sb.problem(exc)

    total, free = _parse_meminfo(ctx, sb, f"{base}/meminfo", node_prefix=True)
    distances = _distance_row(ctx, sb, f"{base}/distance", ncols)
    # Two access classes exist (ACCESS_COORDINATE_MAX); the directory is absent without HMAT/CDAT.
    access = tuple(a for k in (0, 1) if f"access{k}" in entries
                   and (a := _access(ctx, sb, base, k)) is not None)
    side_caches = _side_caches(ctx, sb, base) if "memory_side_cache" in entries else ()
    hugepages = _hugepages(ctx, sb, base) if "hugepages" in entries else 0
    return SysNode(id=nid, cpus=cpus, mem_total_bytes=total, mem_free_bytes=free, distances=distances,
                   access=access,
                   side_caches=side_caches, hugepages_bytes=hugepages)


def _parse_meminfo(ctx: ProbeContext, sb: StatusBuilder, rel: str, *, node_prefix: bool) -> tuple[int, int]:
    """(MemTotal, MemFree) in bytes from ``Node N Key: value kB`` lines (or /proc/meminfo's ``Key:``)."""
    try:
        text = ctx.fs.read_text(rel)
    except HostReadError as exc:
        sb.problem(exc)
        return 0, 0
    key_at = 2 if node_prefix else 0
    found: dict[str, int] = {}
    for line in text.split("\n"):
        parts = line.split()
        if len(parts) <= key_at + 1:
            continue
        key = parts[key_at]
        if key not in ("MemTotal:", "MemFree:"):
            continue
        value = parts[key_at + 1]
        if not value.isdigit() or not value.isascii():
            sb.problem(HostReadError(rel, f"{key} is not a number: {excerpt(value)}"))
            found[key] = 0
        else:
            found[key] = int(value) * 1024
        if len(found) == 2:
            break
    for key in ("MemTotal:", "MemFree:"):
        if key not in found:
            sb.problem(HostReadError(rel, f"no {key[:-1]} line"))
    return found.get("MemTotal:", 0), found.get("MemFree:", 0)


def _distance_row(ctx: ProbeContext, sb: StatusBuilder, rel: str, ncols: int) -> tuple[int, ...]:
    try:
        text = ctx.fs.read_text(rel)
    except HostReadError as exc:
        sb.problem(exc)
        return ()
    try:
        # int() also takes "+5", "1_0" and non-ASCII digits; the kernel prints none of those.
        row = tuple(map(int, text.split())) if text.isascii() and "_" not in text and "+" not in text \
            else None
    except ValueError:
        row = None
    if row is None or (row and min(row) < 0):
        sb.problem(HostReadError(rel, f"not a row of integers: {excerpt(text.strip(), 60)}"))
        return ()
    if len(row) != ncols:
        # Columns map to the online nodes by position; a row of another length cannot be placed.
        sb.problem(HostReadError(rel, f"{len(row)} columns, expected {ncols} (one per online node)"))
        return ()
    return row


def _access(ctx: ProbeContext, sb: StatusBuilder, base: str, access_class: int) -> HmatAccess | None:
    rel = f"{base}/access{access_class}/initiators"
    try:
        entries = ctx.fs.listdir(rel)
    except HostReadError as exc:
        sb.problem(exc)
        entries = []
    initiators = tuple(dir_ids(sb, rel, entries, "node"))
    if not initiators and not any(p in entries for p in _PERF_FILES):
        # An initiator-only node (CPUs, no memory) gets accessK/targets and an empty initiators/:
        # it is nobody's target, so it has no entry of its own.
        return None
    # A missing figure and a 0 both mean the firmware gave none: keep 0 (unknown).
    figures = dict.fromkeys(_PERF_FILES, 0)
    for perf in _PERF_FILES:
        if perf in entries:
            try:
                figures[perf] = _read_uint(ctx, f"{rel}/{perf}")
            except HostReadError as exc:
                sb.problem(exc)
    return HmatAccess(
        access_class=access_class, initiators=initiators,
        read_bandwidth_mbps=figures["read_bandwidth"], write_bandwidth_mbps=figures["write_bandwidth"],
        read_latency_ns=figures["read_latency"], write_latency_ns=figures["write_latency"],
    )


def _side_caches(ctx: ProbeContext, sb: StatusBuilder, base: str) -> tuple[SideCache, ...]:
    rel = f"{base}/memory_side_cache"
    try:
        entries = ctx.fs.listdir(rel)
    except HostReadError as exc:
        sb.problem(exc)
        return ()
    caches: list[SideCache] = []
    for e in entries:
        if not (e.startswith("index") and e[5:].isdigit()):
            continue
        d = f"{rel}/{e}"
        try:
            caches.append(SideCache(
                level=int(e[5:]), size_bytes=_read_uint(ctx, f"{d}/size"),
                line_size_bytes=_read_uint(ctx, f"{d}/line_size"),
                indexing=_read_uint(ctx, f"{d}/indexing"), write_policy=_read_uint(ctx, f"{d}/write_policy"),
            ))
        except HostReadError as exc:
            # A half-read cache would pass for direct-mapped write-back; drop it instead.
            sb.problem(exc)
    return tuple(sorted(caches, key=lambda c: c.level))


def _hugepages(ctx: ProbeContext, sb: StatusBuilder, base: str) -> int:
    rel = f"{base}/hugepages"
    try:
        entries = ctx.fs.listdir(rel)
    except HostReadError as exc:
        sb.problem(exc)
        return 0
    total = 0
    for e in entries:
        size_kb = e[10:-2]
        if not (e.startswith("hugepages-") and e.endswith("kB") and size_kb.isdigit()):
            continue
        try:
            total += _read_uint(ctx, f"{rel}/{e}/nr_hugepages") * int(size_kb) * 1024
        except HostReadError as exc:
            sb.problem(exc)
    return total
