"""cpu-binding (as vLLM-Ascend binds CPUs): a CPU pool per running NPU, split by role, as a BindingPlan.

Semantics follow the reference allocator, ``vllm_ascend/cpu_binding.py`` of
github.com/vllm-project/vllm-ascend (``CpuAlloc``, HEAD ``182b75ea``): ``global_slice`` cuts
the sorted allowed CPUs by global logical NPU id; ``topo_affinity`` starts from each NPU's CPU
affinity, extends a single-node pool to the next NUMA node, lets hidden NPUs whose affinity
overlaps the cpuset take their share, and splits shared CPUs evenly. Each pool then splits into
2 IRQ CPUs, main CPUs, one ACL CPU and one release CPU. Where the reference has a defect
(overlapping pools, sparse node ids, IRQs on the wrapped-to node) this module does the correct
thing; ``docs/planner-cpu-binding.md`` lists every deviation.

Pools are kept in *role order* (the NPU's own affinity CPUs first, then extension CPUs), not in
ascending order: the first two CPUs take the NPU's IRQs, so they should be the ones nearest it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from memtopo.cpulist import format_cpulist
from memtopo.planner.errors import PlanError
from memtopo.planner.request import (
    as_object,
    check_plan_target,
    get_cpulist,
    get_cpulist_map,
    get_int,
    get_int_list,
    get_str,
)
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

POLICY: Final = "cpu-binding"
Mode = Literal["global_slice", "topo_affinity"]

# 2 IRQ CPUs (SQ, CQ) + at least 1 main + ACL + release, the reference's minimum.
MIN_CPUS_PER_NPU: Final = 5
_MODE_OF_TYPE: Final[Mapping[str, Mode]] = {"A2": "topo_affinity", "A3": "global_slice", "310P": "topo_affinity"}

# /proc/interrupts action names of an Ascend chip's submit and completion queues (Ascend driver).
SQ_IRQ_PATTERN: Final = "sq_send_trigger_irq"
CQ_IRQ_PATTERN: Final = "cq_update_irq"


# ---- device type ---------------------------------------------------------------------------------
def device_type_of(name: str) -> str | None:
    """A2 / A3 / 310P / A5 from a type name, a SoC version or an npu-smi chip name; None when unknown.

    SoC names as the reference's build-time table (ascend910b* → A2, ascend910_93xx and
    910c → A3, ascend310p* → 310P, ascend950* → A5); chip names as npu-smi prints them ("Ascend 910B3"
    on A2, "Ascend910" on A3, "310P3").
    """
    s = re.sub(r"[\s-]", "", name).upper()
    if s in {"A2", "A3", "310P", "A5"}:
        return s
    if "950" in s:
        return "A5"
    if "310P" in s:
        return "310P"
    if "910B" in s:
        return "A2"
    if "910_93" in s or "910C" in s or s == "ASCEND910":
        return "A3"
    return None


# ---- request -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuBindingRequest:
    device_type: str  # A2, A3, 310P, or any other (upper-cased) name, which selects topo_affinity
    allowed_cpus: tuple[int, ...]  # sorted
    running_npus: tuple[int, ...]  # logical ids, sorted, unique, non-empty
    total_logic_npus: int = 0  # 0 = unknown
    topo_affinity: Mapping[int, tuple[int, ...]] | None = None  # logical id → affinity CPUs
    numa_cpus: Mapping[int, tuple[int, ...]] | None = None  # node → CPUs

    @property
    def total_npus(self) -> int:
        """How many logical NPUs share the host's CPUs, in the reference's order of evidence."""
        if self.total_logic_npus > 0:
            return self.total_logic_npus
        if self.topo_affinity:
            return len(self.topo_affinity)
        return len(self.running_npus)


def parse_request(obj: Any) -> CpuBindingRequest:
    """Validate a decoded JSON request; every problem is a PlanError("invalid_request") naming the field."""
    req = as_object(obj)
    raw_type = get_str(req, "device_type").strip()
    if not raw_type:
        raise PlanError("invalid_request", "device_type: must not be empty")
    device_type = device_type_of(raw_type) or raw_type.upper()
    if device_type == "A5":
        raise PlanError(
            "invalid_request",
            "device_type: A5 (Ascend 950) binds each NPU to whole CPU clusters (8 cores each) with no "
            "IRQ/ACL/release roles; cpu-binding does not implement that path",
        )
    allowed = get_cpulist(req, "allowed_cpus")
    running = tuple(sorted(set(get_int_list(req, "running_npus"))))
    if not running:
        raise PlanError("invalid_request", "running_npus: no running NPU (nothing to bind)")
    total = get_int(req, "total_logic_npus", 0, minimum=0)
    if total and running[-1] >= total:
        raise PlanError(
            "invalid_request",
            f"running_npus: NPU {running[-1]} is not among the {total} logical NPUs (total_logic_npus)",
        )
    affinity = get_cpulist_map(req, "topo_affinity")
    numa = get_cpulist_map(req, "numa_cpus")
    if numa is not None:
        _check_numa(numa)
    return CpuBindingRequest(
        device_type=device_type,
        allowed_cpus=allowed,
        running_npus=running,
        total_logic_npus=total,
        topo_affinity=dict(sorted(affinity.items())) if affinity is not None else None,
        numa_cpus=dict(sorted(numa.items())) if numa is not None else None,
    )


def _check_numa(numa: Mapping[int, tuple[int, ...]]) -> None:
    if not numa:
        raise PlanError("invalid_request", "numa_cpus: names no NUMA node")
    owner: dict[int, int] = {}
    for node, cpus in numa.items():
        for cpu in cpus:
            if cpu in owner:
                raise PlanError("invalid_request", f"numa_cpus: CPU {cpu} is on node {owner[cpu]} and node {node}")
            owner[cpu] = node


# ---- decision ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NpuPool:
    """One NPU's CPUs in role order: IRQ (SQ, CQ), main…, ACL, release."""

    npu: int
    cpus: tuple[int, ...]

    @property
    def irq(self) -> tuple[int, int]:
        return self.cpus[0], self.cpus[1]

    @property
    def main(self) -> tuple[int, ...]:
        return self.cpus[2:-2]

    @property
    def acl(self) -> int:
        return self.cpus[-2]

    @property
    def release(self) -> int:
        return self.cpus[-1]

    def to_json(self) -> dict[str, str | int]:
        return {
            "cpus": format_cpulist(self.cpus),
            "irq": format_cpulist(self.irq),
            "main": format_cpulist(self.main),
            "acl": self.acl,
            "release": self.release,
        }


