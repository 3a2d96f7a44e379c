"""``memtopo apply``, ``memtopo rollback`` and ``memtopo exec``.

    memtopo apply PLAN.json|- [--dry-run] [--state-dir DIR] [--agent-socket PATH] [--format text|json]
    memtopo rollback PLAN_ID [--state-dir DIR] [--format text|json]
    memtopo exec [--cpus LIST] [--membind NODES | --interleave NODES|all | --preferred NODE | --localalloc]
                 -- CMD [ARG ...]

Exit status: 0 applied / unchanged / dry run / rolled back on request; 1 the plan was rejected,
failed or rolled back because of a failure; 2 bad usage or an unusable plan file or state dir.
``exec`` exits with the command's own status; 127 when there is no such command, 126 when it
cannot be executed, 2 for a bad policy or CPU list.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memtopo.apply.defaults import DEFAULT_STATE_DIR, IRQBALANCE_POLICIES
from memtopo.cli.output import EXIT_USAGE, fail, write_text

if TYPE_CHECKING:
    from memtopo.apply import launch
    from memtopo.apply.engine import Engine
    from memtopo.v1 import plan_pb2 as planpb
    from memtopo.v1 import topology_pb2 as pb

EXIT_OK = 0
EXIT_NOT_APPLIED = 1
EXIT_CANNOT_EXECUTE = 126  # exec: the command was found but could not be run
EXIT_NOT_FOUND = 127  # exec: no such command

STATE_DIR_ENV = "MEMTOPO_STATE_DIR"



def ok_states() -> tuple[int, ...]:
    """The results a caller asked for: applied, already in place, or a dry run."""
    from memtopo.v1.plan_pb2 import PlanResult

    return (PlanResult.STATE_APPLIED, PlanResult.STATE_UNCHANGED, PlanResult.STATE_DRY_RUN)

# The agent's default sockets (agent/config.py ListenConfig): it holds an flock on PATH.lock.
AGENT_SOCKETS = ("/run/memtopo/agent.sock", "/run/memtopo/agent-read.sock")


def add_commands(subparsers: Any) -> None:
    """Register apply, rollback and exec on the ``memtopo`` sub-command parser."""
    ap = subparsers.add_parser("apply", help="validate a binding plan, show the diff, apply and verify it")
    ap.add_argument("plan", help="plan file (proto3 JSON BindingPlan), or - for stdin")
    ap.add_argument("--dry-run", action="store_true", help="show the diff only; touch nothing")
    _common(ap)
    ap.add_argument("--irqbalance", choices=IRQBALANCE_POLICIES, default=None,
                    help="what to do about a running irqbalance (default: ban the plan's IRQs)")
    ap.add_argument("--cgroup-prefix", action="append", default=None, metavar="PATH",
                    help="cgroup path the plan may change (repeatable; default: memtopo)")
    ap.add_argument("--agent-socket", action="append", default=None, metavar="PATH",
                    help="a running agent's socket: the holder of its lock (PATH.lock) is never a target "
                         f"(repeatable; default: {' and '.join(AGENT_SOCKETS)})")
    ap.set_defaults(func=cmd_apply)

    rb = subparsers.add_parser("rollback", help="restore what an applied plan changed")
    rb.add_argument("plan_id")
    _common(rb)
    rb.set_defaults(func=cmd_rollback)

    ex = subparsers.add_parser("exec", help="run a command with a CPU set and a memory policy (like numactl)")
    ex.add_argument("--cpus", help="CPU list for the command (0-3,8)")
    pol = ex.add_mutually_exclusive_group()
    pol.add_argument("--membind", metavar="NODES", help="bind: allocate only from these nodes")
    pol.add_argument("--interleave", metavar="NODES", help="interleave pages over these nodes (or all)")
    pol.add_argument("--preferred", metavar="NODE", help="prefer this node, fall back to others")
    pol.add_argument("--localalloc", action="store_true", help="allocate on the node of the running CPU")
    pol.add_argument("--policy", help="local | interleave=NODES | preferred=NODE | bind=NODES")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="-- CMD [ARG ...]")
    ex.set_defaults(func=cmd_exec)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", default=None,
                   help=f"journal and results (default: ${STATE_DIR_ENV} or {DEFAULT_STATE_DIR})")
    p.add_argument("--format", choices=("text", "json"), default="text")


def _state_dir(args: argparse.Namespace) -> str:
    return str(args.state_dir or os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def live_topology() -> pb.MemoryTopology:
    """This host's topology, discovered when the engine first asks for it (not for a stored result)."""
    from memtopo.discovery.discover import discover
    from memtopo.discovery.source import ProbeContext

    return discover(ProbeContext.live())


