"""Human view of a MemoryTopology: what an operator reads first, in the units they think in."""

from __future__ import annotations

import itertools
import textwrap
from collections import Counter
from collections.abc import Iterable, Sequence

from memtopo.cli.output import table
from memtopo.cpulist import format_cpulist
from memtopo.discovery.sysfs_numa import SOURCE as SYSFS_NUMA
from memtopo.links import link_word, pair_links
from memtopo.text import human_bytes, natural_key
from memtopo.v1 import topology_pb2 as pb

# Above this many domains the pairwise link table is summarised: 64 nodes make 2016 pairs.
MAX_LINK_ROWS = 16
# Matrices wider than this many columns are folded into blocks of columns (a 64-node SLIT is 262
# columns wide, a 64-GPU link matrix 472).
MAX_WIDTH = 100
# Pairs with measured performance listed one by one when the link table is summarised.
MAX_MEASURED_ROWS = 16
# Past this many nodes the SLIT matrix is summarised by distance (a 64-node matrix folds into a few
# blocks; a 1,024-node one would be a million numbers).
MAX_SLIT_ROWS = 64


def _ids(ids: Iterable[int]) -> str:
    return format_cpulist(ids) or "-"


def _enum(enum: object, value: int, prefix: str) -> str:
    name: str = enum.Name(value)  # type: ignore[attr-defined]
    return name.removeprefix(prefix).lower().replace("_", "-")


def _perf(p: pb.LinkPerformance) -> str:
    if p.source in (pb.PERFORMANCE_SOURCE_UNSPECIFIED, pb.PERFORMANCE_SOURCE_SLIT):
        return "-"
    bw = p.read_bandwidth_mbps or p.write_bandwidth_mbps
    lat = p.read_latency_ns or p.write_latency_ns
    src = _enum(pb.PerformanceSource, p.source, "PERFORMANCE_SOURCE_")
    if p.access_class >= 0:
        src += f" access{p.access_class}"
    return f"{f'{bw} MB/s' if bw else '? MB/s'} {f'{lat} ns' if lat else '? ns'} ({src})"


def folded_table(corner: str, columns: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]],
                 tail: Sequence[str] = (), tails: Sequence[Sequence[str]] = (), indent: str = "  ",
                 width: int = MAX_WIDTH) -> list[str]:
    """A labelled matrix whose columns are split into blocks no wider than ``width`` (each block
    repeats the row labels; the ``tail`` columns, one row each in ``tails``, close the last block)."""
    label_w = max([len(corner), *(len(label) for label, _ in rows)])
    widths = [max([len(h), *(len(cells[i]) for _, cells in rows)]) for i, h in enumerate(columns)]
    blocks: list[list[int]] = [[]]
    used = len(indent) + label_w
    for i, w in enumerate(widths):
        if blocks[-1] and used + 2 + w > width:
            blocks.append([])
            used = len(indent) + label_w
        blocks[-1].append(i)
        used += 2 + w
    out: list[str] = []
    for n, block in enumerate(blocks):
        last = n == len(blocks) - 1
        if n:
            out.append("")
        headers = [corner, *(columns[i] for i in block), *(tail if last else ())]
        body = [[label, *(cells[i] for i in block), *(tails[r] if last and tails else ())]
                for r, (label, cells) in enumerate(rows)]
        out += table(headers, body, indent=indent)
    return out


def _free_known(topo: pb.MemoryTopology) -> bool:
    """Free memory comes from sysfs meminfo; an hwloc XML export or a capture without it has none."""
    return any(s.source == SYSFS_NUMA and s.state in (pb.SOURCE_STATE_OK, pb.SOURCE_STATE_DEGRADED)
               for s in topo.sources)


def _node_of(topo: pb.MemoryTopology, domain: int, node: int) -> int:
    """An interconnect end's NUMA node; where the message leaves it unknown (-1), its domain's first."""
    if node >= 0:
        return node
    d = topo.domains[domain] if 0 <= domain < len(topo.domains) else None
    return d.numa_nodes[0] if d is not None and d.numa_nodes else -1


