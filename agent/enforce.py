"""The node carries the scheduler's CPU decision out: exclusive CPUs through the container runtime (CRI).

A thin loop around ``k8s/enforcement.py`` (the decisions) and ``k8s/cri.py`` (the runtime):

1. read the kubelet's ``cpuManagerPolicy``: ``static`` means the kubelet's CPU manager owns every
   container's cpuset, so memtopo touches none and says so (state ``kubelet``, logged once);
2. list the runtime's running containers (the kubelet's labels tie them to pods), read each one's
   cpuset from its cgroup (``/proc/PID/cgroup``, through the agent's root);
3. decide (assignments kept from earlier passes; after a start, first adopt what already runs);
4. carry it out in the order that never lets two pods share a CPU: shared containers leave CPUs that
   became exclusive, then each pod's containers are pinned — all of a pod's updates or none (the
   ones made are undone when one fails) — then shared containers get the rest of the pool;
5. tell each pod what happened through the reporter seam (status annotation + Event, on change only);
6. move the memory of a container just pinned to fewer memory nodes than the node has: setting
   ``cpuset.mems`` leaves pages already allocated where they are, so the processes of its cgroup get
   a page migration plan through the apply engine (journaled and validated like every plan), off the
   event loop, once per container and memory node set. Its outcome is reported (the status
   annotation's ``memory``); a failure never undoes the pinning.

It runs again on every pod change, on every runtime event where the runtime has them (containerd 1.6
has none: it polls), and every ``interval`` seconds, which is what finds and restores drift. Nothing
that goes wrong stops it: a runtime that is missing, hangs or answers garbage makes the state
``runtime_unavailable`` and the next pass tries again; a report that fails is retried.

The two seams the API side provides are :class:`PodSource` and :class:`PodReporter`; the daemon wires
:data:`Migrator` to its apply engine (:class:`EngineMigrator`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

import structlog
from prometheus_client import CollectorRegistry

from memtopo.agent.config import KubernetesConfig
from memtopo.agent.metrics import EnforceMetrics, EnforceState
from memtopo.cpulist import CpuListError, format_cpulist, parse_cpulist
from memtopo.hostfs import HostFS, HostReadError
from memtopo.k8s import cri
from memtopo.k8s import enforcement as ef
from memtopo.k8s.facts import EnforcedCpus, KubeletFacts
from memtopo.mounts import Mount, cgroup_mounts, parse_proc_cgroup
from memtopo.text import shorten
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

if TYPE_CHECKING:
    from memtopo.apply.engine import Engine

log = structlog.get_logger()

DEFAULT_INTERVAL_S = 1.0
REPORT_TIMEOUT_S = 10.0
# A container's processes whose pages one migration plan moves (one plan action each); a container
# with more gets the first ones, and the log says so.
MAX_MOVED_PROCS = 1024
# cgroup.procs of that many processes and far more: a larger file is not read.
MAX_PROCS_BYTES = 1 << 16


# ---- the seams the API side provides ---------------------------------------------------------------
class PodSource(Protocol):
    """The pods bound to this node (``spec.nodeName`` = the node), as the API server gives them: each a
    Pod object as JSON (``metadata.uid/name/namespace/annotations/generation/creationTimestamp``,
    ``spec.containers[].name/resources``, ``spec.initContainers``, ``status.phase``)."""

    def synced(self) -> bool:
        """True once the first full list has arrived: before it, an empty list means "not known yet",
        and the enforcement must not release anyone's CPUs on it."""
        ...

    def bound_pods(self) -> Sequence[Mapping[str, Any]]:
        """The current pods (a snapshot; the enforcement does not keep or change them)."""
        ...

    async def wait_changed(self) -> None:
        """Return after the next change (add, update, delete) of a bound pod."""
        ...


class PodReporter(Protocol):
    """Writes what the enforcement did to the pod. Either call may raise: it is retried next pass."""

    async def annotate(self, namespace: str, name: str, uid: str, key: str, value: str) -> None:
        """Set one annotation on the pod (a merge patch guarded by ``metadata.uid``)."""
        ...

    async def event(self, namespace: str, name: str, uid: str, type_: str, reason: str, message: str) -> None:
        """Record an Event about the pod (``type_`` Normal or Warning; ``reason`` CamelCase)."""
        ...


