"""place: CPUs, GPUs and memory for one allocation on a node's memory topology.

On one node (``decide``):

1. hard constraints first: ``require_unified_memory`` needs a Unified domain; memory above the
   node's local (non-CXL) capacity needs ``allow_cxl_memory`` *and* CXL memory;
2. CPUs and GPUs co-located in one memory domain when one domain holds enough of both, choosing
   the domain with the best GPU–NIC affinity; otherwise an anchor domain plus the domains with the
   highest-bandwidth links to what is already chosen;
3. memory nodes: the allocation's own domains first, then other local memory by link bandwidth,
   then CXL memory when allowed;
4. the memory policy: the explicit one, else ``local`` (``bind`` when the memory spills, so the
   kernel cannot overflow into memory the request did not allow), skipped on Unified memory;
5. ``intra_node_fitness = β·gpu_link_fitness + (1−β)·memory_locality_fitness``.

Over the fleet (``rank_nodes``): nodes that fail a constraint are rejected with the constraint's
name; the rest are ranked by ``intra_node_fitness``. Where the vendor-neutral memory topology
design leaves a formula open, the definition used is in ``docs/planner-guest-pci-place.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memtopo.cpulist import format_cpulist
from memtopo.links import pair_links
from memtopo.planner.errors import PlanError
from memtopo.planner.request import as_object, check_plan_target, get_bool, get_int, get_str, reject_unknown
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

POLICY = "place"
GIB = 1 << 30
BETA: Mapping[str, float] = {"gpu-heavy": 0.7, "cpu-heavy": 0.3, "default": 0.5}
MEMORY_POLICIES = ("local", "interleave", "preferred", "bind")
CONSTRAINTS = ("memory_policy", "prefer_same_numa", "require_unified_memory", "prefer_local_memory", "allow_cxl_memory")

_DT = pb.MemoryDomainType
# Memory the memory topology design calls "local DRAM": what an allocation may use without opting in to CXL.
_LOCAL_TYPES = frozenset(
    {
        _DT.MEMORY_DOMAIN_TYPE_DRAM,
        _DT.MEMORY_DOMAIN_TYPE_HBM,
        _DT.MEMORY_DOMAIN_TYPE_UNIFIED,
        _DT.MEMORY_DOMAIN_TYPE_UNSPECIFIED,
    }
)
_CXL = _DT.MEMORY_DOMAIN_TYPE_CXL_ATTACHED
_UNIFIED = _DT.MEMORY_DOMAIN_TYPE_UNIFIED
# GPU_MEMORY (a GPU's own memory as a CPU-less node) and NVM are never placement memory: the memory
# topology design knows only DRAM/HBM/Unified and CXL, and neither is general-purpose RAM for an allocation.

# GPU pair quality by the nvidia-smi path words, best first: any direct link (NV#, HCCS, XGMI …)
# beats every PCIe path class. Evenly spaced from 1 to 0 (see the docs).
_PATH_CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")
_PAIR_SCORE = {"DIRECT": 1.0, "PIX": 0.8, "PXB": 0.6, "PHB": 0.4, "NODE": 0.2, "SYS": 0.0}
_USABLE_HEALTH = frozenset({"", "ok", "healthy", "warning"})
_NIC_KINDS = frozenset({pb.PciDeviceKind.PCI_DEVICE_KIND_NIC, pb.PciDeviceKind.PCI_DEVICE_KIND_INFINIBAND})
# A SLIT distance worse than any real one, for domain pairs nobody measured.
_UNKNOWN_DISTANCE = 1 << 16


# ---- request --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlaceRequest:
    cpus: int
    gpus: int = 0
    memory_gb: float = 0.0
    workload: str = "default"
    memory_policy: str | None = None  # None: not explicit (default local, skipped on Unified)
    prefer_same_numa: bool = False
    require_unified_memory: bool = False
    prefer_local_memory: bool = False
    allow_cxl_memory: bool = False

    @property
    def beta(self) -> float:
        return BETA[self.workload]

    @property
    def memory_bytes(self) -> int:
        return math.ceil(self.memory_gb * GIB)


MAX_MEMORY_GB = 1 << 40


def _bad(field: str, why: str) -> PlanError:
    return PlanError("invalid_request", f"{field}: {why}")


def parse_request(obj: Any) -> PlaceRequest:
    req = as_object(obj)
    reject_unknown(req, ("cpus", "gpus", "memory_gb", "workload", "constraints"), "request")
    memory = req.get("memory_gb", 0)
    # The upper bound keeps GiB → bytes inside a float/uint64 (1e300 or 10**400 would overflow).
    if isinstance(memory, bool) or not isinstance(memory, int | float) or not 0 <= memory <= MAX_MEMORY_GB:
        raise _bad("memory_gb", f"expected a number of GiB from 0 to {MAX_MEMORY_GB}, got {memory!r}")
    workload = get_str(req, "workload", "default")
    if workload not in BETA:
        raise _bad("workload", f"expected one of {sorted(BETA)}, got {workload!r}")
    constraints = as_object(req.get("constraints", {}), "constraints")
    reject_unknown(constraints, CONSTRAINTS, "constraints")
    policy = constraints.get("memory_policy")
    if policy is not None and policy not in MEMORY_POLICIES:
        raise _bad("constraints.memory_policy", f"expected one of {list(MEMORY_POLICIES)}, got {policy!r}")
    return PlaceRequest(
        cpus=get_int(req, "cpus", minimum=1),
        gpus=get_int(req, "gpus", 0, minimum=0),
        memory_gb=float(memory),
        workload=workload,
        memory_policy=policy,
        prefer_same_numa=get_bool(constraints, "prefer_same_numa", False),
        require_unified_memory=get_bool(constraints, "require_unified_memory", False),
        prefer_local_memory=get_bool(constraints, "prefer_local_memory", False),
        allow_cxl_memory=get_bool(constraints, "allow_cxl_memory", False),
    )


class ConstraintError(PlanError):
    """A node that cannot take the allocation, naming the constraint (or resource) it fails."""

    def __init__(self, constraint: str, message: str) -> None:
        super().__init__("unsatisfiable", f"{constraint}: {message}")
        self.constraint = constraint
        self.reason = message


# ---- the node as the policy sees it ---------------------------------------------------------------
@dataclass(frozen=True)
class _Domain:
    id: int
    type: int
    cpus: tuple[int, ...]  # attached ∩ allowed
    gpus: tuple[int, ...]  # indices into topology.accelerators, usable, homed here
    nics: int
    node_bytes: tuple[tuple[int, int], ...]  # (allowed NUMA node, bytes)

    @property
    def memory_bytes(self) -> int:
        return sum(b for _, b in self.node_bytes)


@dataclass(frozen=True)
class _Node:
    name: str
    domains: tuple[_Domain, ...]  # by id
    gpu_ids: Mapping[int, str]  # accelerator index → Accelerator.id (for links and output)
    gpu_home: Mapping[int, int]
    pair_class: Mapping[frozenset[str], str]
    links: Mapping[tuple[int, int], tuple[int, int]]  # (a, b), a < b → (bandwidth MB/s, distance)

    def domain(self, domain_id: int) -> _Domain:
        return next(d for d in self.domains if d.id == domain_id)

    def pair_score(self, a: int, b: int) -> float:
        cls = self.pair_class.get(frozenset((self.gpu_ids[a], self.gpu_ids[b])))
        if cls is None:  # nothing measured: the NUMA layout is all we know
            cls = "NODE" if self.gpu_home.get(a) == self.gpu_home.get(b) else "SYS"
        return _PAIR_SCORE[cls]

    def link(self, a: int, b: int) -> tuple[int, int]:
        if a == b:
            return (1 << 62, 0)
        return self.links.get((min(a, b), max(a, b)), (0, _UNKNOWN_DISTANCE))

    def link_key(self, candidate: int, chosen: Sequence[int]) -> tuple[int, int, int]:
        """Sort key for "closest to the chosen set": highest bandwidth, then shortest distance."""
        best = max((self.link(candidate, c) for c in chosen), key=lambda bd: (bd[0], -bd[1]))
        return (-best[0], best[1], candidate)


def _type_name(t: int) -> str:
    return pb.MemoryDomainType.Name(t).removeprefix("MEMORY_DOMAIN_TYPE_")  # type: ignore[arg-type]


def _pair_class(kind: str) -> str:
    word = kind.upper()
    return word if word in _PATH_CLASSES else "DIRECT"


def _view(topo: pb.MemoryTopology, name: str) -> _Node:
    ids = [d.id for d in topo.domains]
    if len(ids) != len(set(ids)):
        raise PlanError("invalid_topology", f"{name}: duplicate memory domain ids {sorted(ids)}")
    by_id = {d.id: d for d in topo.domains}
    node_domain = {n: d.id for d in topo.domains for n in d.numa_nodes}
    node_bytes = {n.id: n.memory_bytes for n in topo.numa_nodes}
    # An empty allowed list means the allowed probe did not run: everything the domains list is usable.
    allowed_cpus = set(topo.allowed_cpus) or {c for d in topo.domains for c in d.attached_cpus}
    allowed_mems = set(topo.allowed_memory_nodes) or set(node_domain)

    gpu_ids: dict[int, str] = {}
    gpu_home: dict[int, int] = {}
    for idx, acc in enumerate(topo.accelerators):
        if acc.kind != pb.AcceleratorKind.ACCELERATOR_KIND_GPU or acc.health.strip().lower() not in _USABLE_HEALTH:
            continue
        home = _gpu_home(topo, idx, acc, by_id, node_domain)
        if home is None:
            continue
        gpu_ids[idx] = acc.id or f"GPU{acc.index}"
        gpu_home[idx] = home

    nics: dict[int, int] = {}
    for dev in topo.pci_devices:
        # VFs share their PF's port; counting them would make one port look like many.
        if dev.kind in _NIC_KINDS and not dev.physfn and dev.numa_node in node_domain:
            nics[node_domain[dev.numa_node]] = nics.get(node_domain[dev.numa_node], 0) + 1

    domains = []
    for d in sorted(topo.domains, key=lambda d: d.id):
        per_node = d.capacity_bytes // max(1, len(d.numa_nodes))
        domains.append(
            _Domain(
                id=d.id,
                type=d.type,
                cpus=tuple(sorted(set(d.attached_cpus) & allowed_cpus)),
                gpus=tuple(sorted(i for i, h in gpu_home.items() if h == d.id)),
                nics=nics.get(d.id, 0),
                node_bytes=tuple(
                    (n, node_bytes.get(n) or per_node) for n in sorted(set(d.numa_nodes)) if n in allowed_mems
                ),
            )
        )

    pair_class: dict[frozenset[str], str] = {}
    for a, b, link in pair_links(topo):
        key, cls = frozenset((a, b)), _pair_class(link.kind)
        if key not in pair_class or _PAIR_SCORE[cls] > _PAIR_SCORE[pair_class[key]]:
            pair_class[key] = cls

    links: dict[tuple[int, int], tuple[int, int]] = {}
    for ic in topo.interconnects:
        if ic.domain_a not in by_id or ic.domain_b not in by_id or ic.domain_a == ic.domain_b:
            continue
        # The slower direction bounds traffic both ways; 0 is "unknown", never a real figure.
        bws = [bw for bw in (ic.a_to_b.read_bandwidth_mbps, ic.b_to_a.read_bandwidth_mbps) if bw]
        dists = [x for x in (ic.distance_a_to_b, ic.distance_b_to_a) if x]
        links[(min(ic.domain_a, ic.domain_b), max(ic.domain_a, ic.domain_b))] = (
            min(bws) if bws else 0,
            max(dists) if dists else _UNKNOWN_DISTANCE,
        )
    # Without interconnects, the SLIT row on each domain still ranks neighbours.
    order = [d.id for d in topo.domains]
    for d in topo.domains:
        for pos, dist in enumerate(d.distances[: len(order)]):
            other = order[pos]
            key2 = (min(d.id, other), max(d.id, other))
            if other != d.id and dist and key2 not in links:
                links[key2] = (0, dist)

    return _Node(
        name=name, domains=tuple(domains), gpu_ids=gpu_ids, gpu_home=gpu_home, pair_class=pair_class, links=links
    )


def _gpu_home(
    topo: pb.MemoryTopology,
    idx: int,
    acc: pb.Accelerator,
    by_id: Mapping[int, pb.MemoryDomain],
    node_domain: Mapping[int, int],
) -> int | None:
    """The domain whose CPUs are local to the GPU.

    Evidence in order: the domains listing it in attached_accelerators, its NUMA node, then
    Accelerator.domain last, because proto3 cannot tell an unset domain from domain 0. A GPU whose
    memory is a CPU-less GPU_MEMORY domain is homed with the CPUs of its PCI node, since co-location
    is about the CPUs that drive it.
    """
    candidates = [d.id for d in topo.domains if idx in d.attached_accelerators]
    if acc.numa_node >= 0 and acc.numa_node in node_domain:
        candidates.append(node_domain[acc.numa_node])
    if acc.domain >= 0 and acc.domain in by_id:
        candidates.append(acc.domain)
    for c in candidates:
        if by_id[c].attached_cpus:
            return c
    if acc.local_cpus:
        local = set(acc.local_cpus)
        best = max(topo.domains, key=lambda d: (len(local & set(d.attached_cpus)), -d.id), default=None)
        if best is not None and local & set(best.attached_cpus):
            return best.id
    return candidates[0] if candidates else None


# ---- decision -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPolicyChoice:
    mode: str  # local | interleave | preferred | bind | skip
    nodes: tuple[int, ...]
    explicit: bool
    reason: str

    @property
    def numactl(self) -> tuple[str, ...]:
        nodes = format_cpulist(self.nodes)
        return {
            "local": ("--localalloc",),
            "interleave": (f"--interleave={nodes}",),
            "preferred": (f"--preferred={nodes}",),
            "bind": (f"--membind={nodes}",),
        }.get(self.mode, ())

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "nodes": format_cpulist(self.nodes),
            "explicit": self.explicit,
            "numactl": list(self.numactl),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class DomainUse:
    id: int
    type: str
    cpus: tuple[int, ...]
    gpus: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "cpus": format_cpulist(self.cpus), "gpus": list(self.gpus)}


@dataclass(frozen=True)
class MemoryUse:
    node: int
    domain: int
    type: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "domain": self.domain, "type": self.type, "gb": round(self.bytes / GIB, 3)}


@dataclass(frozen=True)
class PlaceDecision:
    node: str
    cpus: tuple[int, ...]
    gpus: tuple[int, ...]  # accelerator indices
    gpu_ids: tuple[str, ...]
    domains: tuple[DomainUse, ...]  # in choice order: the anchor first
    co_located: bool
    memory: tuple[MemoryUse, ...]  # in fill order
    memory_policy: MemoryPolicyChoice
    beta: float
    gpu_link_fitness: float
    memory_locality_fitness: float
    intra_node_fitness: float

    @property
    def memory_nodes(self) -> tuple[int, ...]:
        return tuple(sorted({m.node for m in self.memory}))

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": POLICY,
            "node": self.node,
            "cpus": format_cpulist(self.cpus),
            "gpus": [{"index": i, "id": g} for i, g in zip(self.gpus, self.gpu_ids, strict=True)],
            "domains": [d.to_json() for d in self.domains],
            "co_located": self.co_located,
            "memory": {"nodes": format_cpulist(self.memory_nodes), "by_node": [m.to_json() for m in self.memory]},
            "memory_policy": self.memory_policy.to_json(),
            "beta": self.beta,
            "gpu_link_fitness": round(self.gpu_link_fitness, 6),
            "memory_locality_fitness": round(self.memory_locality_fitness, 6),
            "intra_node_fitness": round(self.intra_node_fitness, 6),
        }


def _gib(n: int) -> str:
    return f"{n / GIB:g} GiB"


def _check_hard(req: PlaceRequest, node: _Node) -> None:
    if req.require_unified_memory and not any(d.type == _UNIFIED for d in node.domains):
        raise ConstraintError("require_unified_memory", "the node has no Unified memory domain (GH200/GB200, MI300A)")
    need = req.memory_bytes
    local = sum(d.memory_bytes for d in node.domains if d.type in _LOCAL_TYPES)
    if need <= local:
        return
    cxl = sum(d.memory_bytes for d in node.domains if d.type == _CXL)
    over = f"{_gib(need)} requested exceeds the node's local DRAM ({_gib(local)})"
    if not req.allow_cxl_memory:
        raise ConstraintError("allow_cxl_memory", f"{over}; using CXL memory needs allow_cxl_memory")
    if cxl == 0:
        raise ConstraintError("allow_cxl_memory", f"{over} and the node has no CXL memory")
    if need > local + cxl:
        raise ConstraintError("memory_gb", f"{_gib(need)} requested exceeds local DRAM + CXL ({_gib(local + cxl)})")


def _nic_affinity(d: _Domain, gpus: int) -> float:
    """Share of the allocation's GPUs that can have a NIC of their own in the same domain."""
    return min(d.nics, gpus) / gpus if gpus else 0.0


