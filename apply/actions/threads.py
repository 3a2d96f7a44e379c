"""Thread affinity: ``sched_setaffinity(2)`` per TID, no taskset.

Speed matters here (processes with thousands of threads): one batched read of the current masks,
one batched set of the threads that differ, one journal record for all of them. Verification reads
back only threads whose new mask is not inside their previous one: a successful setaffinity leaves
``desired ∩ cpuset``, and the previous mask was already inside the thread's cpuset, so narrowing
within it is exact by construction. Widening (or a mask predicted by an earlier step) is read back.
"""

from __future__ import annotations

import errno
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from memtopo.apply.actions.base import ActionError, ActionKind, Applied, Overlay, Prepared, RunContext, Step, ids
from memtopo.apply.checks import CheckContext, ProcRef, fmt_ids
from memtopo.apply.errors import errno_name
from memtopo.apply.undo import AffinityUndo
from memtopo.v1 import plan_pb2 as planpb


@dataclass(frozen=True)
class ThreadTarget:
    proc: ProcRef
    tids: tuple[int, ...]
    selector: str
    cpus: frozenset[int]
    # Thread names, when the selection read them (name_pattern).
    names: Mapping[int, str] = field(default_factory=dict)


def check(action: planpb.PlanAction, ctx: CheckContext) -> ThreadTarget | None:
    aid = action.id
    ta = action.thread_affinity
    cpus = ctx.cpus(aid, ta.cpus)
    sel = ta.threads.WhichOneof("selector") if ta.HasField("threads") else None
    if sel is None:
        ctx.reject(aid, "threads: no selector (all, tids, name_pattern or main_thread)")
        return None
    if (sel == "all" and not ta.threads.all) or (sel == "main_thread" and not ta.threads.main_thread):
        ctx.reject(aid, f"threads.{sel} is false: it selects nothing")
        return None
    if sel == "tids" and len(ta.threads.tids.tids) > ctx.config.max_tids:
        ctx.reject(aid, f"threads.tids: {len(ta.threads.tids.tids)} entries, more than {ctx.config.max_tids}")
        return None
    pattern = ctx.regex(aid, ta.threads.name_pattern, "threads.name_pattern") if sel == "name_pattern" else None
    if sel == "name_pattern" and pattern is None:
        return None
    proc = ctx.proc(action, ta.pid)
    if proc is None or cpus is None:
        return None
    names: dict[int, str] = {}
    if sel == "main_thread":
        tids: list[int] = [proc.pid]
        selector = "main thread"
    else:
        live = ctx.procs.tids(proc.pid)
        if sel == "all":
            tids, selector = sorted(live), "all threads"
        elif sel == "tids":
            want = list(ta.threads.tids.tids)
            if not want:
                ctx.reject(aid, "threads.tids: empty list")
                return None
            if len(set(want)) != len(want):
                ctx.reject(aid, "threads.tids: tids repeat")
                return None
            missing = set(want) - set(live)
            if missing:
                ctx.host_problem(action, f"threads.tids: {fmt_ids(missing)} not thread(s) of pid {proc.pid}")
                return None
            tids, selector = sorted(want), f"tids {fmt_ids(want)}"
        else:
            assert pattern is not None
            for tid in sorted(live):
                comm = ctx.procs.comm(proc.pid, tid)
                if comm is not None and pattern.fullmatch(comm):
                    names[tid] = comm
            tids, selector = sorted(names), f"threads named {pattern.pattern!r}"
    if not tids:
        ctx.host_problem(action, f"no thread of pid {proc.pid} matches ({selector})")
        return None
    return ThreadTarget(proc, tuple(tids), selector, frozenset(cpus), names)