def render(topo: pb.MemoryTopology, all_sources: bool = False) -> str:
    """The text view; ``all_sources`` lists every source with its reasons, where by default the
    unavailable ones (vendors simply absent) share one line."""
    out: list[str] = []
    out.append(f"node {topo.node_name or '?'}  machine-id {topo.machine_id or '?'}  boot-id {topo.boot_id or '?'}")
    out.append(f"generation {topo.generation}  fingerprint {topo.fingerprint[:16]}  root {topo.source_root}")
    c = topo.cpus
    offline = f", offline {_ids(c.offline)}" if c.offline else ""
    out.append(f"cpus {_ids(c.online)} online ({len(c.online)}){offline}; {c.packages} package(s), {c.cores} core(s)")
    cg = topo.cgroup
    cgroup = f"cgroup {_enum(pb.Cgroup.Version, cg.version, 'VERSION_')} {cg.path}" if cg.version else "cgroup ?"
    out.append(f"allowed cpus {_ids(topo.allowed_cpus)}  mems {_ids(topo.allowed_memory_nodes)}  ({cgroup})")
    out.append(f"total capacity {human_bytes(topo.total_capacity_bytes)} in {len(topo.domains)} domain(s)")

    out += ["", "Memory domains"]
    rows = []
    free_known = _free_known(topo)
    for d in topo.domains:
        rows.append([str(d.id), _enum(pb.MemoryDomainType, d.type, "MEMORY_DOMAIN_TYPE_"), _ids(d.numa_nodes),
                     _ids(d.attached_cpus), _ids(d.local_cpus), human_bytes(d.capacity_bytes),
                     human_bytes(d.free_bytes) if free_known else "unknown",
                     str(d.kernel_tier) if d.kernel_tier >= 0 else "-",
                     str(d.hwloc_tier) if d.hwloc_tier >= 0 else "-", d.subtype or "-", _perf(d.local_performance)])
    out += table(["ID", "TYPE", "NODES", "CPUS", "LOCAL-CPUS", "CAPACITY", "FREE", "KERNEL-TIER", "HWLOC-TIER",
                  "SUBTYPE", "LOCAL BW/LAT"], rows)
    out += [f"  domain {d.id}: {d.note}" for d in topo.domains if d.note]

    out += ["", "NUMA nodes"]
    rows = []
    for n in topo.numa_nodes:
        state = "online" if n.state == pb.NUMA_NODE_STATE_ONLINE else "possible-offline"
        flags = ",".join(f for f, on in (("cpu", n.has_cpu), ("mem", n.has_memory),
                                          ("normal", n.has_normal_memory), ("gi", n.generic_initiator)) if on)
        rows.append([str(n.id), state, flags or "-", _ids(n.cpus), human_bytes(n.memory_bytes),
                     str(n.domain) if n.domain >= 0 else "-", _ids(n.initiator_nodes), _ids(n.packages),
                     n.note or "-"])
    out += table(["NODE", "STATE", "HAS", "CPUS", "MEMORY", "DOMAIN", "HMAT-INITIATORS", "PACKAGES", "NOTE"], rows)

    with_rows = [n for n in topo.numa_nodes if n.distances]
    if len(with_rows) > MAX_SLIT_ROWS:
        # A thousand rows of a thousand numbers is no view: how many pairs are how far apart.
        counts = Counter(itertools.chain.from_iterable(n.distances for n in with_rows))
        out += ["", f"NUMA distances (SLIT) of {len(with_rows)} nodes (--format json has each row)"]
        out += table(["DISTANCE", "ENTRIES"], [[str(d), str(k)] for d, k in sorted(counts.items())])
    elif with_rows:
        cols = list(with_rows[0].distance_nodes)
        out += ["", "NUMA distances (SLIT)"]
        out += folded_table("node", list(map(str, cols)), [(str(n.id), list(map(str, n.distances))) for n in with_rows])

    out += _interconnects(topo)

    if topo.memory_tiers:
        out += ["", "Memory tiers"]
        for t in topo.memory_tiers:
            if t.source == pb.TIER_SOURCE_KERNEL:
                out.append(f"  kernel memory_tier{t.id}: nodes {_ids(t.numa_nodes)} (domains {_ids(t.domains)})")
            else:
                out.append(f"  hwloc tier {t.id} ({t.kind}): nodes {_ids(t.numa_nodes)}")
        out.append(f"  demotion {'enabled' if topo.demotion_enabled else 'disabled'}")

    if topo.cxl_devices or topo.cxl_regions:
        out += ["", "CXL"]
        for m in topo.cxl_devices:
            out.append(f"  {m.name}: serial {m.serial:#x} ram {human_bytes(m.ram_size_bytes)} "
                       f"pmem {human_bytes(m.pmem_size_bytes)} host {m.host} ({m.host_bridge}) node {m.numa_node}")
        for r in topo.cxl_regions:
            onlined = f"node {r.numa_node}" if r.numa_node >= 0 else "not onlined"
            out.append(f"  {r.name}: {human_bytes(r.size_bytes)} {r.mode} ways {r.interleave_ways} "
                       f"granularity {r.interleave_granularity} targets {','.join(r.targets) or '-'} "
                       f"memdevs {','.join(r.memdevs) or '-'} dax {','.join(r.dax_devices) or '-'} "
                       f"{r.dax_mode or ''} → {onlined}")

    if topo.pci_devices:
        out += ["", "PCI devices by NUMA node"]
        groups: dict[int, list[pb.PciDevice]] = {}
        for p in topo.pci_devices:
            if p.kind != pb.PCI_DEVICE_KIND_BRIDGE:
                groups.setdefault(p.numa_node, []).append(p)
        for node in sorted(groups, key=lambda n: (n < 0, n)):
            out.append(f"  node {node}:" if node >= 0 else "  no affinity (numa_node -1):")
            rows = []
            for p in groups[node]:
                sriov = f"VF of {p.physfn}" if p.physfn else (f"{len(p.virtfns)} VFs" if p.virtfns else "")
                rows.append([p.bdf, _enum(pb.PciDeviceKind, p.kind, "PCI_DEVICE_KIND_"),
                             f"{p.vendor_id:04x}:{p.device_id:04x}", p.driver or "-",
                             ",".join(p.os_devices) or "-", _ids(p.local_cpus),
                             f"{p.link_speed} x{p.link_width}" if p.link_width else (p.link_speed or "-"),
                             sriov or "-", str(len(p.msi_irqs))])
            out += table(["BDF", "KIND", "ID", "DRIVER", "OS-DEVICES", "LOCAL-CPUS", "LINK", "SR-IOV", "MSI"],
                          rows, indent="    ")

    out += _accelerators(topo)

    out += ["", "Sources"]
    absent = [s.source for s in topo.sources if s.state == pb.SOURCE_STATE_UNAVAILABLE and not all_sources]
    for s in topo.sources:
        if s.source in absent:
            continue
        state = _enum(pb.SourceState, s.state, "SOURCE_STATE_")
        out.append(f"  {s.source:<20} {state:<12} {s.duration_seconds * 1000:6.1f} ms")
        out += [f"      {r}" for r in s.reasons]
    if absent:
        out += textwrap.wrap(f"unavailable: {', '.join(absent)} (topo --sources says why)", MAX_WIDTH,
                             initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)
    return "\n".join(out) + "\n"


