"""The apply engine: validate a BindingPlan, show or apply its diff, journal, verify, roll back.

One plan at a time (a lock in the process, an flock on the state directory across processes).
The order for each action: read the current state and the diff (prepare), journal the previous
values with one fsync, change, verify. Consecutive thread/IRQ affinity actions share one fsync:
they only set per-object values, so none changes what another may do, and the later ones record as
"previous" what the earlier ones will leave (apply/actions/base.py ``Overlay``). IRQ actions also
share the fsync of a cpuset/memory-policy/migration action just before them: nothing but an IRQ
action changes what they read. A cpuset action may end such a group (it reads only cgroup files);
what follows a non-IRQ, non-affinity action is prepared after it has applied.

* A required action that fails restores everything done so far, in reverse, and verifies it:
  ROLLED_BACK, or FAILED when something could not be restored (the action results say what).
* An optional action that fails restores its own changes and is SKIPPED with the reason.
* The same plan id again returns the stored result without touching the host; a different plan
  under a used id is rejected.
* An interrupted run (crash, SIGKILL) leaves an unfinished journal; :meth:`Engine.recover` (also
  run before every apply) restores it. :meth:`Engine.rollback` restores a finished one on request.
* The state directory fills up: its reserve is checked before the first change (nothing changes
  without it) and given up to the writes after it; a journal or result write that still fails
  after a change restores everything started, like a failed required action, and says so. The
  restore itself never waits on the disk.
* An unfinished journal that cannot be read (:attr:`Engine.unreadable`) is kept where it is and
  every apply is refused until an operator removes its pending marker; a journal with damaged
  undo records is restored as far as it reads and names the actions it could not restore.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp

from memtopo.apply import cgroups, irqbalance
from memtopo.apply.actions import ActionError, ActionSkipError, Overlay, Prepared, RunContext, Step, make_step
from memtopo.apply.cgroups import Hierarchy
from memtopo.apply.checks import TopologyFacts
from memtopo.apply.config import ApplyConfig
from memtopo.apply.errors import PlanNotFoundError, StateError, UnreadableJournalError
from memtopo.apply.host import Host
from memtopo.apply.journal import JournalState, JournalWriter, StateStore, StoredResult, plan_hash
from memtopo.apply.undo import Outcome, UndoOp, restore_all
from memtopo.apply.validate import Validation, validate
from memtopo.hostfs import HostReadError
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

S = planpb.ActionResult
P = planpb.PlanResult

TopologyProvider = Callable[[], pb.MemoryTopology]
# The facts a plan is validated against, read without a topology (apply/hostfacts.py), or None for
# the topology provider's.
FactsProvider = Callable[[planpb.BindingPlan], TopologyFacts | None]
# Called with ("before_action" | "after_action", action): tests pause or kill the run here.
Hook = Callable[[str, planpb.PlanAction], None]

OPERATOR_HINT = ("restore the host by hand (the journal is kept as it was), then remove the marker to allow "
                 "applies again")


def _now() -> Timestamp:
    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


def _result(aid: str, status: int, reason: str = "", before: Sequence[str] = (), after: Sequence[str] = (),
            details: dict[str, str] | None = None) -> planpb.ActionResult:
    # The fields in the constructor (one call into protobuf instead of several), but the details map
    # filled key by key: given to the constructor it goes through MutableMapping.update and its ABC
    # check, twice what the two or three entries of an action cost this way.
    r = planpb.ActionResult(action_id=aid, status=status, reason=reason,  # type: ignore[arg-type]
                            before=before, after=after)
    if details:
        held = r.details
        for key, value in details.items():
            held[key] = value
    return r


def _plan_result(plan: planpb.BindingPlan, state: int, message: str, started: Timestamp,
                 node_name: str, actions: Sequence[planpb.ActionResult | None] = (),
                 rejections: Sequence[str] = ()) -> planpb.PlanResult:
    res = planpb.PlanResult(plan_id=plan.plan_id, state=state, message=message)  # type: ignore[arg-type]
    res.actions.extend(a for a in actions if a is not None)
    res.rejections.extend(rejections)
    res.started.CopyFrom(started)
    res.finished.CopyFrom(_now())
    res.node_name = node_name
    return res


def restore_actions(host: Host, entries: Sequence[tuple[str, Sequence[UndoOp]]]) -> dict[str, list[Outcome]]:
    """Restore the undo records of every (action id, ops) entry, all of them as one sequence in
    reverse and verified (undo.restore_all: a later action's restore may be what lets an earlier
    one's hold), and group the outcomes by action. The one restore of a failed run and of a
    journal (a crashed run's, or a rollback on request)."""
    flat: list[UndoOp] = [op for _, ops in entries for op in ops]
    outcomes = restore_all(host, flat) if flat else []
    per_action: dict[str, list[Outcome]] = {}
    k = 0
    for aid, ops in entries:
        per_action.setdefault(aid, []).extend(outcomes[k:k + len(ops)])
        k += len(ops)
    return per_action


def settle(r: planpb.ActionResult, outcomes: Sequence[Outcome], restored: str,
           restore_failed: str = "restore failed") -> bool:
    """Say on an action's result how restoring its changes went; True when every restore held.
    Held: ROLLED_BACK (a FAILED action stays FAILED) and ``restored`` with the restores' notes;
    else ROLLBACK_FAILED and ``restore_failed`` with them."""
    note = "; ".join(o.note for o in outcomes if o.note)
    if all(o.ok for o in outcomes):
        if r.status != S.STATUS_FAILED:
            r.status = S.STATUS_ROLLED_BACK
        r.reason = _join(r.reason, f"{restored}: {note}" if note else restored)
        return True
    r.status = S.STATUS_ROLLBACK_FAILED
    r.reason = _join(r.reason, f"{restore_failed}: {note}")
    return False


class Engine:
    def __init__(self, host: Host, topology_provider: TopologyProvider, state_dir: str | Path,
                 config: ApplyConfig | None = None, hook: Hook | None = None,
                 facts_provider: FactsProvider | None = None) -> None:
        self.host = host
        self.topology = topology_provider
        self.facts_provider = facts_provider
        # The last topology's facts: a provider that holds its topology (the agent) returns the
        # same object until it discovers again, and its sets need not be built per plan.
        self._facts_of: tuple[pb.MemoryTopology, TopologyFacts] | None = None
        self.config = config or ApplyConfig()
        self.store = StateStore(state_dir, host.state)
        self.hook = hook
        # Unfinished journals the last recovery could not read, by key: kept for an operator.
        self._unreadable: dict[str, JournalState] = {}
        self._lock = threading.RLock()
        self._irqbalance_seen: tuple[float, irqbalance.Irqbalance | None] | None = None
        self._boot_id: str | None = None
        self._hierarchies = cgroups.HierarchyCache(host.files, self.config.cgroup_version)

    # ---- public --------------------------------------------------------------------------------------
    def apply(self, plan: planpb.BindingPlan, dry_run: bool = False) -> planpb.PlanResult:
        started = _now()
        with self._lock:
            if dry_run:
                return self._dry_run(plan, started)
            with self.store.lock(self.config.lock_timeout_s):
                self._recover_pending()
                if self._unreadable:
                    raise UnreadableJournalError(self.unreadable_message() + "; nothing was applied")
                sha = plan_hash(plan)
                if plan.plan_id:
                    stored = self.store.load_result(plan.plan_id)
                    if stored is not None:
                        if stored.plan_sha256 != sha:
                            return self._rejected(plan, started, "", [
                                f"plan: plan id {plan.plan_id!r} was already used for a different plan"])
                        res = planpb.PlanResult()
                        res.CopyFrom(stored.result)
                        res.message = f"{res.message} [stored result: this plan id was seen before; nothing changed]"
                        return res
                facts = self._facts(plan)
                validation = validate(plan, facts, self.host, self.config, self._hierarchy())
                if not validation.ok:
                    return self._rejected(plan, started, facts.node_name, list(validation.rejections))
                return self._run(plan, sha, facts.node_name, validation, started)

    def rollback(self, plan_id: str) -> planpb.PlanResult:
        with self._lock, self.store.lock(self.config.lock_timeout_s):
            self._hierarchy()
            js = self.store.read_journal(plan_id)
            if js is not None and js.unreadable:
                raise UnreadableJournalError(
                    f"plan {plan_id!r}: its journal {js.path} cannot be read ({js.unreadable}; its marker is "
                    f"{self.store.marker_path(js.key)}); nothing was restored: {OPERATOR_HINT}")
            try:
                stored = self.store.load_result(plan_id)
            except StateError as exc:
                if js is None:
                    raise
                # The journal says what was changed; the result only how it went.
                stored, why = None, f" (its stored result is unreadable: {exc})"
            else:
                why = ""
            if stored is None and (js is None or not js.plan_id):
                raise PlanNotFoundError(f"no plan {plan_id!r} in {self.store.dir}")
            if js is not None and js.unfinished:
                return self._restore_journal(js, stored.result if stored else None,
                                             "interrupted run rolled back on request" + why)
            if stored is not None and stored.result.state == P.STATE_ROLLED_BACK:
                res = planpb.PlanResult()
                res.CopyFrom(stored.result)
                res.message = f"{res.message} [already rolled back; nothing changed]"
                return res
            if js is None:
                js = JournalState(key="", plan_id=plan_id)
            return self._restore_journal(js, stored.result if stored else None, "rolled back on request" + why,
                                         finished=True)

    def recover(self) -> list[planpb.PlanResult]:
        """Roll back every unfinished journal (a run that died); their results, one per plan."""
        with self._lock, self.store.lock(self.config.lock_timeout_s):
            return self._recover_pending()

    def result(self, plan_id: str) -> planpb.PlanResult | None:
        stored = self.store.load_result(plan_id)
        return stored.result if stored is not None else None

    def list_plans(self) -> list[planpb.PlanResult]:
        return [s.result for s in self.store.results()]

    @property
    def unreadable(self) -> list[JournalState]:
        """Unfinished journals the last recovery could not read and whose pending marker is still
        there (an operator removes it once the host is dealt with; the journal stays)."""
        # Read from other threads (readiness, metrics): the dict is replaced, never changed.
        return [js for key, js in list(self._unreadable.items()) if os.path.lexists(self.store.marker_path(key))]

    def unreadable_message(self) -> str:
        bad = self.unreadable
        return "; ".join(f"unfinished plan journal {js.path} cannot be read ({js.unreadable}; its marker is "
                         f"{self.store.marker_path(js.key)})" for js in bad) + (
            f": the host may still hold what that plan changed; {OPERATOR_HINT}" if bad else "")

    # ---- internals -----------------------------------------------------------------------------------
    def _hierarchy(self) -> Hierarchy | str:
        """The cpuset hierarchy (detected again when the mount table changed: cgroups.HierarchyCache);
        its mount and /proc/irq become writable (nothing else ever is)."""
        hier, fresh = self._hierarchies.get()
        if fresh:
            self.host.files.allow_writes(["proc/irq", *([hier.mount] if isinstance(hier, Hierarchy) else [])])
        return hier

    def _irqbalance(self) -> irqbalance.Irqbalance | None:
        """Detection reads every process's name; the answer is kept for a while across plans, and a
        cached irqbalance is checked to be the same process still."""
        now = time.monotonic()
        seen = self._irqbalance_seen
        if seen is not None and now - seen[0] < self.config.irqbalance_cache_s:
            ib = seen[1]
            if ib is None or self.host.procs.starttime(ib.pid) == ib.starttime:
                return ib
        ib = irqbalance.detect(self.host.procs, self.host.files)
        self._irqbalance_seen = (now, ib)
        return ib

    def boot_id(self) -> str:
        """This boot's id (read once): a journal written under another one guards nothing that
        still exists."""
        if self._boot_id is None:
            try:
                self._boot_id = self.host.files.read_text("proc/sys/kernel/random/boot_id").strip()
            except HostReadError:
                self._boot_id = ""
        return self._boot_id

    def _facts(self, plan: planpb.BindingPlan) -> TopologyFacts:
        if self.facts_provider is not None:
            light = self.facts_provider(plan)
            if light is not None:
                return light
        topo = self.topology()
        seen = self._facts_of
        if seen is not None and seen[0] is topo and seen[1].fingerprint == topo.fingerprint:
            return seen[1]
        facts = TopologyFacts.of(topo)
        self._facts_of = (topo, facts)
        return facts

    def _rejected(self, plan: planpb.BindingPlan, started: Timestamp, node_name: str,
                  rejections: list[str]) -> planpb.PlanResult:
        # Not stored: nothing was touched, and a plan refused on this host's state may be valid later.
        return _plan_result(plan, P.STATE_REJECTED, f"{len(rejections)} validation error(s); nothing was touched",
                            started, node_name, rejections=rejections)

    def _steps(self, plan: planpb.BindingPlan, validation: Validation, ctx: RunContext,
               results: list[planpb.ActionResult | None]) -> list[Step | None]:
        steps: list[Step | None] = []
        for i, action in enumerate(plan.actions):
            if action.id in validation.skips:
                results[i] = _result(action.id, S.STATUS_SKIPPED, validation.skips[action.id])
                steps.append(None)
            else:
                steps.append(make_step(ctx, action, validation.targets[action.id]))
        return steps

    def _dry_run(self, plan: planpb.BindingPlan, started: Timestamp) -> planpb.PlanResult:
        facts = self._facts(plan)
        validation = validate(plan, facts, self.host, self.config, self._hierarchy())
        if not validation.ok:
            return self._rejected(plan, started, facts.node_name, list(validation.rejections))
        ctx = RunContext(self.host, self.config, self._irqbalance)
        results: list[planpb.ActionResult | None] = [None] * len(plan.actions)
        steps = self._steps(plan, validation, ctx, results)
        overlay: Overlay = {}
        for i, step in enumerate(steps):
            if step is None:
                continue
            aid = plan.actions[i].id
            try:
                p = step.prepare(overlay)
            except (ActionError, ActionSkipError) as exc:
                failed = isinstance(exc, ActionError) and plan.actions[i].required
                results[i] = _result(aid, S.STATUS_FAILED if failed else S.STATUS_SKIPPED, str(exc))
                continue
            if p.changes:
                step.predict(overlay)
            status = S.STATUS_WOULD_CHANGE if p.changes else S.STATUS_UNCHANGED
            results[i] = _result(aid, status, "", p.before, p.after, p.details)
        counts = {st: sum(1 for r in results if r is not None and r.status == st)
                  for st in (S.STATUS_WOULD_CHANGE, S.STATUS_UNCHANGED, S.STATUS_SKIPPED, S.STATUS_FAILED)}
        msg = (f"dry run: {counts[S.STATUS_WOULD_CHANGE]} would change, {counts[S.STATUS_UNCHANGED]} unchanged, "
               f"{counts[S.STATUS_SKIPPED]} skipped; nothing was touched")
        if counts[S.STATUS_FAILED]:
            msg += f"; {counts[S.STATUS_FAILED]} required action(s) cannot run now"
        stored = self.store.load_result(plan.plan_id) if plan.plan_id else None
        if stored is not None:
            msg += " (this plan id was applied before: apply would return its stored result)"
        return _plan_result(plan, P.STATE_DRY_RUN, msg, started, facts.node_name, results)

    def _run(self, plan: planpb.BindingPlan, sha: str, node_name: str, validation: Validation,
             started: Timestamp) -> planpb.PlanResult:
        ctx = RunContext(self.host, self.config, self._irqbalance)
        n = len(plan.actions)
        results: list[planpb.ActionResult | None] = [None] * n
        steps = self._steps(plan, validation, ctx, results)
        run = _Run(self.host, self.store, self.hook, self.boot_id(), plan, sha, node_name, started, results)
        try:
            i = 0
            while i < n:
                group = [i]
                first = steps[i]
                if first is not None:
                    j = i + 1
                    closed = not first.groupable
                    while j < n and _joins(first, steps[j], closed):
                        closed = closed or _closes(steps[j])
                        group.append(j)
                        j += 1
                outcome = run.group(group, steps)
                if isinstance(outcome, planpb.PlanResult):
                    return outcome
                i = outcome
            return run.finish()
        finally:
            if run.journal is not None:
                run.journal.close()

    def _restore_journal(self, js: JournalState, base: planpb.PlanResult | None, why: str,
                         finished: bool = False) -> planpb.PlanResult:
        """Restore every undo record of a journal (reverse order, verified) and store the result.

        ``finished``: a journal whose run completed (a rollback on request). Its host is whole, so
        a state directory that cannot record the rollback's start refuses it (StateError) before
        anything is touched. An unfinished one is restored whatever the disk says: the rollback
        record only shortens a later recovery. The result is stored before ``rolled_back``, so a
        result that cannot be written leaves the journal open and the next recovery records it."""
        plan_id = js.plan_id
        entries = js.ops_in_order()
        notes: list[str] = []
        try:
            self.store.mark_open(plan_id)
            self.store.append(plan_id, [{"t": "rollback"}], sync=True)
        except StateError as exc:
            if finished:
                raise StateError(f"cannot record the rollback, nothing was restored: {exc}") from exc
            notes.append(f"the rollback's start could not be journaled ({exc})")
        per_action = restore_actions(self.host, [(aid, ops) for _, aid, ops in entries])
        bad = sum(1 for outs in per_action.values() for o in outs if not o.ok)
        res = planpb.PlanResult()
        plan = js.plan or planpb.BindingPlan(plan_id=plan_id)
        if base is not None:
            res.CopyFrom(base)
        else:
            res.plan_id = plan_id
            res.started.CopyFrom(_now())
            for action in plan.actions:
                done = js.done.get(action.id)
                if action.id in per_action or done is not None:
                    res.actions.append(_result(action.id, S.STATUS_APPLIED if done else S.STATUS_FAILED,
                                               "" if done else "interrupted while being applied"))
                else:
                    res.actions.append(_result(action.id, S.STATUS_SKIPPED, "not run: the run was interrupted"))
            known = {a.id for a in plan.actions}
            res.actions.extend(_result(aid, S.STATUS_FAILED, "in the journal but not in its plan")
                               for _, aid, _ in entries if aid not in known)
        lost = js.unrestorable([a.id for a in plan.actions])
        for aid in lost:
            if aid not in {a.action_id for a in res.actions}:
                res.actions.append(_result(aid, S.STATUS_ROLLBACK_FAILED))
        for ar in res.actions:
            outs = per_action.get(ar.action_id)
            if ar.action_id in lost:
                ar.status = S.STATUS_ROLLBACK_FAILED
                ar.reason = _join(ar.reason, f"not restored: {lost[ar.action_id]}; check it by hand")
                continue
            if outs is not None:
                settle(ar, outs, "restored")
        ok = not bad and not lost
        res.state = P.STATE_ROLLED_BACK if ok else P.STATE_FAILED
        restored = sum(1 for a in res.actions if a.status == S.STATUS_ROLLED_BACK)
        if ok:
            res.message = f"{why}: {restored} action(s) restored"
        elif lost:
            res.message = (f"{why}, but the journal is damaged: {', '.join(sorted(lost))} could not be restored "
                           f"(see actions); {restored} action(s) restored")
        else:
            res.message = f"{why}, but {bad} change(s) could not be restored: see actions"
        res.finished.CopyFrom(_now())
        sha = js.plan_sha256 or (plan_hash(js.plan) if js.plan else "")
        try:
            self.store.save_result(plan_id, sha, res)
            self.store.append(plan_id, [{"t": "rolled_back", "state": P.State.Name(res.state)}], sync=True)
            if not js.ended:
                self.store.append(plan_id, [{"t": "end", "state": P.State.Name(res.state)}])
            self.store.mark_closed(plan_id)
        except StateError as exc:
            notes.append(f"the state directory could not record it ({exc}): the journal stays pending and "
                         "the next recovery restores and records it again")
        if notes:
            res.message = f"{res.message}; {'; '.join(notes)}"
        return res

    def _recover_pending(self) -> list[planpb.PlanResult]:
        out: list[planpb.PlanResult] = []
        boot = self.boot_id()
        unreadable: dict[str, JournalState] = {}
        for js in self.store.pending():
            if js.unreadable:
                unreadable[js.key] = js
                continue
            if js.boot_id and boot and js.boot_id != boot:
                # The host rebooted mid-plan: thread masks, cpusets, IRQ masks and page placement
                # were reset with it, and IRQ numbers, pids and cgroups may now name other objects.
                # Restoring the recorded values would change those, so the journal is only closed.
                with contextlib.suppress(StateError):  # else the next recovery closes it
                    self.store.append(js.plan_id, [{"t": "end", "state": P.State.Name(P.STATE_FAILED)}])
                    self.store.mark_closed(js.plan_id)
                out.append(planpb.PlanResult(
                    plan_id=js.plan_id, state=P.STATE_FAILED,
                    message=f"interrupted before a reboot (boot {js.boot_id[:8]}); nothing restored: the "
                            "reboot reset what the plan had changed"))
                continue
            self._hierarchy()
            stored: StoredResult | None
            try:
                stored = self.store.load_result(js.plan_id)
            except StateError:
                stored = None  # the journal decides: restore
            if stored is not None and not js.rollback_open:
                # The result was written and only the end record is missing: the run completed.
                with contextlib.suppress(StateError):  # else the next recovery closes it
                    self.store.append(js.plan_id, [{"t": "end", "state": P.State.Name(stored.result.state)}])
                    self.store.mark_closed(js.plan_id)
                continue
            out.append(self._restore_journal(js, stored.result if stored else None,
                                             "interrupted run rolled back by recovery"))
        self._unreadable = unreadable
        return out


def _joins(first: Step, step: Step | None, closed: bool) -> bool:
    """May ``step`` share the journal fsync of the group ``first`` starts (``closed``: a
    non-groupable step is in it already)? What a non-groupable step (cpuset, memory policy,
    migration) changes (thread masks, cgroup membership) is read by the steps after it, so only
    independent steps follow one in its group. One that reads nothing the groupable steps change
    (``closes_group``) may end a group of them: a pin and its cpuset take one fsync, not two."""
    if step is None or step.independent:
        return True
    if closed:
        return False
    return step.groupable or (first.groupable and step.closes_group)


def _closes(step: Step | None) -> bool:
    return step is not None and not step.groupable and not step.independent


_STATUS_NAMES: dict[int, str] = {s: S.Status.Name(s) for s in (S.STATUS_APPLIED, S.STATUS_UNCHANGED)}


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


class _Run:
    """One apply in progress: the journal, what was started, and the results so far."""

    def __init__(self, host: Host, store: StateStore, hook: Hook | None, boot_id: str, plan: planpb.BindingPlan,
                 sha: str, node_name: str, started: Timestamp,
                 results: list[planpb.ActionResult | None]) -> None:
        self.host = host
        self.store = store
        self.hook = hook
        self.boot_id = boot_id
        self.plan = plan
        self.sha = sha
        self.node_name = node_name
        self.started_at = started
        self.results = results
        # The actions' ids, read out of the plan once (each read of a protobuf field builds a value).
        self.ids = [a.id for a in plan.actions]
        self.journal: JournalWriter | None = None
        # True once the first write (begin + undo) is in the journal and the plan marked pending.
        self.journaled = False
        # (action id, status) of the actions applied since the last "done" records were written.
        self.done: list[tuple[str, int]] = []
        # Actions whose changes began, in order, with their undo.
        self.started: list[tuple[int, Prepared]] = []
        # State directory writes that failed while restoring or finishing (said in the message).
        self.state_errors: list[str] = []

    def _journal_first(self, entries: list[tuple[int, str, list[UndoOp]]]) -> None:
        """Before the first change: the state directory's reserve (once per apply), begin + the
        first undo records (one fsync), then the plan marked pending. Any failure raises
        StateError with nothing changed and nothing left pending."""
        store = self.store
        try:
            store.reserve()
            self.journal = store.begin(self.plan, self.sha, self.boot_id)
            self.journal.undo(entries)
            store.mark_open(self.plan.plan_id)
            self.journal.on_full = store.spend_reserve
        except StateError:
            if self.journal is not None:
                self.journal.close()
                self.journal = None
            raise
        self.journaled = True

    def _write(self, records: list[dict[str, str]], sync: bool = False) -> None:
        if self.journal is not None and self.journaled:
            self.journal.write(records, sync)

    def _try_write(self, records: list[dict[str, str]], sync: bool = False) -> bool:
        """A journal write on a path that restores or finishes anyway: a failure is remembered for
        the message, never raised."""
        try:
            self._write(records, sync)
            return True
        except StateError as exc:
            self.state_errors.append(str(exc))
            return False

    def group(self, indices: list[int], steps: Sequence[Step | None]) -> int | planpb.PlanResult:
        """Prepare, journal (one fsync) and apply a group; the next index, or the final result."""
        actions = self.plan.actions
        overlay: Overlay = {}
        prepared: list[tuple[int, Prepared]] = []
        # Steps of each kind still to prepare in this group: a prediction is only read by a later
        # step of its own kind (Step.predict), and a thousand-thread one costs a dict entry per tid.
        left = Counter(s.kind for s in (steps[k] for k in indices) if s is not None)
        for k in indices:
            step = steps[k]
            if step is None:
                continue
            left[step.kind] -= 1
            try:
                p = step.prepare(overlay)
            except ActionSkipError as exc:
                self.results[k] = _result(actions[k].id, S.STATUS_SKIPPED, str(exc))
                continue
            except ActionError as exc:
                if actions[k].required:
                    return self.fail(k, str(exc))
                self.results[k] = _result(actions[k].id, S.STATUS_SKIPPED, f"failed: {exc}")
                continue
            prepared.append((k, p))
            if p.changes and left[step.kind]:
                step.predict(overlay)
        ids = self.ids
        entries = [(k, ids[k], p.undo) for k, p in prepared if p.undo]
        if entries:
            try:
                if self.journal is None:
                    self._journal_first(entries)
                else:
                    self.journal.undo(entries)
            except StateError as exc:
                return self.fail(entries[0][0], f"cannot journal the previous state, so it was not changed: {exc}")
        k = indices[0]
        try:
            for k, p in prepared:
                outcome = self._apply_one(k, p, steps)
                if outcome is not None:
                    return outcome
            self._flush_done()
        except StateError as exc:
            # A record after a change could not be written: nothing may stay changed that the
            # state directory does not describe.
            return self.fail(k, f"the journal could not record it, so every change was undone: {exc}")
        return indices[-1] + 1

    def _apply_one(self, k: int, p: Prepared, steps: Sequence[Step | None]) -> int | planpb.PlanResult | None:
        """Apply one prepared action; None to go on with the group, else what group returns."""
        step, aid, hook = steps[k], self.ids[k], self.hook
        assert step is not None
        if hook is not None:
            hook("before_action", self.plan.actions[k])
        if not p.changes and not p.run_anyway:
            self.results[k] = _result(aid, S.STATUS_UNCHANGED, "", p.before, p.after, p.details)
            if hook is not None:
                hook("after_action", self.plan.actions[k])
            return None
        self.started.append((k, p))
        try:
            done = step.apply(p)
        except ActionSkipError as exc:
            self._undo_in_place(k, p, f"{exc}", failed=False)
            return k + 1  # later steps of the group predicted this one: prepare them again
        except ActionError as exc:
            if self.plan.actions[k].required:
                return self.fail(k, str(exc))
            self._undo_in_place(k, p, f"failed: {exc}")
            return k + 1
        except Exception as exc:  # a bug must not leave the host half-changed: restore all
            return self.fail(k, f"internal error: {type(exc).__name__}: {exc}")
        status = S.STATUS_UNCHANGED if done.unchanged else S.STATUS_APPLIED
        self.results[k] = _result(aid, status, "", p.before, done.after, done.details)
        self.done.append((aid, status))
        if hook is not None:
            self._flush_done()  # a hook may stop the process here: keep the record
            hook("after_action", self.plan.actions[k])
        return None

    def _flush_done(self) -> None:
        """"done" records are informational (recovery restores every undo record either way): one
        write per group, not per action."""
        if self.done:
            done, self.done = self.done, []
            if self.journal is not None and self.journaled:
                self.journal.done([(aid, _STATUS_NAMES[status]) for aid, status in done])

    def _undo_in_place(self, k: int, p: Prepared, reason: str, failed: bool = True) -> None:
        """An optional action that could not complete: put back what it changed, skip it."""
        self._flush_done()
        self.started.pop()
        outcomes = restore_all(self.host, p.undo) if p.undo else []
        bad = [o.note for o in outcomes if not o.ok]
        aid = self.plan.actions[k].id
        if bad:
            self.results[k] = _result(aid, S.STATUS_ROLLBACK_FAILED, f"{reason}; restoring it failed: {'; '.join(bad)}",
                                      p.before, p.after, p.details)
            self.started.append((k, p))  # keep it for a later full rollback
        else:
            why = f"{reason}; its changes were restored" if p.undo and failed else reason
            self.results[k] = _result(aid, S.STATUS_SKIPPED, why, p.before, p.after, p.details)
            self._write([{"t": "restored", "action": aid}])

    def fail(self, k: int | None, reason: str) -> planpb.PlanResult:
        """Restore everything started, in reverse: a required action ``k`` failed (itself
        included), or (``k`` None) the state directory could not record the run."""
        actions = self.plan.actions
        failed_id = actions[k].id if k is not None else ""
        self.done = []  # informational, and the journal is about to say "rollback"
        self._try_write([{"t": "rollback"}], sync=True)
        per_action = restore_actions(self.host, [(actions[idx].id, p.undo) for idx, p in self.started])
        all_ok = True
        if k is not None:
            prev = self.results[k]
            self.results[k] = _result(failed_id, S.STATUS_FAILED, reason,
                                      prev.before if prev else (), prev.after if prev else ())
        because = f"{failed_id} failed" if k is not None else "the run could not be recorded"
        for idx, _ in self.started:
            r = self.results[idx]
            if r is None:
                r = _result(actions[idx].id, S.STATUS_APPLIED)
                self.results[idx] = r
            outs = per_action[actions[idx].id]
            if idx == k:
                ok = settle(r, outs, "its partial changes were restored", "restoring its partial changes failed")
            else:
                ok = settle(r, outs, f"restored because {because}")
            all_ok = all_ok and ok
        for i, r in enumerate(self.results):
            if r is None:
                self.results[i] = _result(actions[i].id, S.STATUS_SKIPPED, f"not run: {because}")
        restored = sum(1 for idx, _ in self.started if idx != k)
        self.started = []
        head = f"{failed_id} failed: {reason}" if k is not None else reason
        if all_ok:
            state, msg = P.STATE_ROLLED_BACK, f"{head}; {restored} applied action(s) restored"
        else:
            state, msg = P.STATE_FAILED, f"{head}; the restore did not complete: see actions"
        return self._store(state, msg, rolled_back=True)

    def finish(self) -> planpb.PlanResult:
        counts = {st: sum(1 for r in self.results if r is not None and r.status == st)
                  for st in (S.STATUS_APPLIED, S.STATUS_UNCHANGED, S.STATUS_SKIPPED, S.STATUS_ROLLBACK_FAILED)}
        state = P.STATE_APPLIED if counts[S.STATUS_APPLIED] or counts[S.STATUS_ROLLBACK_FAILED] else P.STATE_UNCHANGED
        msg = (f"{counts[S.STATUS_APPLIED]} applied, {counts[S.STATUS_UNCHANGED]} unchanged, "
               f"{counts[S.STATUS_SKIPPED]} skipped")
        if counts[S.STATUS_ROLLBACK_FAILED]:
            msg += f"; {counts[S.STATUS_ROLLBACK_FAILED]} optional action(s) failed and could not be restored"
        return self._store(state, msg)

    def _store(self, state: int, msg: str, rolled_back: bool = False) -> planpb.PlanResult:
        """Store the result, then close the journal. The result goes first: a journal that ends
        without one would make the run look finished with nothing recorded of it."""
        if self.state_errors:
            msg = f"{msg}; the state directory failed while restoring: {'; '.join(self.state_errors)}"
        res = _plan_result(self.plan, state, msg, self.started_at, self.node_name, self.results)
        name = P.State.Name(state)  # type: ignore[arg-type]
        try:
            self.store.save_result(self.plan.plan_id, self.sha, res)
        except StateError as exc:
            if not rolled_back and self.started:
                # Changed and unrecorded: undo it all rather than leave what no result describes.
                return self.fail(None, f"the result could not be stored, so every change was undone: {exc}")
            res.message = (f"{res.message}; the result could not be stored ({exc})"
                           + ("; the journal stays pending: the next apply or recovery restores the plan "
                              "again and records it" if self.journaled else ""))
            if self.journal is not None:
                self.journal.close()
            return res
        if rolled_back:
            self._try_write([{"t": "rolled_back", "state": name}], sync=True)
        if self.journal is not None:
            ended = self._try_write([{"t": "end", "state": name}])
            self.journal.close()
            if ended and self.journaled:
                self.store.mark_closed(self.plan.plan_id)
        return res
