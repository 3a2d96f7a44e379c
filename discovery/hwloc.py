"""hwloc's view of the machine (through pyhwloc): NUMA nodes, memattrs, distances, PCI locality.

Input, in order: an hwloc XML export (``ctx.hwloc_xml``), the live host, or a captured ``/sys`` +
``/proc`` tree loaded through ``HWLOC_FSROOT``.

Extraction reads hwloc's C structures through the ctypes layer (``pyhwloc.hwloc.core``) instead of
pyhwloc's ``Object`` wrappers: every wrapper attribute re-validates the topology and allocates
Python objects, which made a naive walk cost several times hwloc's own load. Each level is walked
once through ``next_cousin``, bitmaps go through one ``hwloc_bitmap_list_snprintf`` into a reused
buffer with a parse cache (NUMA and PCI localities repeat), and the memattr and distance arrays are
fetched with a single call each where the capacity is known up front.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from discovery.parts import (
    HwlocDistances,
    HwlocMemattrValue,
    HwlocNode,
    HwlocObjectDistances,
    HwlocOsDevice,
    HwlocPackage,
    HwlocPart,
    HwlocPci,
    Ids,
)
from discovery.source import ProbeContext, ProbeResult, StatusBuilder

SOURCE = "hwloc"

EMPTY = HwlocPart(
    version="", nodes=(), packages=(), pus=(), cores=0, allowed_cpus=(), allowed_nodes=(),
    distances=(), memattrs=(), pci=(), other_os_devices=(),
)

# hwloc reads its configuration from the process environment when a topology is loaded, so two
# probes loading different roots at once would see each other's variables.
_LOAD_LOCK = threading.Lock()

# Variables that would silently redirect discovery away from the input we were asked to read.
_REDIRECTING_ENV = ("HWLOC_FSROOT", "HWLOC_COMPONENTS", "HWLOC_XMLFILE", "HWLOC_SYNTHETIC")

# Capacity and Locality are derived by hwloc for every node from local_memory and the cpuset;
# they carry nothing the node list does not already hold.
_DERIVED_MEMATTRS = frozenset({0, 1})

# hwloc_obj_osdev_type_e bits, in the order that decides the one kind we report: a CUDA or NVML
# device is GPU|COPROC, a pmem/CXL memory device is MEMORY|STORAGE.
_OSDEV_KINDS = (
    (1 << 2, "gpu"),
    (1 << 3, "coproc"),
    (1 << 5, "openfabrics"),
    (1 << 4, "network"),
    (1 << 1, "memory"),
    (1 << 0, "storage"),
    (1 << 6, "dma"),
)

# Special depths of hwloc's virtual levels (hwloc_get_type_depth_e).
_DEPTH_NUMANODE = -3
_DEPTH_PCI = -5
_DEPTH_OSDEV = -6

_LOCATION_CPUSET = 1
_UNKNOWN_INDEX = 0xFFFFFFFF
_MEMATTR_NEED_INITIATOR = 1 << 2
_INCLUDE_DISALLOWED = 1 << 0
_FILTER_KEEP_ALL = 0


_PCI_FIELDS = ("domain", "bus", "dev", "func", "prog_if", "class_id", "vendor_id", "device_id",
               "subvendor_id", "subdevice_id", "linkspeed")


def _unpacker(ctype: Any, names: tuple[str, ...]) -> struct.Struct | None:
    """A ``struct`` layout reading ``names`` out of ``ctype`` in one call, or None if it can't.

    Reading a ctypes structure field by field costs a descriptor call and an object per field;
    one unpack of the raw bytes is several times cheaper for the per-PCI-device attributes.
    """
    try:
        fmt, pos = "@", 0
        for name in names:
            field = getattr(ctype, name)
            code = dict(ctype._fields_)[name]._type_
            if field.offset < pos or not isinstance(code, str) or len(code) != 1:
                return None
            fmt += "x" * (field.offset - pos) + code
            pos = field.offset + field.size
        layout = struct.Struct(fmt)
    except (AttributeError, KeyError, TypeError, struct.error):
        return None
    return layout if layout.size == pos <= ctypes.sizeof(ctype) else None


class _Api:
    """The pieces of pyhwloc's ctypes layer we use, resolved once per process."""

    def __init__(self) -> None:
        # pyhwloc raises RuntimeError (not ImportError) when the library's API version is wrong.
        from pyhwloc.hwloc import core
        from pyhwloc.hwloc import lib as hwlib

        self.core: Any = core
        self.lib: Any = hwlib._LIB
        self.pylib: Any = hwlib._pyhwloc_lib
        self.v3 = bool(hwlib._IS_V3)
        obj_type = core.ObjType
        self.t_package = int(obj_type.PACKAGE)
        self.t_core = int(obj_type.CORE)
        self.t_numa = int(obj_type.NUMANODE)
        self.t_bridge = int(obj_type.BRIDGE)
        self.t_pci = int(obj_type.PCI_DEVICE)
        self.t_osdev = int(obj_type.OS_DEVICE)
        self.io_types = frozenset({self.t_bridge, self.t_pci, self.t_osdev})
        self.numa_has_tier = any(name == "memory_tier" for name, *_ in core.NumanodeAttr._fields_)
        self.location_array = core.Location
        self.uint64 = core.hwloc_uint64_t
        self.obj_ptr = core.obj_t
        self.distances_ptr = ctypes.POINTER(core.Distances)
        self.pci_unpack = _unpacker(core.PcidevAttr, _PCI_FIELDS)
        self._type_names: dict[int, str] = {}
        self.library_version = ""

    def type_name(self, obj_type: int) -> str:
        name = self._type_names.get(obj_type)
        if name is None:
            raw = self.lib.hwloc_obj_type_string(obj_type)
            name = raw.decode() if raw else str(obj_type)
            self._type_names[obj_type] = name
        return name


