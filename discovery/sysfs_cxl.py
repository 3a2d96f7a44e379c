"""CXL memdevs, decoders and regions (/sys/bus/cxl/devices) and DAX devices (/sys/bus/dax/devices).

The CXL bus is flat: every object is a symlink in one directory and the hierarchy lives in the
names and the real paths. Ports (rootN, portN, endpointN) share one id space, and decoder X.Y
belongs to the port whose id is X; an endpoint's ``uport`` names its memdev. Those two facts are
enough to tie regions to memdevs without walking the device tree.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtopo.discovery.parts import CxlDecoderInfo, CxlMemdevInfo, CxlRegionInfo, DaxInfo, SysCxl
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.discovery.sysfs_read import AttrReader
from memtopo.hostfs import HostReadError
from memtopo.pci import is_bdf

SOURCE = "sysfs.cxl"

CXL_DEVICES = "sys/bus/cxl/devices"
DAX_DEVICES = "sys/bus/dax/devices"

_PORT_KINDS = (("root", "root"), ("endpoint", "endpoint"), ("port", "switch"))
_DAX_MODES = {"kmem": "system-ram", "device_dax": "devdax"}

_EMPTY = SysCxl((), (), (), ())


@dataclass(frozen=True)
class _RegionPlace:
    """Where a region sits, for attributing pmem DAX devices that reach it only through nvdimm."""

    root: str
    committed: bool
    mode: str
    size: int


def _numbered(name: str, prefix: str) -> int | None:
    rest = name[len(prefix):]
    return int(rest) if name.startswith(prefix) and rest.isdigit() and rest.isascii() else None


def _decoder_ids(name: str) -> tuple[int, int] | None:
    if not name.startswith("decoder"):
        return None
    port, dot, idx = name[7:].partition(".")
    if not dot or not port.isdigit() or not idx.isdigit() or not (port + idx).isascii():
        return None
    return int(port), int(idx)


def probe(ctx: ProbeContext) -> ProbeResult[SysCxl]:
    sb = StatusBuilder(SOURCE)
    if not ctx.sysfs_available:
        sb.unavailable("input is an hwloc XML export")
        return ProbeResult(_EMPTY, sb.finish())
    rd = AttrReader(ctx.fs, sb)
    have_bus = ctx.fs.is_dir(CXL_DEVICES)
    dax_names = rd.listdir(DAX_DEVICES)
    if not have_bus and not dax_names:
        sb.unavailable("no CXL bus")
        return ProbeResult(_EMPTY, sb.finish())
    names = rd.listdir(CXL_DEVICES) if have_bus else []

    # port id → (kind, name); endpoint name → memdev name
    ports: dict[int, tuple[str, str]] = {}
    memdev_names: list[tuple[int, str]] = []
    region_names: list[tuple[int, str]] = []
    decoder_names: list[tuple[tuple[int, int], str]] = []
    for name in names:
        dec = _decoder_ids(name)
        if dec is not None:
            decoder_names.append((dec, name))
            continue
        for prefix, kind in _PORT_KINDS:
            num = _numbered(name, prefix)
            if num is not None:
                ports[num] = (kind, name)
                break
        else:
            if (num := _numbered(name, "mem")) is not None:
                memdev_names.append((num, name))
            elif (num := _numbered(name, "region")) is not None:
                region_names.append((num, name))

    endpoint_memdev: dict[int, str] = {}
    for port_id, (kind, name) in ports.items():
        if kind == "endpoint":
            endpoint_memdev[port_id] = rd.link_name(f"{CXL_DEVICES}/{name}/uport")

    decoders: dict[str, CxlDecoderInfo] = {}
    for (port_id, _), name in sorted(decoder_names):
        kind = ports.get(port_id, ("", ""))[0]
        if kind in ("root", "endpoint"):  # switch decoders add nothing the parts carry
            decoders[name] = _decoder(rd, name, kind)

    memdev_decoders: dict[str, list[CxlDecoderInfo]] = {}
    for (port_id, _), name in sorted(decoder_names):
        if name in decoders and decoders[name].kind == "endpoint":
            memdev = endpoint_memdev.get(port_id, "")
            memdev_decoders.setdefault(memdev, []).append(decoders[name])

    memdevs = tuple(_memdev(rd, name, memdev_decoders.get(name, [])) for _, name in sorted(memdev_names))

    regions: list[CxlRegionInfo] = []
    places: dict[str, _RegionPlace] = {}
    for _, name in sorted(region_names):
        region, place = _region(rd, name, decoders, endpoint_memdev)
        regions.append(region)
        places[name] = place

    roots = tuple(d for d in decoders.values() if d.kind == "root")
    dax = tuple(_dax(rd, name, places) for name in sorted(dax_names, key=_dax_key))
    return ProbeResult(SysCxl(memdevs, tuple(regions), roots, dax), sb.finish())


def _decoder(rd: AttrReader, name: str, kind: str) -> CxlDecoderInfo:
    base = f"{CXL_DEVICES}/{name}"
    entries = set(rd.listdir(base))

    def num(attr: str, base_: int) -> int:
        # start and size are 0400 on recent kernels: unreadable as non-root, reported, not fatal.
        return rd.int_attr(f"{base}/{attr}", base_, 0) if attr in entries else 0

    def text(attr: str) -> str:
        return rd.text(f"{base}/{attr}") if attr in entries else ""

    targets = tuple(t.strip() for t in text("target_list").split(",") if t.strip())
    return CxlDecoderInfo(
        name=name,
        kind=kind,
        start=num("start", 0),
        size=num("size", 0),
        interleave_ways=num("interleave_ways", 10),
        interleave_granularity=num("interleave_granularity", 10),
        targets=targets,
        mode=text("mode"),
        region=text("region"),
        cap_ram=num("cap_ram", 10) == 1,
        cap_pmem=num("cap_pmem", 10) == 1,
    )


def _resolved_parts(rd: AttrReader, rel: str) -> list[str]:
    """Components of the real path of a /sys/bus/cxl link: the hierarchy sysfs flattens away."""
    try:
        return rd.fs.resolve(rel).split("/")
    except HostReadError as exc:
        rd.sb.problem(exc)
        return []


def _memdev(rd: AttrReader, name: str, decoders: list[CxlDecoderInfo]) -> CxlMemdevInfo:
    base = f"{CXL_DEVICES}/{name}"
    entries = set(rd.listdir(base))
    host = host_bridge = ""
    parts = _resolved_parts(rd, base)
    if len(parts) >= 2 and is_bdf(parts[-2]):
        host = parts[-2]
    for part in parts:
        if part.startswith("pci") and is_bdf(part[3:] + ":00.0"):
            host_bridge = part
            break
    return CxlMemdevInfo(
        name=name,
        serial=rd.int_attr(f"{base}/serial", 0, 0) if "serial" in entries else 0,
        ram_size_bytes=rd.int_attr(f"{base}/ram/size", 0, 0) if "ram" in entries else 0,
        pmem_size_bytes=rd.int_attr(f"{base}/pmem/size", 0, 0) if "pmem" in entries else 0,
        host=host,
        host_bridge=host_bridge,
        numa_node=rd.int_attr(f"{base}/numa_node", 10, -1) if "numa_node" in entries else -1,
        firmware_version=rd.text(f"{base}/firmware_version") if "firmware_version" in entries else "",
        decoders=tuple(decoders),
    )


def _region(
    rd: AttrReader, name: str, decoders: dict[str, CxlDecoderInfo], endpoint_memdev: dict[int, str],
) -> tuple[CxlRegionInfo, _RegionPlace]:
    base = f"{CXL_DEVICES}/{name}"
    entries = set(rd.listdir(base))
    targets = tuple(
        rd.text(f"{base}/{entry}")
        for entry in sorted((e for e in entries if _numbered(e, "target") is not None),
                            key=lambda e: int(e[6:]))
    )
    memdevs: list[str] = []
    for target in targets:
        ids = _decoder_ids(target)
        memdev = endpoint_memdev.get(ids[0], "") if ids is not None else ""
        if not memdev:
            rd.sb.problem(f"{base}: target {target!r} has no endpoint memdev")
        memdevs.append(memdev)
    if "mode" in entries:
        mode = rd.text(f"{base}/mode")
    else:
        # Before 6.3 regions had no mode file; the endpoint decoders carry it, and a pmem region
        # always has its pmem_regionN child.
        first = decoders.get(targets[0]) if targets else None
        if first is not None and first.mode:
            mode = first.mode
        elif any(e.startswith("pmem_region") for e in entries):
            mode = "pmem"
        elif any(e.startswith("dax_region") for e in entries):
            mode = "ram"
        else:
            mode = ""
    root_decoder = root = ""
    parts = _resolved_parts(rd, base)
    if len(parts) >= 2 and _decoder_ids(parts[-2]) is not None:
        root_decoder = parts[-2]
    root = next((p for p in parts if _numbered(p, "root") is not None), "")
    size = rd.int_attr(f"{base}/size", 0, 0) if "size" in entries else 0
    committed = "commit" in entries and rd.int_attr(f"{base}/commit", 10, 0) == 1
    region = CxlRegionInfo(
        name=name,
        size_bytes=size,
        # Captures drop resource* files (they can read device registers elsewhere): absent is 0.
        resource=rd.int_attr(f"{base}/resource", 0, 0) if "resource" in entries else 0,
        interleave_ways=rd.int_attr(f"{base}/interleave_ways", 10, 0) if "interleave_ways" in entries else 0,
        interleave_granularity=(
            rd.int_attr(f"{base}/interleave_granularity", 10, 0) if "interleave_granularity" in entries else 0),
        targets=targets,
        memdevs=tuple(memdevs),
        mode=mode,
        committed=committed,
        root_decoder=root_decoder,
    )
    return region, _RegionPlace(root, committed, mode, size)


def _dax_key(name: str) -> tuple[int, int, str]:
    region, dot, idx = name.removeprefix("dax").partition(".")
    if dot and region.isdigit() and idx.isdigit():
        return int(region), int(idx), name
    return 1 << 30, 0, name


def _dax(rd: AttrReader, name: str, places: dict[str, _RegionPlace]) -> DaxInfo:
    base = f"{DAX_DEVICES}/{name}"
    entries = set(rd.listdir(base))
    mode = ""
    if "driver" in entries:
        mode = _DAX_MODES.get(rd.link_name(f"{base}/driver"), "")
    try:
        parts = rd.fs.resolve(base).split("/")
    except HostReadError as exc:
        rd.sb.problem(exc)
        parts = []
    parent_kind, cxl_region = _dax_origin(rd, parts, places)
    if "size" in entries:
        size = rd.int_attr(f"{base}/size", 10, 0)
    else:
        rd.sb.problem(f"{base}/size: missing")
        size = 0
    return DaxInfo(
        name=name,
        # Both are absent on old kernels (numa_node on a 4.x dax device): -1, not a problem.
        target_node=rd.int_attr(f"{base}/target_node", 10, -1) if "target_node" in entries else -1,
        numa_node=rd.int_attr(f"{base}/numa_node", 10, -1) if "numa_node" in entries else -1,
        size_bytes=size,
        mode=mode,
        cxl_region=cxl_region,
        parent_kind=parent_kind,
    )


def _dax_origin(rd: AttrReader, parts: list[str], places: dict[str, _RegionPlace]) -> tuple[str, str]:
    """(parent_kind, cxl region) from the DAX device's real path.

    A ram region's DAX device sits under ``…/decoderX.Y/regionN/dax_regionN/``. A pmem region's
    sits under the CXL nvdimm bridge instead (``…/rootN/nvdimm-bridgeM/ndbusK/regionJ/``), whose
    nd region has its own numbering; it is matched to the committed pmem CXL region under the same
    root, by size when there are several. The memory is CXL either way, so the kind is "cxl".
    """
    for i, part in enumerate(parts):
        if part.startswith("dax_region") and i >= 1 and parts[i - 1] in places:
            return "cxl", parts[i - 1]
    for i, part in enumerate(parts):
        if not part.startswith("nvdimm-bridge"):
            continue
        root = parts[i - 1] if i >= 1 and _numbered(parts[i - 1], "root") is not None else ""
        candidates = [n for n, p in places.items() if p.committed and p.mode == "pmem" and p.root == root]
        if len(candidates) > 1:
            nd_region = next((j for j in range(i + 1, len(parts)) if _numbered(parts[j], "region") is not None),
                             None)
            if nd_region is not None:
                nd_size = rd.int_attr("/".join(parts[: nd_region + 1]) + "/size", 0, -1)
                candidates = [n for n in candidates if places[n].size == nd_size]
        return "cxl", candidates[0] if len(candidates) == 1 else ""
    if any(p.startswith("hmem") for p in parts):
        return "hmem", ""
    if any(_numbered(p, "ndbus") is not None for p in parts):
        return "nvdimm", ""
    return "", ""
