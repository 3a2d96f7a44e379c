"""The shared validation context every action kind's ``check`` works in: the host, the topology's
facts, the config, and the two ways a check says no (apply/validate.py has the rules between them).

* :meth:`CheckContext.reject` refuses the whole plan, whatever the action's ``required`` flag.
* :meth:`CheckContext.host_problem` is a host condition (the process or IRQ is gone, a pattern
  matches nothing): it rejects a required action and skips an optional one, with the reason.

The value checks here (CPU and node lists, processes, patterns, cgroup paths) are the ones several
kinds share; a check used by one kind lives in that kind's module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memtopo.apply import cgroups, irqs
from memtopo.apply.cgroups import Hierarchy
from memtopo.apply.config import ApplyConfig
from memtopo.apply.host import Host, Ids
from memtopo.cpulist import MAX_ID, format_cpulist
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb


@dataclass(frozen=True)
class ProcRef:
    pid: int
    starttime: int
    comm: str

    def describe(self) -> str:
        return f"pid {self.pid} ({self.comm})"


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
    # Not a check: the result says which node applied the plan.
    node_name: str = ""

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
                   allowed_mems or memory, unified, topo.fingerprint, topo.node_name)


def fmt_ids(ids: Iterable[int], limit: int = 8) -> str:
    """A CPU or node list for a message: the first ``limit`` ids and how many in all."""
    ids = sorted(ids)
    text = format_cpulist(ids[:limit])
    return text + (f" … ({len(ids)} in all)" if len(ids) > limit else "")


class CheckContext:
    """One validation's host, facts and config, what it refused or skipped so far, and what it read
    once for every action (the cpuset hierarchy, /proc/interrupts, CPU lists already checked)."""

    def __init__(self, host: Host, facts: TopologyFacts, config: ApplyConfig,
                 hierarchy: Hierarchy | str | None = None) -> None:
        self.host = host
        self.procs = host.procs
        self.facts = facts
        self.config = config
        self._hierarchy = hierarchy
        self.rejections: list[str] = []
        self.skips: dict[str, str] = {}
        self._interrupts: dict[int, irqs.IrqLine] | None = None
        self._cpus_ok: dict[tuple[int, ...], Ids] = {}

    @property
    def hierarchy(self) -> Hierarchy | str:
        if self._hierarchy is None:
            self._hierarchy = cgroups.detect(self.host.files, self.config.cgroup_version)
        return self._hierarchy

    def interrupts(self) -> dict[int, irqs.IrqLine]:
        if self._interrupts is None:
            self._interrupts = irqs.read_interrupts(self.host.files)
        return self._interrupts

    def reject(self, aid: str, reason: str) -> None:
        self.rejections.append(f"{aid}: {reason}")

    def host_problem(self, action: planpb.PlanAction, reason: str) -> None:
        if action.required:
            self.reject(action.id, reason)
        else:
            self.skips.setdefault(action.id, reason)

    def skip(self, aid: str, reason: str) -> None:
        """Skip the action whatever its ``required`` flag (it would have no effect worth forcing)."""
        self.skips[aid] = reason

    # ---- value checks ------------------------------------------------------------------------------
    def cpus(self, aid: str, cpus: Sequence[int], name: str = "cpus", allow_empty: bool = False) -> Ids | None:
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
            self.reject(aid, f"{name}: CPU {fmt_ids(offline)} not online (online: {fmt_ids(self.facts.online_cpus)})")
            return None
        outside = set(cpus) - self.facts.allowed_cpus
        if outside:
            self.reject(aid, f"{name}: CPU {fmt_ids(outside)} not in the allowed CPUs "
                             f"({fmt_ids(self.facts.allowed_cpus)})")
            return None
        return tuple(sorted(cpus))

    def nodes(self, aid: str, nodes: Sequence[int], name: str, need_memory: bool = True) -> Ids | None:
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
                                 f"({fmt_ids(self.facts.allowed_mems)})")
                return None
        return tuple(sorted(nodes))

    def proc(self, action: planpb.PlanAction, pid: int, name: str = "pid") -> ProcRef | None:
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

    def regex(self, aid: str, pattern: str, name: str) -> re.Pattern[str] | None:
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

    def cgroup_path(self, action: planpb.PlanAction, hier: Hierarchy, path: str) -> str | None:
        """``path`` normalized, when it is under the configured prefixes and stays inside the mount."""
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

    def proc_cgroup(self, action: planpb.PlanAction, hier: Hierarchy, proc: ProcRef) -> str | None:
        """The cpuset cgroup ``proc`` is in, relative to the hierarchy's mount."""
        groups = self.procs.cgroups(proc.pid)
        raw = None if groups is None else (groups.v1_cpuset if hier.version == 1 else groups.v2)
        if raw is None:
            self.host_problem(action, f"pid {proc.pid}: no cpuset cgroup in /proc/{proc.pid}/cgroup")
            return None
        path = hier.from_proc(raw)
        if path is None:
            self.host_problem(action, f"pid {proc.pid}: cgroup {raw!r} is outside the mounted hierarchy")
        return path
