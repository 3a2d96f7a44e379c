"""The runners behind ``memtopo plan``: discovery of the facts a request leaves out, the policies,
and the BindingPlan a decision becomes (``memtopo.cli.plan`` parses and answers; this does the work)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from google.protobuf import json_format

from memtopo.cli.plan_errors import InvalidRootError, UsageError
from memtopo.pci import parse_bdf
from memtopo.planner import cpu_binding, guest_pci, hccs, place, xpu
from memtopo.planner.errors import PlanError
from memtopo.planner.request import as_object, reject_unknown
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

if TYPE_CHECKING:
    from memtopo.apply.host import HostFiles

CPU_BINDING_KEYS: Final = ("device_type", "allowed_cpus", "running_npus", "total_logic_npus", "topo_affinity",
                           "numa_cpus")
# Without these cpu_binding.parse_request refuses the request, so their absence asks for discovery.
CPU_BINDING_REQUIRED: Final = ("device_type", "allowed_cpus", "running_npus")
LIVE: Final = "live host"


def _check_plan_options(args: argparse.Namespace) -> None:
    """Options that shape a plan make no sense without the process it binds."""
    if args.pid is not None:
        if args.pid <= 0:
            raise UsageError(f"--pid {args.pid}: a process id is a positive number")
        return
    given = [opt for opt, value in (("--npu", getattr(args, "npu", None)), ("--plan-id", args.plan_id))
             if value is not None]
    if args.emit in ("plan", "both"):
        given.append(f"--emit {args.emit}")
    if given:
        raise UsageError(f"{given[0]} needs --pid: there is no plan without a process to bind")


# ---- topology facts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Facts:
    """A discovered topology, where it came from, and the NPUs' own SQ/CQ IRQs on that root."""

    topology: pb.MemoryTopology
    source: str  # the --root argument, or LIVE
    npu_irqs: Mapping[int, cpu_binding.NpuIrqs] = field(default_factory=dict)  # logical NPU id → IRQs

    def to_json(self, filled: Sequence[str], notes: Sequence[str] = ()) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "node_name": self.topology.node_name,
                               "fingerprint": self.topology.fingerprint, "filled": list(filled)}
        if notes:
            out["notes"] = list(notes)
        return out


def discover_facts(root: str | None, with_irqs: bool = False, pid: int | None = None) -> Facts:
    """Discovery of ``root`` (None: this host); with the NPUs' IRQs when a plan will bind them.

    A plan for this host binds a process that runs here: ``pid`` must (a captured root has no
    processes; `memtopo apply` checks it where the plan runs)."""
    from memtopo.apply.host import HostFiles, Procs
    from memtopo.cli.discovering import DiscoveryError, discovered
    from memtopo.hostfs import HostFS

    if root is None and pid is not None and Procs(HostFiles(HostFS.at("/"))).stat(pid) is None:
        raise UsageError(f"--pid {pid}: no such process on this host")
    try:
        with discovered(root) as (ctx, topo):
            found = npu_irqs(HostFiles(ctx.fs), topo) if with_irqs else {}
    except DiscoveryError as exc:
        raise InvalidRootError(str(exc)) from None
    return Facts(topo, root if root is not None else LIVE, found)


def npu_irqs(files: HostFiles, topo: pb.MemoryTopology) -> dict[int, cpu_binding.NpuIrqs]:
    """Each NPU's SQ and CQ IRQs: its PCI function's ``msi_irqs`` whose action is
    ``sq_send_trigger_irq`` / ``cq_update_irq``, the names the Ascend driver gives them (vLLM-Ascend
    instead takes the first matching SQ IRQ and guesses CQ = SQ + 1).
    NPUs without such vectors are left out, so the plan falls back as the planner decides."""
    from memtopo.apply import irqs

    table: dict[int, irqs.IrqLine] | None = None
    out: dict[int, cpu_binding.NpuIrqs] = {}
    for acc in topo.accelerators:
        if acc.kind != pb.ACCELERATOR_KIND_NPU or parse_bdf(acc.bdf) is None:
            continue
        vectors = irqs.msi_irqs(files, acc.bdf)
        if not vectors:
            continue
        if table is None:
            table = irqs.read_interrupts(files)
        names = {v: irqs.action_names(files, v, table.get(v)) for v in vectors}
        sq = tuple(v for v in vectors if cpu_binding.SQ_IRQ_PATTERN in names[v])
        cq = tuple(v for v in vectors if cpu_binding.CQ_IRQ_PATTERN in names[v])
        if sq or cq:
            out[acc.index] = cpu_binding.NpuIrqs(sq, cq)
    return out


