"""Run the probes against one context and assemble the MemoryTopology: every probe (``discover``), or
again and again, each time only those a change reaches (``Rescanner``)."""

from __future__ import annotations

import _thread
import dataclasses
import functools
import gc
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from memtopo.discovery.assemble import Parts, assemble
from memtopo.discovery.bounds import sanitize
from memtopo.discovery.changes import EVERYTHING, Change
from memtopo.discovery.fingerprint import fingerprint
from memtopo.discovery.parts import AcceleratorPart
from memtopo.discovery.probes import ACCELERATORS, PROBES, ProbeSpec, reached
from memtopo.discovery.source import DiscoveryScope, ProbeContext, ProbeResult, SourceStatus, State, StatusBuilder
from memtopo.text import excerpt
from memtopo.v1 import topology_pb2 as pb


class _Backstop:
    """Probes handle their own errors; this catches what one lets through, so a bug in one probe
    becomes that source's degraded status instead of sinking discovery, and collects the statuses
    of probes that did not answer (overdue, left out)."""

    def __init__(self, ctx: ProbeContext) -> None:
        self.ctx = ctx
        self.failures: list[SourceStatus] = []

    def guarded[T](self, source: str, probe: Callable[[ProbeContext], ProbeResult[T]]) -> ProbeResult[T] | None:
        """The probe in this thread, its exceptions turned into its source's status; a probe the
        context leaves out is not run, and its source says why."""
        left_out = self.ctx.leave_out.get(source)
        if left_out is not None:
            self.failures.append(SourceStatus(source, State.DEGRADED, (left_out,)))
            return None
        watch = self.ctx.on_probe
        if watch is not None:
            watch(source, True)
        try:
            return probe(self.ctx)
        except Exception as exc:  # anything a probe lets through
            reason = f"probe failed: {type(exc).__name__}: {excerpt(str(exc), 200)}"
            self.failures.append(SourceStatus(source, State.DEGRADED, (reason,)))
            return None
        finally:
            if watch is not None:
                watch(source, False)

    def overdue(self, source: str) -> None:
        self.failures.append(SourceStatus(source, State.UNAVAILABLE, (
            f"probe did not finish within its deadline of {self.ctx.deadline_s:g} s; left running",)))


class _Slot:
    """One probe's run: its result once done, which every probe that needs it waits for."""

    def __init__(self, spec: ProbeSpec) -> None:
        self.spec = spec
        self.result: ProbeResult[Any] | None = None
        self.done = threading.Event()
        self.own_thread = False
        self.started_at: float | None = None
        self.started: threading.Event | None = None  # a probe on its own thread sets it as it starts
        self._finishing = threading.Lock()

    def settle(self, backstop: _Backstop, deadline_s: float) -> None:
        """Wait for a probe in its own thread until its deadline (counted from its start); one still
        running then is reported overdue and its part is None."""
        if self.done.is_set():
            return
        assert self.started is not None
        self.started.wait()
        assert self.started_at is not None
        if not self.done.wait(max(0.0, deadline_s - (time.perf_counter() - self.started_at))) and self.finish(None):
            backstop.overdue(self.spec.source)

    def finish(self, result: ProbeResult[Any] | None) -> bool:
        """Record the result unless one already is (an overdue probe's late answer is not read);
        whether this call was the one that finished the slot."""
        with self._finishing:
            if self.done.is_set():
                return False
            self.result = result
            self.done.set()
            return True


def _spawn(fn: Callable[[], None]) -> None:
    """``fn`` on a new thread, without waiting for it to start as threading.Thread.start() does: on
    a busy machine each wait for the other side to be scheduled costs more than a small probe. Like
    a daemon thread, it does not keep the process alive."""
    _thread.start_new_thread(fn, ())


