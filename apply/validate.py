"""Validation of a plan against the current topology and host, before anything is touched.

Two kinds of problems:

* **Rejections** refuse the whole plan, whatever the action's ``required`` flag: malformed or
  hostile input (missing oneof, duplicate ids, bad regex or BDF, ``..`` paths, huge lists), CPUs
  or nodes the topology does not have, protected processes (pid 1, kernel threads, the agent),
  contradictions between actions.
* **Host conditions** (the process or IRQ is gone, a pattern matches nothing, no cpuset hierarchy)
  reject a required action but only skip an optional one, with the reason (seed 000: IRQ binding
  and migration are conditional).

Each rejection is ``"<action id>: <reason>"`` (``"plan: …"`` for the plan itself). Validation
also resolves every selector (threads, IRQs, cgroups) so apply works on what was checked.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from memtopo.apply import cgroups, irqs
from memtopo.apply.cgroups import Hierarchy
from memtopo.apply.config import ApplyConfig
from memtopo.apply.host import Host, Ids
from memtopo.cpulist import MAX_ID, format_cpulist
from memtopo.hostfs import HostReadError
from memtopo.pci import parse_bdf
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

MAX_PLAN_ID = 128
MAX_ACTION_ID = 64
MAX_TEXT = 4096
MAX_PARTITION_VALUES = ("", "member", "root", "isolated")
_ACTION_ID = re.compile(r"[A-Za-z0-9_.:@/+-]+")

Mode = planpb.MemoryPolicy.Mode


@dataclass(frozen=True)
class ProcRef:
    pid: int
    starttime: int
    comm: str

    def describe(self) -> str:
        return f"pid {self.pid} ({self.comm})"


@dataclass(frozen=True)
class ThreadTarget:
    proc: ProcRef
    tids: tuple[int, ...]
    selector: str
    cpus: frozenset[int]
    # Thread names, when the selection read them (name_pattern).
    names: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CpusetTarget:
    hierarchy: Hierarchy
    path: str
    exists: bool
    create: bool
    cpus: Ids | None
    mems: Ids | None
    attach: tuple[ProcRef, ...] = ()
    partition: str = ""


@dataclass(frozen=True)
class IrqTarget:
    irqs: tuple[int, ...]
    selector: str
    cpus: Ids
    names: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MigrationTarget:
    proc: ProcRef
    from_nodes: Ids
    to_nodes: Ids


@dataclass(frozen=True)
class MemPolicyTarget:
    proc: ProcRef
    nodes: Ids
    cpuset: CpusetTarget
    migration: MigrationTarget | None


Target = ThreadTarget | CpusetTarget | IrqTarget | MigrationTarget | MemPolicyTarget


@dataclass(frozen=True)
class Validation:
    rejections: tuple[str, ...]
    # Optional actions that will be skipped, and why (also: memory policy on Unified domains).
    skips: Mapping[str, str]
    targets: Mapping[str, Target]

    @property
    def ok(self) -> bool:
        return not self.rejections


@dataclass(frozen=True)
class TopologyFacts:
    """What validation needs from a MemoryTopology, as sets."""

    online_cpus: frozenset[int]
    allowed_cpus: frozenset[int]
    nodes: frozenset[int]
    online_nodes: frozenset[int]
    memory_nodes: frozenset[int]
    allowed_mems: frozenset[int]
    unified_nodes: frozenset[int]
    fingerprint: str

    @classmethod
    def of(cls, topo: pb.MemoryTopology) -> TopologyFacts:
        online = frozenset(topo.cpus.online)
        allowed = frozenset(topo.allowed_cpus) & online if topo.allowed_cpus else online
        online_nodes = frozenset(n.id for n in topo.numa_nodes if n.state == pb.NUMA_NODE_STATE_ONLINE)
        memory = frozenset(n.id for n in topo.numa_nodes
                           if n.state == pb.NUMA_NODE_STATE_ONLINE and n.has_memory)
        allowed_mems = frozenset(topo.allowed_memory_nodes) & memory if topo.allowed_memory_nodes else memory
        unified = frozenset(n for d in topo.domains if d.type == pb.MEMORY_DOMAIN_TYPE_UNIFIED for n in d.numa_nodes)
        return cls(online, allowed or online, frozenset(n.id for n in topo.numa_nodes), online_nodes, memory,
                   allowed_mems or memory, unified, topo.fingerprint)


def _fmt(ids: Iterable[int], limit: int = 8) -> str:
    ids = sorted(ids)
    text = format_cpulist(ids[:limit])
    return text + (f" … ({len(ids)} in all)" if len(ids) > limit else "")


class Validator:
    def __init__(self, host: Host, topo: pb.MemoryTopology, config: ApplyConfig,
                 hierarchy: Hierarchy | str | None = None) -> None:
        self.host = host
        self.procs = host.procs
        self.facts = TopologyFacts.of(topo)
        self.config = config
        self._hierarchy = hierarchy
        self.rejections: list[str] = []
        self.skips: dict[str, str] = {}
        self.targets: dict[str, Target] = {}
        self._interrupts: dict[int, irqs.IrqLine] | None = None
        self._cpus_ok: dict[tuple[int, ...], Ids] = {}

    # ---- shared ------------------------------------------------------------------------------------
    @property
    def hierarchy(self) -> Hierarchy | str:
        if self._hierarchy is None:
            self._hierarchy = cgroups.detect(self.host.files, self.config.cgroup_version)
        return self._hierarchy

    def reject(self, aid: str, reason: str) -> None:
        self.rejections.append(f"{aid}: {reason}")

    def host_problem(self, action: planpb.PlanAction, reason: str) -> None:
        if action.required:
            self.reject(action.id, reason)
        else:
            self.skips.setdefault(action.id, reason)

    def run(self, plan: planpb.BindingPlan) -> Validation:
        self._plan(plan)
        if not self.rejections:
            seen: dict[str, int] = {}
            for i, action in enumerate(plan.actions):
                self._action(i, action, seen)
            if not self.rejections:
                self._cross(plan)
        for aid in list(self.skips):
            self.targets.pop(aid, None)
        return Validation(tuple(self.rejections), dict(self.skips), dict(self.targets))

    def _plan(self, plan: planpb.BindingPlan) -> None:
        if not plan.plan_id.strip():
            self.reject("plan", "plan_id is empty")
        elif len(plan.plan_id) > MAX_PLAN_ID:
            self.reject("plan", f"plan_id is longer than {MAX_PLAN_ID} characters")
        elif not plan.plan_id.isprintable():
            self.reject("plan", "plan_id contains control characters")
        if len(plan.description) > MAX_TEXT or len(plan.policy) > MAX_TEXT:
            self.reject("plan", f"description or policy longer than {MAX_TEXT} characters")
        if not plan.actions:
            self.reject("plan", "the plan has no actions")
        elif len(plan.actions) > self.config.max_actions:
            self.reject("plan", f"{len(plan.actions)} actions, more than the limit of {self.config.max_actions}")
        if plan.topology_fingerprint and self.facts.fingerprint and plan.topology_fingerprint != self.facts.fingerprint:
            self.reject("plan", f"computed for topology {plan.topology_fingerprint[:16]}…, "
                                f"the host's is now {self.facts.fingerprint[:16]}…: re-plan")

    def _action(self, index: int, action: planpb.PlanAction, seen: dict[str, int]) -> None:
        aid = action.id
        label = aid or f"action[{index}]"
        if not aid:
            self.reject(label, "action id is empty")
            return
        if len(aid) > MAX_ACTION_ID or not _ACTION_ID.fullmatch(aid):
            self.reject(f"action[{index}]", f"action id {aid[:MAX_ACTION_ID]!r} must be 1-{MAX_ACTION_ID} "
                                            "characters of letters, digits and _.:@/+-")
            return
        if aid in seen:
            self.reject(aid, f"duplicate action id (also action[{seen[aid]}])")
            return
        seen[aid] = index
        kind = action.WhichOneof("action")
        if kind is None:
            self.reject(aid, "no action set (one of thread_affinity, cpuset, memory_policy, irq_affinity, "
                             "page_migration)")
        elif kind == "thread_affinity":
            self._threads(action, action.thread_affinity)
        elif kind == "cpuset":
            self._cpuset(action, action.cpuset)
        elif kind == "memory_policy":
            self._mempolicy(action, action.memory_policy)
        elif kind == "irq_affinity":
            self._irq(action, action.irq_affinity)
        elif kind == "page_migration":
            self._migration(action, action.page_migration)

    # ---- value checks ------------------------------------------------------------------------------
    def _cpus(self, aid: str, cpus: Sequence[int], name: str = "cpus", allow_empty: bool = False) -> Ids | None:
        # Plans repeat one CPU list over many actions (an IRQ action per vector): a list that
        # passed once passes again, the facts being fixed for this validation.
        key = tuple(cpus)
        ok = self._cpus_ok.get(key)
        if ok is not None:
            return ok
        checked = self._check_cpus(aid, cpus, name, allow_empty)
        if checked:
            self._cpus_ok[key] = checked
        return checked

    def _check_cpus(self, aid: str, cpus: Sequence[int], name: str, allow_empty: bool) -> Ids | None:
        if len(cpus) > self.config.max_ids:
            self.reject(aid, f"{name}: {len(cpus)} entries, more than any machine's {self.config.max_ids} CPUs")
            return None
        if not cpus:
            if not allow_empty:
                self.reject(aid, f"{name}: empty CPU set")
            return None if not allow_empty else ()
        if len(set(cpus)) != len(cpus):
            self.reject(aid, f"{name}: CPU ids repeat")
            return None
        unknown = [c for c in cpus if c >= MAX_ID]
        if unknown:
            self.reject(aid, f"{name}: CPU {unknown[0]} does not exist")
            return None
        offline = set(cpus) - self.facts.online_cpus
        if offline:
            self.reject(aid, f"{name}: CPU {_fmt(offline)} not online (online: {_fmt(self.facts.online_cpus)})")
            return None
        outside = set(cpus) - self.facts.allowed_cpus
        if outside:
            self.reject(aid, f"{name}: CPU {_fmt(outside)} not in the allowed CPUs ({_fmt(self.facts.allowed_cpus)})")
            return None
        return tuple(sorted(cpus))

    def _nodes(self, aid: str, nodes: Sequence[int], name: str, need_memory: bool = True) -> Ids | None:
        if len(nodes) > self.config.max_ids:
            self.reject(aid, f"{name}: {len(nodes)} entries, more than any machine's nodes")
            return None
        if not nodes:
            self.reject(aid, f"{name}: empty node set")
            return None
        if len(set(nodes)) != len(nodes):
            self.reject(aid, f"{name}: node ids repeat")
            return None
        for n in sorted(nodes):
            if n not in self.facts.nodes:
                self.reject(aid, f"{name}: NUMA node {n} does not exist")
                return None
            if n not in self.facts.online_nodes:
                self.reject(aid, f"{name}: NUMA node {n} is not online")
                return None
            if need_memory and n not in self.facts.memory_nodes:
                self.reject(aid, f"{name}: NUMA node {n} has no memory")
                return None
            if need_memory and n not in self.facts.allowed_mems:
                self.reject(aid, f"{name}: NUMA node {n} is not in the allowed memory nodes "
                                 f"({_fmt(self.facts.allowed_mems)})")
                return None
        return tuple(sorted(nodes))

    def _proc(self, action: planpb.PlanAction, pid: int, name: str = "pid") -> ProcRef | None:
        aid = action.id
        if pid <= 0:
            self.reject(aid, f"{name}: {pid} is not a process id")
            return None
        if pid == 1 and not self.config.allow_init:
            self.reject(aid, f"{name}: pid 1 (init) is refused (config allow_init)")
            return None
        if pid == self.config.self_pid and not self.config.allow_self:
            self.reject(aid, f"{name}: pid {pid} is the agent itself (config allow_self)")
            return None
        if pid in self.config.protected_pids and not self.config.allow_self:
            self.reject(aid, f"{name}: pid {pid} is the running memtopo agent (config allow_self)")
            return None
        st = self.procs.stat(pid)
        if st is None:
            self.host_problem(action, f"{name}: process {pid} does not exist")
            return None
        if st.is_kernel_thread and not self.config.allow_kernel_threads:
            self.reject(aid, f"{name}: pid {pid} ({st.comm}) is a kernel thread (config allow_kernel_threads)")
            return None
        tgid = self.procs.status(pid).get("Tgid")
        if tgid is not None and tgid.isdigit() and int(tgid) != pid:
            if int(tgid) == self.config.self_pid and not self.config.allow_self:
                self.reject(aid, f"{name}: {pid} is a thread of the agent itself")
            elif int(tgid) in self.config.protected_pids and not self.config.allow_self:
                self.reject(aid, f"{name}: {pid} is a thread of the running memtopo agent")
            else:
                self.reject(aid, f"{name}: {pid} is a thread of process {tgid}, not a process")
            return None
        if st.state in ("Z", "X"):
            self.host_problem(action, f"{name}: process {pid} has exited (state {st.state})")
            return None
        return ProcRef(pid, st.starttime, st.comm)

    def _regex(self, aid: str, pattern: str, name: str) -> re.Pattern[str] | None:
        if not pattern:
            self.reject(aid, f"{name}: empty pattern")
            return None
        if len(pattern) > self.config.max_pattern_len:
            self.reject(aid, f"{name}: pattern longer than {self.config.max_pattern_len} characters")
            return None
        try:
            return re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            self.reject(aid, f"{name}: bad regular expression {pattern!r}: {exc}")
            return None

    # ---- per kind ----------------------------------------------------------------------------------
    def _threads(self, action: planpb.PlanAction, ta: planpb.ThreadAffinity) -> None:
        aid = action.id
        cpus = self._cpus(aid, ta.cpus)
        sel = ta.threads.WhichOneof("selector") if ta.HasField("threads") else None
        if sel is None:
            self.reject(aid, "threads: no selector (all, tids, name_pattern or main_thread)")
            return
        if (sel == "all" and not ta.threads.all) or (sel == "main_thread" and not ta.threads.main_thread):
            self.reject(aid, f"threads.{sel} is false: it selects nothing")
            return
        if sel == "tids" and len(ta.threads.tids.tids) > self.config.max_tids:
            self.reject(aid, f"threads.tids: {len(ta.threads.tids.tids)} entries, more than {self.config.max_tids}")
            return
        pattern = self._regex(aid, ta.threads.name_pattern, "threads.name_pattern") if sel == "name_pattern" else None
        if sel == "name_pattern" and pattern is None:
            return
        proc = self._proc(action, ta.pid)
        if proc is None or cpus is None:
            return
        names: dict[int, str] = {}
        if sel == "main_thread":
            tids: list[int] = [proc.pid]
            selector = "main thread"
        else:
            live = self.procs.tids(proc.pid)
            if sel == "all":
                tids, selector = sorted(live), "all threads"
            elif sel == "tids":
                want = list(ta.threads.tids.tids)
                if not want:
                    self.reject(aid, "threads.tids: empty list")
                    return
                if len(set(want)) != len(want):
                    self.reject(aid, "threads.tids: tids repeat")
                    return
                missing = set(want) - set(live)
                if missing:
                    self.host_problem(action, f"threads.tids: {_fmt(missing)} not thread(s) of pid {proc.pid}")
                    return
                tids, selector = sorted(want), f"tids {_fmt(want)}"
            else:
                assert pattern is not None
                for tid in sorted(live):
                    comm = self.procs.comm(proc.pid, tid)
                    if comm is not None and pattern.fullmatch(comm):
                        names[tid] = comm
                tids, selector = sorted(names), f"threads named {pattern.pattern!r}"
        if not tids:
            self.host_problem(action, f"no thread of pid {proc.pid} matches ({selector})")
            return
        self.targets[aid] = ThreadTarget(proc, tuple(tids), selector, frozenset(cpus), names)

    def _cgroup_path(self, action: planpb.PlanAction, hier: Hierarchy, path: str) -> str | None:
        problem = cgroups.path_problem(path, self.config.cgroup_prefixes)
        if problem is not None:
            self.reject(action.id, problem)
            return None
        rel = hier.dir(cgroups.normalize(path))
        escape = self.host.files.resolve_inside(rel, hier.mount)
        if escape is not None:
            self.reject(action.id, f"cgroup path {path!r} {escape}")
            return None
        return cgroups.normalize(path)

    def _cpuset(self, action: planpb.PlanAction, cs: planpb.CpusetAssignment) -> None:
        aid = action.id
        target = cs.WhichOneof("target")
        if target is None:
            self.reject(aid, "cpuset: no target (cgroup_path or pid_cgroup)")
            return
        cpus = self._cpus(aid, cs.cpus) if cs.cpus else None
        mems = self._nodes(aid, cs.mems, "mems") if cs.mems else None
        if (cs.cpus and cpus is None) or (cs.mems and mems is None):
            return
        if cs.partition not in MAX_PARTITION_VALUES:
            self.reject(aid, f"partition {cs.partition[:40]!r} is not one of member, root, isolated")
            return
        if len(cs.attach_pids) > self.config.max_attach_pids:
            self.reject(aid, f"attach_pids: {len(cs.attach_pids)} entries, more than {self.config.max_attach_pids}")
            return
        if len(set(cs.attach_pids)) != len(cs.attach_pids):
            self.reject(aid, "attach_pids: pids repeat")
            return
        if target == "pid_cgroup" and cs.create:
            self.reject(aid, "create applies to cgroup_path only (a process's cgroup exists)")
            return
        if cpus is None and mems is None and not cs.partition and not cs.attach_pids and not cs.create:
            self.reject(aid, "cpuset: nothing to change (no cpus, mems, partition or attach_pids)")
            return
        attach: list[ProcRef] = []
        for pid in cs.attach_pids:
            ref = self._proc(action, pid, "attach_pids")
            if ref is None:
                return
            attach.append(ref)
        hier = self.hierarchy
        if isinstance(hier, str):
            self.host_problem(action, f"no cpuset hierarchy: {hier}")
            return
        if cs.partition and hier.version != 2:
            self.reject(aid, f"partition needs cgroup v2 (this host has {hier.describe()})")
            return
        if target == "cgroup_path":
            path = self._cgroup_path(action, hier, cs.cgroup_path)
        else:
            proc = self._proc(action, cs.pid_cgroup, "pid_cgroup")
            path = self._proc_cgroup(action, hier, proc) if proc is not None else None
            if path is not None:
                path = self._cgroup_path(action, hier, path)
        if path is None:
            return
        exists = self.host.files.is_dir(hier.dir(path))
        if not exists and not cs.create:
            self.host_problem(action, f"cgroup {path!r} does not exist in {hier.describe()} (set create)")
            return
        self.targets[aid] = CpusetTarget(hier, path, exists, cs.create and not exists, cpus, mems,
                                         tuple(attach), cs.partition)

    def _proc_cgroup(self, action: planpb.PlanAction, hier: Hierarchy, proc: ProcRef) -> str | None:
        groups = self.procs.cgroups(proc.pid)
        raw = None if groups is None else (groups.v1_cpuset if hier.version == 1 else groups.v2)
        if raw is None:
            self.host_problem(action, f"pid {proc.pid}: no cpuset cgroup in /proc/{proc.pid}/cgroup")
            return None
        path = hier.from_proc(raw)
        if path is None:
            self.host_problem(action, f"pid {proc.pid}: cgroup {raw!r} is outside the mounted hierarchy")
        return path

    def _mempolicy(self, action: planpb.PlanAction, mp: planpb.MemoryPolicy) -> None:
        aid = action.id
        if mp.mode == planpb.MemoryPolicy.MODE_UNSPECIFIED:
            self.reject(aid, "memory_policy: mode is unset")
            return
        if mp.mode != planpb.MemoryPolicy.MODE_BIND:
            name = planpb.MemoryPolicy.Mode.Name(mp.mode) if mp.mode in Mode.values() else str(mp.mode)
            self.reject(aid, f"memory_policy: {name} cannot be imposed on a running process (only MODE_BIND, "
                             "through its cpuset mems); start the process with `memtopo exec` instead")
            return
        nodes = self._nodes(aid, mp.nodes, "nodes")
        proc = self._proc(action, mp.pid)
        if nodes is None or proc is None:
            return
        unified = set(nodes) & self.facts.unified_nodes
        if unified and not mp.apply_on_unified:
            # Seed 002: on unified memory the policy has little effect; skipped unless asked for.
            self.skips[aid] = (f"node(s) {_fmt(unified)} belong to a Unified memory domain: memory policy skipped "
                               "(set apply_on_unified to apply it)")
            return
        hier = self.hierarchy
        if isinstance(hier, str):
            self.host_problem(action, f"no cpuset hierarchy: {hier}")
            return
        current = self._proc_cgroup(action, hier, proc)
        if current is None:
            return
        if cgroups.path_problem(current, self.config.cgroup_prefixes) is None:
            cpuset = CpusetTarget(hier, current, True, False, None, nodes)
        elif hier.version == 1:
            managed = f"{cgroups.normalize(self.config.managed_cgroup)}/pid-{proc.pid}"
            if self._cgroup_path(action, hier, managed) is None:
                return
            cpus = self._effective(hier, current)
            if cpus is None:
                self.host_problem(action, f"pid {proc.pid}: cannot read the CPUs of its cpuset {current!r}")
                return
            exists = self.host.files.is_dir(hier.dir(managed))
            cpuset = CpusetTarget(hier, managed, exists, not exists, cpus, nodes, (proc,))
        else:
            self.host_problem(action, f"pid {proc.pid} is in cgroup /{current} outside the configured prefixes; on "
                                      "cgroup v2 moving it would move every controller: place it with a cpuset "
                                      "action first")
            return
        migration = None
        if mp.migrate_existing:
            away = tuple(sorted(self.facts.memory_nodes - set(nodes)))
            migration = MigrationTarget(proc, away, nodes) if away else None
        self.targets[aid] = MemPolicyTarget(proc, nodes, cpuset, migration)

    def _effective(self, hier: Hierarchy, path: str) -> Ids | None:
        for name in (hier.effective_cpus_file, hier.cpus_file):
            try:
                ids = self.host.files.read_ids(hier.file(path, name))
            except HostReadError:
                continue
            if ids:
                return ids
        return None

    def _irq(self, action: planpb.PlanAction, ia: planpb.IrqAffinity) -> None:
        aid = action.id
        sel = ia.WhichOneof("selector")
        cpus = self._cpus(aid, ia.cpus)
        if sel is None:
            self.reject(aid, "irq_affinity: no selector (irq, pci_bdf or name_pattern)")
            return
        files = self.host.files
        names: dict[int, str] = {}
        if sel == "irq":
            if ia.irq >= irqs.MAX_IRQ:
                self.reject(aid, f"irq: {ia.irq} is not an IRQ number")
                return
            if cpus is None:
                return
            # Its affinity file writable proves the IRQ exists: one system call in the common case.
            if files.writable_by_us(irqs.affinity_file(ia.irq)):
                self.targets[aid] = IrqTarget((ia.irq,), f"IRQ {ia.irq}", cpus, names)
                return
            if not irqs.exists(files, ia.irq):
                self.host_problem(action, f"IRQ {ia.irq} does not exist (no /proc/irq/{ia.irq})")
                return
            found, selector = [ia.irq], f"IRQ {ia.irq}"
        elif sel == "pci_bdf":
            bdf = ia.pci_bdf.strip().lower()
            if len(bdf) > 32 or parse_bdf(bdf) is None:
                self.reject(aid, f"pci_bdf: {ia.pci_bdf[:40]!r} is not a PCI address (DDDD:BB:DD.F)")
                return
            if cpus is None:
                return
            if not files.is_dir(f"sys/bus/pci/devices/{bdf}"):
                self.host_problem(action, f"PCI device {bdf} does not exist")
                return
            found = list(irqs.msi_irqs(files, bdf))
            if not found:
                intx = irqs.intx_irq(files, bdf)
                hint = f" (it uses INTx IRQ {intx}, possibly shared: target it by number)" if intx else ""
                self.host_problem(action, f"PCI device {bdf} has no MSI/MSI-X vectors{hint}")
                return
            selector = f"PCI {bdf} msi_irqs"
        else:
            pattern = self._regex(aid, ia.name_pattern, "name_pattern")
            if pattern is None or cpus is None:
                return
            if self._interrupts is None:
                self._interrupts = irqs.read_interrupts(files)
            found = []
            for irq in sorted(set(self._interrupts) | set(irqs.listed(files))):
                label = irqs.action_names(files, irq, self._interrupts.get(irq))
                if label and pattern.search(label):
                    found.append(irq)
                    names[irq] = label
            if not found:
                self.host_problem(action, f"no IRQ in /proc/interrupts matches {pattern.pattern!r}")
                return
            selector = f"IRQs named {pattern.pattern!r}"
        if cpus is None:
            return
        for irq in found:
            if not files.writable_by_us(irqs.affinity_file(irq)):
                self.host_problem(action, f"/{irqs.affinity_file(irq)} is not writable (read-only /proc, or not "
                                          "privileged: a container needs --privileged)")
                return
        self.targets[aid] = IrqTarget(tuple(found), selector, cpus, names)

    def _migration(self, action: planpb.PlanAction, pm: planpb.PageMigration) -> None:
        aid = action.id
        from_nodes = self._nodes(aid, pm.from_nodes, "from_nodes", need_memory=False)
        to_nodes = self._nodes(aid, pm.to_nodes, "to_nodes")
        if from_nodes is None or to_nodes is None:
            return
        proc = self._proc(action, pm.pid)
        if proc is None:
            return
        self.targets[aid] = MigrationTarget(proc, from_nodes, to_nodes)

    # ---- between actions ---------------------------------------------------------------------------
    def _cross(self, plan: planpb.BindingPlan) -> None:
        threads: dict[tuple[object, ...], tuple[str, frozenset[int]]] = {}
        cgroups_seen: dict[str, tuple[str, CpusetTarget]] = {}
        irq_owner: dict[int, tuple[str, Ids]] = {}
        migrations: dict[int, list[tuple[str, MigrationTarget]]] = {}
        placed: dict[int, tuple[str, CpusetTarget]] = {}
        policies: dict[int, tuple[str, Ids]] = {}

        def place(aid: str, pid: int, cs: CpusetTarget) -> None:
            prev = placed.get(pid)
            if prev is not None and prev[1].path != cs.path:
                self.reject(aid, f"puts pid {pid} in cgroup {cs.path!r}, action {prev[0]} in {prev[1].path!r}")
            placed[pid] = (aid, cs)

        for action in plan.actions:
            aid = action.id
            t = self.targets.get(aid)
            if isinstance(t, ThreadTarget):
                ta = action.thread_affinity
                sel = ta.threads.WhichOneof("selector") or ""
                value: object = tuple(sorted(ta.threads.tids.tids)) if sel == "tids" else getattr(ta.threads, sel)
                key = (t.proc.pid, sel, value)
                prev_t = threads.get(key)
                if prev_t is not None:
                    self._conflict(aid, prev_t[0], prev_t[1] == t.cpus, f"the same threads of pid {t.proc.pid}")
                threads[key] = (aid, t.cpus)
            elif isinstance(t, CpusetTarget | MemPolicyTarget):
                cs = t if isinstance(t, CpusetTarget) else t.cpuset
                prev_c = cgroups_seen.get(cs.path)
                if prev_c is not None:
                    self._conflict(aid, prev_c[0], prev_c[1] == cs, f"cgroup {cs.path!r}")
                cgroups_seen[cs.path] = (aid, cs)
                for ref in cs.attach:
                    place(aid, ref.pid, cs)
                if isinstance(t, MemPolicyTarget):
                    prev_p = policies.get(t.proc.pid)
                    if prev_p is not None:
                        self._conflict(aid, prev_p[0], prev_p[1] == t.nodes, f"the memory policy of pid {t.proc.pid}")
                    policies[t.proc.pid] = (aid, t.nodes)
                    place(aid, t.proc.pid, cs)
                    if t.migration is not None:
                        migrations.setdefault(t.proc.pid, []).append((aid, t.migration))
                elif action.cpuset.WhichOneof("target") == "pid_cgroup":
                    place(aid, action.cpuset.pid_cgroup, cs)
            elif isinstance(t, IrqTarget):
                for irq in t.irqs:
                    prev_i = irq_owner.get(irq)
                    if prev_i is not None:
                        self._conflict(aid, prev_i[0], prev_i[1] == t.cpus, f"IRQ {irq}")
                    irq_owner[irq] = (aid, t.cpus)
            elif isinstance(t, MigrationTarget):
                for other_aid, other in migrations.get(t.proc.pid, []):
                    if set(other.from_nodes) & set(t.from_nodes):
                        same = other.to_nodes == t.to_nodes and other.from_nodes == t.from_nodes
                        self._conflict(aid, other_aid, same, f"pages of pid {t.proc.pid} on the same nodes")
                migrations.setdefault(t.proc.pid, []).append((aid, t))
        # A plan that pins threads or migrates pages outside the cpuset it puts the process in
        # contradicts itself: the kernel would silently narrow or undo it.
        for action in plan.actions:
            t = self.targets.get(action.id)
            if isinstance(t, ThreadTarget) and t.proc.pid in placed:
                where_aid, cs = placed[t.proc.pid]
                if cs.cpus is not None and not t.cpus <= set(cs.cpus):
                    self.reject(action.id, f"CPUs {_fmt(t.cpus - set(cs.cpus))} are outside cgroup {cs.path!r} "
                                           f"that action {where_aid} puts pid {t.proc.pid} in (cpus {_fmt(cs.cpus)})")
            if isinstance(t, MigrationTarget) and t.proc.pid in placed:
                where_aid, cs = placed[t.proc.pid]
                if cs.mems is not None and not set(t.to_nodes) <= set(cs.mems):
                    self.reject(action.id, f"migrates pages to node(s) {_fmt(set(t.to_nodes) - set(cs.mems))} outside "
                                           f"the mems of cgroup {cs.path!r} (action {where_aid})")

    def _conflict(self, aid: str, other: str, same: bool, what: str) -> None:
        if same:
            self.reject(aid, f"duplicates action {other} ({what})")
        else:
            self.reject(aid, f"contradicts action {other}: both set {what} differently")


def validate(plan: planpb.BindingPlan, topo: pb.MemoryTopology, host: Host, config: ApplyConfig,
             hierarchy: Hierarchy | str | None = None) -> Validation:
    return Validator(host, topo, config, hierarchy).run(plan)