@dataclass(frozen=True)
class CpuBindingDecision:
    mode: Mode
    npus: tuple[NpuPool, ...]  # running NPUs, ascending id

    def pool(self, npu: int) -> NpuPool:
        for p in self.npus:
            if p.npu == npu:
                return p
        running = ", ".join(str(p.npu) for p in self.npus)
        raise PlanError("invalid_request", f"NPU {npu} is not a running NPU of this decision (running: {running})")

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "npus": {str(p.npu): p.to_json() for p in self.npus}}


def decide(req: CpuBindingRequest) -> CpuBindingDecision:
    """Pools and roles for every running NPU; PlanError("unsatisfiable") when the CPUs do not suffice."""
    if not req.allowed_cpus:
        raise PlanError("unsatisfiable", "allowed_cpus is empty: no CPU to bind")
    mode: Mode = _MODE_OF_TYPE.get(req.device_type, "topo_affinity")
    if mode == "topo_affinity" and req.topo_affinity:
        pools = _topo_affinity_pools(req)
    else:
        # No affinity facts at all: the reference falls back to global_slice.
        mode = "global_slice"
        pools = global_slice(req.allowed_cpus, req.running_npus, req.total_npus)
    for npu, cpus in pools.items():
        if len(cpus) < MIN_CPUS_PER_NPU:
            raise PlanError(
                "unsatisfiable",
                f"NPU {npu}: its pool has {len(cpus)} CPUs ({format_cpulist(cpus) or 'none'}); each NPU needs at "
                f"least {MIN_CPUS_PER_NPU} (2 IRQ, 1 or more main, 1 ACL, 1 release)",
            )
    return CpuBindingDecision(mode, tuple(NpuPool(npu, pools[npu]) for npu in sorted(pools)))


