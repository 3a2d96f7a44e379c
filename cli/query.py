"""``memtopo serve`` and ``memtopo query``: run the agent, and a client for every NodeAgent RPC.

    memtopo serve [--config FILE] [--with-controller [ADDR] [--controller-http ADDR]]
    memtopo query topology|watch|health|plans [--addr ADDR] [--format text|json]
    memtopo query apply PLAN.json|- [--dry-run] [--expected-generation N]
    memtopo query result PLAN_ID

ADDR is ``unix:///run/memtopo/agent.sock`` (the default) or ``host:port`` (TLS: --tls-ca, and
--tls-cert/--tls-key for ApplyPlan, which needs a client certificate over TCP).
Exit status: 0 ok; 1 the RPC failed or a plan was not applied; 2 bad usage or config.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from memtopo.cli.output import fail, write_text
from memtopo.controller.defaults import DEFAULT_HTTP, DEFAULT_LISTEN

if TYPE_CHECKING:
    import grpc

    from memtopo.v1 import plan_pb2 as planpb
    from memtopo.v1.agent_pb2_grpc import NodeAgentAsyncStub

DEFAULT_ADDR = "unix:///run/memtopo/agent.sock"
DEFAULT_CONTROLLER = DEFAULT_LISTEN
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_commands(subparsers: Any) -> None:
    s = subparsers.add_parser("serve", help="run the agent (gRPC, controller link, health, metrics)")
    s.add_argument("--config", help="TOML config file (default: the embedded defaults)")
    s.add_argument("--controller-http", default=DEFAULT_HTTP, metavar="ADDR",
                   help=f"with --with-controller: its HTTP listener, the fleet page and /scheduler/ "
                        f"(default {DEFAULT_HTTP}; '' = off)")
    s.add_argument("--with-controller", nargs="?", const=DEFAULT_LISTEN, default=None, metavar="ADDR",
                   help="also run the reference controller in this process on ADDR (loopback) and link to it")
    s.add_argument("--root", help="discover this captured root instead of the host (overrides the config)")
    s.add_argument("--socket", help="Unix socket path (overrides listen.socket)")
    s.add_argument("--health", help="health/metrics listen address (overrides health.listen; '' = off)")
    s.add_argument("--state-dir", help="state directory (overrides state_dir)")
    s.set_defaults(func=cmd_serve)

    q = subparsers.add_parser("query", help="ask a running agent (every NodeAgent RPC and grpc.health)")
    q.add_argument("what", choices=("topology", "watch", "health", "plans", "apply", "result"))
    q.add_argument("arg", nargs="?", help="apply: PLAN.json or -; result: PLAN_ID")
    q.add_argument("--addr", default=DEFAULT_ADDR, help=f"agent address (default {DEFAULT_ADDR})")
    q.add_argument("--format", choices=("text", "json"), default="text")
    q.add_argument("--dry-run", action="store_true", help="apply: validate and show the diff only")
    q.add_argument("--expected-generation", type=int, default=0,
                   help="apply: refuse unless the agent is at this generation")
    q.add_argument("--sources", action="store_true", help="topology: every source with its reasons")
    q.add_argument("--count", type=int, default=0, help="watch: stop after this many events (0 = forever)")
    q.add_argument("--timeout", type=float, default=30.0, help="seconds per unary RPC")
    q.add_argument("--tls-ca", help="CA bundle for a TCP agent")
    q.add_argument("--tls-cert", help="client certificate (ApplyPlan over TCP)")
    q.add_argument("--tls-key", help="client key")
    q.set_defaults(func=cmd_query)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    from pathlib import Path

    from memtopo.agent.config import EXIT_CONFIG, ConfigError, check_host, load_config
    from memtopo.agent.daemon import Agent
    from memtopo.agent.peers import TransportError
    from memtopo.agent.sockets import SocketInUseError, ensure_socket_free
    from memtopo.logs import configure_logging

    try:
        config = load_config(Path(args.config) if args.config else None)
        if args.root:
            config = dataclasses.replace(config, root=args.root)
        if args.state_dir:
            config = dataclasses.replace(config, state_dir=args.state_dir)
        if args.socket:
            config = dataclasses.replace(config, listen=dataclasses.replace(config.listen, socket=args.socket))
        if args.health is not None:
            config = dataclasses.replace(config, health=dataclasses.replace(config.health, listen=args.health))
        check_host(config)
    except ConfigError as exc:
        fail(exc)
        return EXIT_CONFIG  # the unit's RestartPreventExitStatus: a bad config is not retried
    try:
        # Before anything listens: a second agent is told so, not that the health port is taken.
        for path in (config.listen.socket, config.listen.read_socket):
            if path:
                ensure_socket_free(path)
    except SocketInUseError as exc:
        fail(exc)
        return EXIT_FAILED  # not a config error: it works once the other agent stops
    configure_logging(config.log.level, config.log.format)
    sidecar = (EmbeddedController(args.with_controller, args.controller_http or None)
               if args.with_controller is not None else None)
    agent = Agent(config, sidecar=sidecar)
    agent.exit_on_stop_overrun = True
    if sidecar is not None or sys.stderr.isatty():
        agent.on_ready = lambda: _print_banner(agent, sidecar)
    try:
        return asyncio.run(agent.run())
    except ConfigError as exc:  # a listener the config names cannot be set up (port in use, bad path)
        fail(exc)
        return EXIT_CONFIG
    except TransportError as exc:  # socket taken by another process
        fail(exc)
        return EXIT_FAILED


class EmbeddedController:
    """The main job on one machine: the reference controller in the agent's process, which the agent
    then links to over loopback. Put together here: the agent and the controller never import each other."""

    source = "command line"

    def __init__(self, listen: str, http: str | None) -> None:
        self.listen = listen
        self.http = http  # the fleet page and the extender's verbs; None: no HTTP listener
        self._server: Any = None
        self.address = ""  # once started: where it listens, as bound
        self.http_url = ""

    def addresses(self) -> dict[str, str]:
        return {"--with-controller": self.listen, **({"--controller-http": self.http} if self.http else {})}

    async def start(self) -> str:
        """Starts the controller; the address the agent's link dials."""
        from memtopo.agent.config import ConfigError
        from memtopo.cli.controller import listener_routes
        from memtopo.cli.extender import ExtenderOptions
        from memtopo.controller.server import ControllerConfigError, start_controller

        try:
            self._server = await start_controller(self.listen, http=self.http,
                                                  http_routes=listener_routes(ExtenderOptions()))
        except ControllerConfigError as exc:
            key = "--controller-http" if "(HTTP)" in str(exc) else "--with-controller"
            raise ConfigError(key, str(exc), self.source) from None
        host = self.listen.rpartition(":")[0] or "127.0.0.1"
        self.address = f"{host}:{self._server.port}"
        if self._server.http is not None:
            self.http_url = f"http://{self._server.http.address}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(1.0)


