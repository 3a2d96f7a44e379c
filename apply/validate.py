"""Validation of a plan against the current topology and host, before anything is touched.

Two kinds of problems:

* **Rejections** refuse the whole plan, whatever the action's ``required`` flag: malformed or
  hostile input (missing oneof, duplicate ids, bad regex or BDF, ``..`` paths, huge lists), CPUs
  or nodes the topology does not have, protected processes (pid 1, kernel threads, the agent),
  contradictions between actions.
* **Host conditions** (the process or IRQ is gone, a pattern matches nothing, no cpuset hierarchy)
  reject a required action but only skip an optional one, with the reason (IRQ binding and
  migration are conditional).

Each rejection is ``"<action id>: <reason>"`` (``"plan: …"`` for the plan itself). Validation
also resolves every selector (threads, IRQs, cgroups) so apply works on what was checked.

Here are the plan-level rules and the rules between actions; each action kind's own check is in
its module (apply/actions/<kind>.py), called through the registry, and the context they all report
into (host, facts, config, reject and skip) is apply/checks.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from memtopo.apply.actions import ACTIONS
from memtopo.apply.actions.cpuset import CpusetTarget
from memtopo.apply.actions.irq import IrqTarget
from memtopo.apply.actions.mempolicy import MemPolicyTarget
from memtopo.apply.actions.migrate import MigrationTarget
from memtopo.apply.actions.threads import ThreadTarget
from memtopo.apply.cgroups import Hierarchy
from memtopo.apply.checks import CheckContext, TopologyFacts, fmt_ids
from memtopo.apply.config import ApplyConfig
from memtopo.apply.host import Host, Ids
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

MAX_PLAN_ID = 128
MAX_ACTION_ID = 64
MAX_TEXT = 4096
_ACTION_ID = re.compile(r"[A-Za-z0-9_.:@/+-]+")


@dataclass(frozen=True)
class Validation:
    rejections: tuple[str, ...]
    # Optional actions that will be skipped, and why (also: memory policy on Unified domains).
    skips: Mapping[str, str]
    # Each action's target, as its kind's check returned it (apply/actions/<kind>.py).
    targets: Mapping[str, object]

    @property
    def ok(self) -> bool:
        return not self.rejections


class Validator:
    """The plan-level rules (ids, sizes, fingerprint, rules between actions) around each action
    kind's own check (apply/actions/<kind>.py), all reporting into one CheckContext."""

    def __init__(self, host: Host, facts: TopologyFacts, config: ApplyConfig,
                 hierarchy: Hierarchy | str | None = None) -> None:
        self.ctx = CheckContext(host, facts, config, hierarchy)
        self.config = config
        self.facts = self.ctx.facts
        self.targets: dict[str, object] = {}

    def reject(self, aid: str, reason: str) -> None:
        self.ctx.reject(aid, reason)

    def run(self, plan: planpb.BindingPlan) -> Validation:
        ctx = self.ctx
        self._plan(plan)
        if not ctx.rejections:
            seen: dict[str, int] = {}
            for i, action in enumerate(plan.actions):
                self._action(i, action, seen)
            if not ctx.rejections:
                self._cross(plan)
        for aid in list(ctx.skips):
            self.targets.pop(aid, None)
        return Validation(tuple(ctx.rejections), dict(ctx.skips), dict(self.targets))

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
        name = action.WhichOneof("action")
        kind = ACTIONS.get(name) if name is not None else None
        if kind is None:
            self.reject(aid, f"no action set (one of {', '.join(ACTIONS)})")
            return
        target = kind.check(action, self.ctx)
        if target is not None:
            self.targets[aid] = target

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
                    self.reject(action.id, f"CPUs {fmt_ids(t.cpus - set(cs.cpus))} are outside cgroup {cs.path!r} that "
                                           f"action {where_aid} puts pid {t.proc.pid} in (cpus {fmt_ids(cs.cpus)})")
            if isinstance(t, MigrationTarget) and t.proc.pid in placed:
                where_aid, cs = placed[t.proc.pid]
                if cs.mems is not None and not set(t.to_nodes) <= set(cs.mems):
                    away = fmt_ids(set(t.to_nodes) - set(cs.mems))
                    self.reject(action.id, f"migrates pages to node(s) {away} outside the mems of cgroup {cs.path!r} "
                                           f"(action {where_aid})")

    def _conflict(self, aid: str, other: str, same: bool, what: str) -> None:
        if same:
            self.reject(aid, f"duplicates action {other} ({what})")
        else:
            self.reject(aid, f"contradicts action {other}: both set {what} differently")


def validate(plan: planpb.BindingPlan, facts: TopologyFacts | pb.MemoryTopology, host: Host, config: ApplyConfig,
             hierarchy: Hierarchy | str | None = None) -> Validation:
    if isinstance(facts, pb.MemoryTopology):
        facts = TopologyFacts.of(facts)
    return Validator(host, facts, config, hierarchy).run(plan)