def _interconnects(topo: pb.MemoryTopology) -> list[str]:
    """Domain pairs named by their NUMA nodes (the SLIT matrix's ids). Past MAX_LINK_ROWS domains,
    grouped by link and distance, with the pairs that carry measured performance listed."""
    omitted = (f"  and {topo.slit_only_pairs_omitted} pairs with SLIT distances only (the SLIT above; "
               "--format json: domains[].distances)" if topo.HasField("slit_only_pairs_omitted") else "")
    if not topo.interconnects:
        return ["", "Interconnects (NUMA nodes)", omitted] if omitted else []
    out = ["", "Interconnects (NUMA nodes; --format json has each pair)"]
    if omitted:
        out.append(omitted)

    def ends(i: pb.MemoryInterconnect) -> str:
        return f"{_node_of(topo, i.domain_a, i.numa_node_a)}↔{_node_of(topo, i.domain_b, i.numa_node_b)}"

    def link(i: pb.MemoryInterconnect) -> str:
        kind = _enum(pb.MemoryLinkType, i.link_type, "MEMORY_LINK_TYPE_")
        return f"{kind} {i.accelerator}" if i.accelerator else kind

    def measured(i: pb.MemoryInterconnect) -> bool:
        return (i.a_to_b.source not in (pb.PERFORMANCE_SOURCE_SLIT, 0)
                or i.b_to_a.source not in (pb.PERFORMANCE_SOURCE_SLIT, 0))

    def row(i: pb.MemoryInterconnect) -> list[str]:
        domains = str(i.domain_a) if i.domain_a == i.domain_b else f"{i.domain_a}-{i.domain_b}"
        return [ends(i), domains, link(i), f"{i.distance_a_to_b}/{i.distance_b_to_a}", _perf(i.a_to_b),
                _perf(i.b_to_a)]

    headers = ["NODES", "DOMAINS", "LINK", "DIST", "A→B", "B→A"]
    if len(topo.domains) <= MAX_LINK_ROWS:
        return out + table(headers, [row(i) for i in topo.interconnects])
    groups: dict[tuple[str, int, int], list[pb.MemoryInterconnect]] = {}
    for i in topo.interconnects:
        groups.setdefault((link(i), i.distance_a_to_b, i.distance_b_to_a), []).append(i)
    summary = []
    for (kind, ab, ba), pairs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        sample = ", ".join(ends(i) for i in pairs[:4]) + (", …" if len(pairs) > 4 else "")
        summary.append([kind, f"{ab}/{ba}", str(len(pairs)), str(sum(map(measured, pairs))), sample])
    out += table(["LINK", "DIST", "PAIRS", "MEASURED", "E.G."], summary)
    known = [i for i in topo.interconnects if measured(i)]
    if known:
        out += ["", f"  with measured performance ({len(known)} pairs):"]
        out += table(headers, [row(i) for i in known[:MAX_MEASURED_ROWS]], indent="    ")
        if len(known) > MAX_MEASURED_ROWS:
            out.append(f"    … {len(known) - MAX_MEASURED_ROWS} more")
    return out