def _missing(obj: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    return [k for k in keys if obj.get(k) is None]


# ---- policies ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanOutput:
    decision: dict[str, Any]
    plan: planpb.BindingPlan | None = None


def run_cpu_binding(args: argparse.Namespace, obj: Any) -> PlanOutput:
    _check_plan_options(args)
    body = as_object(obj)
    # cpu_binding.parse_request ignores keys it does not know; a misspelt fact must not be dropped.
    reject_unknown(body, CPU_BINDING_KEYS, "request")
    facts: Facts | None = None
    added: list[str] = []
    if args.root is not None or _missing(body, CPU_BINDING_REQUIRED):
        facts = discover_facts(args.root, with_irqs=args.pid is not None, pid=args.pid)
        filled = cpu_binding.fill_from_topology(body, facts.topology)
        still = _missing(filled, CPU_BINDING_REQUIRED)
        if still:
            raise PlanError("invalid_request", f"{still[0]}: not in the request, and discovery of {facts.source} "
                                               "does not give it")
        added = [k for k in CPU_BINDING_KEYS if body.get(k) is None and filled.get(k) is not None]
        body = filled
    req = cpu_binding.parse_request(body)
    decision = cpu_binding.decide(req)
    doc: dict[str, Any] = {"policy": cpu_binding.POLICY, **decision.to_json()}
    if facts is not None:
        doc["facts"] = facts.to_json(added)
    plan = _cpu_binding_plan(args, decision, req, facts) if args.pid is not None else None
    return PlanOutput(doc, plan)


def _npu_of_pid(facts: Facts | None, pid: int, decision: cpu_binding.CpuBindingDecision) -> int | None:
    """The running NPU whose npu-smi process list names ``pid``, if exactly one does."""
    if facts is None:
        return None
    running = {p.npu for p in decision.npus}
    hits = {a.index for a in facts.topology.accelerators
            if a.kind == pb.ACCELERATOR_KIND_NPU and a.index in running
            and str(pid) in a.attributes.get("processes", "").split(",")}
    return hits.pop() if len(hits) == 1 else None


def _cpu_binding_plan(args: argparse.Namespace, decision: cpu_binding.CpuBindingDecision,
                      req: cpu_binding.CpuBindingRequest, facts: Facts | None) -> planpb.BindingPlan:
    pid: int = args.pid
    npu: int | None = args.npu
    if npu is None:
        if len(decision.npus) == 1:
            npu = decision.npus[0].npu
        else:
            npu = _npu_of_pid(facts, pid, decision)
            if npu is None:
                running = ", ".join(str(p.npu) for p in decision.npus)
                raise PlanError("invalid_request", f"--npu: the decision covers NPUs {running} and none of them "
                                                   f"lists pid {pid} as its process: say which NPU's pool it gets")
    irq = facts.npu_irqs.get(npu) if facts is not None else None
    return named_plan(args.plan_id, f"pid{pid}-npu{npu}", lambda plan_id: cpu_binding.to_binding_plan(
        decision, req, pid, plan_id=plan_id, npu=npu, irqs=irq,
        # apply then refuses the plan on a host whose topology is not the one it was made for.
        topology_fingerprint=facts.topology.fingerprint if facts is not None else "",
    ))


def named_plan(plan_id: str | None, subject: str, build: Callable[[str], planpb.BindingPlan]) -> planpb.BindingPlan:
    """The plan ``build`` makes under ``plan_id`` (--plan-id), or else under its default id."""
    plan = build(plan_id if plan_id is not None else "pending")  # any non-empty id: replaced below
    if plan_id is None:
        plan.plan_id = default_plan_id(plan, subject)
    return plan


def default_plan_id(plan: planpb.BindingPlan, subject: str) -> str:
    """``<policy>-<subject>-<12 hex of the content>`` (subject ``pid<P>-npu<N>``, ``pid<P>``):
    planning the same thing again gives the same id, which apply answers from its store; a different
    plan gets a different id instead of a clash."""
    from memtopo.apply.journal import plan_hash

    anonymous = planpb.BindingPlan()
    anonymous.CopyFrom(plan)
    anonymous.plan_id = ""
    return f"{plan.policy}-{subject}-{plan_hash(anonymous)[:12]}"


def fill_guest_pci(body: Mapping[str, Any], facts: Facts) -> tuple[dict[str, Any], list[str], list[str]]:
    """A copy of the request whose devices without ``numa_node`` get their node from the topology
    (-1, no affinity, for a BDF the host does not have: upstream's "failed to read host NUMA
    affinity"); the fields filled and notes on the BDFs not found."""
    out = dict(body)
    devices = body.get("devices")
    if not isinstance(devices, list):
        return out, [], []
    nodes = {d.bdf.lower(): d.numa_node for d in facts.topology.pci_devices}
    filled: list[str] = []
    notes: list[str] = []
    new: list[Any] = []
    for i, dev in enumerate(devices):
        if isinstance(dev, Mapping) and "numa_node" not in dev and isinstance(dev.get("bdf"), str):
            bdf = dev["bdf"].strip().lower()
            node = nodes.get(bdf)
            if node is None:
                notes.append(f"devices[{i}]: {bdf} is not a PCI device of {facts.source}: no NUMA affinity")
            dev = {**dev, "numa_node": -1 if node is None else node}
            filled.append(f"devices[{i}].numa_node")
        new.append(dev)
    out["devices"] = new
    return out, filled, notes


def _lacks_numa_node(obj: Mapping[str, Any]) -> bool:
    devices = obj.get("devices")
    return isinstance(devices, list) and any(isinstance(d, Mapping) and "numa_node" not in d for d in devices)


def run_guest_pci(args: argparse.Namespace, obj: Any) -> PlanOutput:
    body = as_object(obj)
    facts: Facts | None = None
    if args.root is not None or _lacks_numa_node(body):
        facts = discover_facts(args.root)
        body, filled, notes = fill_guest_pci(body, facts)
    decision = guest_pci.decide(guest_pci.parse_request(body))
    doc = decision.to_json()
    if facts is not None:
        doc["facts"] = facts.to_json(filled, notes)
    return PlanOutput(doc)


def parse_topology(obj: Any) -> pb.MemoryTopology:
    """A MemoryTopology from proto3 JSON (what ``memtopo topo --format json`` prints)."""
    from memtopo.protojson import ProtoJsonError, from_json

    topo = pb.MemoryTopology()
    try:
        from_json(dict(as_object(obj, "topology")), topo)
    except ProtoJsonError as exc:
        raise PlanError("invalid_request", f"topology: not a MemoryTopology in proto3 JSON: {exc}") from None
    return topo


def run_place(args: argparse.Namespace, obj: Any) -> PlanOutput:
    body = dict(as_object(obj))
    inline = body.pop("topology", None)
    _check_plan_options(args)
    # Parsed before discovery: a bad request is refused without waiting for the host.
    req = place.parse_request(body)
    facts: Facts | None = None
    if inline is not None:
        if args.root is not None:
            raise UsageError("the request carries a topology and --root names another; give one of them")
        topo = parse_topology(inline)
    else:
        facts = discover_facts(args.root, pid=args.pid)
        topo = facts.topology
    decision = place.decide(req, topo)
    doc = decision.to_json()
    if facts is not None:
        doc["facts"] = facts.to_json(["topology"])
    pid: int | None = args.pid
    plan = None if pid is None else named_plan(
        args.plan_id, f"pid{pid}", lambda plan_id: place.to_binding_plan(decision, topo, pid, plan_id=plan_id))
    return PlanOutput(doc, plan)


def run_hccs(args: argparse.Namespace, obj: Any) -> PlanOutput:
    return PlanOutput(hccs.decide(hccs.parse_request(obj)).to_json())


def run_xpu(args: argparse.Namespace, obj: Any) -> PlanOutput:
    return PlanOutput(xpu.decide(xpu.parse_request(obj)).to_json())


# ---- output ------------------------------------------------------------------------------------------
def plan_json(plan: planpb.BindingPlan) -> dict[str, Any]:
    """proto3 JSON with the .proto's field names, as ``apply.planio.load_plan`` reads it."""
    return json_format.MessageToDict(plan, preserving_proto_field_name=True)


def emit(args: argparse.Namespace, out: PlanOutput) -> dict[str, Any]:
    emit: str | None = getattr(args, "emit", None)
    if out.plan is None or emit == "decision":
        return out.decision
    if emit == "plan":
        return plan_json(out.plan)
    return {"decision": out.decision, "plan": plan_json(out.plan)}