def _print_banner(agent: Any, sidecar: EmbeddedController | None) -> None:
    """What a person can do with the agent now serving, at the addresses it actually bound (stderr;
    the logs are stdout's)."""
    import contextlib
    import os

    from memtopo.text import escaped

    prog = _program()
    listen = agent.config.listen
    addr = "" if listen.socket == DEFAULT_ADDR.removeprefix("unix://") else f" --addr unix://{listen.socket}"
    rows: list[tuple[str, str]] = []  # command, what it shows
    if listen.socket:
        rows += [(f"{prog} query topology{addr}", "the topology, over the agent's socket"),
                 (f"{prog} query watch{addr}", f"then each new generation (kill -HUP {os.getpid()} rescans)"),
                 (f"{prog} query health{addr}", "grpc.health.v1")]
    if listen.read_socket:
        rows.append((f"{prog} query topology --addr unix://{listen.read_socket}", "the readers' socket"))
    if agent.tcp_port:
        rows.append((f"{prog} query topology --addr {listen.tcp.rpartition(':')[0]}:{agent.tcp_port} --tls-ca CA",
                     "over TCP (TLS)"))
    if sidecar is not None and sidecar.address:
        ctl = "" if sidecar.address == DEFAULT_CONTROLLER else f" --addr {sidecar.address}"
        rows.append((f"{prog} controller nodes{ctl}", "what the controller holds"))
    if agent.health_server is not None:
        url = agent.health_server.url
        rows.append((f"curl -s {url}/readyz; curl -s {url}/metrics", "readiness, metrics"))
    width = max((len(command) for command, _ in rows), default=0)
    lines = [f"memtopo: the agent serves generation {agent.state.generation} (pid {os.getpid()}); in another shell:",
             *(f"  {command:<{width}}  # {what}" for command, what in rows)]
    if sidecar is not None and sidecar.http_url:
        lines.append(f"  open {sidecar.http_url}/ in a browser: the controller's fleet page")
    lines.append("Ctrl-C (or SIGTERM) stops it.")
    with contextlib.suppress(OSError, ValueError):  # no terminal to tell: the agent serves all the same
        print(escaped("\n".join(lines), keep="\n"), file=sys.stderr, flush=True)


def _program() -> str:
    """How to run this memtopo: `memtopo` when that name on PATH is this program (tools/setup.sh links
    it there), else this program's path."""
    import os
    import shutil

    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    on_path = shutil.which("memtopo")
    if not os.path.basename(me).startswith("memtopo") or (on_path and os.path.realpath(on_path) == me):
        return "memtopo"
    return me


def channel(args: argparse.Namespace) -> grpc.aio.Channel:
    import grpc

    from memtopo import tls

    addr: str = args.addr
    if addr.startswith("unix:"):
        return grpc.aio.insecure_channel(addr)

    return grpc.aio.secure_channel(addr, tls.channel_credentials(args.tls_ca, args.tls_cert, args.tls_key))


