"""The agent's background tasks, supervised: one that fails is started again, never the end of the agent.

The rescan loop, the controller link and the NodeResourceTopology publisher each run until the agent
stops. One that raises (or returns before the stop) is restarted after a capped, jittered backoff
(the count of its failures starts over once it has run :data:`HEALTHY_SECONDS`); meanwhile the gRPC
server, the health endpoint and plan application go on serving. Each failure is counted
(``memtopo_agent_task_restarts_total{task}``) and shown in ``/readyz`` (check ``task_<name>``: the
agent is unready while the task is down and for :data:`HEALTHY_SECONDS` after it failed, so a task
failing over and over keeps it unready), and logged once per distinct cause — its type, a short
escaped excerpt of its message and where it was raised — not once per failure, and never as a
traceback the size of whatever the failing input was.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from memtopo.backoff import Backoff
from memtopo.logs import get_logger
from memtopo.text import shorten

log = get_logger(component="agent")

# A task that ran this long before failing had recovered: its next restart is a first one again, and
# the agent is ready again this long after its last failure.
HEALTHY_SECONDS: Final = 60.0
DEFAULT_BACKOFF: Final = Backoff(1.0, 60.0)
CAUSE_CHARS: Final = 160
# Distinct causes remembered per task for logging (a task inventing new messages cannot grow it).
MAX_CAUSES: Final = 32


def cause_of(exc: BaseException) -> str:
    """``Type: message`` (short, escaped) and the file and line of the innermost frame that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return shorten(f"{type(exc).__name__}: {exc}", CAUSE_CHARS) + where


@dataclass
class TaskState:
    """What ``/readyz`` shows of one task (read from the health thread: plain attributes)."""

    name: str
    restarts: int = 0
    cause: str = ""  # of its last failure
    failed_at: float | None = None
    down_until: float | None = None  # while it waits to be started again
    logged: dict[str, None] = field(default_factory=dict)


class Supervisor:
    """Runs named tasks until ``stopping()`` is true, restarting one that ends earlier."""

    def __init__(self, stopping: Callable[[], bool], on_restart: Callable[[str], None] = lambda name: None, *,
                 backoff: Backoff = DEFAULT_BACKOFF, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self._stopping = stopping
        self._on_restart = on_restart
        self._backoff = backoff
        self._clock = clock
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self.states: dict[str, TaskState] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()

    def start(self, name: str, job: Callable[[], Awaitable[None]]) -> None:
        state = self.states[name] = TaskState(name)
        task = asyncio.get_running_loop().create_task(self._keep(state, job), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def checks(self, now: float | None = None) -> dict[str, tuple[bool, str]]:
        """``task_<name>`` → (ready, what to show) for every task that has failed at least once."""
        now = self._clock() if now is None else now
        out: dict[str, tuple[bool, str]] = {}
        for name, s in list(self.states.items()):
            if s.failed_at is None:
                continue
            down_until = s.down_until
            if down_until is not None:
                text = f"down after {s.cause}; restart {s.restarts} in {max(down_until - now, 0):.1f} s"
                out[f"task_{name}"] = (False, text)
            else:
                recent = now - s.failed_at < HEALTHY_SECONDS
                text = (f"running; restarted {s.restarts} time{'s' if s.restarts != 1 else ''}, "
                        f"{now - s.failed_at:.0f} s ago, after {s.cause}")
                out[f"task_{name}"] = (not recent, text)
        return out

    async def stop(self) -> None:
        """Cancel every task (call once ``stopping()`` is true) and wait for them."""
        self._wake.set()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _keep(self, state: TaskState, job: Callable[[], Awaitable[None]]) -> None:
        attempt = 0
        while not self._stopping():
            started = self._clock()
            try:
                await job()
                if self._stopping():
                    return
                cause = "it ended before the agent stopped"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: the task is started again, the agent goes on
                cause = cause_of(exc)
            if self._stopping():
                return
            now = self._clock()
            if now - started >= HEALTHY_SECONDS:
                attempt = 0
            delay = self._backoff.delay(attempt, self._rng)
            attempt += 1
            state.restarts += 1
            state.cause, state.failed_at, state.down_until = cause, now, now + delay
            self._on_restart(state.name)
            if cause not in state.logged:
                if len(state.logged) >= MAX_CAUSES:
                    del state.logged[next(iter(state.logged))]
                state.logged[cause] = None
                log.error("agent_task_failed", task=state.name, cause=cause, restarts=state.restarts,
                          restart_seconds=round(delay, 3))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            state.down_until = None