class _LaneRun:
    """One thread running the shared lane's probes one after another, watched by the caller.

    The thread tells the caller nothing until the lane is done: a handoff per probe (a wakeup of
    each side, on a busy two-core machine a wait for a core each time) cost more than most probes.
    The caller sleeps until then or until the running probe's deadline, counted from its start."""

    def __init__(self, slots: list[_Slot], start: Callable[[_Slot], Callable[[], ProbeResult[Any] | None]]) -> None:
        self.slots = slots
        self.start = start  # waits for the slot's needs, then returns its run
        self.cond = threading.Condition(threading.Lock())
        self.running = -1
        self.started_at: float | None = None  # None between probes (and while one waits for its needs)
        self.done = False
        self.abandoned = False

    def work(self) -> None:
        try:
            for i, slot in enumerate(self.slots):
                run = self.start(slot)
                with self.cond:
                    if self.abandoned:
                        return
                    self.running, self.started_at = i, time.perf_counter()
                result = run()
                with self.cond:
                    if self.abandoned:  # its late answer is not read
                        return
                    slot.finish(result)
                    self.started_at = None
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def wait(self, deadline_s: float) -> int | None:
        """None once every probe has run; else the index of the one that overran its deadline (the
        thread is abandoned to it: it runs nothing more, and what it returns is dropped)."""
        with self.cond:
            while not self.done:
                started = self.started_at
                if started is None:
                    self.cond.wait(deadline_s)
                    continue
                left = started + deadline_s - time.perf_counter()
                if left <= 0:
                    self.abandoned = True
                    return self.running
                self.cond.wait(left)
            return None


def _run_lane(slots: list[_Slot], start: Callable[[_Slot], Callable[[], ProbeResult[Any] | None]],
              backstop: _Backstop, deadline_s: float) -> None:
    """The lane's probes in order, on a thread of their own; one still running at its deadline is
    reported overdue and left to finish on its own (nothing can interrupt a read or a C library),
    and the probes after it go on in a fresh thread."""
    while slots:
        lane = _LaneRun(slots, start)
        _spawn(lane.work)
        stuck = lane.wait(deadline_s)
        if stuck is None:
            return
        backstop.overdue(slots[stuck].spec.source)
        slots[stuck].finish(None)
        slots = slots[stuck + 1:]


def _call(spec: ProbeSpec, ctx: ProbeContext, needed: tuple[ProbeResult[Any] | None, ...]
          ) -> Callable[[ProbeContext], ProbeResult[Any]]:
    """The probe with its needs bound; a vendor that is certainly absent is reported without its module."""
    def run(c: ProbeContext) -> ProbeResult[Any]:
        t0 = time.perf_counter()
        absent = spec.absent_result(c, needed)
        if absent is not None:
            st = absent.status
            return ProbeResult(absent.data, SourceStatus(st.source, st.state, st.reasons, time.perf_counter() - t0))
        return spec.function()(c, *needed)
    return run


def collect(ctx: ProbeContext, scope: DiscoveryScope, probes: tuple[ProbeSpec, ...] | None = None,
            reuse: Mapping[str, ProbeResult[Any]] | None = None) -> Parts:
    """All probes' parts, scheduled from their declarations (discovery/probes.py); a source in
    ``reuse`` is not run: that result stands for it (and is what probes that need it get).

    A probe whose ``own_thread`` holds runs in a thread of its own, started first (hwloc beside the
    sysfs probes; on the live host the vendor probes, whose tools and libraries can take seconds);
    the others run one after another in the shared lane, in declaration order. Either way a probe
    starts once the parts it needs are done, gets them as arguments, and is bounded by
    ``ctx.deadline_s`` from its start: an overdue or raising probe costs its own source only, and a
    probe that needs it gets None.

    What the probes defer (see DiscoveryScope) runs when the caller closes ``scope``."""
    probes = PROBES if probes is None else probes
    ctx = dataclasses.replace(ctx, scope=scope)
    backstop = _Backstop(ctx)
    slots = {spec.source: _Slot(spec) for spec in probes}
    for slot in slots.values():
        kept = reuse.get(slot.spec.source) if reuse else None
        if kept is not None:
            slot.finish(kept)

    def needed(spec: ProbeSpec) -> tuple[ProbeResult[Any] | None, ...]:
        for n in spec.needs:
            if slots[n].own_thread:
                slots[n].settle(backstop, ctx.deadline_s)
            slots[n].done.wait()  # a lane probe's slot is finished before the next one starts
        return tuple(slots[n].result for n in spec.needs)

    def threaded(slot: _Slot) -> None:
        result = None
        try:
            try:
                args = needed(slot.spec)
            finally:
                slot.started_at = time.perf_counter()
                assert slot.started is not None
                slot.started.set()
            result = backstop.guarded(slot.spec.source, _call(slot.spec, ctx, args))
        finally:
            slot.finish(result)

    def in_lane(slot: _Slot) -> Callable[[], ProbeResult[Any] | None]:
        call = _call(slot.spec, ctx, needed(slot.spec))
        return lambda: backstop.guarded(slot.spec.source, call)

    own = [slot for slot in slots.values() if not slot.done.is_set() and slot.spec.own_thread(ctx)]
    # Vendors first: theirs are the longest waits.
    own.sort(key=lambda slot: slot.spec.part != ACCELERATORS)
    try:
        for slot in own:  # all known as threaded before any starts and asks about another
            slot.own_thread = True
            slot.started = threading.Event()
        for slot in own:
            _spawn(functools.partial(threaded, slot))
        _run_lane([slot for slot in slots.values() if not slot.own_thread and not slot.done.is_set()], in_lane,
                  backstop, ctx.deadline_s)
        for slot in own:
            slot.settle(backstop, ctx.deadline_s)
    finally:
        for slot in slots.values():
            if not slot.done.is_set():
                slot.finish(None)  # nothing waits forever on a probe that never ran
    parts: dict[str, Any] = {}
    accelerators: dict[str, ProbeResult[AcceleratorPart]] = {}
    for slot in slots.values():
        if slot.result is None:
            continue
        if slot.spec.part == ACCELERATORS:
            accelerators[slot.spec.source] = slot.result
        else:
            parts[slot.spec.part] = slot.result
    return Parts(**parts, accelerators=accelerators, extra_statuses=tuple(backstop.failures))