@dataclass(frozen=True)
class MemoryMove:
    """The pages of a pinned container's processes to move off ``from_nodes`` onto ``to_nodes``."""

    pod_uid: str
    container: str  # the runtime's container id
    pids: tuple[int, ...]
    from_nodes: tuple[int, ...]
    to_nodes: tuple[int, ...]


class MemoryMoveError(Exception):
    """The memory could not be moved; the message (short) says why."""


# Moves the pages (in a worker thread): MOVED or IN_PLACE, or raises (MemoryMoveError says why).
Migrator = Callable[[MemoryMove], str]
MOVED: Final = "moved"  # pages were moved onto the container's memory nodes
IN_PLACE: Final = "in place"  # nothing was on other nodes (or the kernel moved it with cpuset.mems)


# ---- a container's cpuset, from its cgroup ---------------------------------------------------------
class CgroupCpusets:
    """Reads a process's cpuset (effective CPUs and memory nodes) from its cgroup under ``fs``."""

    def __init__(self, fs: HostFS) -> None:
        self.fs = fs
        mounts, _problems = cgroup_mounts(fs)
        # Only the last mount at a mount point can be read through it: in a pod given the host's /sys,
        # the host's cgroup mounts hide the ones the runtime made of the pod's own cgroup.
        visible = list({m.mount_point: m for m in mounts}.values())
        self.v1 = [m for m in visible if m.fstype == "cpuset" or (m.fstype == "cgroup" and "cpuset" in m.options)]
        self.v2 = [m for m in visible if m.fstype == "cgroup2"]

    def _cgroup(self, pid: int) -> tuple[str, tuple[str, str]] | None:
        """The process's cpuset cgroup directory under the root, and the names of its effective CPU
        and memory node files there."""
        try:
            cg = parse_proc_cgroup(self.fs.read_text(f"proc/{pid}/cgroup"))
        except HostReadError:
            return None
        for mounts, path, names in (
                (self.v1, cg.v1_cpuset, ("cpuset.effective_cpus", "cpuset.effective_mems")),
                (self.v2, cg.v2, ("cpuset.cpus.effective", "cpuset.mems.effective"))):
            mount = _mount_of(mounts, path) if path is not None else None
            if mount is None or path is None:
                continue
            root = mount.root.rstrip("/")
            rel = f"{mount.mount_point.strip('/')}/{path[len(root):].strip('/')}".rstrip("/")
            if mount.fstype == "cpuset" or "noprefix" in mount.options:
                names = ("effective_cpus", "effective_mems")
            return rel, names
        return None

    def _files(self, pid: int) -> tuple[str, str] | None:
        found = self._cgroup(pid)
        if found is None:
            return None
        rel, names = found
        return f"{rel}/{names[0]}", f"{rel}/{names[1]}"

    def procs(self, pid: int) -> tuple[int, ...] | None:
        """The processes of ``pid``'s cpuset cgroup (``cgroup.procs``, as the agent's PID namespace
        numbers them), at most :data:`MAX_MOVED_PROCS`; None when it cannot be read."""
        found = self._cgroup(pid)
        if found is None:
            return None
        try:
            text = self.fs.read_text(f"{found[0]}/cgroup.procs", MAX_PROCS_BYTES)
        except HostReadError:
            return None
        pids: list[int] = []
        for line in text.split():
            if not line.isdigit():
                return None
            pids.append(int(line))
        return tuple(dict.fromkeys(pids))

    def read(self, pid: int) -> ef.Observed:
        files = self._files(pid)
        if files is None:
            return ef.Observed(None, None)
        out: list[frozenset[int] | None] = []
        for rel in files:
            try:
                out.append(frozenset(parse_cpulist(self.fs.read_text(rel))))
            except (HostReadError, CpuListError):
                out.append(None)
        return ef.Observed(out[0], out[1])


def _mount_of(mounts: Sequence[Mount], path: str) -> Mount | None:
    """The mount a cgroup ``path`` can be read under: of those whose root holds it, the deepest."""
    best: Mount | None = None
    for mount in mounts:
        root = mount.root.rstrip("/")
        if root and path != root and not path.startswith(root + "/"):
            continue
        if best is None or len(root) > len(best.root.rstrip("/")):
            best = mount
    return best