_API: _Api | None = None


def _api() -> _Api:
    global _API
    if _API is None:
        _API = _Api()
    return _API


# ---- loading ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Input:
    kind: str  # xml | live | fsroot
    path: str
    env: Mapping[str, str]

    def describe(self) -> str:
        return self.kind if self.kind == "live" else f"{self.kind} {self.path}"


def _input_of(ctx: ProbeContext) -> _Input:
    if ctx.hwloc_xml is not None:
        # The bundled library ignores <memtier> elements; a refresh rebuilds tiers from the
        # subtypes and memattrs the XML does carry.
        env = {"HWLOC_MEMTIERS_REFRESH": "1", **ctx.hwloc_env}
        return _Input("xml", str(ctx.hwloc_xml), env)
    if ctx.fs.is_live:
        return _Input("live", "/", dict(ctx.hwloc_env))
    # linux,stop keeps the x86/pci backends from mixing this host's data into the captured tree.
    env = {"HWLOC_FSROOT": str(ctx.fs.root), "HWLOC_COMPONENTS": "linux,stop", **ctx.hwloc_env}
    return _Input("fsroot", str(ctx.fs.root), env)


@contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """hwloc's input environment for one load: variables that could redirect discovery are cleared,
    ``env`` is set, and everything is restored afterwards (hwloc reads them at load time)."""
    keys = set(_REDIRECTING_ENV) | set(env)
    saved = {k: os.environ.get(k) for k in keys}
    try:
        for k in _REDIRECTING_ENV:
            os.environ.pop(k, None)
        os.environ.update(env)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _destroy(api: _Api, hdl: ctypes.c_void_p) -> None:
    if hdl:
        api.core.topology_destroy(hdl)


def _new_topology(api: _Api, xml: str | None) -> ctypes.c_void_p:
    hdl = ctypes.c_void_p(0)
    api.core.topology_init(hdl)
    try:
        if xml is not None:
            api.core.topology_set_xml(hdl, xml)
        api.core.topology_set_flags(hdl, _INCLUDE_DISALLOWED)
        api.core.topology_set_io_types_filter(hdl, _FILTER_KEEP_ALL)
        api.core.topology_load(hdl)
    except BaseException:
        _destroy(api, hdl)
        raise
    return hdl


