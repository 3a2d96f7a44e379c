"""NVIDIA GPUs: NVML (nvidia-ml-py) plus the driver's ``/proc/driver/nvidia/gpus/<BDF>/numa_status``.

NVML gives, per device: name, UUID, PCI bus id, memory, the GPU memory's own NUMA node
(``nvmlDeviceGetNumaNodeId``, coherent platforms only), the nearest host memory node and CPUs, C2C
mode and links, addressing mode, MIG mode and NVLink peers. The driver's procfs names, for every GPU
whose NUMA support is not disabled, the node its memory is onlined to and that node's state. It is
read with or without NVML, so a captured root or a host without nvidia-ml-py still says which NUMA
node is GPU memory (devices known only from procfs get ``index_source = "pci_order"``).

**Superchips** (GH200, GB200, GB300, GB10): ``unified_memory`` is set when the model string names
one *and* NVML says C2C is enabled; node ids are never assumed. In the default NUMA mode the GPU
memory is a CPU-less node (``memory_numa_nodes``). In CDMM mode the driver keeps it: NumaNodeId is
NOT_SUPPORTED and no numa_status node is online, so ``attributes["cdmm"] == "true"``.

**MIG placeholder nodes**: firmware declares, after each GPU's memory node, a block of CPU-less nodes
for MIG instances (7 per GPU on GH200/GB200). NVML does not say which belong to which GPU, so they are
attributed from the kernel's view (:func:`attribute_mig_placeholders`): walking up from the GPU
memory node, the consecutive CPU-less nodes whose nearest CPU node by SLIT is the memory node's own,
up to a node with CPUs, another GPU's memory node or a node nearer other CPUs; the empty ones are the
placeholders. No block size is assumed, and without a SLIT that singles out one CPU node nothing is
attributed. Without a GPU memory node (CDMM, discrete GPUs) nothing is attributed either.

**Errors** (the NVML interface: discovery/nvml.py; its live, replayed and recording sides beside it):
LibraryNotFound or DriverNotLoaded at init (or
no nvidia-ml-py) means no NVML: the source is UNAVAILABLE, or DEGRADED when procfs still listed GPUs
(those are reported). NotSupported is an *answer* where it means "this device has none" (NumaNodeId,
C2C mode and links, NVLink, MIG, addressing mode); anywhere else, and any other error, the fact stays
unknown and the source is DEGRADED with a reason naming the call.

The NVML replay format is described in discovery/nvml_replay.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from memtopo.cpulist import MAX_ID, format_cpulist
from memtopo.discovery import presence
from memtopo.discovery.nvml import CALLS, NvidiaParseError, NvLinkPeer, NvmlApi, NvmlCallError, id_spans
from memtopo.discovery.nvml_live import PynvmlApi
from memtopo.discovery.nvml_replay import load_nvml_replay
from memtopo.discovery.parts import AccelDevice, AcceleratorPart, AccelLink, Ids, SysNuma
from memtopo.discovery.presence import PROC_GPUS
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.hostfs import HostReadError
from memtopo.pci import bdf_sort_key, normalize_bdf
from memtopo.text import excerpt

SOURCE = "nvidia"


# GH200, GB200, GB300, GB10: Grace-based superchips. The look-arounds keep "80GB" out.
_SUPERCHIP = re.compile(r"(?<![A-Za-z0-9])G[BH]\d{2,3}(?![0-9])")

# NotSupported from these means "the device has none of it", which is a fact, not a fault.
_UNSUPPORTED_IS_AN_ANSWER = frozenset({
    "numa_node_id", "c2c_enabled", "c2c_links", "nvlinks", "mig_mode", "addressing_mode",
})
# The library or the driver is absent: NVML has nothing to say on this host.
_ABSENT = frozenset({"LibraryNotFound", "DriverNotLoaded"})
ADDRESSING_MODES: Mapping[int, str] = {0: "none", 1: "HMM", 2: "ATS"}


# ---- numa_status -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class NumaStatus:
    """``/proc/driver/nvidia/gpus/<BDF>/numa_status`` (nvidia ``nv-procfs.c``)."""

    node: int | None  # None when the driver prints -1 (no node)
    status: str  # disabled, offline, online_in_progress, online, online_failed, … as printed
    address: int | None = None  # absent until the GPU is initialised
    size_bytes: int | None = None

    @property
    def online_node(self) -> int | None:
        """The node holding the GPU memory now, if any."""
        return self.node if self.status == "online" else None


_STATUS_WORD = re.compile(r"[a-z][a-z_]*")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def parse_numa_status(text: str) -> NumaStatus:
    """``Node: <%d>``, ``Status: <word>`` and, once initialised, ``Address:``/``Size:`` in bare hex."""
    fields: dict[str, str] = {}
    for raw in text.replace("\0", "").splitlines():
        line = raw.strip()
        if not line:
            continue
        key, colon, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not colon or not key or not value:
            raise NvidiaParseError(f"not a 'Key: value' line: {excerpt(line, 60)}")
        if key in fields:
            raise NvidiaParseError(f"{key} given twice")
        fields[key] = value
    if "Node" not in fields or "Status" not in fields:
        raise NvidiaParseError("no Node: or Status: line")
    node_s = fields["Node"]
    digits = node_s.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()) or int(node_s) < -1 or int(node_s) >= MAX_ID:
        raise NvidiaParseError(f"Node is not a node id: {excerpt(node_s)}")
    status = fields["Status"]
    if not _STATUS_WORD.fullmatch(status):
        raise NvidiaParseError(f"Status is not a state word: {excerpt(status)}")
    node = int(node_s)
    return NumaStatus(None if node < 0 else node, status,
                      _hex_field(fields, "Address"), _hex_field(fields, "Size"))


def _hex_field(fields: Mapping[str, str], key: str) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    if len(value) > 16 or not _HEX_DIGITS.issuperset(value):
        raise NvidiaParseError(f"{key} is not a 64-bit hex number: {excerpt(value)}")
    return int(value, 16)


def is_superchip_model(model: str) -> bool:
    """GH200 / GB200 / GB300 / GB10 in an NVML device name."""
    return _SUPERCHIP.search(model) is not None

# ---- MIG placeholder attribution ---------------------------------------------------------------------
def attribute_mig_placeholders(numa: SysNuma, memory_nodes: Mapping[int, int]) -> dict[int, Ids]:
    """GPU index → its empty MIG placeholder nodes, given each GPU's memory node (see the docstring)."""
    nodes = {n.id: n for n in numa.nodes}
    cols = numa.distance_nodes
    cpu_nodes = [n.id for n in numa.nodes if n.cpus]

    def nearest_cpu_node(nid: int) -> int | None:
        node = nodes.get(nid)
        if node is None or len(node.distances) != len(cols):
            return None
        row = dict(zip(cols, node.distances, strict=True))
        cands = [(row[c], c) for c in cpu_nodes if c in row]
        if not cands:
            return None
        best = min(d for d, _ in cands)
        winners = [c for d, c in cands if d == best]
        return winners[0] if len(winners) == 1 else None

    order = sorted(nodes)
    gpu_memory = set(memory_nodes.values())
    out: dict[int, Ids] = {}
    for gpu, mem in memory_nodes.items():
        home = nearest_cpu_node(mem)
        found: list[int] = []
        if home is not None:
            for nid in order[order.index(mem) + 1:]:
                node = nodes[nid]
                if node.cpus or nid in gpu_memory or nearest_cpu_node(nid) != home:
                    break
                if node.mem_total_bytes == 0:
                    found.append(nid)
        out[gpu] = tuple(found)
    return out


