"""Run every probe against one context and assemble the MemoryTopology."""

from __future__ import annotations

import dataclasses
import gc
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout

from memtopo.discovery import (
    amd,
    ascend,
    hwloc,
    identity,
    kunlunxin,
    nvidia,
    proc_allowed,
    sysfs_cxl,
    sysfs_numa,
    sysfs_pci,
    sysfs_tiers,
)
from memtopo.discovery.assemble import Parts, assemble
from memtopo.discovery.bounds import sanitize
from memtopo.discovery.fingerprint import fingerprint
from memtopo.discovery.parts import AcceleratorPart, HwlocPart
from memtopo.discovery.source import DiscoveryScope, ProbeContext, ProbeResult, SourceStatus, State, StatusBuilder
from memtopo.text import excerpt
from memtopo.v1 import topology_pb2 as pb


class _Lane:
    """Runs calls one after another on a thread of its own, each waited for until a deadline. A
    call still running at its deadline is left to finish on its own (nothing can interrupt a read
    or a C library) and later calls get a fresh thread: one stuck probe costs its own source."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] | None = None

    def call[T](self, fn: Callable[[], T], deadline_s: float) -> tuple[bool, T | None]:
        """(True, what ``fn`` returned), or (False, None) when it ran past ``deadline_s``."""
        box: list[T] = []
        done = threading.Event()

        def job() -> None:
            try:
                box.append(fn())
            finally:
                done.set()

        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._queue,), name="memtopo-probe", daemon=True).start()
        self._queue.put(job)
        if not done.wait(deadline_s):
            self._queue.put(None)  # the stuck thread ends once its call returns
            self._queue = None
            return False, None
        return True, box[0] if box else None

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
            self._queue = None


def _serve(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    while (job := jobs.get()) is not None:
        job()


class _Backstop:
    """Probes handle their own errors; this catches what one lets through, so a bug in one probe
    becomes that source's degraded status instead of sinking discovery. It also bounds each probe
    in time (``ProbeContext.deadline_s``): one that runs past it is reported and left behind."""

    def __init__(self, ctx: ProbeContext, lane: _Lane | None = None) -> None:
        self.ctx = ctx
        self.lane = lane
        self.failures: list[SourceStatus] = []

    def guarded[T](self, source: str, probe: Callable[[ProbeContext], ProbeResult[T]]) -> ProbeResult[T] | None:
        """The probe in this thread, its exceptions turned into its source's status."""
        try:
            return probe(self.ctx)
        except Exception as exc:  # anything a probe lets through
            reason = f"probe failed: {type(exc).__name__}: {excerpt(str(exc), 200)}"
            self.failures.append(SourceStatus(source, State.DEGRADED, (reason,)))
            return None

    def run[T](self, source: str, probe: Callable[[ProbeContext], ProbeResult[T]]) -> ProbeResult[T] | None:
        if self.lane is None:
            return self.guarded(source, probe)
        finished, result = self.lane.call(lambda: self.guarded(source, probe), self.ctx.deadline_s)
        if not finished:
            self.overdue(source)
        return result

    def overdue(self, source: str) -> None:
        self.failures.append(SourceStatus(source, State.UNAVAILABLE, (
            f"probe did not finish within its deadline of {self.ctx.deadline_s:g} s; left running",)))


# Vendor accelerator sources. Each runs its own tools concurrently (runner.run_all).
ACCELERATOR_PROBES: tuple[tuple[str, Callable[[ProbeContext], ProbeResult[AcceleratorPart]]], ...] = (
    (amd.SOURCE, amd.probe),
    (ascend.SOURCE, ascend.probe),
    (kunlunxin.SOURCE, kunlunxin.probe),
    (nvidia.SOURCE, nvidia.probe),
)