def _library_version(api: _Api) -> str:
    """The bundled library's own version string (an XML's hwlocVersion is its exporter's)."""
    if not api.library_version:
        hdl = ctypes.c_void_p(0)
        api.core.topology_init(hdl)
        try:
            api.core.topology_set_synthetic(hdl, "pu:1")
            api.core.topology_load(hdl)
            infos = _topology_infos(api, hdl)
        finally:
            _destroy(api, hdl)
        major, minor, rev = api.core.get_api_version()
        api.library_version = infos.get("hwlocVersion") or f"{major}.{minor}.{rev}"
    return api.library_version


def _load(api: _Api, src: _Input) -> tuple[ctypes.c_void_p, str]:
    with _LOAD_LOCK:
        if not api.library_version:
            # Outside the input's environment: HWLOC_FSROOT would turn the synthetic load into
            # a Linux discovery of the captured tree.
            with environment({}):
                _library_version(api)
        with environment(src.env):
            return _new_topology(api, src.path if src.kind == "xml" else None), api.library_version


# ---- extraction -------------------------------------------------------------------------------
def _parse_list(text: bytes) -> Ids:
    """hwloc's list format ("0-3,8,10-"): a trailing open range means "and everything above"."""
    if not text:
        return ()
    out: list[int] = []
    for chunk in text.split(b","):
        lo, dash, hi = chunk.partition(b"-")
        if dash and hi:
            out.extend(range(int(lo), int(hi) + 1))
        else:
            # An infinite set only happens for a full allowed set; its first id is what matters.
            out.append(int(lo))
    return tuple(out)


_CHAR_PP = ctypes.POINTER(ctypes.c_char_p)


def _infos_dict(infos: Any) -> dict[str, str]:
    count = infos.count
    if not count:
        return {}
    # hwloc_info_s is two char pointers: read the whole array as one flat slice of strings
    # instead of building a ctypes structure per entry.
    flat = ctypes.cast(infos.array, _CHAR_PP)[: 2 * count]
    out: dict[str, str] = {}
    for i in range(0, 2 * count, 2):
        name, value = flat[i], flat[i + 1]
        if name:
            out[name.decode(errors="replace")] = value.decode(errors="replace") if value else ""
    return out


def _topology_infos(api: _Api, hdl: ctypes.c_void_p) -> dict[str, str]:
    if not api.v3:
        root = api.core.get_root_obj(hdl).contents
        return _infos_dict_v2(root)
    ptr = api.lib.hwloc_topology_get_infos(hdl)
    return _infos_dict(ptr.contents) if ptr else {}