def _link_fitness(node: _Node, gpus: Sequence[int]) -> float:
    pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
    return sum(node.pair_score(a, b) for a, b in pairs) / len(pairs) if pairs else 1.0


def _pick_gpus(node: _Node, pool: Sequence[int], count: int, chosen: Sequence[int]) -> list[int]:
    """``count`` GPUs from ``pool`` with the best links to each other and to ``chosen``.

    Greedy, seeded from every candidate when nothing is chosen yet; ties go to lower indices.
    """
    if count <= 0:
        return []
    if count >= len(pool):
        return list(pool)

    def grow(start: list[int]) -> list[int]:
        picked = list(start)
        while len(picked) < count + len(chosen):
            rest = [g for g in pool if g not in picked]
            picked.append(max(rest, key=lambda g: (sum(node.pair_score(g, p) for p in picked), -g)))
        return picked[len(chosen) :]

    if chosen:
        return grow(list(chosen))
    options = [grow([seed]) for seed in pool]
    return max(options, key=lambda o: (_link_fitness(node, o), [-g for g in sorted(o)]))


def _split_cpus(order: Sequence[_Domain], gpus_in: Mapping[int, int], want: int, same_numa: bool) -> dict[int, int]:
    """How many CPUs each chosen domain gives, when the allocation spans domains."""
    rank = {d.id: i for i, d in enumerate(order)}
    if same_numa:
        # Soft: all CPUs in one domain if any chosen domain has room, the one with most GPUs first.
        fits = [d for d in order if len(d.cpus) >= want]
        if fits:
            best = min(fits, key=lambda d: (-gpus_in.get(d.id, 0), rank[d.id]))
            return {best.id: want}
    share = {d.id: 0 for d in order}
    total_gpus = sum(gpus_in.values())
    if total_gpus:
        # Each domain's GPUs get a proportional share of CPUs from that domain, so the threads that
        # drive a GPU stay local to it; largest remainders round up.
        exact = {d.id: want * gpus_in.get(d.id, 0) / total_gpus for d in order}
        for d in order:
            share[d.id] = min(math.floor(exact[d.id]), len(d.cpus))
        for d in sorted(order, key=lambda d: (math.floor(exact[d.id]) - exact[d.id], rank[d.id])):
            if sum(share.values()) < want and share[d.id] < min(math.ceil(exact[d.id]), len(d.cpus)):
                share[d.id] += 1
    for d in order:  # what is left, in choice order (anchor first, then by link)
        share[d.id] += min(want - sum(share.values()), len(d.cpus) - share[d.id])
    return {i: n for i, n in share.items() if n}


