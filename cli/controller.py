"""``memtopo controller``: run the reference controller, or ask a running one.

    memtopo controller [serve] [--listen 127.0.0.1:9470] [--tls-cert F --tls-key F [--tls-client-ca F]]
                       [--http 127.0.0.1:9471|'' [--http-tls-cert F --http-tls-key F [--http-tls-client-ca F]]
                        [--http-insecure] [--http-host NAME]...]
                       [--kube-api in-cluster|URL [--kube-refresh S]] [--fleet agents|nrt [--nrt-max-age S]
                       [--claim-ttl S] [--score STRATEGY] [--score-weight RESOURCE=N]]
                       [--extender-client-ca F [--extender-allow-subject CN]] [--extender-token-file F]
                       [--log-level L] [--log-format json|console]
    memtopo controller nodes [--format text|json]
    memtopo controller topology NODE [--format text|json]
    memtopo controller submit NODE PLAN.json|- [--dry-run] [--timeout S] [--format text|json]
    memtopo controller result NODE PLAN_ID [--format text|json]
    memtopo controller place hccs|xpu|place --request FILE|-
    (client commands: --addr HOST:PORT (default 127.0.0.1:9470), --tls-ca/--tls-cert/--tls-key)

A client speaks plaintext only to a loopback address without TLS options; any other address uses
TLS (the system's roots unless --tls-ca). Exit status: 0 done (for submit/result: the plan was
applied, unchanged or dry-run); 1 the plan was not applied (rejected, rolled back, failed);
2 bad usage, an unreadable plan file or credentials; 3 the controller refused or could not be
reached (the message names the gRPC status: NOT_FOUND, UNAVAILABLE, DEADLINE_EXCEEDED …).
``place`` follows ``memtopo plan``'s contract instead: one JSON document on stdout, the decision or
``{"error": {"code", "message"}}``; exit 0, 1 unsatisfiable, 2 invalid, 3 ``rpc_failed``/``internal``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memtopo.cli import plan as plan_cli
from memtopo.cli.output import EXIT_USAGE, error_document, fail, write_text
from memtopo.controller.defaults import (
    DEFAULT_HTTP,
    DEFAULT_LISTEN,
    DEFAULT_PLAN_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    MAX_PLAN_TIMEOUT_S,
)
from memtopo.planner.names import FLEET_POLICIES
from memtopo.text import shorten

if TYPE_CHECKING:
    import grpc

    from memtopo.cli.extender import ExtenderOptions
    from memtopo.controller.server import RouteInstaller
    from memtopo.controller.state import ControllerState
    from memtopo.httpserve import Routes
    from memtopo.k8s.kubeapi import KubeApi
    from memtopo.v1 import agent_pb2 as apb
    from memtopo.v1 import plan_pb2 as planpb

EXIT_OK = 0
EXIT_NOT_APPLIED = 1
EXIT_RPC = 3

# memtopo.logs' words, written out here: --help must not import structlog.
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "console")
RPC_TIMEOUT_S = 10.0
# SubmitPlan waits on the agent; the client's deadline covers the controller's wait plus transit.
SUBMIT_MARGIN_S = 10.0
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),)


def add_commands(subparsers: Any) -> None:
    """Register ``controller`` (serve by default, plus nodes/topology/submit/result)."""
    ctl = subparsers.add_parser("controller", help="run the reference controller, or query a running one",
                                description="Without a sub-command: serve.")
    _serve_options(ctl, suppress=False)
    ctl.set_defaults(func=cmd_serve)
    sub = ctl.add_subparsers(dest="controller_command", metavar="{serve,nodes,topology,submit,result,place}")

    serve = sub.add_parser("serve", help="accept agent links and operator requests until SIGTERM/SIGINT")
    # Given after `serve` or before it: a default here would overwrite what was given before.
    _serve_options(serve, suppress=True)
    serve.set_defaults(func=cmd_serve)

    nodes = sub.add_parser("nodes", help="list the nodes the controller knows")
    # "table" was this command's old name for text; still accepted so scripts keep working.
    nodes.add_argument("--format", choices=("text", "json", "table"), default="text", metavar="{text,json}")
    _client_options(nodes)
    nodes.set_defaults(func=cmd_nodes)

    topo = sub.add_parser("topology", help="a node's latest topology")
    topo.add_argument("node")
    topo.add_argument("--format", choices=("text", "json"), default="text")
    _client_options(topo)
    topo.set_defaults(func=cmd_topology)

    submit = sub.add_parser("submit", help="send a binding plan to a node and wait for its result")
    submit.add_argument("node")
    submit.add_argument("plan", help="plan file (proto3 JSON BindingPlan), or - for stdin")
    submit.add_argument("--dry-run", action="store_true", help="the agent shows the diff only")
    submit.add_argument("--timeout", type=_positive_int, default=None, metavar="S",
                        help=f"seconds to wait for the node's result (default {DEFAULT_PLAN_TIMEOUT_S})")
    submit.add_argument("--format", choices=("text", "json"), default="text")
    _client_options(submit)
    submit.set_defaults(func=cmd_submit)

    result = sub.add_parser("result", help="a plan result the controller received from a node")
    result.add_argument("node")
    result.add_argument("plan_id")
    result.add_argument("--format", choices=("text", "json"), default="text")
    _client_options(result)
    result.set_defaults(func=cmd_result)

    place = sub.add_parser("place", help="run a fleet placement policy (hccs, xpu, place) over the nodes "
                                         "the controller holds; prints the decision as JSON",
                           description="Exit status as `memtopo plan`: 0 decision, 1 unsatisfiable, 2 invalid "
                                       "request or usage, 3 controller unreachable or internal error.")
    place.add_argument("policy", choices=FLEET_POLICIES)
    place.add_argument("--request", required=True, metavar="FILE",
                       help="the JSON request (as `memtopo plan POLICY` without nodes; optional node_names, "
                            "and allocated for hccs/xpu), or - for stdin")
    _client_options(place)
    place.set_defaults(func=cmd_place)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None
    if not 1 <= value <= MAX_PLAN_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_PLAN_TIMEOUT_S} seconds")
    return value


def _serve_options(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    def default(value: str) -> str:
        return argparse.SUPPRESS if suppress else value

    p.add_argument("--listen", default=default(DEFAULT_LISTEN),
                   help=f"host:port or unix:PATH (default {DEFAULT_LISTEN}); plaintext only on loopback")
    p.add_argument("--tls-cert", default=default(""), help="server certificate (PEM)")
    p.add_argument("--tls-key", default=default(""), help="server private key (PEM)")
    p.add_argument("--tls-client-ca", default=default(""),
                   help="CA for client certificates: every client (agent, operator) must present one")
    p.add_argument("--http", default=default(DEFAULT_HTTP), metavar="ADDR",
                   help=f"HTTP listener host:port for /healthz, /metrics, the scheduler extender (/scheduler/…) "
                        f"and the fleet page (default {DEFAULT_HTTP}; '' disables); plaintext only on loopback")
    p.add_argument("--http-tls-cert", default=default(""), help="HTTP listener certificate (PEM)")
    p.add_argument("--http-tls-key", default=default(""), help="HTTP listener private key (PEM)")
    p.add_argument("--http-tls-client-ca", default=default(""), metavar="F",
                   help="CA for HTTP client certificates: a client that presents one must present one it signed, "
                        "and routes see its subject (clients without one are still served)")
    p.add_argument("--http-insecure", action="store_true", default=default(False),  # type: ignore[arg-type]
                   help="serve plaintext HTTP off loopback (only behind a network that is trusted)")
    p.add_argument("--http-host", action="append", default=default([]), metavar="NAME",  # type: ignore[arg-type]
                   help="a name clients use for the HTTP listener (a Service's DNS name): accepted in Host "
                        "besides IP addresses, localhost and --http's own host; repeatable")
    p.add_argument("--kube-api", default=default(""), metavar="in-cluster|URL",
                   help="the Kubernetes API server the scheduler extender reads and binds through: in-cluster "
                        "(the pod's service account) or a URL such as kubectl proxy's http://127.0.0.1:8001 "
                        "(default: none; bind then answers an Error)")
    p.add_argument("--kube-refresh", type=float, default=default(10.0), metavar="S",  # type: ignore[arg-type]
                   help="--fleet agents: seconds between reads of the bound pods' device annotations (default 10)")
    p.add_argument("--fleet", choices=("agents", "nrt"), default=default(""),
                   help="what the scheduler extender decides over: agents (the topologies agents stream to this "
                        "controller; the default without --kube-api) or nrt (the API server's "
                        "NodeResourceTopology objects and pods; the default with --kube-api)")
    p.add_argument("--nrt-max-age", type=float, default=default(120.0), metavar="S",  # type: ignore[arg-type]
                   help="--fleet nrt: a node whose NodeResourceTopology lags the pods bound to it for longer is "
                        "refused (default 120)")
    p.add_argument("--claim-ttl", type=float, default=default(30.0), metavar="S",  # type: ignore[arg-type]
                   help="--fleet nrt: seconds a bind's claim on a node's zones holds before the pod is bound "
                        "(default 30)")
    p.add_argument("--score", default=default("memtopo"), metavar="STRATEGY",
                   choices=("memtopo", "LeastAllocated", "MostAllocated", "BalancedAllocation", "LeastNUMANodes"),
                   help="--fleet nrt: prioritize's strategy: memtopo (its policy's rank for the pods it places, "
                        "else LeastNUMANodes; the default), LeastAllocated, MostAllocated, BalancedAllocation, "
                        "LeastNUMANodes")
    p.add_argument("--score-weight", action="append", default=default(None), metavar="RESOURCE=N",  # type: ignore[arg-type]
                   help="a resource's weight for LeastAllocated and MostAllocated (repeatable; default 1)")
    p.add_argument("--extender-client-ca", default=default(""), metavar="FILE",
                   help="CA of the client certificates the extender's verbs accept (kube-scheduler's tlsConfig "
                        "certFile); needs --http-tls-cert/--http-tls-key")
    p.add_argument("--extender-allow-subject", action="append", default=default(None), metavar="CN",  # type: ignore[arg-type]
                   help="only client certificates with this subject common name may call (repeatable)")
    p.add_argument("--extender-token-file", default=default(""), metavar="FILE",
                   help="a bearer token the extender's verbs accept (Authorization: Bearer …), read again "
                        "when the file changes")
    p.add_argument("--log-level", choices=LOG_LEVELS, default=default("info"),
                   help="events at this level and above (default info)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=default("json"),
                   help="json: one object per line on stdout, as the agent logs (default); console: for a terminal")


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=DEFAULT_LISTEN, help=f"controller address (default {DEFAULT_LISTEN})")
    p.add_argument("--tls-ca", default="", help="CA that signed the controller's certificate (PEM)")
    p.add_argument("--tls-cert", default="", help="client certificate (PEM), for a controller that wants one")
    p.add_argument("--tls-key", default="", help="client private key (PEM)")


class _RpcFailedError(Exception):
    """A ControllerAdmin call that failed; the message names the address and the gRPC status."""


Command = Callable[[argparse.Namespace], int]


def _exits(fn: Command) -> Command:
    """Errors the user can act on become a message and an exit code."""
    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        from memtopo.controller.server import ControllerConfigError

        try:
            return fn(args)
        except ControllerConfigError as exc:
            fail(f"controller: {exc}")
            return EXIT_USAGE
        except _RpcFailedError as exc:
            fail(exc)
            return EXIT_RPC
    return run


# ---- serve -------------------------------------------------------------------------------------------
@_exits
def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from memtopo.addresses import is_host_name
    from memtopo.controller.server import (
        ControllerConfigError,
        http_ssl_context,
        serve_until_signalled,
        server_credentials,
    )
    from memtopo.logs import configure_logging

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ControllerConfigError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ControllerConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    creds = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    http_cert, http_key = getattr(args, "http_tls_cert", ""), getattr(args, "http_tls_key", "")
    if bool(http_cert) != bool(http_key):
        raise ControllerConfigError("--http-tls-cert and --http-tls-key go together")
    http_ca, extender_ca = getattr(args, "http_tls_client_ca", ""), getattr(args, "extender_client_ca", "")
    if http_ca and extender_ca and http_ca != extender_ca:
        raise ControllerConfigError("--http-tls-client-ca and --extender-client-ca name the one listener's client CA: "
                                    "give one")
    client_ca = extender_ca or http_ca
    if client_ca and not http_cert:
        flag = "--extender-client-ca" if extender_ca else "--http-tls-client-ca"
        raise ControllerConfigError(f"{flag} needs --http-tls-cert and --http-tls-key")
    http_ssl = http_ssl_context(http_cert, http_key, client_ca) if http_cert else None
    hosts = tuple(getattr(args, "http_host", None) or ())
    for name in hosts:
        if not is_host_name(name):
            raise ControllerConfigError(f"--http-host {shorten(name)!r}: not a host name")
    options = _extender_options(args)
    configure_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "json"))
    asyncio.run(serve_until_signalled(args.listen, creds, http=getattr(args, "http", DEFAULT_HTTP) or None,
                                      http_ssl=http_ssl, http_insecure=bool(getattr(args, "http_insecure", False)),
                                      http_routes=listener_routes(options), http_hosts=hosts, kube=options.kube))
    return EXIT_OK


def _seconds(args: argparse.Namespace, key: str, default: float, low: float, high: float) -> float:
    from memtopo.controller.server import ControllerConfigError

    value = float(getattr(args, key, default))
    if not low <= value <= high:
        raise ControllerConfigError(f"--{key.replace('_', '-')}: {low:g} to {high:g} seconds")
    return value


def _extender_options(args: argparse.Namespace) -> ExtenderOptions:
    """The scheduler extender's settings from the command line; ControllerConfigError for a bad one."""
    from memtopo.cli.extender import ExtenderOptions
    from memtopo.controller.server import ControllerConfigError
    from memtopo.extender.auth import AuthConfigError, Authenticator

    kube = _kube_api(getattr(args, "kube_api", ""))
    fleet = getattr(args, "fleet", "") or ("nrt" if kube is not None else "agents")
    if fleet == "nrt" and kube is None:
        raise ControllerConfigError("--fleet nrt reads the API server's NodeResourceTopologies: give --kube-api")
    weights: dict[str, int] = {}
    for item in getattr(args, "score_weight", None) or ():
        name, sep, value = item.partition("=")
        if not sep or not name or not value.isdigit() or not 1 <= int(value) <= 1000:
            raise ControllerConfigError(f"--score-weight {item!r}: expected RESOURCE=N with N from 1 to 1000")
        weights[name] = int(value)
    try:
        auth = Authenticator(client_ca=bool(getattr(args, "extender_client_ca", "")),
                             subjects=getattr(args, "extender_allow_subject", None) or (),
                             token_file=getattr(args, "extender_token_file", ""))
    except AuthConfigError as exc:
        raise ControllerConfigError(str(exc)) from None
    return ExtenderOptions(fleet=fleet, kube=kube, auth=auth,
                           refresh_s=_seconds(args, "kube_refresh", 10.0, 0.1, 3600),
                           max_age=_seconds(args, "nrt_max_age", 120.0, 1, 86400),
                           claim_ttl=_seconds(args, "claim_ttl", 30.0, 1, 3600),
                           score=getattr(args, "score", "memtopo"), weights=weights)