def _infos_dict_v2(obj: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for i in range(obj.infos_count):
        item = obj.infos[i]
        if item.name:
            out[item.name.decode(errors="replace")] = item.value.decode(errors="replace") if item.value else ""
    return out


def _osdev_kind(types: int) -> str:
    for bit, kind in _OSDEV_KINDS:
        if types & bit:
            return kind
    return "other"


def _tier(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


class _Extractor:
    def __init__(self, api: _Api, hdl: ctypes.c_void_p, status: StatusBuilder) -> None:
        self.api = api
        self.hdl = hdl
        self.status = status
        self.lib = api.lib
        self._buflen = 1024
        self._buf = ctypes.create_string_buffer(self._buflen)
        self._sets: dict[bytes, Ids] = {}

    # -- helpers
    def ids(self, bitmap: int | None) -> Ids:
        if not bitmap:
            return ()
        n = self.lib.hwloc_bitmap_list_snprintf(self._buf, self._buflen, bitmap)
        if n >= self._buflen:
            self._buflen = n + 1
            self._buf = ctypes.create_string_buffer(self._buflen)
            self.lib.hwloc_bitmap_list_snprintf(self._buf, self._buflen, bitmap)
        key = self._buf.value
        cached = self._sets.get(key)
        if cached is None:
            cached = _parse_list(key)
            self._sets[key] = cached
        return cached

    def info(self, obj: Any) -> dict[str, str]:
        return _infos_dict(obj.infos) if self.api.v3 else _infos_dict_v2(obj)

    def level(self, depth: int) -> Iterator[Any]:
        """The objects of one level (a real or virtual depth), as ``Obj`` structures."""
        ptr = self.lib.hwloc_get_obj_by_depth(self.hdl, depth, 0)
        while ptr:
            obj = ptr.contents
            yield obj
            ptr = obj.next_cousin

    def level_of_type(self, obj_type: int) -> Iterator[Any]:
        depth = self.lib.hwloc_get_type_depth(self.hdl, obj_type)
        if depth >= 0:
            yield from self.level(depth)
        elif depth == -2:  # HWLOC_TYPE_DEPTH_MULTIPLE (Groups, caches): walk each depth.
            for d in range(self.lib.hwloc_topology_get_depth(self.hdl)):
                if self.lib.hwloc_get_depth_type(self.hdl, d) == obj_type:
                    yield from self.level(d)

    # -- sections
    def nodes(self) -> tuple[HwlocNode, ...]:
        api = self.api
        t_package = api.t_package
        has_tier_attr = api.numa_has_tier
        out: list[HwlocNode] = []
        for obj in self.level(_DEPTH_NUMANODE):
            package: int | None = None
            parent = obj.parent
            while parent:
                p = parent.contents
                if p.type == t_package:
                    package = p.os_index
                    break
                parent = p.parent
            info = self.info(obj)
            numa_attr = obj.attr.contents.numanode
            tier = _tier(info.get("MemoryTier"))
            if tier is None and has_tier_attr:
                raw = int(numa_attr.memory_tier)
                tier = None if raw < 0 or raw == 0xFFFFFFFF else raw
            subtype = obj.subtype
            out.append(HwlocNode(
                os_index=obj.os_index,
                subtype=subtype.decode() if subtype else "",
                local_memory=int(numa_attr.local_memory),
                cpuset=self.ids(obj.cpuset),
                memory_tier=tier,
                package=package,
                info=info,
            ))
        return tuple(out)

    def packages(self) -> tuple[HwlocPackage, ...]:
        return tuple(HwlocPackage(o.os_index, self.ids(o.cpuset))
                     for o in self.level_of_type(self.api.t_package))

    def distances(self) -> tuple[tuple[HwlocDistances, ...], tuple[HwlocObjectDistances, ...]]:
        """NUMA matrices, and the others (NVLinkBandwidth …) with their objects labelled."""
        lib, hdl, t_numa = self.lib, self.hdl, self.api.t_numa
        nr = ctypes.c_uint(0)
        lib.hwloc_distances_get(hdl, ctypes.byref(nr), None, 0, 0)
        if not nr.value:
            return (), ()
        arr = (self.api.distances_ptr * nr.value)()
        if lib.hwloc_distances_get(hdl, ctypes.byref(nr), arr, 0, 0) != 0:
            self.status.problem("hwloc_distances_get failed")
            return (), ()
        out: list[HwlocDistances] = []
        others: list[HwlocObjectDistances] = []
        try:
            for i in range(min(nr.value, len(arr))):
                d = arr[i].contents
                n = d.nbobjs
                objs = [d.objs[j].contents for j in range(n)]
                if not objs:
                    continue
                flat = d.values[: n * n]
                name = lib.hwloc_distances_get_name(hdl, arr[i])
                label = name.decode() if name else ""
                matrix = tuple(tuple(flat[r * n:(r + 1) * n]) for r in range(n))
                if all(o.type == t_numa for o in objs):
                    out.append(HwlocDistances(name=label, kind=int(d.kind),
                                              nodes=tuple(o.os_index for o in objs), matrix=matrix))
                else:
                    others.append(HwlocObjectDistances(label, tuple(self._label(o) for o in objs), matrix))
        finally:
            for i in range(min(nr.value, len(arr))):
                lib.hwloc_distances_release(hdl, arr[i])
        return tuple(out), tuple(others)

    def _label(self, obj: Any) -> str:
        api = self.api
        if obj.type == api.t_osdev and obj.name:
            return str(obj.name.decode(errors="replace"))
        if obj.type == api.t_pci:
            domain, bus, dev, func = self._pcidev(obj, api.pci_unpack)[:4]
            return f"{api.type_name(obj.type)}@{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"
        index = obj.os_index if obj.os_index != _UNKNOWN_INDEX else obj.logical_index
        return f"{api.type_name(obj.type)}#{index}"

    def memattrs(self, n_nodes: int) -> tuple[HwlocMemattrValue, ...]:
        api, lib, hdl = self.api, self.lib, self.hdl
        if not n_nodes:
            return ()
        name_p = ctypes.c_char_p()
        flags = ctypes.c_ulong(0)
        nr = ctypes.c_uint(0)
        t_numa = api.t_numa
        tcap = n_nodes
        targets = (api.obj_ptr * tcap)()
        tvalues = (api.uint64 * tcap)()
        cap = 16
        locs = (api.location_array * cap)()
        lvalues = (api.uint64 * cap)()
        out: list[HwlocMemattrValue] = []
        attr_id = 0
        # hwloc has no "number of attributes" call: ids are dense, the first unknown one fails.
        while lib.hwloc_memattr_get_name(hdl, attr_id, ctypes.byref(name_p)) == 0:
            current = attr_id
            attr_id += 1
            if current in _DERIVED_MEMATTRS:
                continue
            name = name_p.value.decode() if name_p.value else str(current)
            lib.hwloc_memattr_get_flags(hdl, current, ctypes.byref(flags))
            need_initiator = bool(flags.value & _MEMATTR_NEED_INITIATOR)
            nr.value = tcap
            rc = lib.hwloc_memattr_get_targets(hdl, current, None, 0, ctypes.byref(nr), targets, tvalues)
            if rc == 0 and nr.value > tcap:
                tcap = nr.value
                targets = (api.obj_ptr * tcap)()
                tvalues = (api.uint64 * tcap)()
                rc = lib.hwloc_memattr_get_targets(hdl, current, None, 0, ctypes.byref(nr), targets, tvalues)
            if rc != 0:
                self.status.problem(f"hwloc_memattr_get_targets({name}) failed")
                continue
            for t in range(min(nr.value, tcap)):
                target_ptr = targets[t]
                target_obj = target_ptr.contents
                # Custom attributes may also target PUs or Groups; the contract is per NUMA node.
                if target_obj.type != t_numa:
                    continue
                target = target_obj.os_index
                if not need_initiator:
                    out.append(HwlocMemattrValue(name, target, int(tvalues[t])))
                    continue
                nr_locs = ctypes.c_uint(cap)
                rc = lib.hwloc_memattr_get_initiators(
                    hdl, current, target_ptr, 0, ctypes.byref(nr_locs), locs, lvalues)
                if rc == 0 and nr_locs.value > cap:
                    cap = nr_locs.value
                    locs = (api.location_array * cap)()
                    lvalues = (api.uint64 * cap)()
                    nr_locs.value = cap
                    rc = lib.hwloc_memattr_get_initiators(
                        hdl, current, target_ptr, 0, ctypes.byref(nr_locs), locs, lvalues)
                if rc != 0:
                    # EINVAL means "no value for this node" (see hwloc memattrs.c), not an error.
                    continue
                for k in range(min(nr_locs.value, cap)):
                    loc = locs[k]
                    if loc.type == _LOCATION_CPUSET:
                        out.append(HwlocMemattrValue(name, target, int(lvalues[k]),
                                                     initiator_cpus=self.ids(loc.location.cpuset)))
                    else:
                        ini = loc.location.object.contents
                        # Groups have no OS index; hwloc's tools then name them by logical index.
                        index = ini.os_index if ini.os_index != _UNKNOWN_INDEX else ini.logical_index
                        label = f"{api.type_name(ini.type)}#{index}"
                        out.append(HwlocMemattrValue(name, target, int(lvalues[k]), initiator_object=label))
        return tuple(out)

    def os_devices(self) -> tuple[dict[int, list[HwlocOsDevice]], list[HwlocOsDevice]]:
        """OS devices grouped by the gp_index of their PCI parent, and the ones with no PCI parent."""
        t_pci = self.api.t_pci
        by_pci: dict[int, list[HwlocOsDevice]] = {}
        other: list[HwlocOsDevice] = []
        for obj in self.level(_DEPTH_OSDEV):
            name = obj.name
            subtype = obj.subtype
            dev = HwlocOsDevice(
                name=name.decode(errors="replace") if name else "",
                kind=_osdev_kind(int(obj.attr.contents.osdev.types)),
                subtype=subtype.decode(errors="replace") if subtype else "",
                info=self.info(obj),
            )
            parent = obj.parent
            if parent:
                p = parent.contents
                if p.type == t_pci:
                    by_pci.setdefault(p.gp_index, []).append(dev)
                    continue
            other.append(dev)
        return by_pci, other

    def pci(self, by_pci: Mapping[int, list[HwlocOsDevice]]) -> tuple[HwlocPci, ...]:
        out: list[HwlocPci] = []
        unpack = self.api.pci_unpack
        # Keyed by the parent's gp_index: siblings under one switch share one walk up the tree.
        above: dict[int, tuple[Ids, Ids, tuple[str, ...]]] = {}
        for obj in self.level(_DEPTH_PCI):
            domain, bus, dev, func, prog_if, class_id, vendor, device, subvendor, subdevice, linkspeed = (
                self._pcidev(obj, unpack))
            parent = obj.parent
            cpuset, nodeset, upstream = self._above(parent.contents, above) if parent else ((), (), ())
            subtype = obj.subtype
            out.append(HwlocPci(
                bdf=f"{domain:04x}:{bus:02x}:{dev:02x}.{func:x}",
                vendor_id=vendor,
                device_id=device,
                subsystem_vendor_id=subvendor,
                subsystem_device_id=subdevice,
                class_code=(class_id << 8) | prog_if,
                # The attribute is a C float: round away its binary noise (8.0, 0.25, 15.754).
                link_speed_gbps=round(float(linkspeed), 4),
                cpuset=cpuset,
                nodeset=nodeset,
                os_devices=tuple(by_pci.get(obj.gp_index, ())),
                subtype=subtype.decode(errors="replace") if subtype else "",
                upstream=upstream,
            ))
        return tuple(out)

    @staticmethod
    def _pcidev(obj: Any, unpack: struct.Struct | None) -> tuple[Any, ...]:
        """The pcidev attributes; a bridge's upstream PCI side has the same layout at offset 0."""
        if unpack is not None:
            return unpack.unpack_from(bytes(obj.attr.contents))
        a = obj.attr.contents.pcidev
        return tuple(getattr(a, n) for n in _PCI_FIELDS)

    def _above(self, p: Any, cache: dict[int, tuple[Ids, Ids, tuple[str, ...]]]
               ) -> tuple[Ids, Ids, tuple[str, ...]]:
        """Locality (cpuset, nodeset of the first non-I/O ancestor) and the bridge path down to here."""
        key = p.gp_index
        found = cache.get(key)
        if found is not None:
            return found
        if p.type not in self.api.io_types:
            found = (self.ids(p.cpuset), self.ids(p.nodeset), ())
        else:
            grand = p.parent
            cpuset, nodeset, upstream = self._above(grand.contents, cache) if grand else ((), (), ())
            if p.type == self.api.t_bridge:
                # Only identity matters for path classes (a shared prefix), so a bridge is named by
                # its gp_index: reading every bridge's PCI address cost more than the rest of this.
                upstream = (*upstream, f"bridge#{p.gp_index}")
            found = (cpuset, nodeset, upstream)
        cache[key] = found
        return found


def _extract(api: _Api, hdl: ctypes.c_void_p, version: str, status: StatusBuilder) -> HwlocPart:
    ex = _Extractor(api, hdl, status)
    lib = api.lib
    nodes = ex.nodes()
    info = _topology_infos(api, hdl)

    def section[T](what: str, fn: Callable[[], T], empty: T) -> T:
        try:
            return fn()
        except Exception as exc:  # one unreadable section must not cost the others
            status.problem(f"hwloc {what}: {type(exc).__name__}: {exc}")
            return empty

    no_devices: tuple[dict[int, list[HwlocOsDevice]], list[HwlocOsDevice]] = ({}, [])
    no_distances: tuple[tuple[HwlocDistances, ...], tuple[HwlocObjectDistances, ...]] = ((), ())
    no_memattrs: tuple[HwlocMemattrValue, ...] = ()
    no_pci: tuple[HwlocPci, ...] = ()
    distances, object_distances = section("distances", ex.distances, no_distances)
    memattrs = section("memattrs", lambda: ex.memattrs(len(nodes)), no_memattrs)
    by_pci, other = section("os devices", ex.os_devices, no_devices)
    pci = section("pci", lambda: ex.pci(by_pci), no_pci)

    tiers_nr = _tier(info.get("MemoryTiersNr"))
    if tiers_nr is None:
        tiers_nr = len({n.memory_tier for n in nodes if n.memory_tier is not None})
    return HwlocPart(
        version=version,
        nodes=nodes,
        packages=ex.packages(),
        pus=ex.ids(lib.hwloc_topology_get_topology_cpuset(hdl)),
        cores=max(0, int(api.pylib.pyhwloc_get_nbobjs_by_type(hdl, api.t_core))),
        allowed_cpus=ex.ids(lib.hwloc_topology_get_allowed_cpuset(hdl)),
        allowed_nodes=ex.ids(lib.hwloc_topology_get_allowed_nodeset(hdl)),
        distances=distances,
        memattrs=memattrs,
        pci=pci,
        other_os_devices=tuple(other),
        memory_tiers_nr=tiers_nr,
        info=info,
        object_distances=object_distances,
    )


def probe(ctx: ProbeContext) -> ProbeResult[HwlocPart]:
    status = StatusBuilder(SOURCE)
    src = _input_of(ctx)
    try:
        api = _api()
    except Exception as exc:  # ImportError, or RuntimeError for a wrong libhwloc API version
        status.unavailable(f"pyhwloc unavailable: {type(exc).__name__}: {exc}")
        return ProbeResult(EMPTY, status.finish())

    # hwloc reports a missing root or file only as EINVAL (after printing to stderr): say which.
    if src.kind == "xml" and not os.path.isfile(src.path):
        status.unavailable(f"hwloc XML {src.path}: no such file")
        return ProbeResult(EMPTY, status.finish())
    if src.kind == "fsroot" and not os.path.isdir(src.path):
        status.unavailable(f"hwloc root {src.path}: not a directory")
        return ProbeResult(EMPTY, status.finish())

    try:
        hdl, version = _load(api, src)
    except Exception as exc:
        status.unavailable(f"hwloc load failed ({src.describe()}): {type(exc).__name__}: {exc}")
        return ProbeResult(EMPTY, status.finish())
    try:
        part = _extract(api, hdl, version, status)
    except Exception as exc:
        status.unavailable(f"hwloc extraction failed ({src.describe()}): {type(exc).__name__}: {exc}")
        return ProbeResult(EMPTY, status.finish())
    finally:
        _destroy(api, hdl)
    return ProbeResult(part, status.finish())