def _choose_domains(req: PlaceRequest, node: _Node) -> tuple[list[_Domain], dict[int, list[int]], dict[int, int]]:
    """The domains used, the GPUs taken from each and the CPU count from each."""
    eligible = [
        d for d in node.domains if (d.cpus or d.gpus) and (not req.require_unified_memory or d.type == _UNIFIED)
    ]
    where = " in Unified domains" if req.require_unified_memory else ""
    have_cpus, have_gpus = sum(len(d.cpus) for d in eligible), sum(len(d.gpus) for d in eligible)
    if have_cpus < req.cpus:
        raise ConstraintError("cpus", f"{req.cpus} requested, the node has {have_cpus} allowed CPUs{where}")
    if have_gpus < req.gpus:
        raise ConstraintError("gpus", f"{req.gpus} requested, the node has {have_gpus} usable GPUs{where}")

    need = req.memory_bytes
    single = [d for d in eligible if len(d.cpus) >= req.cpus and len(d.gpus) >= req.gpus]
    if single:
        picks = {d.id: sorted(_pick_gpus(node, d.gpus, req.gpus, [])) for d in single}

        def rank(d: _Domain) -> tuple[float, ...]:
            nic = _nic_affinity(d, req.gpus)
            link = _link_fitness(node, picks[d.id])
            mem = min(1.0, d.memory_bytes / need) if need else 1.0
            if req.prefer_local_memory:
                return (-mem, -nic, -link, d.id)
            return (-nic, -link, -mem, d.id)

        best = min(single, key=rank)
        return [best], {best.id: picks[best.id]}, {best.id: req.cpus}

    # No single domain holds both: start where most of the request fits, grow by link bandwidth.
    anchor = min(
        eligible,
        key=lambda d: (-min(len(d.gpus), req.gpus), -_nic_affinity(d, req.gpus), -min(len(d.cpus), req.cpus), d.id),
    )
    chosen = [anchor]
    while sum(len(d.cpus) for d in chosen) < req.cpus or sum(len(d.gpus) for d in chosen) < req.gpus:
        short_gpus = sum(len(d.gpus) for d in chosen) < req.gpus
        short_cpus = sum(len(d.cpus) for d in chosen) < req.cpus
        rest = [d for d in eligible if d not in chosen]
        ids = [c.id for c in chosen]
        # A domain that adds what is missing beats a better-linked one that adds nothing.
        chosen.append(
            min(
                rest,
                key=lambda d: (not ((short_gpus and d.gpus) or (short_cpus and d.cpus)), *node.link_key(d.id, ids)),
            )
        )
    gpus: dict[int, list[int]] = {}
    taken: list[int] = []
    for d in chosen:
        got = _pick_gpus(node, d.gpus, min(req.gpus - len(taken), len(d.gpus)), taken)
        if got:
            gpus[d.id] = sorted(got)
            taken += got
    cpus = _split_cpus(chosen, {i: len(g) for i, g in gpus.items()}, req.cpus, req.prefer_same_numa)
    used = [d for d in chosen if cpus.get(d.id) or gpus.get(d.id)]
    return used, gpus, cpus


