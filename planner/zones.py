"""memtopo's policies over a node's NUMA zones: choose among the placements the kubelet will accept.

Where the fleet is the API server's NodeResourceTopology objects (the scheduler extender's ``--fleet
nrt``), a node is a set of NUMA zones with counts (CPUs, memory, devices per device-plugin resource,
what is free after the pods in flight) and memtopo's facts about each zone's memory (type, kernel tier,
local read bandwidth and latency) and accelerators (the HCCS ring or XPU NUMA half they belong to).
The kubelet's Topology Manager decides which NUMA placements it would admit (``k8s.admission``); this
module never looks outside them. It decides, per node, whether memtopo's policy can use one of them
and how good the best one is (``ZoneChoice.key``: larger is better, compared across nodes):

* **hccs** (``huawei.com/Ascend910``): the NPUs of a ring are counted over the zones the ring touches
  (memtopo's ``memtopo.io/hccs-ring`` zone attribute; without it, each zone is taken as one ring). A
  pod of 1, 2 or 4 NPUs stays inside one ring; the ring's free count gives the priority group (A–D)
  and the node the upstream score ``8·(capacity·4 − g) + (8 − available)`` (``planner.hccs``). A pod
  of 8 needs every ring entirely free.
* **xpu** (``kunlunxin.com/xpu``): the two NUMA halves (``memtopo.io/xpu-numa-half``, else zones) and
  their used counts give the node's occupancy; the xpu policy's selector picks the half, and the score
  is ``1000·(1 − ΔMTF)``, then the XPUs already used (``planner.xpu``).
* **place** (GPU pods and pods with ``memtopo.io/`` annotations): each accepted placement's memory is
  rated by type (DRAM/HBM/Unified 1, unknown 0.8, CXL 0.5, NVM and GPU memory 0.2), kernel tier (the
  node's fastest tier 1, slower 0.5), read bandwidth (against the node's best) and latency (the node's
  best against it), averaged, and divided by the number of zones the placement spans; a placement whose
  memory is all CXL needs ``allow_cxl``. Between nodes whose best placements rate alike, the one with
  the higher read bandwidth (the lowest of its zones'; unknown counts 0), then the lower latency, wins.

The devices a pod gets are the kubelet's to pick, inside the NUMA zones its Topology Manager chose: for
hccs and xpu, when the kubelet aligns devices (``kubelet_choice`` given), the policy judges the ring or
half of that choice — what will happen — rather than the one it would have preferred.

Pure: no I/O, no Kubernetes types (the extender converts its read model into ``ZoneFacts``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from memtopo.planner import hccs, xpu

HCCS: Final = "hccs"
XPU: Final = "xpu"
PLACE: Final = "place"
POLICIES: Final = (HCCS, XPU, PLACE)

_TYPE_SCORE: Final[Mapping[str, float]] = {"DRAM": 1.0, "HBM": 1.0, "UNIFIED": 1.0, "": 0.8, "UNKNOWN": 0.8,
                                           "CXL": 0.5, "NVM": 0.2, "GPU_MEMORY": 0.2}
_CXL: Final = "CXL"
Placement = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ZoneFacts:
    """One NUMA zone as memtopo's policies read it. ``devices``/``free_devices``: of the pod's device
    resource (hccs, xpu), free after what is in flight; ``groups``: the accelerator groups (HCCS rings,
    XPU NUMA halves) with a device in this zone, each as its member names."""

    numa_id: int
    memory_type: str = ""
    tier: int | None = None
    read_bandwidth_mbps: int | None = None
    read_latency_ns: int | None = None
    groups: tuple[tuple[str, ...], ...] = ()
    devices: int = 0
    free_devices: int = 0


@dataclass(frozen=True, slots=True)
class ZoneRequest:
    policy: str
    devices: int = 0  # hccs, xpu: per pod
    allow_cxl: bool = False


@dataclass(frozen=True, slots=True)
class ZoneChoice:
    """The policy's answer for one node: the placement it takes (None: none fits, ``reason`` says why,
    ``unresolvable`` when freeing devices could not change that), its ``key`` (larger is better,
    compared across nodes) and a short ``detail`` of the choice (``ring NPU4–NPU7 group A``)."""

    placement: Placement | None
    key: tuple[float, ...] = ()
    reason: str = ""
    unresolvable: bool = False
    detail: str = ""


def _zones_text(ids: Sequence[int]) -> str:
    return "{" + ",".join(f"node-{i}" for i in ids) + "}"


def _fail(reason: str, unresolvable: bool = False) -> ZoneChoice:
    return ZoneChoice(None, (), reason, unresolvable)


# ---- device groups -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Group:
    name: str
    zones: Placement
    capacity: int
    free: int


def _groups(zones: Mapping[int, ZoneFacts], what: str) -> list[_Group] | str:
    """The device groups of the node (rings, halves) with their zones and counts; a string saying why
    they cannot be counted (a zone with devices of two groups: counts per zone cannot be split)."""
    holding = [z for z in sorted(zones.values(), key=lambda z: z.numa_id) if z.devices > 0]
    if not holding:
        return []
    if not any(z.groups for z in holding):
        return [_Group(f"node-{z.numa_id}", (z.numa_id,), z.devices, z.free_devices) for z in holding]
    by_group: dict[tuple[str, ...], list[ZoneFacts]] = {}
    for z in holding:
        if len(z.groups) != 1:
            names = "; ".join(",".join(g) for g in z.groups) or "none"
            return (f"zone node-{z.numa_id} holds devices of {len(z.groups)} {what}s ({names}): the free "
                    f"devices of each cannot be told from the zone's counts")
        by_group.setdefault(z.groups[0], []).append(z)
    out = []
    for members, members_zones in by_group.items():
        label = f"{members[0]}–{members[-1]}" if len(members) > 1 else members[0]
        out.append(_Group(label, tuple(z.numa_id for z in members_zones), sum(z.devices for z in members_zones),
                          sum(z.free_devices for z in members_zones)))
    return sorted(out, key=lambda g: g.zones)


def _group_of_choice(groups: Sequence[_Group], choice: Placement) -> _Group | str | None:
    """The one group the kubelet's chosen zones belong to; None when they hold none of its devices;
    a reason when they span several."""
    touched = [g for g in groups if set(g.zones) & set(choice)]
    if len(touched) > 1:
        return f"the kubelet's placement {_zones_text(choice)} spans " + " and ".join(g.name for g in touched)
    return touched[0] if touched else None


def _hccs(req: ZoneRequest, zones: Mapping[int, ZoneFacts], accepted: Sequence[Placement],
          kubelet_choice: Placement | None) -> ZoneChoice:
    groups = _groups(zones, "HCCS ring")
    if isinstance(groups, str):
        return _fail(groups, True)
    if not groups:
        return _fail("no zone lists an Ascend 910 NPU", True)
    published = any(z.groups for z in zones.values())
    odd = [g for g in groups if g.capacity > hccs.RING_NPUS] if published else []
    if odd:
        return _fail(f"not an Ascend 910 node of HCCS rings of {hccs.RING_NPUS} NPUs (ring {odd[0].name} has "
                     f"{odd[0].capacity})", True)
    capacity = sum(g.capacity for g in groups)
    free = sum(g.free for g in groups)
    per_pod = req.devices
    if per_pod == hccs.NODE_NPUS:
        if capacity < hccs.NODE_NPUS:
            return _fail(f"a pod of 8 NPUs takes a whole node; this one has {capacity}", True)
        if free < capacity:
            return _fail(f"a pod of 8 NPUs takes the whole node; {free}/{capacity} free")
        whole = tuple(sorted({z for g in groups for z in g.zones}))
        return ZoneChoice(whole, (float(hccs.node_score(min(capacity, 8), 0, free)),), detail="whole node")
    if capacity < per_pod:
        return _fail(f"{capacity} NPUs, fewer than the pod's {per_pod}", True)
    if kubelet_choice is not None:
        chosen = _group_of_choice(groups, kubelet_choice)
        if isinstance(chosen, str):
            return _fail(f"{chosen}: a pod of {per_pod} NPUs must stay inside one HCCS ring")
        candidates = [chosen] if chosen is not None else []
    else:
        candidates = list(groups)
    best: tuple[int, _Group] | None = None
    for g in candidates:
        index = hccs.ring_group(per_pod, g.free)
        if index is not None and (best is None or index < best[0]):
            best = (index, g)
    if best is None:
        shown = ", ".join(f"{g.name}: {g.free} free" for g in groups)
        where = f" in the kubelet's placement {_zones_text(kubelet_choice)}" if kubelet_choice is not None else ""
        return _fail(f"no HCCS ring{where} can hold {per_pod} NPUs under the ring rule ({shown})")
    index, ring = best
    placement = _within(ring.zones, accepted, kubelet_choice)
    if placement is None:
        return _fail(f"ring {ring.name} ({_zones_text(ring.zones)}) is not a placement the kubelet accepts")
    score = hccs.node_score(min(capacity, hccs.NODE_NPUS), index, free)
    return ZoneChoice(placement, (float(score),), detail=f"ring {ring.name} group {hccs.GROUPS[index]}")


def _xpu(req: ZoneRequest, zones: Mapping[int, ZoneFacts], accepted: Sequence[Placement],
         kubelet_choice: Placement | None) -> ZoneChoice:
    groups = _groups(zones, "XPU NUMA half")
    if isinstance(groups, str):
        return _fail(groups, True)
    if len(groups) != 2 or any(g.capacity != xpu.HALF for g in groups):
        shown = ", ".join(f"{g.name}: {g.capacity}" for g in groups) or "none"
        return _fail(f"not an 8-XPU node in two NUMA halves of 4 ({shown})", True)
    used = [xpu.HALF - min(g.free, xpu.HALF) for g in groups]
    occupancy = (1 << used[0]) - 1 | ((1 << used[1]) - 1) << xpu.HALF
    before = xpu.mtf(occupancy)
    n = req.devices
    if n == xpu.DEVICES:
        if occupancy:
            return _fail(f"a task of 8 XPUs takes the whole node; {8 - sum(used)}/8 free")
        after = xpu.mtf(0xFF)
        whole = tuple(sorted({z for g in groups for z in g.zones}))
        return ZoneChoice(whole, (float(xpu.score_for_delta(after - before)), float(sum(used))), detail="whole node")
    if kubelet_choice is not None:
        chosen = _group_of_choice(groups, kubelet_choice)
        if isinstance(chosen, str):
            return _fail(f"{chosen}: a task of {n} XPUs stays inside one NUMA half")
        half = next((i for i, g in enumerate(groups) if g is chosen), None)
        if half is not None and groups[half].free not in xpu.half_sizes(n):
            half = None
    else:
        # The xpu policy's own selector over the node's occupancy picks the half.
        devices = xpu.select(n, occupancy)
        half = (0 if devices[0] < xpu.HALF else 1) if devices else None
    if half is None:
        halves = ", ".join(f"{g.name}: {g.free} free" for g in groups)
        where = f" in the kubelet's placement {_zones_text(kubelet_choice)}" if kubelet_choice is not None else ""
        return _fail(f"no NUMA half{where} can hold {n} XPUs under the rule ({halves})")
    taken = list(used)
    taken[half] += n
    after = xpu.mtf((1 << taken[0]) - 1 | ((1 << taken[1]) - 1) << xpu.HALF)
    score = xpu.score_for_delta(after - before)
    placement = _within(groups[half].zones, accepted, kubelet_choice)
    if placement is None:
        return _fail(f"half {groups[half].name} ({_zones_text(groups[half].zones)}) is not a placement the "
                     "kubelet accepts")
    # Binpack next, as the xpu policy ranks: the node with more XPUs already used.
    return ZoneChoice(placement, (float(score), float(sum(used))), detail=f"half {groups[half].name}")


def _within(zones: Placement, accepted: Sequence[Placement], kubelet_choice: Placement | None) -> Placement | None:
    """The placement inside ``zones`` the kubelet takes: its own choice when it makes one, else the
    narrowest accepted placement inside them (any, when the kubelet accepts every placement)."""
    if kubelet_choice is not None:
        return kubelet_choice if set(kubelet_choice) <= set(zones) else None
    if not accepted:
        return zones
    return next((p for p in accepted if set(p) <= set(zones)), None)


# ---- place ---------------------------------------------------------------------------------------------
def memory_fitness(zones: Mapping[int, ZoneFacts], placement: Placement) -> float:
    """How good the memory of ``placement`` is, 0–1 (see the module's description)."""
    if not placement:
        return 0.0
    tiers = [z.tier for z in zones.values() if z.tier is not None]
    bandwidths = [z.read_bandwidth_mbps for z in zones.values() if z.read_bandwidth_mbps]
    latencies = [z.read_latency_ns for z in zones.values() if z.read_latency_ns]
    total = 0.0
    for zid in placement:
        z = zones[zid]
        parts = [_TYPE_SCORE.get(z.memory_type, 0.8)]
        if z.tier is not None and tiers:
            parts.append(1.0 if z.tier == min(tiers) else 0.5)
        if z.read_bandwidth_mbps and bandwidths:
            parts.append(z.read_bandwidth_mbps / max(bandwidths))
        if z.read_latency_ns and latencies:
            parts.append(min(latencies) / z.read_latency_ns)
        total += sum(parts) / len(parts)
    return total / len(placement) / len(placement)


def _place(req: ZoneRequest, zones: Mapping[int, ZoneFacts], accepted: Sequence[Placement],
           kubelet_choice: Placement | None) -> ZoneChoice:
    if kubelet_choice is not None:
        candidates: list[Placement] = [kubelet_choice]
    elif accepted:
        candidates = list(accepted)
    else:
        ids = sorted(zones)
        candidates = [(i,) for i in ids] + ([tuple(ids)] if len(ids) > 1 else [])
    best: tuple[float, Placement] | None = None
    refused: list[str] = []
    for p in candidates:
        if not req.allow_cxl and p and all(zones[i].memory_type == _CXL for i in p if i in zones):
            refused.append(_zones_text(p))
            continue
        fitness = round(memory_fitness(zones, tuple(i for i in p if i in zones)), 6)
        if best is None or fitness > best[0]:
            best = (fitness, p)
    if best is None:
        return _fail(f"allow_cxl_memory: the placements the kubelet accepts ({', '.join(refused)}) hold CXL "
                     "memory only (memtopo.io/allow-cxl: \"true\" allows it)", True)
    fitness, placement = best
    used = [zones[i] for i in placement if i in zones]
    bandwidth = min((z.read_bandwidth_mbps or 0 for z in used), default=0)
    latency = max((z.read_latency_ns or 0 for z in used), default=0)
    return ZoneChoice(placement, (fitness, float(bandwidth), float(-latency)),
                      detail=f"memory {_zones_text(placement)} fitness {fitness:g}")


_POLICY: Final = {HCCS: _hccs, XPU: _xpu, PLACE: _place}


def choose(req: ZoneRequest, zones: Mapping[int, ZoneFacts], accepted: Sequence[Placement],
           kubelet_choice: Placement | None = None) -> ZoneChoice:
    """The policy's choice among ``accepted`` (the placements the kubelet takes as aligned, narrowest
    first; empty: it aligns nothing and takes any). ``kubelet_choice``: the placement the kubelet will
    use itself (its devices' zones; its CPUs' and memory's under its static managers) — then that one
    is judged, never another."""
    return _POLICY[req.policy](req, zones, accepted, kubelet_choice)