_SCHEMA_ERRORS = (ValueError, TypeError, OverflowError)


def assemble_checked(parts: Parts, source_root: str) -> pb.MemoryTopology:
    """The assembly, which never fails on what a source read: values the schema cannot carry are
    replaced and their sources degraded (discovery.bounds); should the assembly still refuse, the
    sources are left out one at a time, in the order of _DROP_ORDER, until it does not."""
    try:
        return assemble(parts, source_root=source_root)
    except _SCHEMA_ERRORS as exc:
        first = exc
    parts = _sanitized(parts)
    for source in (None, *_DROP_ORDER):
        if source is not None:
            parts = _without(parts, source, f"left out: the topology could not hold what it read "
                                            f"({type(first).__name__}: {excerpt(str(first), 120)})")
        try:
            return assemble(parts, source_root=source_root)
        except _SCHEMA_ERRORS as exc:
            first = exc
    raise first


_PART_FIELDS = ("identity", "numa", "tiers", "cxl", "pci", "allowed", "hwloc")
# Vendors first (recorded answers are the likeliest to be odd), the kernel's own view last.
_DROP_ORDER = ("accelerators", "hwloc", "cxl", "tiers", "pci", "allowed", "identity", "numa")


def _degrade[T](result: ProbeResult[T], reasons: list[str], data: T) -> ProbeResult[T]:
    st = result.status
    state = st.state if st.state is State.UNAVAILABLE else State.DEGRADED
    return ProbeResult(data, dataclasses.replace(st, state=state, reasons=(*st.reasons, *reasons)))


def _sanitized(parts: Parts) -> Parts:
    def fix[T](result: ProbeResult[T] | None) -> ProbeResult[T] | None:
        if result is None:
            return None
        reasons: list[str] = []
        data = sanitize(result.data, type(result.data).__name__, reasons.append)
        if len(reasons) > StatusBuilder.MAX_REASONS:
            reasons[StatusBuilder.MAX_REASONS:] = [f"and {len(reasons) - StatusBuilder.MAX_REASONS} more"]
        return _degrade(result, reasons, data) if reasons else result

    changes: dict[str, object] = {name: fix(getattr(parts, name)) for name in _PART_FIELDS}
    changes["accelerators"] = {k: r for k, v in parts.accelerators.items() if (r := fix(v)) is not None}
    return dataclasses.replace(parts, **changes)  # type: ignore[arg-type]