def _memory_order(req: PlaceRequest, node: _Node, used: Sequence[_Domain]) -> list[_Domain]:
    ids = [d.id for d in used]
    own = [d for d in used if d.type in _LOCAL_TYPES or (req.allow_cxl_memory and d.type == _CXL)]
    others = [d for d in node.domains if d.id not in ids]
    local = sorted((d for d in others if d.type in _LOCAL_TYPES), key=lambda d: node.link_key(d.id, ids))
    cxl = sorted((d for d in others if d.type == _CXL), key=lambda d: node.link_key(d.id, ids))
    return own + local + (cxl if req.allow_cxl_memory else [])


def _fill(order: Sequence[_Domain], need: int) -> list[MemoryUse]:
    out: list[MemoryUse] = []
    left = need
    for d in order:
        for n, size in d.node_bytes:
            if left <= 0:
                return out
            take = min(size, left)
            if take > 0:
                out.append(MemoryUse(n, d.id, _type_name(d.type), take))
                left -= take
    return out


def _spread(order: Sequence[_Domain], need: int) -> list[MemoryUse]:
    """Interleave: equal shares per node, a small node's shortfall spread over the others."""
    nodes = [(n, d, size) for d in order for n, size in d.node_bytes if size > 0]
    share: dict[int, int] = {}
    left, open_nodes = need, list(nodes)
    while left > 0 and open_nodes:
        each = math.ceil(left / len(open_nodes))
        full = [x for x in open_nodes if x[2] - share.get(x[0], 0) <= each]
        for n, _, size in full or open_nodes:
            take = min(size - share.get(n, 0), each, left)
            share[n] = share.get(n, 0) + take
            left -= take
        open_nodes = [x for x in open_nodes if share.get(x[0], 0) < x[2]]
    return [MemoryUse(n, d.id, _type_name(d.type), share.get(n, 0)) for n, d, _ in nodes]