def _engine(args: argparse.Namespace) -> Engine:
    from memtopo.apply.config import ApplyConfig
    from memtopo.apply.engine import Engine
    from memtopo.apply.host import Host, flock_holders

    overrides: dict[str, Any] = {}
    if getattr(args, "irqbalance", None):
        overrides["irqbalance"] = args.irqbalance
    if getattr(args, "cgroup_prefix", None):
        overrides["cgroup_prefixes"] = tuple(args.cgroup_prefix)
    host = Host.live()
    if hasattr(args, "agent_socket"):
        # The running agent is protected like this process: pinning its threads from here would
        # bypass the refusal its own ApplyPlan makes.
        sockets = args.agent_socket or AGENT_SOCKETS
        agents = flock_holders(host.files, [f"{s}.lock" for s in sockets])
        overrides["protected_pids"] = tuple(sorted(p for p in agents if p != os.getpid()))
    from memtopo.apply.hostfacts import light_facts

    fs = host.files.fs
    # Validation needs a few host facts, read from their files; a whole discovery only where the
    # plan needs more (a fingerprint to compare, a memory policy) or the files do not say.
    return Engine(host, live_topology, _state_dir(args), ApplyConfig(**overrides),
                  facts_provider=lambda plan: light_facts(plan, fs))


def read_plan(source: str) -> planpb.BindingPlan:
    from memtopo.apply.errors import ApplyError
    from memtopo.apply.planio import load_plan

    if source == "-":
        return load_plan(sys.stdin.read())
    try:
        text = Path(source).read_bytes()
    except OSError as exc:
        raise ApplyError(f"{source}: {exc.strerror}") from exc
    return load_plan(text)


def cmd_apply(args: argparse.Namespace) -> int:
    from memtopo.apply.errors import ApplyError
    from memtopo.v1 import plan_pb2 as planpb

    try:
        plan = read_plan(args.plan)
        engine = _engine(args)
        recovered = [] if args.dry_run else engine.recover()
        before = engine.result(plan.plan_id) if plan.plan_id and not args.dry_run else None
        result = engine.apply(plan, dry_run=args.dry_run)
    except ApplyError as exc:
        fail(exc)
        return EXIT_USAGE
    for r in recovered:
        fail(f"recovered unfinished plan {r.plan_id}: {planpb.PlanResult.State.Name(r.state)}: {r.message}")
    _emit(result, args.format, plan)
    rolled_back = planpb.PlanResult.STATE_ROLLED_BACK
    if before is not None and before.state == rolled_back and result.state == rolled_back:
        fail(spent_plan_hint(plan.plan_id))
    return EXIT_OK if result.state in ok_states() else EXIT_NOT_APPLIED


def spent_plan_hint(plan_id: str) -> str:
    """What to say when a plan id that was rolled back is applied again, locally or through an agent.

    A plan id is an idempotency key (a controller resends a plan after a reconnect): once rolled
    back it stays so, and the resend answers with the stored result. Binding again is a new plan."""
    return (f"plan {plan_id} was rolled back earlier; a plan id applies once, so nothing was "
            "applied now. To bind again, apply it under a new plan_id (memtopo plan ... --plan-id NEW, "
            'or edit "plan_id")')


