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

from memtopo.cli.output import fail
from memtopo.controller.defaults import DEFAULT_HTTP

if TYPE_CHECKING:
    import grpc

    from memtopo.v1 import plan_pb2 as planpb
    from memtopo.v1.agent_pb2_grpc import NodeAgentAsyncStub

DEFAULT_ADDR = "unix:///run/memtopo/agent.sock"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_commands(subparsers: Any) -> None:
    s = subparsers.add_parser("serve", help="run the agent (gRPC, controller link, health, metrics)")
    s.add_argument("--config", help="TOML config file (default: the embedded defaults)")
    s.add_argument("--controller-http", default=DEFAULT_HTTP, metavar="ADDR",
                   help=f"with --with-controller: its HTTP listener, the fleet page and /scheduler/ "
                        f"(default {DEFAULT_HTTP}; '' = off)")
    s.add_argument("--with-controller", nargs="?", const="127.0.0.1:9470", default=None, metavar="ADDR",
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
    from memtopo.agent.logs import configure_logging
    from memtopo.agent.peers import TransportError
    from memtopo.agent.sockets import SocketInUseError, ensure_socket_free

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

    def __init__(self, listen: str, http: str | None) -> None:
        self.listen = listen
        self.http = http  # the fleet page and the extender's verbs; None: no HTTP listener
        self._server: Any = None

    async def start(self) -> str:
        """Starts the controller; the address the agent's link dials."""
        from memtopo.cli.controller import listener_routes
        from memtopo.controller.server import start_controller

        self._server = await start_controller(self.listen, http=self.http, http_routes=listener_routes)
        host = self.listen.rpartition(":")[0] or "127.0.0.1"
        return f"{host}:{self._server.port}"

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(1.0)


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
        fail(f"{args.what}: {exc.code().name}: {exc.details()}")
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
            sys.stdout.write(render(topo, all_sources=args.sources) if text else message_json(topo) + "\n")
        elif args.what == "health":
            hstub = health_pb2_grpc.HealthStub(ch)
            resp = await hstub.Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            print(status if text else message_json(resp))
            return EXIT_OK if resp.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILED
        elif args.what == "plans":
            listed = await stub.ListPlans(apb.ListPlansRequest(), timeout=args.timeout)
            if text and not listed.plans:
                print("no plans: this agent has applied, dry-run or recorded none")
            elif text:
                for p in listed.plans:
                    print(f"{p.plan_id}\t{planpb.PlanResult.State.Name(p.state).removeprefix('STATE_')}"
                          f"\t{p.message}")
            else:  # {"plans": []} when there are none, not {}
                print(message_json(listed, defaults=True))
        elif args.what == "result":
            res = await stub.GetPlanResult(apb.GetPlanResultRequest(plan_id=args.arg), timeout=args.timeout)
            sys.stdout.write(render_result(res) if text else message_json(res) + "\n")
        elif args.what == "apply":
            plan = read_plan(args.arg)
            before = await _stored_result(stub, plan.plan_id, args) if plan.plan_id and not args.dry_run else None
            res = await stub.ApplyPlan(apb.ApplyPlanRequest(plan=plan, dry_run=args.dry_run,
                                                            expected_generation=args.expected_generation),
                                       timeout=args.timeout)
            sys.stdout.write(render_result(res, plan) if text else message_json(res) + "\n")
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
            print(message_json(ev, indent=None), flush=True)
        else:
            extra = (f" {len(ev.snapshot.numa_nodes)} NUMA nodes" if kind == "snapshot" else
                     " (rescanned: same topology)" if kind == "unchanged" else "")
            print(f"{kind} generation={ev.generation} fingerprint={ev.fingerprint[:16]}"
                  f" agent={ev.agent_instance_id}{extra}", flush=True)
        seen += 1
        if args.count and seen >= args.count:
            return