def _memory_policy(
    req: PlaceRequest, node: _Node, used: Sequence[_Domain], memory: Sequence[MemoryUse], primary: _Domain
) -> MemoryPolicyChoice:
    nodes = tuple(sorted({m.node for m in memory}))
    unified = bool(nodes) and all(node.domain(m.domain).type == _UNIFIED for m in memory)
    own_nodes = {n for d in used for n, _ in d.node_bytes}
    spills = any(m.node not in own_nodes and m.bytes > 0 for m in memory)
    mode = req.memory_policy
    if mode is None:
        if unified:
            return MemoryPolicyChoice(
                "skip",
                (),
                False,
                "Unified memory: CPU and GPU share one pool, so no NUMA "
                "policy is set unless memory_policy asks for one",
            )
        if spills:
            return MemoryPolicyChoice(
                "bind",
                nodes,
                False,
                "the memory does not fit the allocation's own domains; "
                "bind keeps it on the nodes planned (nearest first)",
            )
        return MemoryPolicyChoice("local", (), False, "default: allocate on the node the thread runs on")
    if mode == "local":
        return MemoryPolicyChoice("local", (), True, "requested")
    if mode == "preferred":
        first = next((n for n, _ in primary.node_bytes), nodes[0] if nodes else None)
        return MemoryPolicyChoice(
            "preferred",
            () if first is None else (first,),
            True,
            "requested: the node of the domain holding most of the allocation",
        )
    return MemoryPolicyChoice(mode, nodes, True, "requested")


