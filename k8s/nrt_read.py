"""A NodeResourceTopology object (``topology.node.k8s.io/v1alpha2``) as a compact, immutable read model.

The objects come from memtopo's publisher (``k8s/nrt.py``) or from another one (NFD's topology-updater,
``k8stopologyawareschedwg/resource-topology-exporter``); :func:`read_nrt` takes the JSON the API server
returns and gives a :class:`NodeTopology` or raises :class:`NrtReadError`, never anything else.

What is read, and how:

- **Topology Manager policy and scope**: the defaults are the kubelet's (``none``, ``container``); the
  deprecated ``topologyPolicies`` field (its first entry: ``SingleNUMANodePodLevel`` …) sets both; the
  ``topologyManagerPolicy``/``topologyManagerScope`` attributes then win, each on its own (the order
  scheduler-plugins' ``nodeconfig.TopologyManagerFromNodeResourceTopology`` applies). A value the kubelet
  does not know is an error here, where scheduler-plugins silently keeps the default: a node whose policy
  cannot be read cannot be judged. ``topologyManagerMaxNUMANodes`` (scored by LeastNUMANodes) defaults to
  8; an invalid value is ignored and a value over 1024 is capped, as upstream does.
- **CPU and memory manager policies**: memtopo's ``memtopo.io/cpu-manager-policy`` and
  ``memtopo.io/memory-manager-policy`` attributes carry the KubeletConfiguration values (``none``/
  ``static``, ``None``/``Static``). Another publisher does not write them: then ``static``/``Static`` is
  assumed where the Topology Manager policy is not ``none`` (a node set up for alignment has them), and
  ``none``/``None`` where it is.
- **Zones**: those of type ``Node``; the others are skipped. A Node zone's NUMA id comes from its name as
  ``numanode.NameToID`` parses it (``node-`` then Go's ``strconv.Atoi``: ``node-0``, ``node-07``,
  ``node-+3``); any other name (``socket-0``, ``Node-1``) is an error, and so is an id above 1023 (Linux
  has no such NUMA node) or a repeated id. Zones keep the object's order (LeastNUMANodes breaks ties in
  that order, as upstream does).
- **Resources**: every ``capacity``, ``allocatable`` and ``available`` is required and must be a whole,
  non-negative quantity below 2⁶³ (CPUs, bytes and devices are all counted in whole units): ``1.5``,
  ``lots``, ``-1``, ``1e30`` are errors. A resource named twice in a zone is an error.
- **Costs**: the zone's distances (the SLIT row) by NUMA id; entries whose name is not a NUMA zone name
  are skipped, as scheduler-plugins' ``extractCosts`` does.
- **memtopo's zone attributes**: memory type, kernel tier, local read/write bandwidth (MB/s) and latency
  (ns), CPU-less, and the accelerator groups with a device in the zone (``memtopo.io/hccs-ring``,
  ``memtopo.io/xpu-numa-half``: groups separated by ``;``, members by ``,``); other attributes are not
  kept.
- **The pods fingerprint**: ``nodeTopologyPodsFingerprint`` and how its publisher chose the pods it
  counts (``nodeTopologyPodsFingerprintMethod``; ``all`` when absent, as scheduler-plugins reads it).

Bounds, so a hostile or broken object costs bounded work and memory: at most :data:`MAX_ZONES` zones
(any type), :data:`MAX_ENTRIES` resources, costs or attributes in one list, names and values of at most
:data:`MAX_TEXT` characters. Beyond them the object is an error naming the list; nothing past the bound is
read. Names repeated across objects (``cpu``, ``node-0``) are interned, so 10,000 objects share them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple, NoReturn

from memtopo.k8s.quantity import QuantityError, parse_nonnegative
from memtopo.text import excerpt

# A node of this many NUMA zones does not exist (the largest have a few dozen); 256 keeps reading cheap.
MAX_ZONES: Final = 256
MAX_ENTRIES: Final = 256
MAX_TEXT: Final = 512
# Linux's MAX_NUMNODES is at most 1 << 10.
MAX_NUMA_ID: Final = 1023
# The kubelet's topology manager holds NUMA affinity in a 64-bit mask (bitmask.go), and
# scheduler-plugins drops zones beyond it: only zones below this id can be aligned to.
ALIGNABLE_IDS: Final = 64

ZONE_TYPE: Final = "Node"
POLICIES: Final = ("none", "best-effort", "restricted", "single-numa-node")
SCOPES: Final = ("container", "pod")
CPU_MANAGER_POLICIES: Final = ("none", "static")
MEMORY_MANAGER_POLICIES: Final = ("None", "Static")
DEFAULT_MAX_NUMA_NODES: Final = 8
LIMIT_MAX_NUMA_NODES: Final = 1024

ATTR_POLICY: Final = "topologyManagerPolicy"
ATTR_SCOPE: Final = "topologyManagerScope"
ATTR_MAX_NUMA_NODES: Final = "topologyManagerMaxNUMANodes"
ATTR_PODS_FINGERPRINT: Final = "nodeTopologyPodsFingerprint"
ATTR_PODS_FINGERPRINT_METHOD: Final = "nodeTopologyPodsFingerprintMethod"
ATTR_HCCS_RING: Final = "memtopo.io/hccs-ring"
ATTR_XPU_HALF: Final = "memtopo.io/xpu-numa-half"
ATTR_CPU_MANAGER: Final = "memtopo.io/cpu-manager-policy"
ATTR_MEMORY_MANAGER: Final = "memtopo.io/memory-manager-policy"

# The deprecated ``topologyPolicies`` values (noderesourcetopology-api's TopologyManagerPolicy): the
# policy and scope each stands for. The plain ones name no scope; the kubelet's default is container.
LEGACY_POLICIES: Final[Mapping[str, tuple[str, str]]] = {
    "SingleNUMANodeContainerLevel": ("single-numa-node", "container"),
    "SingleNUMANodePodLevel": ("single-numa-node", "pod"),
    "RestrictedContainerLevel": ("restricted", "container"),
    "RestrictedPodLevel": ("restricted", "pod"),
    "BestEffortContainerLevel": ("best-effort", "container"),
    "BestEffortPodLevel": ("best-effort", "pod"),
    "Restricted": ("restricted", "container"),
    "BestEffort": ("best-effort", "container"),
    "None": ("none", "container"),
}

_ZONE_NAME: Final = re.compile(r"node-([+-]?[0-9]+)")
_GO_INT_MAX: Final = (1 << 63) - 1
_MEMORY_ATTRS: Final = {
    "memtopo.io/memory-tier": "tier",
    "memtopo.io/read-bandwidth-mbps": "read_bandwidth_mbps",
    "memtopo.io/write-bandwidth-mbps": "write_bandwidth_mbps",
    "memtopo.io/read-latency-ns": "read_latency_ns",
    "memtopo.io/write-latency-ns": "write_latency_ns",
}

# Values shared between objects (see _shared): bounded, so neither churn nor hostile objects grow it.
_SHARED_MAX: Final = 1 << 16
_SHARED: dict[Any, Any] = {}
# Quantity texts already read as whole counts, and zone names as NUMA ids (bounded like _SHARED).
_COUNTS: dict[str, int] = {}
_ZONE_IDS: dict[str, int | None] = {}
_ZONE_ATTRS: Final = frozenset({*_MEMORY_ATTRS, "memtopo.io/memory-type", "memtopo.io/cpuless", ATTR_HCCS_RING,
                                ATTR_XPU_HALF})
_TOP_ATTRS: Final = frozenset({ATTR_POLICY, ATTR_SCOPE, ATTR_MAX_NUMA_NODES, ATTR_PODS_FINGERPRINT,
                               ATTR_PODS_FINGERPRINT_METHOD, ATTR_CPU_MANAGER, ATTR_MEMORY_MANAGER})
# Accelerator groups named in one zone attribute, and members in one group: more is not a real node.
MAX_GROUPS: Final = 16
MAX_MEMBERS: Final = 64


class NrtReadError(ValueError):
    """The object cannot be read; the message names the object and the field and quotes a short excerpt."""


class ZoneResource(NamedTuple):
    name: str
    capacity: int
    allocatable: int
    available: int


class MemoryFacts(NamedTuple):
    """memtopo's ``memtopo.io/…`` facts of a zone's memory; None where the object does not say."""

    memory_type: str | None = None
    tier: int | None = None
    read_bandwidth_mbps: int | None = None
    write_bandwidth_mbps: int | None = None
    read_latency_ns: int | None = None
    write_latency_ns: int | None = None
    cpuless: bool | None = None


class ZoneGroups(NamedTuple):
    """The accelerator groups with a device in a zone, each as its member names (``NPU0``…)."""

    hccs_rings: tuple[tuple[str, ...], ...] = ()
    xpu_halves: tuple[tuple[str, ...], ...] = ()


class Zone(NamedTuple):
    """One NUMA zone: its id, its resources, and its distances to other zones: ``cost_values[i]`` to
    NUMA id ``cost_ids[i]`` (two flat tuples, shared between objects that have the same)."""

    numa_id: int
    name: str
    resources: tuple[ZoneResource, ...] = ()
    cost_ids: tuple[int, ...] = ()
    cost_values: tuple[int, ...] = ()
    memory: MemoryFacts | None = None
    groups: ZoneGroups | None = None

    def resource(self, name: str) -> ZoneResource | None:
        for res in self.resources:
            if res.name == name:
                return res
        return None

    def cost(self, numa_id: int) -> int | None:
        for other, value in zip(self.cost_ids, self.cost_values, strict=True):
            if other == numa_id:
                return value
        return None


class NodeTopology(NamedTuple):
    """What one NRT object says about its node."""

    name: str
    policy: str
    scope: str
    cpu_manager_policy: str
    memory_manager_policy: str
    zones: tuple[Zone, ...]
    pods_fingerprint: str = ""
    max_numa_nodes: int = DEFAULT_MAX_NUMA_NODES
    pods_fingerprint_method: str = "all"

    def alignable_zones(self) -> tuple[Zone, ...]:
        """The zones the kubelet can align to (NUMA id below 64), in the object's order."""
        return tuple(z for z in self.zones if z.numa_id < ALIGNABLE_IDS)


