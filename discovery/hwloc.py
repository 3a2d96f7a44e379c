"""hwloc's view of the machine (through pyhwloc): NUMA nodes, memattrs, distances, PCI locality.

Input, in order: an hwloc XML export (``ctx.hwloc_xml``), the live host, or a captured ``/sys`` +
``/proc`` tree loaded through ``HWLOC_FSROOT``.

Extraction reads hwloc's C structures through the ctypes layer (``pyhwloc.hwloc.core``) instead of
pyhwloc's ``Object`` wrappers: every wrapper attribute re-validates the topology and allocates
Python objects, which made a naive walk cost several times hwloc's own load. Objects are read
through ``_ObjView``, a structure laid over ``hwloc_obj`` with only the fields we use and typed for
cheap reads (pointers as plain addresses, the infos array as strings); each level is walked once
through ``next_cousin``, bitmaps go through one ``hwloc_bitmap_list_snprintf`` into a reused buffer
with a parse cache (NUMA and PCI localities repeat), and the memattr and distance arrays are
fetched with a single call each where the capacity is known up front.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache, lru_cache, partial
from typing import Any

from memtopo.discovery import hwloc_input
from memtopo.discovery.parts import (
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
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.hostfs import MAX_TREE_FILE_BYTES, HostFS
from memtopo.model import frozen
from memtopo.text import excerpt

SOURCE = "hwloc"

EMPTY = HwlocPart(
    version="", nodes=(), packages=(), pus=(), cores=0, allowed_cpus=(), allowed_nodes=(),
    distances=(), memattrs=(), pci=(), other_os_devices=(),
)

# hwloc reads its configuration from the process environment when a topology is loaded, so two
# probes loading different roots at once would see each other's variables. A topology loaded
# without plugins is also freed under it (see probe).
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


def _overlay(name: str, fields: list[tuple[str, int, Any]], size: int) -> type[ctypes.Structure]:
    """A structure with ``fields`` (name, offset, ctype) at the given offsets and padding between.

    Reading a pointer field of pyhwloc's structures yields a pointer object (and ``.contents`` one
    more); an overlay that types it ``c_void_p`` yields the plain address, several times cheaper
    for the walks below, which follow thousands of pointers per discovery.
    """
    layout: list[tuple[str, Any]] = []
    pos = 0
    for n, (fname, offset, ctype) in enumerate(sorted(fields, key=lambda f: f[1])):
        if offset < pos:
            raise RuntimeError(f"hwloc {name} layout: {fname} overlaps the previous field")
        if offset > pos:
            layout.append((f"_pad{n}", ctypes.c_char * (offset - pos)))
        layout.append((fname, ctype))
        pos = offset + ctypes.sizeof(ctype)
    if pos < size:
        layout.append(("_tail", ctypes.c_char * (size - pos)))
    view = type(name, (ctypes.Structure,), {"_fields_": layout})
    # Padding is plain bytes, so natural alignment could only move a field, never hide it: check.
    for fname, offset, _ in fields:
        if getattr(view, fname).offset != offset:
            raise RuntimeError(f"hwloc {name} layout: {fname} not at offset {offset}")
    return view


def _obj_view(core: Any, v3: bool) -> type[ctypes.Structure]:
    """``_ObjView``: the hwloc_obj fields the extractor reads, at pyhwloc's own offsets."""
    obj = core.Obj
    vp, cp = ctypes.c_void_p, ctypes.c_char_p
    fields: list[tuple[str, int, Any]] = [
        ("type", obj.type.offset, ctypes.c_int),
        ("subtype", obj.subtype.offset, cp),
        ("os_index", obj.os_index.offset, ctypes.c_uint),
        ("name", obj.name.offset, cp),
        ("attr", obj.attr.offset, vp),
        ("logical_index", obj.logical_index.offset, ctypes.c_uint),
        ("next_cousin", obj.next_cousin.offset, vp),
        ("parent", obj.parent.offset, vp),
        ("cpuset", obj.cpuset.offset, vp),
        ("nodeset", obj.nodeset.offset, vp),
        ("gp_index", obj.gp_index.offset, ctypes.c_uint64),
    ]
    # An info entry is two char pointers (name, value): read the array as a flat list of strings.
    if v3:  # struct hwloc_infos_s embedded in the object
        base = obj.infos.offset
        fields += [("infos_array", base + core.Infos.array.offset, ctypes.POINTER(cp)),
                   ("infos_count", base + core.Infos.count.offset, ctypes.c_uint)]
    else:
        fields += [("infos_array", obj.infos.offset, ctypes.POINTER(cp)),
                   ("infos_count", obj.infos_count.offset, ctypes.c_uint)]
    return _overlay("_ObjView", fields, ctypes.sizeof(obj))