def collect(ctx: ProbeContext, scope: DiscoveryScope) -> Parts:
    """All probes' parts. hwloc's load is C code that releases the GIL, so the sysfs probes run
    beside it on another core instead of after it (with XML input there is nothing to overlap).

    On the live host the vendor probes start first, in their own threads: their tools and
    libraries can take seconds (or hang until their timeout), and that wait should overlap
    everything else rather than add to it. Replayed tools answer instantly and run inline.

    What the probes defer (see DiscoveryScope) runs when the caller closes ``scope``."""
    started = time.perf_counter()
    ctx = dataclasses.replace(ctx, scope=scope)
    lane = _Lane()
    backstop = _Backstop(ctx, lane)
    vendor_pool = ThreadPoolExecutor(max_workers=len(ACCELERATOR_PROBES)) if (
        ctx.libraries_live and ACCELERATOR_PROBES) else None
    vendor_futures = {name: vendor_pool.submit(backstop.guarded, name, probe)
                      for name, probe in ACCELERATOR_PROBES} if vendor_pool else {}
    hw: list[ProbeResult[HwlocPart] | None] = []  # what hwloc's thread hands over
    hw_result: ProbeResult[HwlocPart] | None = None
    hw_thread: threading.Thread | None = None
    try:
        if ctx.sysfs_available:
            hw_thread = threading.Thread(target=lambda: hw.append(backstop.guarded(hwloc.SOURCE, hwloc.probe)),
                                         name="memtopo-hwloc", daemon=True)
            hw_thread.start()
        else:
            hw_result = backstop.run(hwloc.SOURCE, hwloc.probe)
        identity_r = backstop.run(identity.SOURCE, identity.probe)
        numa_r = backstop.run(sysfs_numa.SOURCE, sysfs_numa.probe)
        tiers_r = backstop.run(sysfs_tiers.SOURCE, sysfs_tiers.probe)
        cxl_r = backstop.run(sysfs_cxl.SOURCE, sysfs_cxl.probe)
        pci_r = backstop.run(sysfs_pci.SOURCE, sysfs_pci.probe)
        allowed_r = backstop.run(proc_allowed.SOURCE, proc_allowed.probe)
        vendor: dict[str, ProbeResult[AcceleratorPart] | None] = {}
        if vendor_pool is None:
            vendor = {name: backstop.run(name, probe) for name, probe in ACCELERATOR_PROBES}
        if hw_thread is not None:
            # Its deadline counts from its start, which was before the probes above.
            hw_thread.join(max(0.0, ctx.deadline_s - (time.perf_counter() - started)))
            if hw_thread.is_alive():
                backstop.overdue(hwloc.SOURCE)  # what it hands over later is not read
            else:
                hw_result = hw[0] if hw else None
        if vendor_pool is not None:
            for name, f in vendor_futures.items():
                try:
                    vendor[name] = f.result(timeout=max(0.0, ctx.deadline_s - (time.perf_counter() - started)))
                except FuturesTimeout:
                    backstop.overdue(name)
    finally:
        lane.close()
        if vendor_pool is not None:
            vendor_pool.shutdown(wait=False)
    return Parts(identity=identity_r, numa=numa_r, tiers=tiers_r, cxl=cxl_r, pci=pci_r, allowed=allowed_r,
                 hwloc=hw_result, accelerators={k: v for k, v in vendor.items() if v is not None},
                 extra_statuses=tuple(backstop.failures))


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


def discover(ctx: ProbeContext, generation: int = 1) -> pb.MemoryTopology:
    root = str(ctx.hwloc_xml) if ctx.hwloc_xml is not None else str(ctx.fs.root)
    # Discovery allocates tens of thousands of short-lived, acyclic objects; letting the cyclic
    # collector run in the middle of that costs ~10% of the whole and frees nothing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with DiscoveryScope() as scope:
            topo = assemble_checked(collect(ctx, scope), source_root=root)
            topo.generation = generation
            topo.fingerprint = fingerprint(topo)
    finally:
        if gc_was_enabled:
            gc.enable()
    # What Timestamp.GetCurrentTime gives (the same clock, whole microseconds) without its trip
    # through datetime and calendar.
    seconds, micros = divmod(time.time_ns() // 1000, 1_000_000)
    topo.discovery_time.seconds, topo.discovery_time.nanos = seconds, micros * 1000
    return topo