def decide(req: PlaceRequest, topo: pb.MemoryTopology, *, name: str | None = None) -> PlaceDecision:
    """Place one allocation on one node; raises ConstraintError naming the constraint it fails."""
    node = _view(topo, name or topo.node_name or "node")
    _check_hard(req, node)
    used, gpus, cpu_counts = _choose_domains(req, node)

    cpus: list[int] = []
    for d in used:
        cpus += d.cpus[: cpu_counts.get(d.id, 0)]
    counts = {d.id: cpu_counts.get(d.id, 0) + len(gpus.get(d.id, [])) for d in used}
    primary = max(used, key=lambda d: (counts[d.id], -used.index(d)))

    order = _memory_order(req, node, used)
    need = req.memory_bytes
    memory = _spread(order, need) if req.memory_policy == "interleave" else _fill(order, need)
    if not memory:  # nothing to size: the allocation's own local nodes are its memory
        memory = [MemoryUse(n, d.id, _type_name(d.type), 0) for d in used if d in order for n, _ in d.node_bytes]
    planned = sum(m.bytes for m in memory)
    if planned < need:  # the hard-constraint check counts the same capacity, so this means a bad topology
        raise ConstraintError("memory_gb", f"{_gib(need)} requested, {_gib(planned)} usable")
    policy = _memory_policy(req, node, used, memory, primary)

    all_gpus = [g for d in used for g in gpus.get(d.id, [])]
    total = req.cpus + req.gpus
    locality = max(counts.values()) / total
    if req.prefer_same_numa:
        locality *= max(cpu_counts.get(d.id, 0) for d in used) / req.cpus
    if req.prefer_local_memory and need:
        own = {d.id for d in used}
        locality *= sum(m.bytes for m in memory if m.domain in own) / planned
    link = _link_fitness(node, all_gpus)
    return PlaceDecision(
        node=node.name,
        cpus=tuple(sorted(cpus)),
        gpus=tuple(all_gpus),
        gpu_ids=tuple(node.gpu_ids[g] for g in all_gpus),
        domains=tuple(
            DomainUse(d.id, _type_name(d.type), tuple(d.cpus[: cpu_counts.get(d.id, 0)]), tuple(gpus.get(d.id, [])))
            for d in used
        ),
        co_located=len(used) == 1,
        memory=tuple(memory),
        memory_policy=policy,
        beta=req.beta,
        gpu_link_fitness=link,
        memory_locality_fitness=locality,
        intra_node_fitness=req.beta * link + (1 - req.beta) * locality,
    )