def zone_id(name: str) -> int | None:
    """The NUMA id in a zone name as ``numanode.NameToID`` reads it, or None when it is not one."""
    if name in _ZONE_IDS:
        return _ZONE_IDS[name]
    match = _ZONE_NAME.fullmatch(name) if len(name) <= 64 else None
    value = int(match.group(1)) if match is not None else None
    found = value if value is not None and 0 <= value <= _GO_INT_MAX else None
    if len(_ZONE_IDS) >= _SHARED_MAX:
        _ZONE_IDS.clear()
    _ZONE_IDS[name] = found
    return found


class _Reader:
    """Reads one object; ``fail`` raises the error naming the object and the field."""

    def __init__(self, name: object) -> None:
        self.shown = excerpt(name, 63) if isinstance(name, str) else "(unnamed)"

    def fail(self, where: str, problem: str) -> NoReturn:
        raise NrtReadError(f"NodeResourceTopology {self.shown}: {where}: {problem}")

    def mapping(self, value: object, where: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            self.fail(where, f"not an object: {excerpt(repr(value))}")
        return value

    def items(self, value: object, where: str, *, required: bool = False) -> Sequence[Any]:
        if value is None and not required:
            return ()
        if not isinstance(value, list):
            self.fail(where, "missing" if value is None else f"not a list: {excerpt(repr(value))}")
        bound = MAX_ZONES if where == "zones" else MAX_ENTRIES
        if len(value) > bound:
            self.fail(where, f"{len(value)} entries, more than the {bound} memtopo reads")
        return value

    def text(self, value: object, where: str) -> str:
        if not isinstance(value, str):
            self.fail(where, "missing" if value is None else f"not a string: {excerpt(repr(value))}")
        if len(value) > MAX_TEXT:
            self.fail(where, f"{excerpt(value)} is longer than {MAX_TEXT} characters")
        return value

    def count(self, value: object, where: str) -> int:
        if value is None:
            self.fail(where, "missing")
        fast = _fast_count(value)
        if fast is not None:
            return fast
        try:
            number = parse_nonnegative(value)
        except QuantityError as exc:
            self.fail(where, str(exc))
        if number.denominator != 1:
            self.fail(where, f"{excerpt(str(value))} is not a whole number")
        if isinstance(value, str) and len(value) <= 32:
            if len(_COUNTS) >= _SHARED_MAX:
                _COUNTS.clear()
            _COUNTS[value] = int(number)
        return int(number)


def _attributes(reader: _Reader, value: object, where: str, wanted: frozenset[str]) -> dict[str, str]:
    """The ``wanted`` attributes by name; the others (any publisher's own) are not looked at."""
    out: dict[str, str] = {}
    for i, item in enumerate(reader.items(value, where)):
        name = item.get("name") if isinstance(item, Mapping) else None
        if isinstance(name, str) and name in wanted:
            # Later entries win, as scheduler-plugins reads the list in order.
            out[name] = reader.text(item.get("value"), f"{where}[{i}].value")
    return out


def _fast_count(value: object) -> int | None:
    """A whole count read without the exact parser: a plain int, a string of digits, or a text read
    before (most quantities are plain integers or a few sizes repeated on every node, 64Gi, and the
    exact parser costs most of an object's reading otherwise); None when it needs the parser (or its
    error message)."""
    if type(value) is int:
        return value if 0 <= value <= _GO_INT_MAX else None
    if type(value) is str:
        known = _COUNTS.get(value)
        if known is not None:
            return known
        if value.isascii() and value.isdigit() and len(value) <= 18:
            return int(value)
    return None


def _resources(reader: _Reader, value: object, where: str) -> tuple[ZoneResource, ...]:
    out: list[ZoneResource] = []
    seen: set[str] = set()
    for i, item in enumerate(reader.items(value, where)):
        # The common well-formed entry first, without building the field paths of its messages.
        if type(item) is dict:
            name = item.get("name")
            if type(name) is str and 0 < len(name) <= MAX_TEXT and name not in seen:
                cap, alloc, avail = (_fast_count(item.get("capacity")), _fast_count(item.get("allocatable")),
                                     _fast_count(item.get("available")))
                if cap is not None and alloc is not None and avail is not None:
                    seen.add(name)
                    out.append(_shared(ZoneResource(sys.intern(name), cap, alloc, avail)))
                    continue
        at = f"{where}[{i}]"
        entry = reader.mapping(item, at)
        name = reader.text(entry.get("name"), f"{at}.name")
        if name in seen:
            reader.fail(f"{at}.name", f"{excerpt(name)} is listed twice in the zone")
        seen.add(name)
        out.append(_shared(ZoneResource(sys.intern(name), reader.count(entry.get("capacity"), f"{at}.capacity"),
                                        reader.count(entry.get("allocatable"), f"{at}.allocatable"),
                                        reader.count(entry.get("available"), f"{at}.available"))))
    return _shared(tuple(out))


def _shared[T: tuple[Any, ...]](value: T) -> T:
    """One copy of an immutable value for every object that has an equal one (the same SLIT row, the
    same idle CPU counts), up to a bound, so that a fleet of alike nodes costs little more than one."""
    # Keyed by type too: a NamedTuple equals a plain tuple of the same values.
    key = (type(value), value)
    found = _SHARED.get(key)
    if found is not None:
        return found  # type: ignore[no-any-return]  # the table maps each key to a value of its type
    if len(_SHARED) >= _SHARED_MAX:
        # Values that changed (``available`` moves) would fill it for good: start again. The objects
        # read so far keep what they share.
        _SHARED.clear()
    _SHARED[key] = value
    return value


def _costs(reader: _Reader, value: object, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ids: list[int] = []
    values: list[int] = []
    for i, item in enumerate(reader.items(value, where)):
        # The common well-formed entry first, without building the field paths of its messages.
        if type(item) is dict:
            name, cost = item.get("name"), item.get("value")
            if type(name) is str and len(name) <= MAX_TEXT and type(cost) is int and 0 <= cost <= _GO_INT_MAX:
                numa = zone_id(name)
                if numa is not None and numa <= MAX_NUMA_ID:
                    ids.append(numa)
                    values.append(cost)
                continue
        entry = reader.mapping(item, f"{where}[{i}]")
        numa = zone_id(reader.text(entry.get("name"), f"{where}[{i}].name"))
        cost = entry.get("value")
        if isinstance(cost, bool) or not isinstance(cost, int) or not 0 <= cost <= _GO_INT_MAX:
            reader.fail(f"{where}[{i}].value", f"{excerpt(repr(cost))} is not a distance (a non-negative int64)")
        if numa is not None and numa <= MAX_NUMA_ID:
            ids.append(numa)
            values.append(cost)
    return _shared(tuple(ids)), _shared(tuple(values))


def _memory_facts(reader: _Reader, attrs: Mapping[str, str], where: str) -> MemoryFacts | None:
    found: dict[str, Any] = {}
    kind = attrs.get("memtopo.io/memory-type")
    if kind is not None:
        found["memory_type"] = sys.intern(kind)
    for attr, field in _MEMORY_ATTRS.items():
        text = attrs.get(attr)
        if text is None:
            continue
        if not (text.isascii() and text.isdigit() and len(text) <= 18):
            reader.fail(f"{where}: {attr}", f"{excerpt(text)} is not a non-negative integer")
        found[field] = int(text)
    cpuless = attrs.get("memtopo.io/cpuless")
    if cpuless is not None:
        if cpuless not in ("true", "false"):
            reader.fail(f"{where}: memtopo.io/cpuless", f"{excerpt(cpuless)} is not true or false")
        found["cpuless"] = cpuless == "true"
    return _shared(MemoryFacts(**found)) if found else None


def _group_list(reader: _Reader, text: str | None, where: str) -> tuple[tuple[str, ...], ...]:
    if not text:
        return ()
    groups = [g for g in text.split(";") if g]
    if len(groups) > MAX_GROUPS:
        reader.fail(where, f"{len(groups)} groups, more than the {MAX_GROUPS} memtopo reads")
    out = []
    for g in groups:
        members = tuple(sys.intern(m) for m in g.split(",") if m)
        if len(members) > MAX_MEMBERS:
            reader.fail(where, f"a group of {len(members)} members, more than the {MAX_MEMBERS} memtopo reads")
        out.append(members)
    return tuple(out)


def _zone_groups(reader: _Reader, attrs: Mapping[str, str], where: str) -> ZoneGroups | None:
    rings = _group_list(reader, attrs.get(ATTR_HCCS_RING), f"{where}: {ATTR_HCCS_RING}")
    halves = _group_list(reader, attrs.get(ATTR_XPU_HALF), f"{where}: {ATTR_XPU_HALF}")
    return _shared(ZoneGroups(rings, halves)) if rings or halves else None


def _zone(reader: _Reader, item: object, where: str) -> Zone | None:
    entry = reader.mapping(item, where)
    name = reader.text(entry.get("name"), f"{where}.name")
    if reader.text(entry.get("type"), f"{where}.type") != ZONE_TYPE:
        return None
    numa = zone_id(name)
    if numa is None:
        reader.fail(f"{where}.name", f"{excerpt(name)} is not a NUMA zone name (node-<id>)")
    if numa > MAX_NUMA_ID:
        reader.fail(f"{where}.name", f"NUMA id {numa} is beyond {MAX_NUMA_ID}, the highest Linux has")
    attrs = _attributes(reader, entry.get("attributes"), f"{where}.attributes", _ZONE_ATTRS)
    cost_ids, cost_values = _costs(reader, entry.get("costs"), f"{where}.costs")
    return _shared(Zone(numa, sys.intern(name), _resources(reader, entry.get("resources"), f"{where}.resources"),
                        cost_ids, cost_values, _memory_facts(reader, attrs, f"{where}.attributes"),
                        _zone_groups(reader, attrs, f"{where}.attributes")))


def _choice(reader: _Reader, attrs: Mapping[str, str], name: str, allowed: Sequence[str], default: str) -> str:
    value = attrs.get(name)
    if value is None:
        return default
    if value not in allowed:
        reader.fail(f"attributes: {name}", f"{excerpt(value)} is not one of {', '.join(allowed)}")
    return value


def _max_numa_nodes(attrs: Mapping[str, str]) -> int:
    text = attrs.get(ATTR_MAX_NUMA_NODES, "")
    # strconv.Atoi's grammar; a value of 1 or less is invalid (it divides a score).
    if re.fullmatch(r"[+-]?[0-9]{1,18}", text) is None or int(text) <= 1:
        return DEFAULT_MAX_NUMA_NODES
    return min(int(text), LIMIT_MAX_NUMA_NODES)


def read_nrt(obj: object) -> NodeTopology:
    """The read model of one NodeResourceTopology object (parsed JSON); :class:`NrtReadError` otherwise."""
    if not isinstance(obj, Mapping):
        raise NrtReadError(f"NodeResourceTopology: not an object: {excerpt(repr(obj))}")
    meta = obj.get("metadata")
    raw_name = meta.get("name") if isinstance(meta, Mapping) else None
    reader = _Reader(raw_name)
    name = reader.text(raw_name, "metadata.name")
    if not name:
        reader.fail("metadata.name", "empty")

    policy, scope = "none", "container"
    legacy = reader.items(obj.get("topologyPolicies"), "topologyPolicies")
    if legacy:
        first = reader.text(legacy[0], "topologyPolicies[0]")
        if first not in LEGACY_POLICIES:
            reader.fail("topologyPolicies[0]", f"{excerpt(first)} is not a topology manager policy")
        policy, scope = LEGACY_POLICIES[first]
    attrs = _attributes(reader, obj.get("attributes"), "attributes", _TOP_ATTRS)
    policy = _choice(reader, attrs, ATTR_POLICY, POLICIES, policy)
    scope = _choice(reader, attrs, ATTR_SCOPE, SCOPES, scope)
    aligning = policy != "none"
    cpu_policy = _choice(reader, attrs, ATTR_CPU_MANAGER, CPU_MANAGER_POLICIES, "static" if aligning else "none")
    memory_policy = _choice(reader, attrs, ATTR_MEMORY_MANAGER, MEMORY_MANAGER_POLICIES,
                            "Static" if aligning else "None")

    zones: list[Zone] = []
    seen: dict[int, int] = {}
    for i, item in enumerate(reader.items(obj.get("zones"), "zones", required=True)):
        zone = _zone(reader, item, f"zones[{i}]")
        if zone is None:
            continue
        if zone.numa_id in seen:
            reader.fail(f"zones[{i}].name", f"NUMA id {zone.numa_id} is also zones[{seen[zone.numa_id]}]")
        seen[zone.numa_id] = i
        zones.append(zone)
    return NodeTopology(name, policy, scope, cpu_policy, memory_policy, tuple(zones),
                        attrs.get(ATTR_PODS_FINGERPRINT, ""), _max_numa_nodes(attrs),
                        sys.intern(attrs.get(ATTR_PODS_FINGERPRINT_METHOD, "all")))