def global_slice(allowed: Iterable[int], running: Sequence[int], total_npus: int) -> dict[int, tuple[int, ...]]:
    """Logical id g gets the g-th of ``total_npus`` near-equal slices of the sorted allowed CPUs.

    The minimum is checked on the smallest slice over *all* logical NPUs, as the reference does: every
    worker of the host computes the same slicing, so one that fits while another does not is refused.
    """
    cpus = sorted(set(allowed))
    total = max(total_npus, 1)
    base, extra = divmod(len(cpus), total)

    def size(g: int) -> int:
        return base + (1 if g < extra else 0)

    if base < MIN_CPUS_PER_NPU:
        short = [g for g in running if 0 <= g < total and size(g) < MIN_CPUS_PER_NPU]
        npu = short[0] if short else extra
        raise PlanError(
            "unsatisfiable",
            f"NPU {npu}: its global slice has {size(npu)} CPUs; insufficient CPUs for binding with CPU role "
            f"reservations: total_allowed={len(cpus)}, total_npus={total}, min_per_npu={base} "
            f"(<{MIN_CPUS_PER_NPU}). Need at least {total * MIN_CPUS_PER_NPU} CPUs in cpuset.",
        )
    out: dict[int, tuple[int, ...]] = {}
    for g in sorted(set(running)):
        if not 0 <= g < total:
            raise PlanError("invalid_request", f"Invalid NPU id {g}, total_npus={total}.")
        start = g * base + min(g, extra)
        out[g] = tuple(cpus[start : start + size(g)])
    return out