def listener_routes(options: ExtenderOptions) -> RouteInstaller:
    """What the controller's HTTP listener serves, put together here: the controller's own /healthz and
    /metrics, the scheduler extender's verbs (and its /readyz), and the fleet page, which shows the
    devices the extender handed out. The controller imports neither of the others."""
    from memtopo.cli.extender import installer
    from memtopo.controller.routes import install_core
    from memtopo.fleetpage import page

    install_extender = installer(options)

    def install(routes: Routes, state: ControllerState) -> None:
        install_core(routes, state)
        install_extender(routes, state)
        handed_out = state.extender
        page.install(routes, state, in_use=handed_out.in_use if handed_out is not None else None)

    return install


def _kube_api(value: str) -> KubeApi | None:
    from memtopo.controller.server import ControllerConfigError
    from memtopo.k8s.kubeapi import KubeApi, KubeApiError

    if not value:
        return None
    try:
        return KubeApi.from_flag(value)
    except KubeApiError as exc:
        raise ControllerConfigError(f"--kube-api: {exc}") from exc


# ---- clients -----------------------------------------------------------------------------------------
def _channel(args: argparse.Namespace) -> grpc.Channel:
    import grpc

    from memtopo import tls
    from memtopo.addresses import is_loopback
    from memtopo.controller.server import ControllerConfigError, check_address

    check_address(args.addr)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ControllerConfigError("--tls-cert and --tls-key go together")
    if not (args.tls_ca or args.tls_cert or args.tls_key) and is_loopback(args.addr):
        return grpc.insecure_channel(args.addr, options=CHANNEL_OPTIONS)
    try:
        creds = tls.channel_credentials(args.tls_ca or None, args.tls_cert or None, args.tls_key or None)
    except tls.TlsError as exc:
        raise ControllerConfigError(str(exc)) from None
    return grpc.secure_channel(args.addr, creds, options=CHANNEL_OPTIONS)