# ---- the probe -------------------------------------------------------------------------------------
@dataclass
class _Gpu:
    """One device while it is being assembled."""

    index: int
    model: str = ""
    uuid: str = ""
    bdf: str = ""
    memory_bytes: int = 0
    numa_node_id: int | None = None
    numa_id_unsupported: bool = False
    memory_affinity: Ids | None = None
    local_cpus: Ids = ()
    c2c: bool | None = None
    nvlinks: tuple[NvLinkPeer | None, ...] = ()
    attributes: dict[str, str] = field(default_factory=dict)
    memory_nodes: set[int] = field(default_factory=set)


class _Asker:
    """Asks one device's questions; a failed call becomes a reason naming it, never an exception."""

    def __init__(self, sb: StatusBuilder, index: int) -> None:
        self.sb = sb
        self.index = index
        self.unsupported: set[str] = set()

    def __call__[T](self, what: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except NvmlCallError as exc:
            if exc.error == "NotSupported" and what in _UNSUPPORTED_IS_AN_ANSWER:
                self.unsupported.add(what)
            else:
                self.sb.problem(f"GPU {self.index}: {exc}")
            return None


def probe(ctx: ProbeContext, numa: ProbeResult[SysNuma] | None = None, *,
          api: NvmlApi | None = None) -> ProbeResult[AcceleratorPart]:
    """NVIDIA GPUs of the root. ``numa``: sysfs.numa's part, which MIG placeholder nodes are attributed
    from. ``api`` replaces the NVML choice (tests inject fakes through it)."""
    sb = StatusBuilder(SOURCE)
    if api is None and (nothing := presence.nvidia(ctx)) is not None:
        sb.unavailable(nothing)
        return ProbeResult(AcceleratorPart(), sb.finish())
    procfs = _read_procfs(ctx, sb) if ctx.sysfs_available else {}
    gpus: list[_Gpu] = []
    absent: str | None = None
    if api is None:
        api, absent = _choose_api(ctx, sb)
    if api is not None:
        gpus, absent = _query_nvml(api, ctx, sb)
    gpus = _merge_procfs(gpus, procfs, nvml_answered=absent is None, sb=sb)
    if absent is not None:
        if gpus:
            sb.problem(f"NVML: {absent}; GPUs from {PROC_GPUS} only")
        else:
            sb.unavailable(presence.nvidia_absent(absent))
    elif not gpus:
        sb.unavailable("no NVIDIA GPUs (NVML reports 0 devices)")
    _attribute_placeholders(ctx, gpus, numa, sb)
    devices = tuple(_freeze(g) for g in gpus)
    links, groups = nvlink_topology({g.index: g.bdf for g in gpus}, {g.index: g.nvlinks for g in gpus})
    return ProbeResult(AcceleratorPart(devices, links, groups), sb.finish())


def _choose_api(ctx: ProbeContext, sb: StatusBuilder) -> tuple[NvmlApi | None, str | None]:
    if ctx.nvml_replay is not None:
        try:
            return load_nvml_replay(ctx.nvml_replay, ctx.fs), None
        except NvidiaParseError as exc:
            sb.problem(f"{ctx.nvml_replay.name}: {exc}")
            return None, "recording unusable"
    if ctx.libraries_live:
        return PynvmlApi(), None
    if not ctx.sysfs_available:
        return None, presence.XML_ONLY
    return None, presence.NO_NVML_RECORDING


def _query_nvml(api: NvmlApi, ctx: ProbeContext, sb: StatusBuilder) -> tuple[list[_Gpu], str | None]:
    """Every device's answers, or the reason NVML is absent (library or driver missing)."""
    try:
        api.init()
    except NvmlCallError as exc:
        if exc.error in _ABSENT:
            return [], str(exc)
        sb.problem(str(exc))
        return [], None
    try:
        try:
            count = api.device_count()
        except NvmlCallError as exc:
            if exc.error in _ABSENT:
                return [], str(exc)
            sb.problem(str(exc))
            return [], None
        max_nodes, max_cpus = id_spans(ctx)
        return [_query_device(api, i, sb, max_nodes, max_cpus) for i in range(count)], None
    finally:
        api.shutdown()


def _query_device(api: NvmlApi, i: int, sb: StatusBuilder, max_nodes: int, max_cpus: int) -> _Gpu:
    gpu = _Gpu(i)
    try:
        api.open(i)
    except NvmlCallError as exc:
        sb.problem(f"GPU {i}: {exc}")
        return gpu
    ask = _Asker(sb, i)
    gpu.model = ask("name", lambda: api.name(i)) or ""
    gpu.uuid = ask("uuid", lambda: api.uuid(i)) or ""
    bus = ask("pci_bus_id", lambda: api.pci_bus_id(i))
    if bus is not None:
        gpu.bdf = normalize_bdf(bus) or ""
        if not gpu.bdf:
            sb.problem(f"GPU {i}: {CALLS['pci_bus_id']}: not a PCI address: {excerpt(bus)}")
    gpu.memory_bytes = ask("memory_total", lambda: api.memory_total(i)) or 0
    numa_id = ask("numa_node_id", lambda: api.numa_node_id(i))
    gpu.numa_node_id = numa_id if numa_id is not None and numa_id >= 0 else None
    gpu.numa_id_unsupported = "numa_node_id" in ask.unsupported or numa_id == -1
    gpu.memory_affinity = ask("memory_affinity", lambda: api.memory_affinity(i, max_nodes))
    gpu.local_cpus = ask("cpu_affinity", lambda: api.cpu_affinity(i, max_cpus)) or ()
    attrs = gpu.attributes
    gpu.c2c = ask("c2c_enabled", lambda: api.c2c_enabled(i))
    if gpu.c2c is not None:
        attrs["c2c_mode"] = "enabled" if gpu.c2c else "disabled"
    elif "c2c_enabled" in ask.unsupported:
        attrs["c2c_mode"] = "unsupported"
    if gpu.c2c:
        links = ask("c2c_links", lambda: api.c2c_links(i))
        if links is not None:
            active = [link for link in links if link.active]
            attrs["c2c_link_count"] = str(len(active))
            attrs["c2c_bandwidth_mbps"] = str(sum(link.max_bw_mbps for link in active))
    mode = ask("addressing_mode", lambda: api.addressing_mode(i))
    if mode is not None:
        attrs["addressing_mode"] = ADDRESSING_MODES.get(mode, f"unknown ({mode})")
    mig = ask("mig_mode", lambda: api.mig_mode(i))
    if mig is not None:
        attrs["mig_mode"] = "enabled" if mig[0] else "disabled"
        if bool(mig[1]) != bool(mig[0]):
            attrs["mig_mode_pending"] = "enabled" if mig[1] else "disabled"
    elif "mig_mode" in ask.unsupported:
        attrs["mig_mode"] = "unsupported"
    gpu.nvlinks = ask("nvlinks", lambda: api.nvlinks(i)) or ()
    return gpu


def _read_procfs(ctx: ProbeContext, sb: StatusBuilder) -> dict[str, NumaStatus | None]:
    """BDF → its numa_status (None when the file is absent: NUMA support disabled, discrete GPU)."""
    out: dict[str, NumaStatus | None] = {}
    try:
        entries = ctx.fs.listdir(PROC_GPUS)
    except HostReadError as exc:
        sb.problem(exc)
        return out
    for entry in entries:
        bdf = normalize_bdf(entry)
        if bdf is None:
            continue
        rel = f"{PROC_GPUS}/{entry}/numa_status"
        out[bdf] = None
        try:
            out[bdf] = parse_numa_status(ctx.fs.read_text(rel))
        except HostReadError as exc:
            if exc.reason != "missing":
                sb.problem(exc)
        except NvidiaParseError as exc:
            sb.problem(HostReadError(rel, str(exc)))
    return out


def _merge_procfs(gpus: list[_Gpu], procfs: Mapping[str, NumaStatus | None], *, nvml_answered: bool,
                  sb: StatusBuilder) -> list[_Gpu]:
    """numa_status into the NVML devices (by BDF), and GPUs only procfs knows as devices of their own."""
    remaining = dict(procfs)
    for gpu in gpus:
        status = remaining.pop(gpu.bdf, None) if gpu.bdf else None
        _apply_numa_status(gpu, status, sb)
    if not remaining:
        return gpus
    if any(not g.bdf for g in gpus):
        # An NVML device without a bus id may be one of them: adding them could count a GPU twice.
        sb.problem(f"{PROC_GPUS} lists {', '.join(sorted(remaining))}, not matched to NVML devices")
        return gpus
    out = list(gpus)
    for bdf in sorted(remaining, key=bdf_sort_key):
        if nvml_answered:
            sb.problem(f"GPU {bdf} is in {PROC_GPUS} but not in NVML")
        # NVML and nvidia-smi enumerate in PCI bus order, the best guess at the index NVML would give.
        gpu = _Gpu(len(out), bdf=bdf, attributes={"index_source": "pci_order"})
        _apply_numa_status(gpu, remaining[bdf], sb)
        out.append(gpu)
    return out


def _apply_numa_status(gpu: _Gpu, status: NumaStatus | None, sb: StatusBuilder) -> None:
    nodes = {gpu.numa_node_id} if gpu.numa_node_id is not None else set()
    if status is not None:
        gpu.attributes["numa_status"] = status.status
        online = status.online_node
        if online is not None:
            if gpu.numa_node_id is not None and online != gpu.numa_node_id:
                sb.problem(f"GPU {gpu.index}: NVML puts its memory on node {gpu.numa_node_id}, "
                           f"numa_status on node {online}")
            nodes.add(online)
            if not gpu.memory_bytes and status.size_bytes:
                gpu.memory_bytes = status.size_bytes
                gpu.attributes["memory_source"] = "numa_status"
    gpu.memory_nodes = nodes
    if gpu.c2c:
        if nodes:
            gpu.attributes["cdmm"] = "false"
        elif gpu.numa_id_unsupported:
            gpu.attributes["cdmm"] = "true"


def _attribute_placeholders(ctx: ProbeContext, gpus: list[_Gpu], numa: ProbeResult[SysNuma] | None,
                            sb: StatusBuilder) -> None:
    memory_nodes = {g.index: min(g.memory_nodes) for g in gpus if g.memory_nodes}
    if not memory_nodes or not ctx.sysfs_available:
        return
    if numa is None:
        sb.problem("no sysfs.numa part (that probe failed or overran): MIG placeholder nodes not attributed")
        return
    # The kernel's own node view (the sysfs.numa probe reports its problems itself).
    for index, nodes in attribute_mig_placeholders(numa.data, memory_nodes).items():
        if nodes:
            gpus[index].attributes["mig_placeholder_nodes"] = format_cpulist(nodes)


def _freeze(gpu: _Gpu) -> AccelDevice:
    attrs = dict(gpu.attributes)
    memory_nodes = tuple(sorted(gpu.memory_nodes))
    numa_node: int | None = None
    if gpu.memory_affinity:
        # The GPU's own memory node can be listed too; the host node is the one that is not.
        host = [n for n in gpu.memory_affinity if n not in memory_nodes] or list(gpu.memory_affinity)
        if len(host) == 1:
            numa_node = host[0]
        else:
            attrs["memory_affinity_nodes"] = format_cpulist(host)
    return AccelDevice(
        kind="GPU", vendor="NVIDIA", index=gpu.index, model=gpu.model, uuid=gpu.uuid, bdf=gpu.bdf,
        memory_bytes=gpu.memory_bytes, numa_node=numa_node, local_cpus=gpu.local_cpus,
        memory_numa_nodes=memory_nodes,
        unified_memory=bool(gpu.c2c) and is_superchip_model(gpu.model),
        attributes=attrs,
    )


def nvlink_topology(bdfs: Mapping[int, str], peers: Mapping[int, Sequence[NvLinkPeer | None]],
                    ) -> tuple[tuple[AccelLink, ...], tuple[Ids, ...]]:
    """NV links between GPUs (index → BDF, index → its links' far ends) and the islands they form.

    A direct GPU↔GPU link counts from either end (the larger count wins, in case one end's answer is
    missing). GPUs whose links go to NVSwitches all share the host's switch fabric (HGX boards,
    NVL72 trays): each such pair is NV<fewest switch links of the two>, as nvidia-smi prints it.
    """
    by_bdf = {bdf: index for index, bdf in bdfs.items() if bdf}
    direct: dict[tuple[int, int], int] = {}
    switch: dict[int, int] = {}
    for index, ends in peers.items():
        for peer in ends:
            if peer is None:
                continue
            if peer.remote_type == "SWITCH":
                switch[index] = switch.get(index, 0) + 1
                continue
            target = by_bdf.get(peer.remote_bdf)
            if target is not None and target != index and peer.remote_type in ("GPU", ""):
                direct[(index, target)] = direct.get((index, target), 0) + 1
    pairs: dict[tuple[int, int], int] = {}
    for (a, b), n in direct.items():
        key = (min(a, b), max(a, b))
        pairs[key] = max(pairs.get(key, 0), n)
    switched = sorted(switch)
    for x, a in enumerate(switched):
        for b in switched[x + 1:]:
            pairs.setdefault((a, b), min(switch[a], switch[b]))
    links = tuple(AccelLink(a, b, "NV", n) for (a, b), n in sorted(pairs.items()))
    return links, _islands(links)


def _islands(links: Sequence[AccelLink]) -> tuple[Ids, ...]:
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for link in links:
        parent[root(link.a)] = root(link.b)
    members: dict[int, list[int]] = {}
    for x in list(parent):
        members.setdefault(root(x), []).append(x)
    return tuple(sorted(tuple(sorted(m)) for m in members.values() if len(m) > 1))
