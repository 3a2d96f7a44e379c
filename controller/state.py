"""What HTTP handlers (and other controller features) reach: the fleet, the metrics, change events.

``ControllerState`` is built once per running controller and handed to every route installer
(``install(routes, state)``). Everything on it lives on the controller's event loop: handlers read
it directly (no locks); work that takes long runs in a thread on a copy taken on the loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from memtopo.controller.fleet import Fleet
    from memtopo.controller.metrics import ControllerMetrics
    from memtopo.k8s.kubeapi import KubeApi

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


@dataclass
class ControllerState:
    fleet: Fleet
    metrics: ControllerMetrics
    changes: Changes = field(default_factory=Changes)
    # Set when the controller begins to stop: /healthz then answers 503.
    stopping: bool = False
    # node → (plan_id, dry_run) of the plans sent to it that await a result (the server sets it).
    pending_plans: Callable[[str], Iterable[tuple[str, bool]]] = lambda node: ()
    # The Kubernetes API server the scheduler extender binds through and reads pods from (None: none).
    kube: KubeApi | None = None
    kube_refresh_s: float = 10.0
    # The scheduler extender once installed (controller.extender.Extender).
    extender: Any = None
    # Background tasks features start; cancelled when the controller stops.
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