def _call(args: argparse.Namespace, method: str, request: Any, timeout: float = RPC_TIMEOUT_S) -> Any:
    """One ControllerAdmin call; gRPC failures become ``_RpcFailed`` with a one-line message."""
    import grpc

    from memtopo.v1 import agent_pb2_grpc as apb_grpc

    with _channel(args) as channel:
        stub = apb_grpc.ControllerAdminStub(channel)
        try:
            return getattr(stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            from memtopo.cli.reach import CONTROLLER, rpc_failure

            raise _RpcFailedError(rpc_failure(CONTROLLER, args.addr, exc)) from exc


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{max(seconds, 0):.0f}s ago"


def render_nodes(resp: apb.ListNodesResponse, now: float | None = None) -> str:
    """One row per node: link state, held generation, short fingerprint, sizes, last seen, peer."""
    import time

    from memtopo.cli.output import table
    from memtopo.text import escaped

    if not resp.nodes:
        return "no nodes\n"
    clock = time.time() if now is None else now
    # Names from the network, escaped before the columns are measured: the rows stay aligned.
    rows = [[escaped(n.node_name), "connected" if n.connected else "disconnected",
             str(n.generation) if n.fingerprint else "-", escaped(n.fingerprint[:12]) or "-", str(n.numa_nodes),
             str(n.accelerators), _age(clock - n.last_seen.ToNanoseconds() / 1e9) if n.HasField("last_seen") else "-",
             escaped(n.peer) or "-"]
            for n in resp.nodes]
    headers = ["NODE", "LINK", "GENERATION", "FINGERPRINT", "NUMA", "ACCEL", "LAST SEEN", "PEER"]
    return "\n".join(table(headers, rows, indent="")) + "\n"


@_exits
def cmd_nodes(args: argparse.Namespace) -> int:
    from memtopo.cli.output import message_json
    from memtopo.v1 import agent_pb2 as apb

    resp = _call(args, "ListNodes", apb.ListNodesRequest())
    if args.format == "json":
        write_text(message_json(resp, defaults=True) + "\n")
    else:
        write_text(render_nodes(resp))
    return EXIT_OK


@_exits
def cmd_topology(args: argparse.Namespace) -> int:
    from memtopo.v1 import agent_pb2 as apb

    topo = _call(args, "GetNodeTopology", apb.GetNodeTopologyRequest(node_name=args.node))
    if args.format == "json":
        from memtopo.cli.output import message_json

        write_text(message_json(topo, defaults=True) + "\n")
    else:
        from memtopo.cli.render import render

        write_text(render(topo))
    return EXIT_OK


def _emit_result(result: planpb.PlanResult, fmt: str, plan: planpb.BindingPlan | None) -> int:
    from memtopo.cli.apply import ok_states
    from memtopo.cli.apply import render as render_result
    from memtopo.cli.output import message_json

    write_text(message_json(result) + "\n" if fmt == "json" else render_result(result, plan))
    return EXIT_OK if result.state in ok_states() else EXIT_NOT_APPLIED


@_exits
def cmd_submit(args: argparse.Namespace) -> int:
    from memtopo.apply.errors import ApplyError
    from memtopo.cli.apply import read_plan
    from memtopo.v1 import agent_pb2 as apb

    try:
        plan = read_plan(args.plan)
    except ApplyError as exc:
        fail(exc)
        return EXIT_USAGE
    wait = args.timeout or DEFAULT_PLAN_TIMEOUT_S
    request = apb.SubmitPlanRequest(node_name=args.node, plan=plan, dry_run=args.dry_run,
                                    timeout_seconds=args.timeout or 0)
    result = _call(args, "SubmitPlan", request, timeout=wait + SUBMIT_MARGIN_S)
    return _emit_result(result, args.format, plan)


@_exits
def cmd_result(args: argparse.Namespace) -> int:
    from memtopo.v1 import agent_pb2 as apb

    result = _call(args, "GetNodePlanResult", apb.GetNodePlanResultRequest(node_name=args.node,
                                                                            plan_id=args.plan_id))
    return _emit_result(result, args.format, None)


def cmd_place(args: argparse.Namespace) -> int:
    import json

    from memtopo.controller.server import ControllerConfigError
    from memtopo.v1 import agent_pb2 as apb

    def produce() -> dict[str, Any]:
        # Decoded here first: a file that is not JSON is the caller's to fix, without a round trip.
        body = plan_cli.read_request(args.request)
        try:
            resp = _call(args, "Place", apb.FleetPlaceRequest(policy=args.policy, request_json=json.dumps(body)))
        except _RpcFailedError as exc:
            return error_document("rpc_failed", str(exc))
        except ControllerConfigError as exc:
            return error_document("usage", str(exc))
        doc: dict[str, Any] = json.loads(resp.result_json)
        return doc

    return plan_cli.answer(produce)