def split_evenly(cpus: Sequence[int], npus: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Consecutive equal shares in ``npus`` order, the remainder to the last."""
    if not npus:
        return {}
    per = len(cpus) // len(npus)
    out = {npu: tuple(cpus[i * per : (i + 1) * per]) for i, npu in enumerate(npus[:-1])}
    out[npus[-1]] = tuple(cpus[(len(npus) - 1) * per :])
    return out


class _Numa:
    """CPU → node and the next node of each node, over the nodes that have CPUs."""

    def __init__(self, numa_cpus: Mapping[int, Sequence[int]]) -> None:
        self.cpus = {node: tuple(cpus) for node, cpus in numa_cpus.items() if cpus}
        self.node_of = {cpu: node for node, cpus in self.cpus.items() for cpu in cpus}
        order = sorted(self.cpus)
        # By id, wrapping to the lowest: node ids may be sparse ({0, 2}), and the reference's
        # "(n + 1) % count" then looks at a node that does not exist (deviation 4 in
        # docs/planner-cpu-binding.md).
        self.next = {node: order[(i + 1) % len(order)] for i, node in enumerate(order)}

    def nodes(self, cpus: Iterable[int]) -> set[int]:
        return {self.node_of[c] for c in cpus if c in self.node_of}


def extend_to_next_node(
    base: Sequence[int], numa_cpus: Mapping[int, Sequence[int]], allowed: Iterable[int]
) -> tuple[int, ...]:
    """``base`` followed by the allowed CPUs of the next node when ``base`` lies on one node."""
    return _extend(tuple(base), _Numa(numa_cpus), frozenset(allowed), npu=None)


def _extend(base: tuple[int, ...], numa: _Numa | None, allowed: frozenset[int], npu: int | None) -> tuple[int, ...]:
    if not base or numa is None:
        return base
    missing = [c for c in base if c not in numa.node_of]
    if missing:
        who = f"NPU {npu}: affinity" if npu is not None else "base"
        raise PlanError("invalid_topology", f"{who} CPU {missing[0]} is on no node of numa_cpus")
    nodes = numa.nodes(base)
    if len(nodes) != 1:
        return base
    node = nodes.pop()
    nxt = numa.next[node]
    if nxt == node:  # a single node has no next one (the reference re-adds the node's own CPUs)
        return base
    have = set(base)
    return base + tuple(sorted(c for c in numa.cpus[nxt] if c in allowed and c not in have))


def _topo_affinity_pools(req: CpuBindingRequest) -> dict[int, tuple[int, ...]]:
    affinity = req.topo_affinity or {}
    allowed = frozenset(req.allowed_cpus)
    running = set(req.running_npus)
    # Only NPUs with an affinity row or a process can be candidates: never walk 0…total_logic_npus.
    known = sorted(set(affinity) | running)
    all_logic = [n for n in known if n < req.total_logic_npus] if req.total_logic_npus else known
    # Hidden NPUs whose affinity touches this cpuset take their share too, so that independent
    # single-NPU workers sharing a cpuset compute the same split, as the reference does.
    candidates = [n for n in all_logic if n in running or not allowed.isdisjoint(affinity.get(n, ()))]
    numa = _Numa(req.numa_cpus) if req.numa_cpus else None

    bases: dict[int, tuple[int, ...]] = {}
    pools: dict[int, tuple[int, ...]] = {}
    for npu in candidates:
        if npu not in affinity:
            raise PlanError("unsatisfiable", f"NPU {npu}: topo_affinity has no entry for it")
        bases[npu] = tuple(c for c in affinity[npu] if c in allowed)
        if not bases[npu]:
            raise PlanError(
                "unsatisfiable",
                f"NPU {npu}: none of its affinity CPUs ({format_cpulist(affinity[npu])}) is in allowed_cpus "
                f"({format_cpulist(allowed)}); CPUs available in 'Cpus_allowed_list' conflict with NUMA affinity",
            )
        pools[npu] = _extend(bases[npu], numa, allowed, npu)

    out: dict[int, tuple[int, ...]] = {}
    for members in _overlapping_groups(candidates, pools):
        shares = _share(members, bases, pools)
        out.update((npu, cpus) for npu, cpus in shares.items() if npu in running)
    return out


def _overlapping_groups(npus: Sequence[int], pools: Mapping[int, Sequence[int]]) -> list[list[int]]:
    """Connected components of "pools share a CPU", members ascending, components by first member.

    The reference only splits pools that are exactly equal; pools that merely overlap were used as
    is and shared CPUs, even ACL/release ones. Splitting every overlapping group keeps the
    reference's result where pools are equal or disjoint and makes all pools disjoint.
    """
    groups: list[tuple[list[int], set[int]]] = []
    for npu in npus:
        cpus = set(pools[npu])
        touching = [g for g in groups if not g[1].isdisjoint(cpus)]
        members = [npu]
        for g in touching:
            members += g[0]
            cpus |= g[1]
            groups.remove(g)
        groups.append((sorted(members), cpus))
    return sorted((g[0] for g in groups), key=lambda m: m[0])


def _share(
    members: Sequence[int], bases: Mapping[int, Sequence[int]], pools: Mapping[int, Sequence[int]]
) -> dict[int, tuple[int, ...]]:
    if len(members) == 1:
        return {members[0]: tuple(pools[members[0]])}
    # The members' own affinity CPUs first (in member order), then the extension CPUs: the lowest id
    # gets its own node even when the extension wrapped to a lower-numbered node (the reference sorts,
    # so there the IRQ CPUs land on node 0), and for
    # equal pools on ascending nodes this is the reference's sorted order.
    order: list[int] = []
    seen: set[int] = set()
    for npu in members:
        for c in bases[npu]:
            if c not in seen:
                seen.add(c)
                order.append(c)
    union = set().union(*(pools[n] for n in members))
    order += sorted(union - seen)
    return split_evenly(order, members)


# ---- topology → request --------------------------------------------------------------------------
def fill_from_topology(obj: Any, topo: pb.MemoryTopology) -> dict[str, Any]:
    """A copy of the request with what discovery knows filled in where the request is silent (absent or null).

    allowed_cpus ← topo.allowed_cpus; numa_cpus ← NUMA nodes with CPUs; from the NPU accelerators
    (by logical ``index``): topo_affinity ← local_cpus, running_npus ← those whose
    ``attributes["processes"]`` is non-empty (or ``attributes["running"] == "true"``),
    total_logic_npus ← their count, device_type ← when every NPU agrees: the npu-smi probe's
    ``attributes["series"]`` (which also knows two chips per card mean A3), else the model.
    """
    out = dict(as_object(obj))
    npus = sorted((a for a in topo.accelerators if a.kind == pb.ACCELERATOR_KIND_NPU), key=lambda a: a.index)

    def fill(field: str, value: Any) -> None:
        if out.get(field) is None and value:
            out[field] = value

    fill("allowed_cpus", format_cpulist(topo.allowed_cpus))
    fill(
        "numa_cpus", {str(n.id): format_cpulist(n.cpus) for n in sorted(topo.numa_nodes, key=lambda n: n.id) if n.cpus}
    )
    if npus:
        fill("topo_affinity", {str(a.index): format_cpulist(a.local_cpus) for a in npus if a.local_cpus})
        if out.get("running_npus") is None:
            out["running_npus"] = [a.index for a in npus if _is_running(a)]
        fill("total_logic_npus", len(npus))
        types = {_npu_type(a) for a in npus}
        if len(types) == 1:
            fill("device_type", types.pop())
    return out


def _is_running(npu: pb.Accelerator) -> bool:
    return bool(npu.attributes.get("processes", "").strip()) or npu.attributes.get("running") == "true"


def _npu_type(npu: pb.Accelerator) -> str | None:
    series = npu.attributes.get("series", "").strip()
    if series:
        # Series the reference has no type for (first-generation 910, 310B …) stay as named: an
        # unknown type selects topo_affinity, as the reference does.
        return device_type_of(series) or series.upper()
    return device_type_of(npu.model)


# ---- decision → plan -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ThreadRoles:
    """comm patterns (``re.fullmatch``) of the threads pinned apart; every other thread is "main".

    The reference matches ``acl_thread`` / ``release_thread`` anywhere in a ``ps -Te`` line.
    """

    acl: str = r".*acl_thread.*"
    release: str = r".*release_thread.*"

    @property
    def main(self) -> str:
        # Disjoint from the role patterns, so the three actions hold whatever order the engine uses.
        return rf"(?!(?:{self.acl})\Z)(?!(?:{self.release})\Z).*"


@dataclass(frozen=True)
class NpuIrqs:
    """The NPU's own SQ and CQ IRQ numbers (its ``msi_irqs`` named ``sq_send_trigger_irq`` /
    ``cq_update_irq`` in /proc/interrupts), when the caller resolved them."""

    sq: tuple[int, ...] = ()
    cq: tuple[int, ...] = ()


def to_binding_plan(
    decision: CpuBindingDecision,
    req: CpuBindingRequest,
    pid: int,
    *,
    plan_id: str,
    thread_roles: ThreadRoles | None = None,
    npu: int | None = None,
    irqs: NpuIrqs | None = None,
    topology_fingerprint: str = "",
) -> planpb.BindingPlan:
    """Bind process ``pid`` to the pool of ``npu`` (default: the decision's single running NPU).

    Actions in the reference's order: main threads, ACL threads, release threads
    (required); page migration to the pool's NUMA node(s) (optional); the NPU's SQ/CQ IRQs to the
    two IRQ CPUs (optional). IRQs go by number when ``irqs`` is given; by name pattern only when the
    host has a single NPU, since the names are the same for every chip and a pattern would move
    every NPU's IRQs.
    """
    check_plan_target(pid, plan_id)
    roles = thread_roles or ThreadRoles()
    for name, pattern in (("acl", roles.acl), ("release", roles.release)):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise PlanError("invalid_request", f"thread_roles.{name}: bad pattern {pattern!r}: {exc}") from None
    if npu is None:
        if len(decision.npus) != 1:
            running = ", ".join(str(p.npu) for p in decision.npus)
            raise PlanError(
                "invalid_request", f"the decision covers NPUs {running}: say which NPU's pool pid {pid} gets"
            )
        npu = decision.npus[0].npu
    pool = decision.pool(npu)
    prefix = f"npu{npu}"
    actions: list[planpb.PlanAction] = []

    def threads(role: str, pattern: str, cpus: Iterable[int]) -> None:
        affinity = planpb.ThreadAffinity(
            pid=pid, threads=planpb.ThreadSelector(name_pattern=pattern), cpus=sorted(cpus), role=role
        )
        actions.append(planpb.PlanAction(id=f"{prefix}-{role}", required=True, thread_affinity=affinity))

    threads("main", roles.main, pool.main)
    threads("acl", roles.acl, [pool.acl])
    threads("release", roles.release, [pool.release])

    notes: list[str] = []
    migration = _page_migration(pool, req, pid)
    if migration is None:
        notes.append("no page migration: numa_cpus does not place the pool on a node other nodes could move from")
    else:
        actions.append(planpb.PlanAction(id=f"{prefix}-migrate", required=False, page_migration=migration))

    sq_cpu, cq_cpu = pool.irq
    if irqs is not None:
        for kind, numbers, cpu in (("sq", irqs.sq, sq_cpu), ("cq", irqs.cq, cq_cpu)):
            for irq in sorted(set(numbers)):
                actions.append(
                    planpb.PlanAction(
                        id=f"{prefix}-irq-{kind}-{irq}",
                        required=False,
                        irq_affinity=planpb.IrqAffinity(irq=irq, cpus=[cpu]),
                    )
                )
    elif req.total_npus == 1:
        for kind, pattern, cpu in (("sq", SQ_IRQ_PATTERN, sq_cpu), ("cq", CQ_IRQ_PATTERN, cq_cpu)):
            actions.append(
                planpb.PlanAction(
                    id=f"{prefix}-irq-{kind}",
                    required=False,
                    irq_affinity=planpb.IrqAffinity(name_pattern=pattern, cpus=[cpu]),
                )
            )
    else:
        notes.append(
            f"no IRQ binding: {req.total_npus} NPUs share the IRQ names and the NPU's IRQ numbers were not given"
        )

    main = format_cpulist(pool.main)
    desc = (
        f"{POLICY} ({decision.mode}): pid {pid} on NPU {npu}: main {main}, acl {pool.acl}, "
        f"release {pool.release}, IRQ CPUs {sq_cpu},{cq_cpu}"
    )
    return planpb.BindingPlan(
        plan_id=plan_id,
        policy=POLICY,
        description="; ".join([desc, *notes]),
        actions=actions,
        topology_fingerprint=topology_fingerprint,
    )


def pool_nodes(pool: NpuPool, numa_cpus: Mapping[int, Sequence[int]]) -> tuple[int, ...]:
    """The NUMA nodes the pool's CPUs are on (the reference used only pool[0]'s node)."""
    return tuple(sorted(_Numa(numa_cpus).nodes(pool.cpus)))


def _page_migration(pool: NpuPool, req: CpuBindingRequest, pid: int) -> planpb.PageMigration | None:
    if not req.numa_cpus:
        return None
    to_nodes = pool_nodes(pool, req.numa_cpus)
    from_nodes = sorted(n for n, cpus in req.numa_cpus.items() if cpus and n not in to_nodes)
    if not to_nodes or not from_nodes:
        return None
    return planpb.PageMigration(pid=pid, from_nodes=from_nodes, to_nodes=to_nodes)


# ---- examples ------------------------------------------------------------------------------------
def example_a3_request() -> dict[str, Any]:
    """The A3 host of vLLM-Ascend's CPU-binding design document: 640 CPUs on 8 nodes of 80, 16 NPUs,
    all running."""
    return {
        "device_type": "A3",
        "allowed_cpus": "0-639",
        "running_npus": list(range(16)),
        "total_logic_npus": 16,
        "numa_cpus": {str(n): f"{80 * n}-{80 * n + 79}" for n in range(8)},
    }