# ---- binding plan ---------------------------------------------------------------------------------
def to_binding_plan(decision: PlaceDecision, topo: pb.MemoryTopology, pid: int, *, plan_id: str,
                    ) -> planpb.BindingPlan:
    """Bind running process ``pid`` to the decision: every thread on its CPUs (required), then its
    memory as far as a running process allows (apply/actions/mempolicy.py: only bind can be imposed from
    outside, through the cpuset's mems):

    * ``bind``: MODE_BIND on the planned nodes with migrate_existing (required); on a Unified
      domain only because the request named the policy (a Unified domain skips NUMA policy unless the
      user explicitly asks for one), so apply_on_unified follows it.
    * ``local`` / ``preferred``: the pages already placed move to the allocation's own nodes (the
      preferred node) once (optional); new pages follow the CPUs (local) or the kernel's default.
    * ``interleave``: nothing a running process can be given; the description says how to start it.
    * ``skip`` (Unified, not explicit): no memory action.

    Accelerators are chosen, not bound: a device is handed to a process by its runtime or plugin.
    """
    check_plan_target(pid, plan_id)
    policy = decision.memory_policy
    actions = [planpb.PlanAction(
        id="place-cpus", required=True,
        thread_affinity=planpb.ThreadAffinity(pid=pid, threads=planpb.ThreadSelector(all=True),
                                              cpus=decision.cpus, role="place"))]
    notes: list[str] = []
    launch = " ".join(["memtopo exec", f"--cpus {format_cpulist(decision.cpus)}", *policy.numactl, "-- COMMAND"])
    if policy.mode == "bind":
        actions.append(planpb.PlanAction(
            id="place-membind", required=True,
            memory_policy=planpb.MemoryPolicy(pid=pid, mode=planpb.MemoryPolicy.MODE_BIND, nodes=policy.nodes,
                                              migrate_existing=True, apply_on_unified=policy.explicit)))
    elif policy.mode in ("local", "preferred"):
        targets = set(policy.nodes if policy.mode == "preferred" else decision.memory_nodes)
        away = sorted(n.id for n in topo.numa_nodes if n.memory_bytes > 0 and n.id not in targets)
        if targets and away:
            actions.append(planpb.PlanAction(
                id="place-migrate", required=False,
                page_migration=planpb.PageMigration(pid=pid, from_nodes=away, to_nodes=sorted(targets))))
        else:
            notes.append("no page migration: no other node holds memory")
        if policy.mode == "preferred":
            notes.append(f"preferred cannot be set on a running process: its pages move once; to keep new ones "
                         f"there, start it with `{launch}`")
    elif policy.mode == "interleave":
        notes.append(f"interleave cannot be imposed on a running process: start it with `{launch}`")
    else:
        notes.append(f"no memory policy: {policy.reason}")
    gpus = f", GPUs {','.join(decision.gpu_ids)}" if decision.gpu_ids else ""
    desc = (f"{POLICY}: pid {pid} on CPUs {format_cpulist(decision.cpus)}{gpus}, memory {policy.mode}"
            f"{' on ' + format_cpulist(policy.nodes) if policy.nodes else ''}")
    return planpb.BindingPlan(plan_id=plan_id, policy=POLICY, description="; ".join([desc, *notes]),
                              actions=actions, topology_fingerprint=topo.fingerprint)


