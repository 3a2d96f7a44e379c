"""``memtopo plan``: run one placement policy on a JSON request and print its decision as JSON.

    memtopo plan cpu-binding --request FILE|- [--root DIR|TARBALL]
                             [--pid PID [--npu N] [--plan-id ID] [--emit decision|plan|both]]
    memtopo plan guest-pci   --request FILE|- [--root DIR|TARBALL]
    memtopo plan place       --request FILE|- [--root DIR|TARBALL]
                             [--pid PID [--plan-id ID] [--emit decision|plan|both]]
    memtopo plan hccs        --request FILE|-
    memtopo plan xpu         --request FILE|-
    memtopo plan mtf OCCUPANCY

Everything goes to stdout as one JSON document: the decision, or ``{"error": {"code", "message"}}``
(a machine reader wants one stream; stderr carries only argparse's usage line). Exit status:
0 decision; 1 ``unsatisfiable`` (a valid request the policy cannot place); 2 ``invalid_request``,
``invalid_topology``, ``invalid_root`` or ``usage`` (fix the input); 3 ``internal`` (a bug).

Topology facts the request leaves out come from discovery: of ``--root``, else of this host when
the request lacks one the policy cannot do without (cpu-binding: ``device_type``, ``allowed_cpus``
or ``running_npus``; guest-pci: a device's ``numa_node``; place: the ``topology``). Values the
request gives always win. ``docs/planner-cli.md`` is the user's page.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, Final, NoReturn

from memtopo.cli.output import error_document, show_help, write_document
from memtopo.cli.plan_errors import InvalidRootError, UsageError

EXIT_OK: Final = 0
EXIT_UNSATISFIABLE: Final = 1
EXIT_INVALID: Final = 2
EXIT_INTERNAL: Final = 3
EMIT_CHOICES: Final = ("decision", "plan", "both")


# Not the caller's input to fix: a bug, or (``memtopo controller place``) a controller out of reach.
SERVICE_ERRORS: Final = frozenset({"internal", "rpc_failed"})


def _exit_code(code: str) -> int:
    if code == "unsatisfiable":
        return EXIT_UNSATISFIABLE
    return EXIT_INTERNAL if code in SERVICE_ERRORS else EXIT_INVALID


class _JsonErrorParser(argparse.ArgumentParser):
    """Per-policy parser whose usage errors (bad --pid, missing --request …) follow the JSON contract."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        write_document(error_document("usage", f"{self.prog}: {message}"))
        sys.exit(EXIT_INVALID)


# ---- command line ------------------------------------------------------------------------------------
def add_commands(subparsers: Any) -> None:
    """Register ``plan`` on the ``memtopo`` sub-command parser."""
    plan = subparsers.add_parser(
        "plan", help="run a placement policy on a JSON request and print the decision as JSON",
        description="Exit status: 0 decision, 1 unsatisfiable, 2 invalid request/topology/root or usage, "
                    "3 internal error. Errors are {\"error\": {\"code\", \"message\"}} on stdout.")
    policies = plan.add_subparsers(dest="policy", metavar="POLICY", parser_class=_JsonErrorParser)
    plan.set_defaults(func=show_help(plan))

    cb = policies.add_parser("cpu-binding", **_described("cpu-binding"),
                             help="CPU pools and roles per running Ascend NPU (vLLM-Ascend's CPU binding)")
    _request_and_root(cb)
    _plan_options(cb, "binding this process by thread role")
    cb.add_argument("--npu", type=int, help="whose pool the process gets (default: the NPU that lists the pid "
                                            "among its processes, or the only running NPU)")
    cb.set_defaults(func=cmd_plan, run="run_cpu_binding")

    pl = policies.add_parser("place", **_described("place"),
                             help="CPUs, GPUs and memory for one allocation on the node")
    _request_and_root(pl)
    _plan_options(pl, "binding this process to the CPUs and memory chosen")
    pl.set_defaults(func=cmd_plan, run="run_place")

    for name, run, text, root in (
        ("guest-pci", "run_guest_pci", "NUMA-aware guest PCIe topology for passthrough (KubeVirt VEP 115)", True),
        ("hccs", "run_hccs", "rank Ascend 910 nodes for a job by HCCS ring", False),
        ("xpu", "run_xpu", "rank Kunlunxin P800 nodes for a task by MTF", False),
    ):
        p = policies.add_parser(name, help=text, **_described(name))
        _request_and_root(p, root=root)
        p.set_defaults(func=cmd_plan, run=run)

    mtf = policies.add_parser("mtf", help="MTF (minimized tasks to fill) of one Kunlunxin P800 node")
    mtf.add_argument("occupancy", help='8 characters of 0/1, the rightmost is XPU 0 ("00000011")')
    mtf.set_defaults(func=cmd_mtf)


