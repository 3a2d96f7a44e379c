"""IRQs as the engine finds them: ``/proc/interrupts``, ``/proc/irq/N``, a PCI function's
``msi_irqs`` and the action names in ``/sys/kernel/irq/N/actions``."""

from __future__ import annotations

from dataclasses import dataclass

from memtopo.apply.host import HostFiles, Ids
from memtopo.hostfs import HostReadError

INTERRUPTS = "proc/interrupts"
# Far above the kernel's NR_IRQS on any machine; refuses "IRQ 4294967295" before touching a path.
MAX_IRQ = 1 << 20


@dataclass(frozen=True)
class IrqLine:
    irq: int
    # Count per CPU id (columns mapped through the header: offline CPUs have no column).
    counts: dict[int, int]
    # The text after the counts: chip, hwirq, trigger and action names.
    tail: str


def parse_interrupts(text: str) -> dict[int, IrqLine]:
    """Numeric rows of ``/proc/interrupts``; anything malformed is skipped, never an exception."""
    lines = text.split("\n")
    if not lines:
        return {}
    cpus: list[int] = []
    for tok in lines[0].split():
        if tok.startswith("CPU") and tok[3:].isdigit() and len(tok) < 12:
            cpus.append(int(tok[3:]))
    out: dict[int, IrqLine] = {}
    for line in lines[1:]:
        head, sep, rest = line.partition(":")
        head = head.strip()
        if not sep or not head.isdigit() or not head.isascii() or len(head) > 7:
            continue
        toks = rest.split()
        counts: dict[int, int] = {}
        n = 0
        while n < len(cpus) and n < len(toks) and toks[n].isdigit() and toks[n].isascii():
            counts[cpus[n]] = int(toks[n])
            n += 1
        out[int(head)] = IrqLine(int(head), counts, " ".join(toks[n:]))
    return out


def read_interrupts(files: HostFiles) -> dict[int, IrqLine]:
    try:
        return parse_interrupts(files.read_big(INTERRUPTS))
    except HostReadError:
        return {}


def action_names(files: HostFiles, irq: int, line: IrqLine | None) -> str:
    """The handler names of an IRQ: ``/sys/kernel/irq/N/actions`` when the kernel has it (exact),
    else the text after the counts in /proc/interrupts (also holds the chip name: a superset)."""
    try:
        return files.read_text(f"sys/kernel/irq/{irq}/actions").strip()
    except HostReadError:
        return line.tail if line is not None else ""


def exists(files: HostFiles, irq: int) -> bool:
    return files.is_dir(f"proc/irq/{irq}")


def listed(files: HostFiles) -> list[int]:
    return sorted(int(n) for n in files.listdir("proc/irq") if n.isdigit() and len(n) < 8)


def msi_irqs(files: HostFiles, bdf: str) -> Ids:
    names = files.listdir(f"sys/bus/pci/devices/{bdf}/msi_irqs")
    return tuple(sorted(int(n) for n in names if n.isdigit() and len(n) < 8))


def intx_irq(files: HostFiles, bdf: str) -> int:
    try:
        return int(files.read_text(f"sys/bus/pci/devices/{bdf}/irq").strip())
    except (HostReadError, ValueError):
        return 0


def affinity_file(irq: int) -> str:
    return f"proc/irq/{irq}/smp_affinity_list"


def effective_file(irq: int) -> str:
    return f"proc/irq/{irq}/effective_affinity_list"