# ---- the loop --------------------------------------------------------------------------------------
@dataclass
class PassResult:
    state: EnforceState
    message: str = ""
    outcomes: dict[str, ef.Outcome] = field(default_factory=dict)
    pods: dict[str, ef.PodView] = field(default_factory=dict)
    updated: list[str] = field(default_factory=list)  # container ids changed in this pass
    moves: list[PendingMove] = field(default_factory=list)  # memory to move, started after the pass


@dataclass(frozen=True)
class PendingMove:
    pod_uid: str
    container: str
    pid: int  # the container's first process: its cgroup names the others
    from_nodes: tuple[int, ...]
    to_nodes: tuple[int, ...]


class Enforcer:
    """The enforcement on one node. ``node`` gives the current node facts (None until a topology is
    there), ``kubelet`` the kubelet's configuration facts, ``connect`` a CRI client."""

    def __init__(self, *, node: Callable[[], ef.NodeFacts | None], kubelet: Callable[[], KubeletFacts],
                 connect: Callable[[], cri.CriClient], pods: PodSource, reporter: PodReporter,
                 cpusets: Callable[[int], ef.Observed], metrics: EnforceMetrics | None = None,
                 interval: float = DEFAULT_INTERVAL_S, migrate: Migrator | None = None,
                 procs: Callable[[int], Sequence[int] | None] | None = None) -> None:
        self.node, self.kubelet, self.connect = node, kubelet, connect
        self.pods, self.reporter, self.cpusets = pods, reporter, cpusets
        # Without a migrator (or a way to find a container's processes) pages stay where they are.
        self.migrate, self.procs = migrate, procs
        self.metrics = metrics or EnforceMetrics()
        self.interval = interval
        self.held: dict[str, ef.Assignment] = {}
        self.adopted = False
        self.last: PassResult = PassResult("waiting", "not started")
        self._client: cri.CriClient | None = None
        self._events_client: cri.CriClient | None = None
        self._pids: dict[str, int] = {}
        self._targets: dict[str, ef.Target] = {}  # container id → the cpuset memtopo last gave it
        self._reported: dict[str, tuple[str, str]] = {}  # pod uid → (annotation without memory, memory) written
        self._said: set[str] = set()  # one-time log lines already written
        self._moved: dict[str, tuple[int, ...]] = {}  # container id → memory nodes its pages were sent to
        self._memory: dict[str, dict[str, str]] = {}  # pod uid → container id → how moving its pages went
        self._moving: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._lock = threading.Lock()
        self._exclusive = EnforcedCpus(False, note="not started")
        # Called on the loop when what :meth:`exclusive` says changes (the NRT publisher applies again).
        self.on_exclusive_change: Callable[[], None] | None = None

    # ---- what /readyz shows (never makes the agent unready: enforcement is best effort per pod) ----
    def status(self) -> tuple[bool, str]:
        r = self.last
        return True, f"{r.state}: {r.message}" if r.message else r.state

    def wake(self) -> None:
        self._wake.set()

    def exclusive(self) -> EnforcedCpus:
        """The exclusive CPUs memtopo holds for pods now (the NodeResourceTopology's ``available``
        counts them: the kubelet's PodResources does not know them); not ``known`` before the first
        pass that decided."""
        return self._exclusive

    def _track_exclusive(self, result: PassResult) -> None:
        if result.state == "active":
            value = EnforcedCpus(True, frozenset(c for a in self.held.values() for c in a.cpus), len(self.held))
        elif result.state == "kubelet":
            value = EnforcedCpus(True, note="kubelet: its static CPU manager owns container cpusets")
        elif self.adopted:
            return  # still holds what the last pass decided: nothing was released since
        else:
            value = EnforcedCpus(False, note=f"{result.state}: {result.message}" if result.message else result.state)
        if value != self._exclusive:
            self._exclusive = value
            if self.on_exclusive_change is not None:
                self.on_exclusive_change()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    async def run(self) -> None:
        """Pass after pass until cancelled; a failing pass is logged and the loop goes on."""
        watchers = [asyncio.create_task(self._watch_pods(), name="enforce_pods"),
                    asyncio.create_task(self._watch_runtime(), name="enforce_runtime_events")]
        try:
            while True:
                self._wake.clear()
                try:
                    await self.reconcile()
                except Exception:
                    log.exception("enforce_pass_failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval)
        finally:
            # A thread blocked on the runtime's event stream ends when its channel closes.
            events = self._events_client
            if events is not None:
                events.close()
            for w in watchers:
                w.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            # A migration in the engine finishes (or rolls back) there; its journal is closed first.
            await self.moves_done()
            self.close()

    async def moves_done(self) -> None:
        """Return once every memory move started so far has ended (and been recorded)."""
        while self._moving:
            await asyncio.shield(asyncio.gather(*self._moving, return_exceptions=True))

    async def _watch_pods(self) -> None:
        while True:
            try:
                await self.pods.wait_changed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("enforce_pod_watch_failed", error=shorten(str(exc)))
                await asyncio.sleep(self.interval)
            self._wake.set()

    async def _watch_runtime(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            stop = threading.Event()
            outcome = await asyncio.to_thread(self._follow_events, loop, stop)
            if outcome == "unimplemented":
                self._say_once("enforce_runtime_events_unavailable", "the runtime has no container events; polling",
                              interval_s=self.interval)
                return
            await asyncio.sleep(max(self.interval, 1.0))

    def _follow_events(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> str:
        try:
            client = self.connect()
        except cri.CriError:
            return "unavailable"
        self._events_client = client
        try:
            for _event in client.events():
                loop.call_soon_threadsafe(self._wake.set)
                if stop.is_set():
                    break
        except cri.CriError as exc:
            return "unimplemented" if exc.unimplemented else "failed"
        finally:
            self._events_client = None
            client.close()
        return "ended"

    def _say_once(self, event: str, message: str, **fields: Any) -> None:
        if event not in self._said:
            self._said.add(event)
            log.info(event, message=message, **fields)

    async def reconcile(self) -> PassResult:
        started = time.perf_counter()
        # The pod source belongs to the event loop: read it here, hand the thread a snapshot.
        pods = list(self.pods.bound_pods()) if self.pods.synced() else None
        result = await asyncio.to_thread(self._pass, pods)
        self.metrics.pass_duration.observe(time.perf_counter() - started)
        self.metrics.set_state(result.state)
        self.last = result
        self._track_exclusive(result)
        for move in result.moves:
            self._start_move(move)
        if result.state == "active":
            counts = {s: 0 for s in ef.STATES}
            for o in result.outcomes.values():
                counts[o.state] += 1
            for s, n in counts.items():
                self.metrics.pods.labels(s).set(n)
            await self._report(result)
        return result

    # ---- one pass (a worker thread) ----------------------------------------------------------------
    def _runtime(self) -> cri.CriClient:
        if self._client is None:
            self._client = self.connect()
        return self._client

    def _pass(self, pods: list[Mapping[str, Any]] | None) -> PassResult:
        with self._lock:
            return self._pass_locked(pods)

    def _pass_locked(self, pods: list[Mapping[str, Any]] | None) -> PassResult:
        facts = self.kubelet()
        if facts.problem:
            return PassResult("config_unreadable", f"kubelet configuration: {shorten(facts.problem)}; "
                                                   "memtopo cannot know who owns cpusets and changes none")
        if facts.cpu_manager_policy == "static":
            self._say_once("enforce_left_to_kubelet", "the kubelet's static CPU manager owns container cpusets; "
                           "memtopo changes none", config=facts.config_path)
            return PassResult("kubelet", "the kubelet's static CPU manager owns container cpusets")
        if facts.cpu_manager_policy not in (None, "none"):
            return PassResult("config_unreadable", f"cpuManagerPolicy {shorten(facts.cpu_manager_policy)} "
                                                   "is not one memtopo knows; it changes no cpuset")
        if pods is None:
            return PassResult("waiting", "the pod list has not arrived yet")
        node = self.node()
        if node is None:
            return PassResult("waiting", "no topology yet")
        try:
            return self._enforce(node, pods)
        except cri.CriError as exc:
            self.close()
            log.warning("enforce_runtime_unavailable", code=exc.code, reason=exc.reason)
            return PassResult("runtime_unavailable", f"{exc.code}: {exc.reason}")

    def _observe(self, client: cri.CriClient, c: cri.RuntimeContainer) -> ef.Observed | None:
        """The container's cpuset; None when it went away meanwhile."""
        pid = self._pids.get(c.id)
        if pid is None:
            try:
                pid = client.container_status(c.id).pid
            except cri.CriError as exc:
                if exc.not_found:
                    return None
                raise
            if pid is None:
                return None
            self._pids[c.id] = pid
        return self.cpusets(pid)

    def _enforce(self, node: ef.NodeFacts, pods: list[Mapping[str, Any]]) -> PassResult:
        client = self._runtime()
        listed = [c for c in client.list_containers(state=cri.RUNNING) if c.pod_uid]
        observed: dict[str, ef.Observed] = {}
        for c in listed:
            seen = self._observe(client, c)
            if seen is not None:
                observed[c.id] = seen
        running = [ef.RunningContainer(c.id, c.pod_uid, c.name) for c in listed if c.id in observed]
        self._pids = {cid: pid for cid, pid in self._pids.items() if cid in observed}
        views = {v.uid: v for v in (ef.pod_view(p) for p in pods) if v is not None}
        if not self.adopted:
            by_pod: dict[str, dict[str, ef.Observed]] = {}
            for rc in running:
                by_pod.setdefault(rc.pod_uid, {})[rc.name] = observed[rc.id]
            self.held = ef.adopt(node, views.values(), by_pod)
            self.adopted = True
            if self.held:
                log.info("enforce_adopted", pods=len(self.held),
                         cpus=format_cpulist(c for a in self.held.values() for c in a.cpus))
        released = set(self.held) - set(views)
        decision = ef.decide(node, list(views.values()), running, self.held)
        for uid in released - set(decision.assignments):
            log.info("enforce_released", pod_uid=uid, cpus=format_cpulist(self.held[uid].cpus))
        self.held = decision.assignments
        result = PassResult("active", f"{len(decision.assignments)} pods pinned, shared pool "
                                      f"{format_cpulist(decision.pool)}", decision.outcomes, views)
        exclusive = frozenset(c for a in decision.assignments.values() for c in a.cpus)
        done: set[str] = set()
        # 1. Shared containers leave the CPUs that are now exclusive before anyone is pinned there.
        for cid, target in decision.shared.items():
            seen = observed[cid]
            if seen.cpus is None or seen.cpus & exclusive:
                self._update(client, cid, target, seen, result)
                done.add(cid)
        # 2. Each pod: all of its updates or none.
        for uid, targets in decision.pinned.items():
            why = self._pin_pod(client, targets, observed, result)
            if why:
                o = decision.outcomes[uid]
                decision.outcomes[uid] = ef.Outcome(ef.PENDING, why, o.assignment, o.generation)
        # 3. The rest of the shared pool.
        for cid, target in decision.shared.items():
            if cid not in done and ef.needs_update(target, observed[cid], pinned=False):
                self._update(client, cid, target, observed[cid], result)
        self._targets = dict(decision.shared)
        for targets in decision.pinned.values():
            self._targets.update(targets)
        self._plan_moves(node, decision, result)
        return result

    def _plan_moves(self, node: ef.NodeFacts, decision: ef.Decision, result: PassResult) -> None:
        """The memory to move after this pass: of each container pinned in it, once per set of memory
        nodes (a drift put back moves nothing again)."""
        for cid in [c for c in self._moved if c not in self._pids]:
            del self._moved[cid]
        if self.migrate is None or self.procs is None:
            return
        updated = set(result.updated)
        for uid, targets in decision.pinned.items():
            for cid, target in targets.items():
                if cid not in updated:
                    continue
                span = ef.memory_move(target, node)
                if span is None:
                    self._moved.pop(cid, None)
                    continue
                pid = self._pids.get(cid)
                if pid is None or self._moved.get(cid) == span[1]:
                    continue
                self._moved[cid] = span[1]
                result.moves.append(PendingMove(uid, cid, pid, *span))

    def _drifted(self, cid: str, target: ef.Target, seen: ef.Observed) -> None:
        before = self._targets.get(cid)
        if before == target and seen.cpus is not None:
            self.metrics.drift.inc()
            log.info("enforce_drift_restored", container=cid[:12], found=format_cpulist(seen.cpus),
                     restored=format_cpulist(target.cpus))

    def _update(self, client: cri.CriClient, cid: str, target: ef.Target, seen: ef.Observed,
                result: PassResult) -> bool:
        self._drifted(cid, target, seen)
        try:
            client.update_cpuset(cid, target.cpus, target.mems)
        except cri.CriError as exc:
            self.metrics.updates.labels("failed").inc()
            if exc.not_found:
                return False
            log.warning("enforce_update_failed", container=cid[:12], code=exc.code, reason=exc.reason)
            if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "NO_SOCKET", "NOT_SOCKET"):
                raise
            return False
        self.metrics.updates.labels("ok").inc()
        result.updated.append(cid)
        return True

    def _pin_pod(self, client: cri.CriClient, targets: Mapping[str, ef.Target],
                 observed: Mapping[str, ef.Observed], result: PassResult) -> str:
        """Pin every container of one pod that is off its share; on a failure undo the ones changed and
        say why ("" when all went well)."""
        changed: list[str] = []
        for cid, target in targets.items():
            if not ef.needs_update(target, observed[cid], pinned=True):
                continue
            self._drifted(cid, target, observed[cid])
            try:
                client.update_cpuset(cid, target.cpus, target.mems)
            except cri.CriError as exc:
                self.metrics.updates.labels("failed").inc()
                for done in reversed(changed):
                    self._undo(client, done, observed[done], result)
                what = "went away during the update" if exc.not_found else f"could not be updated ({exc.code})"
                log.warning("enforce_pod_not_pinned", container=cid[:12], code=exc.code, reason=exc.reason,
                            undone=len(changed))
                if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "NO_SOCKET", "NOT_SOCKET"):
                    raise
                return f"container {cid[:12]} {what}; its pod's other updates were undone; retrying"
            self.metrics.updates.labels("ok").inc()
            changed.append(cid)
            result.updated.append(cid)
        return ""

    def _undo(self, client: cri.CriClient, cid: str, seen: ef.Observed, result: PassResult) -> None:
        if seen.cpus is None:
            return
        try:
            client.update_cpuset(cid, seen.cpus, seen.mems or ())
        except cri.CriError as exc:
            log.warning("enforce_undo_failed", container=cid[:12], code=exc.code, reason=exc.reason)
            return
        self.metrics.updates.labels("undone").inc()
        result.updated.remove(cid)

    # ---- moving memory (a task on the loop, the migration in a worker thread) ----------------------
    def _start_move(self, move: PendingMove) -> None:
        self._memory.setdefault(move.pod_uid, {}).pop(move.container, None)
        task = asyncio.create_task(self._run_move(move), name=f"enforce_move_{move.container[:12]}")
        self._moving.add(task)
        task.add_done_callback(self._moving.discard)

    async def _run_move(self, move: PendingMove) -> None:
        started = time.perf_counter()
        try:
            outcome = await asyncio.to_thread(self._move, move)
        except Exception as exc:
            reason = shorten(str(exc) or type(exc).__name__, 160)
            self.metrics.migrations.labels("failed").inc()
            log.warning("enforce_memory_move_failed", pod_uid=move.pod_uid, container=move.container[:12],
                        from_nodes=format_cpulist(move.from_nodes), to_nodes=format_cpulist(move.to_nodes),
                        reason=reason)
            outcome = f"failed: {reason}"
        else:
            self.metrics.migrations.labels("moved" if outcome == MOVED else "in_place").inc()
            log.info("enforce_memory_moved", pod_uid=move.pod_uid, container=move.container[:12], outcome=outcome,
                     from_nodes=format_cpulist(move.from_nodes), to_nodes=format_cpulist(move.to_nodes),
                     seconds=round(time.perf_counter() - started, 3))
        if self._moved.get(move.container) == move.to_nodes:  # not pinned elsewhere meanwhile
            self._memory.setdefault(move.pod_uid, {})[move.container] = outcome
        self._wake.set()  # the next pass reports it

    def _move(self, move: PendingMove) -> str:
        assert self.migrate is not None and self.procs is not None
        pids = self.procs(move.pid)
        if pids is None:
            raise MemoryMoveError("the container's cgroup.procs cannot be read")
        if not pids:
            raise MemoryMoveError("the container has no processes left")
        if len(pids) > MAX_MOVED_PROCS:
            log.warning("enforce_memory_move_truncated", container=move.container[:12], processes=len(pids),
                        moved=MAX_MOVED_PROCS)
        return self.migrate(MemoryMove(move.pod_uid, move.container, tuple(pids[:MAX_MOVED_PROCS]),
                                       move.from_nodes, move.to_nodes))

    def memory_state(self, uid: str) -> str:
        """How moving the pod's pinned containers' pages went: the first failure, else ``moved`` if
        any moved, else ``in place``; "" before any move ended."""
        done = self._memory.get(uid, {}).values()
        failed = next((o for o in done if o.startswith("failed")), None)
        if failed is not None:
            return failed
        return MOVED if MOVED in done else IN_PLACE if done else ""

    # ---- reports (the event loop) ------------------------------------------------------------------
    async def _report(self, result: PassResult) -> None:
        for uid in list(self._reported):
            if uid not in result.pods:
                del self._reported[uid]
        for uid in list(self._memory):
            if uid not in result.outcomes:
                del self._memory[uid]
        for uid, outcome in result.outcomes.items():
            pod = result.pods.get(uid)
            if pod is None:
                continue
            memory = self.memory_state(uid)
            said = (ef.status_annotation(outcome), memory)
            before = self._reported.get(uid)
            if before == said:
                continue
            try:
                value = ef.status_annotation(outcome, memory)
                await _bounded(self.reporter.annotate(pod.namespace, pod.name, uid, ef.STATUS_ANNOTATION, value))
                # An Event for what changed: the pinning, or only how moving its memory went.
                event = _event(outcome) if before is None or before[0] != said[0] else _memory_event(memory)
                if event is not None:
                    await _bounded(self.reporter.event(pod.namespace, pod.name, uid, *event))
            except Exception as exc:
                self.metrics.reports_failed.inc()
                log.warning("enforce_report_failed", pod=pod.key, error=shorten(str(exc) or type(exc).__name__))
                continue
            self._reported[uid] = said
            log.info("enforce_pod", pod=pod.key, state=outcome.state, reason=outcome.reason or None,
                     cpus=format_cpulist(outcome.assignment.cpus) if outcome.assignment else None)


async def _bounded(call: Awaitable[None]) -> None:
    await asyncio.wait_for(call, REPORT_TIMEOUT_S)


def _event(outcome: ef.Outcome) -> tuple[str, str, str] | None:
    a = outcome.assignment
    if outcome.state == ef.APPLIED and a is not None:
        note = f" ({outcome.reason})" if outcome.reason else ""
        return ("Normal", "CPUsPinned", f"exclusive CPUs {format_cpulist(a.cpus)}, memory nodes "
                f"{format_cpulist(a.mems) or 'unchanged'}, from the {a.how} decision{note}")
    if outcome.state == ef.FAILED:
        return "Warning", "CPUPinningFailed", outcome.reason
    if outcome.state == ef.PENDING and "retrying" in outcome.reason:
        return "Warning", "CPUPinningRetried", outcome.reason
    return None


def _memory_event(memory: str) -> tuple[str, str, str] | None:
    if memory == MOVED:
        return "Normal", "MemoryMoved", "pages of the pinned containers moved onto their memory nodes"
    if memory.startswith("failed"):
        return ("Warning", "MemoryMoveFailed", f"pages of a pinned container could not be moved onto its memory "
                f"nodes ({memory.removeprefix('failed: ')}); its CPUs and memory nodes stay pinned")
    return None


def node_facts(node_name: str, topo: pb.MemoryTopology, fs: HostFS, reserved: Sequence[int]) -> ef.NodeFacts:
    """The node facts of a topology, each CPU's core from sysfs. ``reserved`` is the kubelet's
    ``reservedSystemCPUs``; without any, the lowest CPU is kept back for the shared pool."""
    from memtopo.k8s.cputopo import CpuTopology, read_cpu_places

    cpus = [c for n in topo.numa_nodes for c in n.cpus]
    model = CpuTopology.from_topology(topo, read_cpu_places(fs, cpus))
    mems = frozenset(n.id for n in topo.numa_nodes if n.has_memory and n.memory_bytes > 0)
    kept = frozenset(reserved) & model.cpus
    if not kept and model.cpus:
        # The kubelet's static policy refuses to run without a reserved CPU: the shared pool, where
        # the system and every other container run, must never be handed out to the last CPU.
        kept = frozenset({min(model.cpus)})
    return ef.NodeFacts(node_name, model, kept, mems)



class _Every:
    """``read()``'s answer, read again at most every ``seconds`` (the kubelet's file changes rarely;
    a pass runs every second)."""

    def __init__(self, read: Callable[[], KubeletFacts], seconds: float) -> None:
        self.read, self.seconds = read, seconds
        self._value: KubeletFacts | None = None
        self._at = 0.0

    def __call__(self) -> KubeletFacts:
        now = time.monotonic()
        if self._value is None or now - self._at >= self.seconds:
            self._value, self._at = self.read(), now
        return self._value


# ---- moving memory through the apply engine ----------------------------------------------------------
def migration_plan(move: MemoryMove, plan_id: str) -> planpb.BindingPlan:
    """One optional page migration action per process: one that exited meanwhile is skipped, and a
    failed one leaves the others moved (a required one would move them all back)."""
    plan = planpb.BindingPlan(plan_id=plan_id, policy="cpu-enforcement",
                              description=f"memory of container {move.container[:12]} (pod uid {move.pod_uid}) "
                                          f"onto the memory nodes it is pinned to")
    for pid in move.pids:
        plan.actions.add(id=f"pid-{pid}", required=False, page_migration=planpb.PageMigration(
            pid=pid, from_nodes=move.from_nodes, to_nodes=move.to_nodes))
    return plan


def migration_outcome(result: planpb.PlanResult) -> str:
    """MOVED or IN_PLACE for an engine result, or MemoryMoveError with its reason: refused, failed,
    or no process whose pages could be read."""
    status = planpb.ActionResult
    if result.state == planpb.PlanResult.STATE_REJECTED:
        raise MemoryMoveError(f"the plan was refused: {result.rejections[0] if result.rejections else result.message}")
    done = [a for a in result.actions if a.status in (status.STATUS_APPLIED, status.STATUS_UNCHANGED)]
    if result.state not in (planpb.PlanResult.STATE_APPLIED, planpb.PlanResult.STATE_UNCHANGED) or not done:
        why = next((a.reason for a in result.actions if a.reason), result.message)
        raise MemoryMoveError(f"plan {result.plan_id}: {why}")
    return MOVED if any(a.status == status.STATUS_APPLIED for a in done) else IN_PLACE


class EngineMigrator:
    """The :data:`Migrator` of the agent's apply engine: a page migration plan per move, journaled and
    validated like every plan, its id naming the container and when (a stored result is never
    mistaken for a new move)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __call__(self, move: MemoryMove) -> str:
        plan_id = f"enforce-memory-{move.container[:12]}-{time.time_ns()}"
        result = self.engine.apply(migration_plan(move, plan_id))
        outcome = migration_outcome(result)
        left = sum(int(a.details.get("pages_left_on_source", "0") or 0) for a in result.actions)
        if left:
            log.info("enforce_memory_left", container=move.container[:12], plan_id=plan_id, pages=left,
                     from_nodes=format_cpulist(move.from_nodes))
        return outcome


def enforcer_for(cfg: KubernetesConfig, agent_node_name: str, fs: HostFS,
                 topology: Callable[[], pb.MemoryTopology | None], pods: PodSource, reporter: PodReporter,
                 registry: CollectorRegistry | None = None, migrate: Migrator | None = None) -> Enforcer:
    """The agent's enforcement for its ``[kubernetes]`` section; ``topology`` gives the published
    MemoryTopology (None before the first), ``fs`` is the agent's root, ``migrate`` moves a pinned
    container's pages (:class:`EngineMigrator`; None leaves them where they are)."""
    import os

    from memtopo.k8s.defaults import DEFAULT_CONFIG_PATHS
    from memtopo.k8s.kubelet import read_kubelet_facts

    paths = (cfg.kubelet_config,) if cfg.kubelet_config else DEFAULT_CONFIG_PATHS
    kubelet = _Every(lambda: read_kubelet_facts(fs, paths), 10.0)
    name = cfg.node_name or os.environ.get("NODE_NAME", "") or agent_node_name
    cache: dict[tuple[str, tuple[int, ...]], ef.NodeFacts] = {}

    def node() -> ef.NodeFacts | None:
        topo = topology()
        if topo is None:
            return None
        key = (topo.fingerprint, kubelet().reserved_cpus)
        if key not in cache:
            cache.clear()
            cache[key] = node_facts(name, topo, fs, key[1])
        return cache[key]

    def connect() -> cri.CriClient:
        # Resolved at each connect: a runtime that starts after the agent is found when it does.
        return cri.CriClient(cri.resolve_endpoint(cfg.runtime_endpoint))

    cgroups = CgroupCpusets(fs)
    return Enforcer(node=node, kubelet=kubelet, connect=connect, pods=pods, reporter=reporter,
                    cpusets=cgroups.read, metrics=EnforceMetrics(registry),
                    interval=cfg.enforce_interval_seconds, migrate=migrate, procs=cgroups.procs)