# ---- fleet ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeRejection:
    node: str
    constraint: str  # the request field (or "topology") the node fails
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "fits": False, "constraint": self.constraint, "reason": self.reason}


@dataclass(frozen=True)
class FleetDecision:
    ranked: tuple[PlaceDecision, ...]  # best first
    rejected: tuple[NodeRejection, ...]  # in input order

    @property
    def chosen(self) -> PlaceDecision | None:
        return self.ranked[0] if self.ranked else None

    def to_json(self) -> dict[str, Any]:
        ranked = [
            {"node": d.node, "fits": True, "score": round(d.intra_node_fitness, 6), "decision": d.to_json()}
            for d in self.ranked
        ]
        return {
            "policy": POLICY,
            "chosen": self.chosen.node if self.chosen else None,
            "nodes": ranked + [r.to_json() for r in self.rejected],
        }


def rank_nodes(req: PlaceRequest, topologies: Sequence[pb.MemoryTopology]) -> FleetDecision:
    """Filter the fleet by the hard constraints, then rank the rest by intra-node fitness."""
    fits: list[tuple[float, str, int, PlaceDecision]] = []
    rejected: list[NodeRejection] = []
    for i, topo in enumerate(topologies):
        name = topo.node_name or f"node[{i}]"
        try:
            d = decide(req, topo, name=name)
        except ConstraintError as exc:
            rejected.append(NodeRejection(name, exc.constraint, exc.reason))
            continue
        except PlanError as exc:
            rejected.append(NodeRejection(name, "topology", exc.message))
            continue
        fits.append((-d.intra_node_fitness, name, i, d))
    fits.sort(key=lambda t: t[:3])
    return FleetDecision(ranked=tuple(t[3] for t in fits), rejected=tuple(rejected))