def cmd_query(args: argparse.Namespace) -> int:
    import asyncio

    import grpc

    from memtopo.apply.errors import ApplyError
    from memtopo.tls import TlsError

    try:
        return asyncio.run(_query(args))
    except grpc.aio.AioRpcError as exc:
        from memtopo.cli.reach import AGENT, rpc_failure

        fail(f"query {args.what}: {rpc_failure(AGENT, args.addr, exc)}")
        return EXIT_FAILED
    except (ApplyError, TlsError) as exc:
        fail(exc)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK


async def _query(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from memtopo.cli.apply import ok_states, read_plan, spent_plan_hint
    from memtopo.cli.apply import render as render_result
    from memtopo.cli.output import message_json
    from memtopo.cli.render import render
    from memtopo.v1 import agent_pb2 as apb
    from memtopo.v1 import agent_pb2_grpc
    from memtopo.v1 import plan_pb2 as planpb

    if args.what in ("apply", "result") and not args.arg:
        fail(f"query {args.what} needs {'a plan file' if args.what == 'apply' else 'a plan id'}")
        return EXIT_USAGE
    async with channel(args) as ch:
        stub = agent_pb2_grpc.NodeAgentStub(ch)
        text = args.format == "text"
        if args.what == "topology":
            topo = await stub.GetTopology(apb.GetTopologyRequest(), timeout=args.timeout)
            write_text(render(topo, all_sources=args.sources) if text else message_json(topo) + "\n")
        elif args.what == "health":
            hstub = health_pb2_grpc.HealthStub(ch)
            resp = await hstub.Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            write_text((status if text else message_json(resp)) + "\n")
            return EXIT_OK if resp.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILED
        elif args.what == "plans":
            listed = await stub.ListPlans(apb.ListPlansRequest(), timeout=args.timeout)
            if text and not listed.plans:
                write_text("no plans: this agent has applied, dry-run or recorded none\n")
            elif text:
                for p in listed.plans:
                    write_text(f"{p.plan_id}\t{planpb.PlanResult.State.Name(p.state).removeprefix('STATE_')}"
                               f"\t{p.message}\n")
            else:  # {"plans": []} when there are none, not {}
                write_text(message_json(listed, defaults=True) + "\n")
        elif args.what == "result":
            res = await stub.GetPlanResult(apb.GetPlanResultRequest(plan_id=args.arg), timeout=args.timeout)
            write_text(render_result(res) if text else message_json(res) + "\n")
        elif args.what == "apply":
            plan = read_plan(args.arg)
            before = await _stored_result(stub, plan.plan_id, args) if plan.plan_id and not args.dry_run else None
            res = await stub.ApplyPlan(apb.ApplyPlanRequest(plan=plan, dry_run=args.dry_run,
                                                            expected_generation=args.expected_generation),
                                       timeout=args.timeout)
            write_text(render_result(res, plan) if text else message_json(res) + "\n")
            rolled_back = planpb.PlanResult.STATE_ROLLED_BACK
            if before is not None and before.state == rolled_back and res.state == rolled_back:
                fail(spent_plan_hint(plan.plan_id))
            return EXIT_OK if res.state in ok_states() else EXIT_FAILED
        else:
            await _watch(stub, args)
    return EXIT_OK


async def _stored_result(stub: NodeAgentAsyncStub, plan_id: str,
                         args: argparse.Namespace) -> planpb.PlanResult | None:
    """The agent's result for ``plan_id`` from before this apply, or None when it has none."""
    import grpc

    from memtopo.v1 import agent_pb2 as apb

    try:
        stored: planpb.PlanResult = await stub.GetPlanResult(apb.GetPlanResultRequest(plan_id=plan_id),
                                                             timeout=args.timeout)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise
    return stored


async def _watch(stub: NodeAgentAsyncStub, args: argparse.Namespace) -> None:
    from collections.abc import AsyncIterator

    from memtopo.cli.output import message_json
    from memtopo.v1 import agent_pb2 as apb

    events: AsyncIterator[apb.TopologyEvent] = stub.WatchTopology(apb.WatchTopologyRequest()).__aiter__()
    seen = 0
    async for ev in events:
        kind = ev.WhichOneof("event")
        if args.format == "json":
            write_text(message_json(ev, indent=None) + "\n", flush=True)
        else:
            extra = (f" {len(ev.snapshot.numa_nodes)} NUMA nodes" if kind == "snapshot" else
                     " (rescanned: same topology)" if kind == "unchanged" else "")
            write_text(f"{kind} generation={ev.generation} fingerprint={ev.fingerprint[:16]}"
                       f" agent={ev.agent_instance_id}{extra}\n", flush=True)
        seen += 1
        if args.count and seen >= args.count:
            return