def _distances_view(core: Any) -> type[ctypes.Structure]:
    d = core.Distances
    return _overlay("_DistancesView", [
        ("nbobjs", d.nbobjs.offset, ctypes.c_uint),
        ("objs", d.objs.offset, ctypes.POINTER(ctypes.c_void_p)),
        ("kind", d.kind.offset, ctypes.c_uint64),
        ("values", d.values.offset, ctypes.c_void_p),
    ], ctypes.sizeof(d))


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
        self.pci_raw = ctypes.c_char * ctypes.sizeof(core.PcidevAttr)
        self.obj_view = _obj_view(core, self.v3)
        self.distances_view = _distances_view(core)
        # Our own prototype of the level walk's entry point: pyhwloc's returns a pointer object.
        self.obj_by_depth = self.lib["hwloc_get_obj_by_depth"]
        self.obj_by_depth.restype = ctypes.c_void_p
        self.obj_by_depth.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint)
        self._type_names: dict[int, str] = {}
        self.library_version = ""
        self.plugin_blacklist = ",".join(_discovery_plugins(hwlib._hwloc_lib_name))

    def type_name(self, obj_type: int) -> str:
        name = self._type_names.get(obj_type)
        if name is None:
            raw = self.lib.hwloc_obj_type_string(obj_type)
            name = raw.decode() if raw else str(obj_type)
            self._type_names[obj_type] = name
        return name


def _discovery_plugins(library: str) -> list[str]:
    """The library's discovery plugins by name (hwloc_cuda, hwloc_nvml, hwloc_pci ...), as
    HWLOC_PLUGINS_BLACKLIST takes them; XML parser plugins (hwloc_xml_*) are left out."""
    # pyhwloc points HWLOC_PLUGINS_PATH at its bundled plugins; a system library keeps them beside it.
    paths = os.environ.get("HWLOC_PLUGINS_PATH") or os.path.join(os.path.dirname(library), "hwloc")
    names: set[str] = set()
    for directory in paths.split(":"):
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        names.update(stem for e in entries if (stem := e.removesuffix(".so")) != e
                     and stem.startswith("hwloc_") and not stem.startswith("hwloc_xml_"))
    return sorted(names)


_API: _Api | None = None


def _api() -> _Api:
    global _API
    if _API is None:
        _API = _Api()
    return _API


# ---- loading ------------------------------------------------------------------------------------
@frozen
class _Input:
    kind: str  # xml | live | fsroot
    path: str
    env: Mapping[str, str]

    def describe(self) -> str:
        return self.kind if self.kind == "live" else f"{self.kind} {self.path}"

    @property
    def needs_plugins(self) -> bool:
        """Only a live discovery can use a plugin (NVML's GPUs and NVLink matrix, CUDA's memory
        sizes): an XML export is read by the XML component alone, and a captured root by
        linux,stop. Loading them anyway (dlopen of libcudart, libnvidia-ml, libpciaccess) and
        unloading them was two thirds of hwloc's own load of a small XML (bench/discovery.py)."""
        return self.kind == "live"

    def load_env(self, api: _Api) -> Mapping[str, str]:
        """The environment the load runs under: the input's, and no plugins where none can help
        (a context's own HWLOC_PLUGINS_BLACKLIST still wins)."""
        return self.env if self.needs_plugins else {"HWLOC_PLUGINS_BLACKLIST": api.plugin_blacklist, **self.env}


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


def load_setup(ctx: ProbeContext, default_plugins: bool = False) -> tuple[str, str, Mapping[str, str]]:
    """How the probe has hwloc load ``ctx``: the input's kind (xml, live or fsroot), its path (the
    export, or the root) and the load's environment (for ``environment``), with hwloc's default
    plugins (``default_plugins``) or as the probe loads it: plugins for the live host only. For
    comparing the probe with hwloc's own load of the same input (bench/discovery.py)."""
    src = _input_of(ctx)
    return src.kind, src.path, dict(src.env if default_plugins else src.load_env(_api()))


@contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """hwloc's input environment for one load: variables that could redirect discovery are cleared,
    ``env`` is set, and everything is restored afterwards (hwloc reads them at load time)."""
    keys = set(_REDIRECTING_ENV) | set(env)
    saved = {k: os.environ.get(k) for k in keys}
    try:
        for k in _REDIRECTING_ENV:
            if saved[k] is not None:
                del os.environ[k]
        os.environ.update(env)
        yield
    finally:
        # Each change of os.environ is a putenv(3) or unsetenv(3): only what differs is put back.
        for k, v in saved.items():
            if v is None:
                if k in env:
                    del os.environ[k]
            elif os.environ.get(k) != v:
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


def prepare() -> None:
    """What a process's first load needs, done now: pyhwloc's bindings resolved and the library's
    version read from a one-PU synthetic topology, loaded without plugins and freed at once. A
    process that forks discoveries (discovery/isolated.py) does it once for all its children; no
    topology and no plugin stays loaded. A broken library is left for the probe to report."""
    try:
        api = _api()
    except Exception:  # ImportError, or RuntimeError for a wrong libhwloc API version
        return
    with _LOAD_LOCK, environment({"HWLOC_PLUGINS_BLACKLIST": api.plugin_blacklist}):
        _library_version(api)


def _load(api: _Api, src: _Input) -> tuple[ctypes.c_void_p, str]:
    """Called with _LOAD_LOCK held."""
    if not api.library_version:
        # Outside the input's environment: HWLOC_FSROOT would turn the synthetic load into
        # a Linux discovery of the captured tree.
        with environment({}):
            _library_version(api)
    with environment(src.load_env(api)):
        return _new_topology(api, src.path if src.kind == "xml" else None), api.library_version


# ---- extraction -------------------------------------------------------------------------------
# Bitmaps and infos repeat within a discovery (NUMA and PCI localities) and across discoveries of
# the same host: their parsed forms are immutable and cached by text (bounded for a long-lived agent).
@lru_cache(maxsize=4096)
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


def _pairs_dict(flat: Sequence[bytes | None]) -> dict[str, str]:
    """hwloc infos read as one flat list of strings: name, value, name, value …"""
    out: dict[str, str] = {}
    for i in range(0, len(flat), 2):
        name, value = flat[i], flat[i + 1]
        if name:
            out[name.decode(errors="replace")] = value.decode(errors="replace") if value else ""
    return out


@lru_cache(maxsize=4096)
def _decoded_infos(flat: tuple[bytes | None, ...]) -> tuple[tuple[str, str], ...]:
    return tuple(_pairs_dict(flat).items())


def _view_infos(obj: Any) -> dict[str, str]:
    """An ``_ObjView``'s infos: a new dict each time (callers get their own), decoded once."""
    count = obj.infos_count
    return dict(_decoded_infos(tuple(obj.infos_array[: 2 * count]))) if count else {}


def _topology_infos(api: _Api, hdl: ctypes.c_void_p) -> dict[str, str]:
    if not api.v3:  # hwloc 2 keeps them on the root object
        root = api.core.get_root_obj(hdl).contents
        return _view_infos(api.obj_view.from_address(ctypes.addressof(root)))
    ptr = api.lib.hwloc_topology_get_infos(hdl)
    if not ptr:
        return {}
    infos = ptr.contents
    count = infos.count
    return dict(_decoded_infos(tuple(ctypes.cast(infos.array, _CHAR_PP)[: 2 * count]))) if count else {}


@cache
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


@lru_cache(maxsize=4096)
def _bdf(domain: int, bus: int, dev: int, func: int) -> str:
    """Cached: formatting costs more than the lookup, and the same functions come back each time."""
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"


# A PCI function's locality (cpuset, nodeset of the first non-I/O ancestor) and its bridge path.
_Above = tuple[Ids, Ids, tuple[str, ...]]
_NOWHERE: _Above = ((), (), ())