def _accelerators(topo: pb.MemoryTopology) -> list[str]:
    if not topo.accelerators:
        return []
    out = ["", "Accelerators"]
    rows = []
    accels = sorted(topo.accelerators, key=lambda a: natural_key(a.id))
    for a in accels:
        memory = human_bytes(a.memory_bytes) if a.memory_bytes else "-"
        if a.memory_numa_nodes:
            memory += f" (nodes {_ids(a.memory_numa_nodes)})"
        model = a.model if a.model.lower().startswith(a.vendor.lower()) else f"{a.vendor} {a.model}".strip()
        rows.append([a.id, model, a.uuid or "-", a.bdf or "-", memory, a.health or "-",
                     str(a.numa_node) if a.numa_node >= 0 else "none", _ids(a.local_cpus),
                     (str(a.domain) + (" unified" if a.unified_memory else "")) if a.domain >= 0 else "-",
                     a.source])
    out += table(["ID", "MODEL", "UUID/SERIAL", "BDF", "MEMORY", "HEALTH", "NUMA", "CPUS", "DOMAIN", "SOURCE"],
                  rows)
    for g in topo.accelerator_groups:
        fabric = f" (every pair {link_word(pb.AcceleratorLink(kind=g.link_kind, count=g.link_count))})" \
            if g.link_kind else ""
        out.append(f"  {g.kind}: {' '.join(sorted(g.members, key=natural_key))}{fabric}")
    for a in accels:
        extra = "  ".join(f"{k}={v}" for k, v in sorted(a.attributes.items()))
        if extra:
            out.append(f"  {a.id}: {extra}")
    return out


def render_links(topo: pb.MemoryTopology) -> str:
    """The accelerator matrix in `nvidia-smi topo -m` vocabulary, with CPU and NUMA affinity columns."""
    accels = list(topo.accelerators)
    if not accels:
        return "no accelerators\n"
    words: dict[tuple[str, str], str] = {}
    for a, b, link in pair_links(topo):
        words[(a, b)] = words[(b, a)] = link_word(link)
    accels.sort(key=lambda a: natural_key(a.id))
    ids = [a.id for a in accels]
    out = folded_table("", ids, [(a.id, ["X" if a.id == b else words.get((a.id, b), "-") for b in ids])
                                 for a in accels],
                       tail=["CPU Affinity", "NUMA Affinity"],
                       tails=[[_ids(a.local_cpus), str(a.numa_node) if a.numa_node >= 0 else "N/A"] for a in accels],
                       indent="")
    legend = [
        "", "Legend:",
        "  X    = Self",
        "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes",
        "  NODE = Connection traversing PCIe and the interconnect between host bridges within a NUMA node",
        "  PHB  = Connection traversing PCIe and a PCIe host bridge (typically the CPU)",
        "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe host bridge)",
        "  PIX  = Connection traversing at most a single PCIe bridge",
        "  NV#  = Connection traversing a bonded set of # NVLinks (NV: count unknown)",
        "  HCCS, SIO, XGMI … = the vendor tool's own link words",
    ]
    return "\n".join(out + legend) + "\n"
