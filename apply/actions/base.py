"""What every action kind shares: its check of a plan's action against the host (``ActionKind``), then
read the current state and the diff (``prepare``), then change and verify (``apply``). Restoring is
not here: a step only *describes* its undo (apply/undo.py), so a crashed run's journal is restored
without the step that wrote it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from memtopo.apply import irqbalance, irqs
from memtopo.apply.checks import CheckContext
from memtopo.apply.config import ApplyConfig
from memtopo.apply.errors import ApplyError
from memtopo.apply.host import Host
from memtopo.apply.undo import UndoOp
from memtopo.cpulist import format_cpulist
from memtopo.v1 import plan_pb2 as planpb

# Values the steps of one fsync group expect earlier steps of the group to leave: ("tid", n) →
# cpus. A later step's undo records them as the previous value. (IRQs need none: validation refuses
# a plan with two actions on one IRQ.)
Overlay = dict[tuple[str, int], frozenset[int]]


class ActionError(ApplyError):
    """The action could not be carried out (or did not verify); its own changes get restored."""


class ActionSkipError(ApplyError):
    """Nothing could be done and that is not a failure (every IRQ of the action is kernel-managed)."""


@dataclass
class Prepared:
    before: list[str]
    after: list[str]
    undo: list[UndoOp]
    # False: the host already holds the desired state (UNCHANGED; nothing is written).
    changes: bool
    details: dict[str, str] = field(default_factory=dict)
    # Call apply even without changes (page migration: the kernel decides what is left to move).
    run_anyway: bool = False


@dataclass
class Applied:
    after: list[str]
    details: dict[str, str] = field(default_factory=dict)
    unchanged: bool = False


class RunContext:
    """Per-run state shared by the steps: the host, the config, and facts read once per plan."""

    def __init__(self, host: Host, config: ApplyConfig,
                 detect_irqbalance: Callable[[], irqbalance.Irqbalance | None] | None = None) -> None:
        self.host = host
        self.config = config
        self._detect = detect_irqbalance or (lambda: irqbalance.detect(host.procs, host.files))
        self._irqbalance: irqbalance.Irqbalance | bool | None = False
        self.interrupts_cache: dict[int, irqs.IrqLine] | None = None
        # The banned list as this plan's prepared steps leave it (None until read from irqbalance), and
        # whether a step already stops it: steps are prepared before the ones before them apply.
        self.irqbalance_banned: tuple[int, ...] | None = None
        self.irqbalance_stopped = False

    def irqbalance(self) -> irqbalance.Irqbalance | None:
        if self._irqbalance is False:
            self._irqbalance = self._detect()
        assert not isinstance(self._irqbalance, bool)
        return self._irqbalance

    def interrupts(self) -> dict[int, irqs.IrqLine]:
        if self.interrupts_cache is None:
            self.interrupts_cache = irqs.read_interrupts(self.host.files)
        return self.interrupts_cache


class Step(ABC):
    # Steps that only set per-object values (thread masks, IRQ masks) may share one journal fsync
    # with their neighbours: none changes what another may do.
    groupable: ClassVar[bool] = False
    # Steps whose prepare reads only what no other *kind* of step changes (IRQ masks, irqbalance's
    # bans) may also join the group a non-groupable step starts: preparing them before that step
    # applies reads what it will leave. Same-kind effects go through the overlay as above.
    independent: ClassVar[bool] = False
    # A non-groupable step whose prepare reads nothing a groupable step changes (thread or IRQ
    # masks) may end a group of them and share its fsync; as after any non-groupable step, only
    # independent steps follow it in the group.
    closes_group: ClassVar[bool] = False
    kind: ClassVar[str] = ""

    def __init__(self, ctx: RunContext, action: planpb.PlanAction) -> None:
        self.ctx = ctx
        self.action = action

    @property
    def host(self) -> Host:
        return self.ctx.host

    @abstractmethod
    def prepare(self, overlay: Overlay) -> Prepared:
        """Read the current state; no host change. May raise ActionError/ActionSkipError."""

    @abstractmethod
    def apply(self, prepared: Prepared) -> Applied:
        """Change the host and verify; raises ActionError (then the undo is restored)."""

    def predict(self, overlay: Overlay) -> None:  # noqa: B027 - most steps set nothing groupable
        """Record in ``overlay`` what a successful apply leaves. Only later steps of the same
        ``kind`` read these entries: the engine skips the call when none follows in the group."""


@dataclass(frozen=True)
class ActionKind[T]:
    """One kind of plan action, named by its PlanAction oneof. ``check`` turns the plan's action
    into the target apply works on, resolved against the host (None: it rejected or skipped the
    action through the context, which says why); ``step`` makes the step that applies a target."""

    name: str
    check: Callable[[planpb.PlanAction, CheckContext], T | None]
    step: Callable[[RunContext, planpb.PlanAction, T], Step]


def ids(values: Iterable[int]) -> str:
    return format_cpulist(values) or "none"