class _Extractor:
    """Reads one loaded topology. Objects are ``_ObjView`` overlays, valid while it is loaded."""

    def __init__(self, api: _Api, hdl: ctypes.c_void_p, status: StatusBuilder) -> None:
        self.api = api
        self.hdl = hdl
        self.status = status
        self.lib = api.lib
        self.view = api.obj_view
        self._buflen = 1024
        self._buf = ctypes.create_string_buffer(self._buflen)

    # -- helpers
    def ids(self, bitmap: int | None) -> Ids:
        if not bitmap:
            return ()
        n = self.lib.hwloc_bitmap_list_snprintf(self._buf, self._buflen, bitmap)
        if n >= self._buflen:
            self._buflen = n + 1
            self._buf = ctypes.create_string_buffer(self._buflen)
            self.lib.hwloc_bitmap_list_snprintf(self._buf, self._buflen, bitmap)
        return _parse_list(self._buf.value)

    def level(self, depth: int) -> Iterator[Any]:
        """The objects of one level (a real or virtual depth), as ``_ObjView`` overlays."""
        view = self.view
        addr = self.api.obj_by_depth(self.hdl, depth, 0)
        while addr:
            obj = view.from_address(addr)
            yield obj
            addr = obj.next_cousin

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
        api, view = self.api, self.view
        t_package = api.t_package
        has_tier_attr = api.numa_has_tier
        numa_attr_type = api.core.NumanodeAttr
        out: list[HwlocNode] = []
        for obj in self.level(_DEPTH_NUMANODE):
            package: int | None = None
            parent = obj.parent
            while parent:
                p = view.from_address(parent)
                if p.type == t_package:
                    package = p.os_index
                    break
                parent = p.parent
            info = _view_infos(obj)
            numa_attr = numa_attr_type.from_address(obj.attr)
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
        api, lib, hdl, t_numa, view = self.api, self.lib, self.hdl, self.api.t_numa, self.view
        nr = ctypes.c_uint(0)
        lib.hwloc_distances_get(hdl, ctypes.byref(nr), None, 0, 0)
        if not nr.value:
            return (), ()
        arr = (api.distances_ptr * nr.value)()
        if lib.hwloc_distances_get(hdl, ctypes.byref(nr), arr, 0, 0) != 0:
            self.status.problem("hwloc_distances_get failed")
            return (), ()
        out: list[HwlocDistances] = []
        others: list[HwlocObjectDistances] = []
        count = min(nr.value, len(arr))
        try:
            # The same pointers read as plain addresses, for the overlay.
            addresses = (ctypes.c_void_p * len(arr)).from_buffer(arr)
            for i in range(count):
                address = addresses[i]
                if not address:  # hwloc fills every slot up to nr; never seen, but not worth a crash
                    continue
                d = api.distances_view.from_address(address)
                n = d.nbobjs
                objs = [view.from_address(a) for a in d.objs[:n]]
                if not objs:
                    continue
                # One unpack of the n×n uint64 array into a tuple, whose row slices are the rows.
                flat = struct.unpack_from(f"@{n * n}Q", (ctypes.c_char * (8 * n * n)).from_address(d.values))
                name = lib.hwloc_distances_get_name(hdl, arr[i])
                label = name.decode() if name else ""
                matrix = tuple([flat[r * n:(r + 1) * n] for r in range(n)])
                if all(o.type == t_numa for o in objs):
                    out.append(HwlocDistances(name=label, kind=int(d.kind),
                                              nodes=tuple([o.os_index for o in objs]), matrix=matrix))
                else:
                    others.append(HwlocObjectDistances(label, tuple([self._label(o) for o in objs]), matrix))
        finally:
            for i in range(count):
                lib.hwloc_distances_release(hdl, arr[i])
        return tuple(out), tuple(others)

    def _label(self, obj: Any) -> str:
        api = self.api
        obj_type = obj.type
        if obj_type == api.t_osdev:
            name = obj.name
            if name:
                return str(name.decode(errors="replace"))
        if obj_type == api.t_pci:
            domain, bus, dev, func = self._pcidev(obj)[:4]
            return f"{api.type_name(obj_type)}@{_bdf(domain, bus, dev, func)}"
        index = obj.os_index if obj.os_index != _UNKNOWN_INDEX else obj.logical_index
        return f"{api.type_name(obj_type)}#{index}"

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
        name_ref, flags_ref, nr_ref = ctypes.byref(name_p), ctypes.byref(flags), ctypes.byref(nr)

        def attr_name(attr: int) -> str:
            lib.hwloc_memattr_get_name(hdl, attr, name_ref)
            return name_p.value.decode() if name_p.value else str(attr)

        # hwloc has no "number of attributes" call: ids are dense, the first unknown one fails. Most
        # attributes have no value at all (XML exports, hosts without HMAT): the name is read only
        # for those that do.
        while lib.hwloc_memattr_get_flags(hdl, attr_id, flags_ref) == 0:
            current = attr_id
            attr_id += 1
            if current in _DERIVED_MEMATTRS:
                continue
            need_initiator = bool(flags.value & _MEMATTR_NEED_INITIATOR)
            nr.value = tcap
            rc = lib.hwloc_memattr_get_targets(hdl, current, None, 0, nr_ref, targets, tvalues)
            if rc == 0 and nr.value > tcap:
                tcap = nr.value
                targets = (api.obj_ptr * tcap)()
                tvalues = (api.uint64 * tcap)()
                rc = lib.hwloc_memattr_get_targets(hdl, current, None, 0, nr_ref, targets, tvalues)
            if rc != 0:
                self.status.problem(f"hwloc_memattr_get_targets({attr_name(current)}) failed")
                continue
            if not nr.value:
                continue
            name = attr_name(current)
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
        view = self.view
        osdev_attr = self.api.core.OsdevAttr
        by_pci: dict[int, list[HwlocOsDevice]] = {}
        other: list[HwlocOsDevice] = []
        for obj in self.level(_DEPTH_OSDEV):
            name = obj.name
            subtype = obj.subtype
            dev = HwlocOsDevice(
                name=name.decode(errors="replace") if name else "",
                kind=_osdev_kind(int(osdev_attr.from_address(obj.attr).types)),
                subtype=subtype.decode(errors="replace") if subtype else "",
                info=_view_infos(obj),
            )
            parent = obj.parent
            if parent:
                p = view.from_address(parent)
                if p.type == t_pci:
                    by_pci.setdefault(p.gp_index, []).append(dev)
                    continue
            other.append(dev)
        return by_pci, other

    def pci(self, by_pci: Mapping[int, list[HwlocOsDevice]]) -> tuple[HwlocPci, ...]:
        out: list[HwlocPci] = []
        pcidev, above = self._pcidev, self._above
        # Keyed by the parent's address: siblings under one switch share one walk up the tree.
        cache: dict[int, _Above] = {}
        for obj in self.level(_DEPTH_PCI):
            domain, bus, dev, func, prog_if, class_id, vendor, device, subvendor, subdevice, linkspeed = (
                pcidev(obj))
            parent = obj.parent
            cpuset, nodeset, upstream = above(parent, cache) if parent else _NOWHERE
            subtype = obj.subtype
            devices = by_pci.get(obj.gp_index)
            # Positional, in field order: matching a dozen keywords cost more than building the rest.
            out.append(HwlocPci(
                _bdf(domain, bus, dev, func),
                vendor, device, subvendor, subdevice,
                (class_id << 8) | prog_if,
                # The attribute is a C float: round away its binary noise (8.0, 0.25, 15.754).
                round(linkspeed, 4),
                cpuset, nodeset,
                tuple(devices) if devices else (),
                subtype.decode(errors="replace") if subtype else "",
                upstream,
            ))
        return tuple(out)

    def _pcidev(self, obj: Any) -> tuple[Any, ...]:
        """The pcidev attributes; a bridge's upstream PCI side has the same layout at offset 0."""
        api = self.api
        if api.pci_unpack is not None:
            return api.pci_unpack.unpack_from(api.pci_raw.from_address(obj.attr))
        a = api.core.PcidevAttr.from_address(obj.attr)
        return tuple(getattr(a, n) for n in _PCI_FIELDS)

    def _above(self, addr: int, cache: dict[int, _Above]) -> _Above:
        """Locality (cpuset, nodeset of the first non-I/O ancestor) and the bridge path down to the
        object at ``addr``; every I/O object passed on the way up is cached too."""
        found = cache.get(addr)
        if found is not None:
            return found
        io_types, t_bridge, view = self.api.io_types, self.api.t_bridge, self.view
        # I/O ancestors not cached yet, nearest first, with the name of those that are bridges.
        # Only identity matters for path classes (a shared prefix), so a bridge is named by its
        # gp_index: reading every bridge's PCI address cost more than the rest of this.
        pending: list[tuple[int, str | None]] = []
        while True:
            p = view.from_address(addr)
            obj_type = p.type
            if obj_type not in io_types:
                found = (self.ids(p.cpuset), self.ids(p.nodeset), ())
                cache[addr] = found
                break
            pending.append((addr, f"bridge#{p.gp_index}" if obj_type == t_bridge else None))
            addr = p.parent
            if not addr:
                found = _NOWHERE
                break
            found = cache.get(addr)
            if found is not None:
                break
        cpuset, nodeset, upstream = found
        for io_addr, bridge in reversed(pending):
            if bridge is not None:
                upstream = (*upstream, bridge)
                found = (cpuset, nodeset, upstream)
            cache[io_addr] = found
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
    if src.kind == "xml" and (why := _xml_problem(src.path)):
        status.unavailable(f"hwloc XML {src.path}: {why}")
        return ProbeResult(EMPTY, status.finish())
    if src.kind == "fsroot" and not os.path.isdir(src.path):
        status.unavailable(f"hwloc root {src.path}: not a directory")
        return ProbeResult(EMPTY, status.finish())
    if src.kind == "fsroot" and (unsafe := ctx.fs.tree_problems or _input_problems(ctx.fs)):
        # hwloc opens what it finds with plain opens: a link out of the root, a FIFO or a device
        # would be read as the host's file, block it, or never end; and it parses what it reads as
        # only a kernel writes it (discovery/hwloc_input.py). It never sees such a tree.
        status.problem(f"hwloc not run on this root: {'; '.join(unsafe)}")
        return ProbeResult(EMPTY, status.finish())

    with _LOAD_LOCK:
        try:
            hdl, version = _load(api, src)
        except Exception as exc:
            hint = ": malformed or truncated XML" if src.kind == "xml" else ""
            status.unavailable(f"hwloc load failed ({src.describe()}){hint}: {type(exc).__name__}: {exc}")
            return ProbeResult(EMPTY, status.finish())
        free = partial(_destroy, api, hdl)
        if not src.needs_plugins:
            # Plugins load with the process's first topology and stay until its last one is freed:
            # a plugin-free topology still alive when a live load starts would cost that load its
            # GPUs. So it is freed before the lock goes, at once (no plugin to unload).
            return _extract_and_free(api, hdl, version, src, status, free)
    # Not on a thread of its own (measured: it saved nothing, the assembly slowing by what the free
    # cost while both ran), but after the discovery's assembly when there is one: unloading the
    # plugins evicts the assembly's working set.
    return _extract_and_free(api, hdl, version, src, status,
                             partial(ctx.scope.defer, free) if ctx.scope is not None else free)