def _described(policy: str) -> dict[str, Any]:
    """The policy's request format as its help's epilog, laid out as written."""
    from memtopo.cli.plan_requests import REQUESTS

    return {"epilog": REQUESTS[policy].epilog(policy), "formatter_class": argparse.RawDescriptionHelpFormatter}


def _plan_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--pid", type=int, help=f"also emit a BindingPlan {what}")
    p.add_argument("--plan-id", help="the plan's id (default: derived from the plan's content)")
    p.add_argument("--emit", choices=EMIT_CHOICES,
                   help="what to print: default decision, or both ({\"decision\", \"plan\"}) with --pid; "
                        "plan prints the bare BindingPlan for `memtopo apply -`")


def _request_and_root(p: argparse.ArgumentParser, root: bool = True) -> None:
    p.add_argument("--request", required=True, metavar="FILE", help="the JSON request, or - for stdin")
    if root:
        p.add_argument("--root", help="take topology facts from this captured root (directory or .tar.*) "
                                      "instead of this host")


def cmd_plan(args: argparse.Namespace) -> int:
    from memtopo.cli import plan_run

    run = getattr(plan_run, args.run)
    return answer(lambda: plan_run.emit(args, run(args, read_request(args.request))))


def cmd_mtf(args: argparse.Namespace) -> int:
    from memtopo.planner import xpu

    return answer(lambda: xpu.mtf_of(args.occupancy))


def answer(produce: Callable[[], dict[str, Any]]) -> int:
    """Run ``produce`` and print its document (a decision, or an error document it returns), or the
    error document of what it raised; the exit status."""
    from memtopo.planner.errors import PlanError

    try:
        doc = produce()
    except PlanError as exc:
        constraint = getattr(exc, "constraint", None)  # place.ConstraintError names the one it broke
        doc = (error_document(exc.code, exc.message, constraint=constraint) if constraint is not None
               else error_document(exc.code, exc.message))
    except UsageError as exc:
        doc = error_document("usage", str(exc))
    except InvalidRootError as exc:
        doc = error_document("invalid_root", str(exc))
    except Exception as exc:  # the contract is a JSON answer, never a traceback
        import traceback

        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" at {frame.filename}:{frame.lineno}" if frame else ""
        doc = error_document("internal", f"{type(exc).__name__}: {exc}{where} (a bug in memtopo; please report it)")
    write_document(doc)
    return _exit_code(doc["error"]["code"]) if "error" in doc else EXIT_OK


# ---- request -----------------------------------------------------------------------------------------
def read_request(source: str) -> Any:
    """The request from a file or ``-`` (stdin), decoded."""
    from memtopo.planner.errors import PlanError
    from memtopo.planner.request import MAX_REQUEST_BYTES, parse_json

    if source == "-":
        stream = getattr(sys.stdin, "buffer", sys.stdin)
        data: str | bytes = stream.read(MAX_REQUEST_BYTES + 1)
    else:
        try:
            with open(source, "rb") as f:
                data = f.read(MAX_REQUEST_BYTES + 1)
        except OSError as exc:
            raise PlanError("invalid_request", f"request: cannot read {source}: {exc.strerror or exc}") from None
    return parse_json(data)
