"""IRQ affinity through ``/proc/irq/N/smp_affinity_list`` (kernel ``Documentation/core-api/irq/irq-affinity.rst``).

The effective affinity is read back and reported; it may lag until the next interrupt on x86, so
only ``smp_affinity_list`` must verify. A kernel-managed IRQ refuses the write with EIO (older
kernels) or EPERM (≈6.12+): it is reported as unmovable, never retried and never a failure of
the plan (its affinity is the kernel's to set, and irqbalance leaves it alone too); an action
whose every IRQ is managed is skipped with that reason.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from dataclasses import dataclass, field

from memtopo.apply import irqbalance, irqs
from memtopo.apply.actions.base import (
    ActionError,
    ActionKind,
    ActionSkipError,
    Applied,
    Overlay,
    Prepared,
    RunContext,
    Step,
    ids,
)
from memtopo.apply.checks import CheckContext
from memtopo.apply.errors import HostWriteError, errno_name
from memtopo.apply.host import Ids, cpulist, cpulist_text
from memtopo.apply.undo import BanUndo, FileUndo, ServiceUndo, UndoOp
from memtopo.cpulist import CpuListError
from memtopo.hostfs import HostReadError
from memtopo.pci import parse_bdf
from memtopo.v1 import plan_pb2 as planpb


@dataclass(frozen=True)
class IrqTarget:
    irqs: tuple[int, ...]
    selector: str
    cpus: Ids
    names: Mapping[int, str] = field(default_factory=dict)


def check(action: planpb.PlanAction, ctx: CheckContext) -> IrqTarget | None:
    aid, ia = action.id, action.irq_affinity
    sel = ia.WhichOneof("selector")
    cpus = ctx.cpus(aid, ia.cpus)
    if sel is None:
        ctx.reject(aid, "irq_affinity: no selector (irq, pci_bdf or name_pattern)")
        return None
    files = ctx.host.files
    names: dict[int, str] = {}
    if sel == "irq":
        number = ia.irq
        if number >= irqs.MAX_IRQ:
            ctx.reject(aid, f"irq: {number} is not an IRQ number")
            return None
        if cpus is None:
            return None
        # Its affinity file writable proves the IRQ exists: one system call in the common case.
        if files.writable_by_us(irqs.affinity_file(number)):
            return IrqTarget((number,), f"IRQ {number}", cpus, names)
        if not irqs.exists(files, number):
            ctx.host_problem(action, f"IRQ {number} does not exist (no /proc/irq/{number})")
            return None
        found, selector = [number], f"IRQ {number}"
    elif sel == "pci_bdf":
        bdf = ia.pci_bdf.strip().lower()
        if len(bdf) > 32 or parse_bdf(bdf) is None:
            ctx.reject(aid, f"pci_bdf: {ia.pci_bdf[:40]!r} is not a PCI address (DDDD:BB:DD.F)")
            return None
        if cpus is None:
            return None
        if not files.is_dir(f"sys/bus/pci/devices/{bdf}"):
            ctx.host_problem(action, f"PCI device {bdf} does not exist")
            return None
        found = list(irqs.msi_irqs(files, bdf))
        if not found:
            intx = irqs.intx_irq(files, bdf)
            hint = f" (it uses INTx IRQ {intx}, possibly shared: target it by number)" if intx else ""
            ctx.host_problem(action, f"PCI device {bdf} has no MSI/MSI-X vectors{hint}")
            return None
        selector = f"PCI {bdf} msi_irqs"
    else:
        pattern = ctx.regex(aid, ia.name_pattern, "name_pattern")
        if pattern is None or cpus is None:
            return None
        interrupts = ctx.interrupts()
        found = []
        for irq in sorted(set(interrupts) | set(irqs.listed(files))):
            label = irqs.action_names(files, irq, interrupts.get(irq))
            if label and pattern.search(label):
                found.append(irq)
                names[irq] = label
        if not found:
            ctx.host_problem(action, f"no IRQ in /proc/interrupts matches {pattern.pattern!r}")
            return None
        selector = f"IRQs named {pattern.pattern!r}"
    if cpus is None:
        return None
    for irq in found:
        if not files.writable_by_us(irqs.affinity_file(irq)):
            ctx.host_problem(action, f"/{irqs.affinity_file(irq)} is not writable (read-only /proc, or not "
                                     "privileged: a container needs --privileged)")
            return None
    return IrqTarget(tuple(found), selector, cpus, names)

_UNMOVABLE = (errno.EIO, errno.EPERM)


class IrqStep(Step):
    groupable = True
    # Only IRQ steps write /proc/irq or irqbalance's bans, so a cpuset step before them changes
    # nothing their prepare reads.
    independent = True
    kind = "irq_affinity"

    def __init__(self, ctx: RunContext, action: planpb.PlanAction, target: IrqTarget) -> None:
        super().__init__(ctx, action)
        self.target = target
        self._changed: list[int] = []
        self._ban: tuple[irqbalance.Client, tuple[int, ...]] | None = None
        self._stop: str | None = None
        self._value = cpulist_text(target.cpus)
        # Each IRQ's label, made by prepare (a plan moves dozens of IRQs, one action each: nothing
        # here is built twice).
        self._labels: list[str] = []

    def _ids(self, rel: str) -> tuple[int, ...]:
        try:
            return cpulist(self.host.files.read_record(rel))
        except (HostReadError, CpuListError) as exc:
            raise ActionError(f"/{rel}: {exc}") from exc

    def prepare(self, overlay: Overlay) -> Prepared:
        t = self.target
        names = t.names
        before: list[str] = []
        undo: list[UndoOp] = []
        changed: list[int] = []
        labels: list[str] = []
        for irq in t.irqs:
            rel = irqs.affinity_file(irq)
            # No prediction to read: validation refuses a plan with two actions on one IRQ.
            cur = self._ids(rel)
            text = cpulist_text(cur)
            label = f"IRQ {irq} ({names[irq]})" if irq in names else f"IRQ {irq}"
            labels.append(label)
            # The effective affinity is read after the change (details): one file less per IRQ here.
            before.append(f"{label}: affinity {text or 'none'}")
            if cur != t.cpus:  # both sorted and unique: equal tuples are equal sets
                changed.append(irq)
                undo.append(FileUndo(rel, text, "list"))
        details = {"irqs": str(t.irqs[0]) if len(t.irqs) == 1 else ids(t.irqs), "selector": t.selector}
        self._changed, self._labels = changed, labels
        if changed:
            ban_or_stop = self._irqbalance(details)
            if ban_or_stop:
                undo = ban_or_stop + undo
        desired = self._value or "none"
        after = [f"{label}: affinity {desired}" for label in labels]
        return Prepared(before, after, undo, bool(changed), details)

    def _irqbalance(self, details: dict[str, str]) -> list[UndoOp]:
        """Decide what to do about a running irqbalance; returns the undo of it (applied first)."""
        ctx = self.ctx
        ib = ctx.irqbalance()
        if ib is None:
            return []
        note = ib.describe()
        policy = ctx.config.irqbalance
        undo: list[UndoOp] = []
        if policy == "ban":
            try:
                client = irqbalance.client_for(ib, self.host.files)
                current = ctx.irqbalance_banned if ctx.irqbalance_banned is not None else client.banned()
                wanted = tuple(sorted(set(current) | set(self.target.irqs)))
                irqbalance.ban_command(wanted)
            except irqbalance.IrqbalanceError as exc:
                note += f"; could not ban the IRQs ({exc}): it may move them again"
            else:
                if wanted != current:
                    self._ban = (client, wanted)
                    undo.append(BanUndo(ib.pid, ib.starttime, client.address, current))
                    # Later steps prepared before this one applies must add to this list, not replace it.
                    ctx.irqbalance_banned = wanted
                note += f"; policy ban: IRQ {ids(self.target.irqs)} excluded from balancing"
        elif policy == "stop":
            if ctx.irqbalance_stopped:
                note += "; stopped earlier in this plan"
            elif ib.unit is None:
                note += "; policy stop, but it is not a systemd unit: left running, it may move these IRQs again"
            else:
                self._stop = ib.unit
                undo.append(ServiceUndo(ib.unit))
                ctx.irqbalance_stopped = True
                note += f"; policy stop: systemctl stop {ib.unit} (started again on rollback)"
        else:
            note += "; policy leave: it may move these IRQs again within its interval"
        details["irqbalance"] = note
        return undo

    def apply(self, prepared: Prepared) -> Applied:
        t, files = self.target, self.host.files
        details = dict(prepared.details)
        if self._ban is not None:
            client, wanted = self._ban
            try:
                client.set_banned(wanted)
            except irqbalance.IrqbalanceError as exc:
                details["irqbalance"] += f"; ban failed ({exc}): it may move these IRQs again"
        if self._stop is not None:
            res = self.host.runner.run(["systemctl", "stop", self._stop])
            if not res.ok:
                details["irqbalance"] += f"; stop failed ({res.failure}): it may move these IRQs again"
        value = self._value
        write_read = files.write_read
        # (IRQ, what smp_affinity_list reads right after the write: same descriptor, one open per IRQ)
        moved: list[tuple[int, str]] = []
        unmovable: dict[int, str] = {}
        for irq in self._changed:
            rel = irqs.affinity_file(irq)
            try:
                moved.append((irq, write_read(rel, value)))
            except HostWriteError as exc:
                if exc.errno in _UNMOVABLE:
                    unmovable[irq] = errno_name(exc.errno)
                    continue
                hint = " (no online CPU in the set)" if exc.errno == errno.EINVAL else ""
                raise ActionError(f"IRQ {irq}: write {value} to /{rel}: {exc.reason}{hint}") from exc
            except HostReadError as exc:
                raise ActionError(f"/{rel}: {exc}") from exc
        if unmovable:
            details["unmovable"] = ", ".join(f"{irq} ({code})" for irq, code in unmovable.items())
            if not moved:
                codes = ", ".join(sorted(set(unmovable.values())))
                raise ActionSkipError(f"IRQ {ids(unmovable)} managed by the kernel ({codes}): its affinity cannot "
                                      "be changed from user space")
        effective: list[str] = []
        want = set(t.cpus)
        read_ids = files.read_ids
        for irq, text in moved:
            # An effective affinity inside the new set proves the write held; otherwise (x86 moves an
            # IRQ at its next interrupt) the requested mask must read back as written.
            try:
                eff: tuple[int, ...] | None = read_ids(irqs.effective_file(irq))
            except HostReadError:
                eff = None
            held = eff is not None and bool(eff) and want.issuperset(eff)
            if not held:
                try:
                    got = cpulist(text)
                except CpuListError as exc:
                    raise ActionError(f"/{irqs.affinity_file(irq)}: {exc}") from exc
                if got != t.cpus:
                    raise ActionError(f"IRQ {irq}: smp_affinity_list reads {ids(got)} after writing {value}")
            if eff is not None:
                pending = "" if held else " (pending until its next interrupt)"
                effective.append(f"{irq}→{cpulist_text(eff) or 'none'}{pending}")
        if effective:
            details["effective_affinity"] = ", ".join(effective)
        if not unmovable:
            return Applied(prepared.after, details)  # what prepare said it would leave
        desired = value or "none"
        after = [f"{label}: " + (f"unchanged (managed, {unmovable[irq]})" if irq in unmovable
                                 else f"affinity {desired}") for irq, label in zip(t.irqs, self._labels, strict=True)]
        return Applied(after, details)



KIND = ActionKind("irq_affinity", check, IrqStep)