def _input_problems(fs: HostFS) -> tuple[str, ...]:
    """hwloc_input's check of a captured root, made once per opened root as the tree check is."""
    return fs.once("hwloc_input", lambda: tuple(hwloc_input.problems(fs)))


def _xml_problem(path: str) -> str | None:
    """Why ``path`` cannot be an hwloc XML export, from a look at it before hwloc reads it whole:
    hwloc answers anything else only with EINVAL, and would block on a FIFO or read a device forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        return "no such file" if exc.errno == errno.ENOENT else (exc.strerror or type(exc).__name__)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size > MAX_TREE_FILE_BYTES:
            return f"larger than {MAX_TREE_FILE_BYTES} bytes ({st.st_size})"
        head = os.read(fd, 4096)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    finally:
        os.close(fd)
    if b"<topology" not in head:
        return f"not an hwloc XML export (it starts {excerpt(head.lstrip()[:60])})"
    return None


def _extract_and_free(api: _Api, hdl: ctypes.c_void_p, version: str, src: _Input, status: StatusBuilder,
                      release: Callable[[], None]) -> ProbeResult[HwlocPart]:
    try:
        part = _extract(api, hdl, version, status)
    except Exception as exc:
        status.unavailable(f"hwloc extraction failed ({src.describe()}): {type(exc).__name__}: {exc}")
        return ProbeResult(EMPTY, status.finish())
    finally:
        release()
    return ProbeResult(part, status.finish())