class ThreadStep(Step):
    groupable = True
    kind = "thread_affinity"

    def __init__(self, ctx: RunContext, action: planpb.PlanAction, target: ThreadTarget) -> None:
        super().__init__(ctx, action)
        self.target = target
        self._changed: list[int] = []
        self._read_back: list[int] = []

    def _label(self, tids: list[int]) -> str:
        t = self.target
        if t.names and len(tids) <= 16:
            return f"{t.proc.describe()} " + ", ".join(f"tid {tid} {t.names.get(tid, '?')}" for tid in tids)
        n = len(tids)
        if n <= 64:
            span = ids(tids)
        else:
            # tids are sorted and unique: a contiguous run is one range; otherwise first…last (the
            # full list of thousands of threads is noise in a diff, and costly to format).
            span = f"{tids[0]}-{tids[-1]}" if tids[-1] - tids[0] + 1 == n else f"{tids[0]}…{tids[-1]}"
        return f"{t.proc.describe()} {n} thread{'s' if n != 1 else ''} [tid {span}]"

    def prepare(self, overlay: Overlay) -> Prepared:
        t = self.target
        tids = list(t.tids)
        got = self.host.kernel.get_affinities(tids)
        hard = {tid: e for tid, e in got.errors.items() if e != errno.ESRCH}
        if hard:
            tid, code = next(iter(hard.items()))
            raise ActionError(f"cannot read the affinity of tid {tid}: {errno_name(code)}")
        if got.errors and len(got.errors) == len(tids):
            raise ActionError(f"{t.proc.describe()} has exited")
        desired = t.cpus
        groups: defaultdict[frozenset[int], list[int]] = defaultdict(list)
        changed: list[int] = []
        read_back: list[int] = []
        predicted = any(k[0] == "tid" for k in overlay)
        masks = got.masks
        first = masks[0] if masks else None
        # count() compares in C: one pass over a thousand masks without a generator.
        if not predicted and not got.errors and first is not None and masks.count(first) == len(masks):
            # The common case (every thread has the default mask) without a per-thread loop.
            if first != desired:
                groups[frozenset(first)] = list(tids)
                changed = list(tids)
                read_back = [] if desired <= first else list(tids)
            masks = []
        # Threads mostly share one mask: reuse the last one's key and comparisons instead of
        # building a frozenset per thread (this loop runs once per thread).
        last: set[int] | frozenset[int] | None = None
        key: frozenset[int] = frozenset()
        narrowing = True
        for tid, mask in zip(tids[:len(masks)], masks, strict=True):
            if mask is None:
                continue  # exited since validation: nothing to pin or restore
            prev = overlay.get(("tid", tid), mask) if predicted else mask
            if prev != last:
                if prev == desired:
                    continue
                last, key, narrowing = prev, frozenset(prev), desired <= prev
            groups[key].append(tid)
            changed.append(tid)
            if not narrowing:
                read_back.append(tid)
        gone = len(got.errors)
        details = {"threads": str(len(tids) - gone), "selector": t.selector}
        if self.action.thread_affinity.role:
            details["role"] = self.action.thread_affinity.role
        if gone:
            details["threads_exited"] = str(gone)
        self._changed = changed
        # One thread is always read back, so a kernel that disagrees with the reasoning shows up.
        self._read_back = read_back or changed[:1]
        if not changed:
            same = [f"{self._label(tids)}: cpus {ids(desired)}"]
            return Prepared(same, list(same), [], False, details)
        # Formatting a thousand tids costs more than setting them: one label when one group.
        label = self._label(changed)
        ordered = sorted(groups.items(), key=lambda kv: min(kv[1]))
        before = ([f"{label}: cpus {ids(ordered[0][0])}"] if len(ordered) == 1 else
                  [f"{self._label(sorted(g))}: cpus {ids(mask)}" for mask, g in ordered])
        after = [f"{label}: cpus {ids(desired)}"]
        undo = AffinityUndo(t.proc.pid, t.proc.starttime,
                            tuple((tuple(sorted(mask)), tuple(g)) for mask, g in groups.items()))
        details["changed"] = str(len(changed))
        return Prepared(before, after, [undo], True, details)

    def apply(self, prepared: Prepared) -> Applied:
        t = self.target
        kernel = self.host.kernel
        errors = kernel.set_affinities(self._changed, t.cpus)
        hard = {tid: e for tid, e in errors.items() if e != errno.ESRCH}
        if errors and not hard and len(errors) == len(self._changed):
            raise ActionError(f"{t.proc.describe()} exited before its threads could be pinned")
        if hard:
            tid, code = next(iter(hard.items()))
            why = " (kernel thread, or no allowed CPU in the set)" if code == errno.EINVAL else ""
            raise ActionError(f"sched_setaffinity(tid {tid}, {ids(t.cpus)}): {errno_name(code)}{why}; "
                               f"{len(hard)} thread(s) failed")
        check = [tid for tid in self._read_back if tid not in errors]
        got = kernel.get_affinities(check)
        for tid, mask in zip(check, got.masks, strict=True):
            if mask is not None and mask != t.cpus:
                raise ActionError(f"tid {tid} holds cpus {ids(mask)} after setting {ids(t.cpus)}: its cpuset "
                                   "does not allow all of them")
        details = dict(prepared.details)
        if errors:
            details["threads_exited"] = str(int(details.get("threads_exited", "0")) + len(errors))
        details["verified"] = (f"{len(check)} read back, {len(self._changed) - len(errors) - len(check)} narrowed "
                               "within their previous mask")
        return Applied(prepared.after, details)

    def predict(self, overlay: Overlay) -> None:
        for tid in self._changed:
            overlay[("tid", tid)] = self.target.cpus


KIND = ActionKind("thread_affinity", check, ThreadStep)
