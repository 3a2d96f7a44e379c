"""``memtopo serve`` and ``memtopo query``: run the agent, and a client for every NodeAgent RPC.

    memtopo serve [--config FILE] [--with-controller [ADDR]]
    memtopo query topology|watch|health|plans [--addr ADDR] [--format text|json]
    memtopo query apply PLAN.json|- [--dry-run] [--expected-generation N]
    memtopo query result PLAN_ID

ADDR is ``unix:///run/memtopo/agent.sock`` (the default) or ``host:port`` (TLS: --tls-ca, and
--tls-cert/--tls-key for ApplyPlan, which needs a client certificate over TCP).
Exit status: 0 ok; 1 the RPC failed or a plan was not applied; 2 bad usage or config.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from apply.errors import ApplyError
from apply.planio import to_json
from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import agent_pb2_grpc
from memtopo.v1 import plan_pb2 as planpb

from .apply_cli import OK_STATES, read_plan
from .apply_cli import render as render_result
from .render import render
from .transport import TransportError

if TYPE_CHECKING:
    from memtopo.v1.agent_pb2_grpc import NodeAgentAsyncStub

DEFAULT_ADDR = "unix:///run/memtopo/agent.sock"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_commands(subparsers: Any) -> None:
    s = subparsers.add_parser("serve", help="run the agent (gRPC, controller link, health, metrics)")
    s.add_argument("--config", help="TOML config file (default: the embedded defaults)")
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
    q.add_argument("--count", type=int, default=0, help="watch: stop after this many events (0 = forever)")
    q.add_argument("--timeout", type=float, default=30.0, help="seconds per unary RPC")
    q.add_argument("--tls-ca", help="CA bundle for a TCP agent")
    q.add_argument("--tls-cert", help="client certificate (ApplyPlan over TCP)")
    q.add_argument("--tls-key", help="client key")
    q.set_defaults(func=cmd_query)


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from .config import EXIT_CONFIG, ConfigError, check_host, load_config
    from .daemon import Agent
    from .logs import configure_logging
    from .transport import SocketInUseError, ensure_socket_free

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
        print(f"memtopo: {exc}", file=sys.stderr)
        return EXIT_CONFIG  # the unit's RestartPreventExitStatus: a bad config is not retried
    try:
        # Before anything listens: a second agent is told so, not that the health port is taken.
        for path in (config.listen.socket, config.listen.read_socket):
            if path:
                ensure_socket_free(path)
    except SocketInUseError as exc:
        print(f"memtopo: {exc}", file=sys.stderr)
        return EXIT_FAILED  # not a config error: it works once the other agent stops
    configure_logging(config.log.level, config.log.format)
    agent = Agent(config, embedded_controller=args.with_controller)
    agent.exit_on_stop_overrun = True
    try:
        return asyncio.run(agent.run())
    except ConfigError as exc:  # a listener the config names cannot be set up (port in use, bad path)
        print(f"memtopo: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except TransportError as exc:  # socket taken by another process
        print(f"memtopo: {exc}", file=sys.stderr)
        return EXIT_FAILED


def channel(args: argparse.Namespace) -> grpc.aio.Channel:
    addr: str = args.addr
    if addr.startswith("unix:"):
        return grpc.aio.insecure_channel(addr)
    from .transport import channel_credentials

    return grpc.aio.secure_channel(addr, channel_credentials(args.tls_ca, args.tls_cert, args.tls_key))


def cmd_query(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_query(args))
    except grpc.aio.AioRpcError as exc:
        print(f"memtopo: {args.what}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return EXIT_FAILED
    except (ApplyError, TransportError) as exc:
        print(f"memtopo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK


async def _query(args: argparse.Namespace) -> int:
    if args.what in ("apply", "result") and not args.arg:
        print(f"memtopo: query {args.what} needs {'a plan file' if args.what == 'apply' else 'a plan id'}",
              file=sys.stderr)
        return EXIT_USAGE
    async with channel(args) as ch:
        stub = agent_pb2_grpc.NodeAgentStub(ch)
        text = args.format == "text"
        if args.what == "topology":
            topo = await stub.GetTopology(apb.GetTopologyRequest(), timeout=args.timeout)
            sys.stdout.write(render(topo) if text else to_json(topo) + "\n")
        elif args.what == "health":
            hstub = health_pb2_grpc.HealthStub(ch)
            resp = await hstub.Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            print(status if text else to_json(resp))
            return EXIT_OK if resp.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILED
        elif args.what == "plans":
            listed = await stub.ListPlans(apb.ListPlansRequest(), timeout=args.timeout)
            if text:
                for p in listed.plans:
                    print(f"{p.plan_id}\t{planpb.PlanResult.State.Name(p.state).removeprefix('STATE_')}"
                          f"\t{p.message}")
            else:
                print(to_json(listed))
        elif args.what == "result":
            res = await stub.GetPlanResult(apb.GetPlanResultRequest(plan_id=args.arg), timeout=args.timeout)
            sys.stdout.write(render_result(res) if text else to_json(res) + "\n")
        elif args.what == "apply":
            plan = read_plan(args.arg)
            res = await stub.ApplyPlan(apb.ApplyPlanRequest(plan=plan, dry_run=args.dry_run,
                                                            expected_generation=args.expected_generation),
                                       timeout=args.timeout)
            sys.stdout.write(render_result(res, plan) if text else to_json(res) + "\n")
            return EXIT_OK if res.state in OK_STATES else EXIT_FAILED
        else:
            await _watch(stub, args)
    return EXIT_OK


async def _watch(stub: NodeAgentAsyncStub, args: argparse.Namespace) -> None:
    events: AsyncIterator[apb.TopologyEvent] = stub.WatchTopology(apb.WatchTopologyRequest()).__aiter__()
    seen = 0
    async for ev in events:
        kind = ev.WhichOneof("event")
        if args.format == "json":
            print(json_format.MessageToJson(ev, preserving_proto_field_name=True, indent=None), flush=True)
        else:
            extra = f" {len(ev.snapshot.numa_nodes)} NUMA nodes" if kind == "snapshot" else ""
            print(f"{kind} generation={ev.generation} fingerprint={ev.fingerprint[:16]}"
                  f" agent={ev.agent_instance_id}{extra}", flush=True)
        seen += 1
        if args.count and seen >= args.count:
            return