def cmd_rollback(args: argparse.Namespace) -> int:
    from memtopo.apply.errors import ApplyError
    from memtopo.v1 import plan_pb2 as planpb

    try:
        result = _engine(args).rollback(args.plan_id)
    except ApplyError as exc:
        fail(exc)
        return EXIT_USAGE
    _emit(result, args.format, None)
    return EXIT_OK if result.state == planpb.PlanResult.STATE_ROLLED_BACK else EXIT_NOT_APPLIED


def _exec_policy(args: argparse.Namespace) -> launch.MemPolicySpec | None:
    from memtopo.apply import launch

    if args.membind is not None:
        return launch.parse_policy(f"bind={args.membind}")
    if args.interleave is not None:
        return launch.parse_policy(f"interleave={args.interleave}")
    if args.preferred is not None:
        return launch.parse_policy(f"preferred={args.preferred}")
    if args.localalloc:
        return launch.parse_policy("local")
    if args.policy is not None:
        return launch.parse_policy(args.policy)
    return None


def cmd_exec(args: argparse.Namespace) -> int:
    import errno

    from memtopo.apply import launch
    from memtopo.apply.errors import ApplyError, CommandNotStartedError
    from memtopo.apply.host import Host
    from memtopo.cpulist import CpuListError, parse_cpulist

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    try:
        cpus = parse_cpulist(args.cpus) if args.cpus is not None else None
        policy = _exec_policy(args)
        host = Host.live()
        launch.launch(command, policy, cpus, host.kernel, host.files)
    except CpuListError as exc:
        fail(f"--cpus: {exc}")
    except CommandNotStartedError as exc:
        fail(exc)
        # The shell's convention (also env, nice, numactl): 127 no such command, 126 not executable.
        return EXIT_NOT_FOUND if exc.errno == errno.ENOENT else EXIT_CANNOT_EXECUTE
    except ApplyError as exc:
        fail(exc)
    return EXIT_USAGE


# ---- output ------------------------------------------------------------------------------------------
def _emit(result: planpb.PlanResult, fmt: str, plan: planpb.BindingPlan | None) -> None:
    from memtopo.cli.output import message_json

    write_text(message_json(result) + "\n" if fmt == "json" else render(result, plan))


def render(result: planpb.PlanResult, plan: planpb.BindingPlan | None = None) -> str:
    """The human view: state and message, rejections, then per action its diff (- before, + after)."""
    from memtopo.v1.plan_pb2 import ActionResult, PlanResult

    kinds = {a.id: (a.WhichOneof("action") or "?", a.required) for a in plan.actions} if plan else {}
    lines = [f"plan {result.plan_id or '(no id)'}: {PlanResult.State.Name(result.state).removeprefix('STATE_')}"
             f" — {result.message}"]
    for rej in result.rejections:
        lines.append(f"  rejected  {rej}")
    for ar in result.actions:
        kind, required = kinds.get(ar.action_id, ("", False))
        tag = ActionResult.Status.Name(ar.status).removeprefix("STATUS_")
        head = f"  [{tag}] {ar.action_id}"
        if kind:
            head += f" {kind}{' (required)' if required else ' (optional)'}"
        lines.append(head)
        if ar.reason:
            lines.append(f"      {ar.reason}")
        shown = ar.status in (ActionResult.STATUS_WOULD_CHANGE, ActionResult.STATUS_APPLIED, ActionResult.STATUS_FAILED,
                              ActionResult.STATUS_ROLLBACK_FAILED)
        if ar.status == ActionResult.STATUS_ROLLED_BACK:
            # What the rollback changed: from what the plan had set back to what was there before.
            lines.extend(f"      - {a}" for a in ar.after)
            lines.extend(f"      + {b}" for b in ar.before)
        elif shown:
            lines.extend(f"      - {b}" for b in ar.before)
            lines.extend(f"      + {a}" for a in ar.after)
        elif ar.after:
            lines.extend(f"        {a}" for a in ar.after)
        for key in sorted(ar.details):
            lines.append(f"      {key}: {ar.details[key]}")
    return "\n".join(lines) + "\n"
