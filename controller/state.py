"""What HTTP handlers (and other controller features) reach: the fleet, the metrics, change events.

``ControllerState`` is built once per running controller and handed to every route installer
(``install(routes, state)``). Everything on it lives on the controller's event loop: handlers read
it directly (no locks); work that takes long runs in a thread on a copy taken on the loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from memtopo.logs import get_logger
from memtopo.planner.fleet import Held, SnapshotNodes

if TYPE_CHECKING:
    from memtopo.controller.fleet import Fleet
    from memtopo.controller.metrics import ControllerMetrics
    from memtopo.k8s.kubeapi import KubeApi

log = get_logger(component="controller")

# Changed node names remembered for ``Changes.since``; a watcher further behind reloads everything.
CHANGE_HISTORY: Final = 4096


class Changes:
    """A version number that grows whenever a node's link state, topology or plan results change.

    ``await changes.wait(seen)`` returns once the version is past ``seen``; ``since(seen)`` names the
    nodes changed after ``seen`` (None when that is older than the history: reload everything).
    """

    def __init__(self) -> None:
        self.version = 0
        self._recent: deque[tuple[int, str]] = deque(maxlen=CHANGE_HISTORY)
        self._event = asyncio.Event()

    def bump(self, node: str) -> None:
        self.version += 1
        self._recent.append((self.version, node))
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait(self, seen: int, timeout: float | None = None) -> int:
        """The current version once it is past ``seen`` (or after ``timeout`` seconds, unchanged)."""
        try:
            async with asyncio.timeout(timeout):
                while self.version <= seen:
                    await self._event.wait()
        except TimeoutError:
            pass
        return self.version

    def since(self, seen: int) -> set[str] | None:
        if seen >= self.version:
            return set()
        if not self._recent or self._recent[0][0] > seen + 1:
            return None
        return {node for version, node in self._recent if version > seen}


class DevicesInUse(Protocol):
    """Device ids (0–7) handed out per node for a device policy (hccs, xpu), as whoever hands them out
    knows it: the scheduler extender, when the composition root gives it to the controller."""

    def in_use(self, policy: str) -> Mapping[str, frozenset[int]]: ...


@dataclass
class ControllerState:
    fleet: Fleet
    metrics: ControllerMetrics
    changes: Changes = field(default_factory=Changes)
    # Set when the controller begins to stop: /healthz then answers 503.
    stopping: bool = False
    # node → (plan_id, dry_run) of the plans sent to it that await a result (the server sets it).
    pending_plans: Callable[[str], Iterable[tuple[str, bool]]] = lambda node: ()
    # The Kubernetes API server a feature put together with the controller uses (closed at stop).
    kube: KubeApi | None = None
    # Who hands out devices (the fleet page shows them); None: nobody.
    extender: DevicesInUse | None = None
    # Stored snapshots → FleetNodes, device views derived once per snapshot (Place RPC, extender).
    nodes: SnapshotNodes = field(default_factory=SnapshotNodes)
    # Background tasks features start; cancelled when the controller stops.
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    # ---- what the scheduler extender reads (extender.agents.AgentFleet) ----------------------------
    @property
    def version(self) -> int:
        """Grows whenever a node's link state or topology changes."""
        return self.changes.version

    def held(self, names: Sequence[str]) -> tuple[list[Held], list[str]]:
        """(name, link up, snapshot bytes) of the named nodes the fleet holds, and the names it does not."""
        return self.fleet.held_many(names)

    def start(self, name: str, job: Coroutine[Any, Any, None]) -> None:
        """Run ``job`` until the controller stops (it is cancelled then)."""
        task = asyncio.get_running_loop().create_task(job, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def warm_forever(self, batch: int = 512) -> None:
        """Derive the device views of nodes whose snapshot changed as they arrive, off the loop, so the
        first decision after a start (or after a fleet-wide rescan) does not pay for thousands."""
        seen = 0
        while True:
            now = await self.changes.wait(seen)
            changed = self.changes.since(seen)
            seen = now
            names = [n.node_name for n in self.fleet.nodes()] if changed is None else sorted(changed)
            for i in range(0, len(names), batch):
                held, _ = self.fleet.held_many(names[i:i + batch])
                todo = [h for h in held if h[2] is not None]
                if todo:
                    await asyncio.to_thread(self._warm, todo)

    def _warm(self, held: Sequence[Held]) -> None:
        try:
            self.nodes.warm(held)
        except Exception:  # a bad snapshot is the decision's to report, not the warmer's to die of
            log.exception("controller_warm_failed", nodes=len(held))