def _without(parts: Parts, field: str, reason: str) -> Parts:
    if field == "accelerators":
        return dataclasses.replace(parts, accelerators={
            k: ProbeResult(v.data, SourceStatus(v.status.source, State.UNAVAILABLE, (*v.status.reasons, reason)))
            for k, v in parts.accelerators.items()})
    result = getattr(parts, field)
    if result is None:
        return parts
    status = SourceStatus(result.status.source, State.UNAVAILABLE, (*result.status.reasons, reason))
    return dataclasses.replace(parts, **{field: ProbeResult(result.data, status)})  # type: ignore[arg-type]


def results_by_source(parts: Parts, probes: tuple[ProbeSpec, ...] = PROBES) -> dict[str, ProbeResult[Any]]:
    """The probes' results in ``parts``, by source (those that gave one)."""
    out: dict[str, ProbeResult[Any]] = {}
    for spec in probes:
        result = parts.accelerators.get(spec.source) if spec.part == ACCELERATORS else getattr(parts, spec.part)
        if result is not None:
            out[spec.source] = result
    return out


def discover(ctx: ProbeContext, generation: int = 1, node_name: str = "") -> pb.MemoryTopology:
    """Every probe, assembled. ``node_name``: the operator's name for the node, which wins over the
    host name (a Kubernetes node name need not be the hostname); it is in the fingerprint."""
    return _discover(ctx, generation, node_name, None, None, PROBES)[0]


class Rescanner:
    """Discoveries of one context one after another, each rerunning only the probes its change
    reaches (discovery/probes.py ``reached``); every other source's last result stands. The first
    discovery is full, as is one for EVERYTHING; a probe whose last run gave nothing (it raised or
    overran its deadline) runs every time."""

    def __init__(self, ctx: ProbeContext, probes: tuple[ProbeSpec, ...] = PROBES) -> None:
        self.ctx = ctx
        self.probes = probes
        # The last discovery's result of each source.
        self.results: dict[str, ProbeResult[Any]] = {}
        # The sources the last discovery ran (the others were kept).
        self.ran: frozenset[str] = frozenset()

    def discover(self, change: Change = EVERYTHING, *, generation: int = 1, node_name: str = "",
                 scope: DiscoveryScope | None = None) -> pb.MemoryTopology:
        """The topology after ``change``. ``scope``: given, the caller closes it (a process that exits
        right after need not free hwloc's topology); else it is closed before this returns."""
        rerun = reached(change, self.probes)
        reuse = {source: r for source, r in self.results.items() if source not in rerun}
        topo, parts = _discover(self.ctx, generation, node_name, reuse, scope, self.probes)
        self.results = results_by_source(parts, self.probes)
        self.ran = frozenset(spec.source for spec in self.probes if spec.source not in reuse)
        return topo

    def keep(self, results: Mapping[str, ProbeResult[Any]], ran: frozenset[str]) -> None:
        """Take what a discovery elsewhere found (a forked child's), as if this one had run it."""
        self.results, self.ran = dict(results), ran


def _discover(ctx: ProbeContext, generation: int, node_name: str, reuse: Mapping[str, ProbeResult[Any]] | None,
              scope: DiscoveryScope | None, probes: tuple[ProbeSpec, ...]) -> tuple[pb.MemoryTopology, Parts]:
    root = str(ctx.hwloc_xml) if ctx.hwloc_xml is not None else str(ctx.fs.root)
    # Discovery allocates tens of thousands of short-lived, acyclic objects; letting the cyclic
    # collector run in the middle of that costs ~10% of the whole and frees nothing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    own_scope = scope is None
    current = DiscoveryScope() if scope is None else scope
    try:
        parts = collect(ctx, current, probes, reuse)
        topo = assemble_checked(parts, source_root=root)
        topo.generation = generation
        if node_name:
            topo.node_name = node_name
        topo.fingerprint = fingerprint(topo)
    finally:
        try:
            if own_scope:
                current.close()
        finally:
            if gc_was_enabled:
                gc.enable()
    # What Timestamp.GetCurrentTime gives (the same clock, whole microseconds) without its trip
    # through datetime and calendar.
    seconds, micros = divmod(time.time_ns() // 1000, 1_000_000)
    topo.discovery_time.seconds, topo.discovery_time.nanos = seconds, micros * 1000
    return topo, parts
