"""``memtopo k8s nrt``: this node's NodeResourceTopology object, as the agent would publish it."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from memtopo.cli.output import EXIT_USAGE, fail, show_help
from memtopo.k8s.defaults import DEFAULT_CONFIG_PATHS, DEFAULT_POD_RESOURCES_SOCKET


def dump(obj: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        import json

        return json.dumps(obj, indent=2) + "\n"
    import yaml

    # libyaml's emitter where PyYAML has it: the pure-Python one took minutes over a 1,024-zone object.
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return str(yaml.dump(obj, Dumper=dumper, sort_keys=False, default_flow_style=False))


def cmd_nrt(args: argparse.Namespace) -> int:
    from memtopo.cli.discovering import DiscoveryError, discovered
    from memtopo.k8s.facts import PodResourcesView
    from memtopo.k8s.kubelet import read_kubelet_facts
    from memtopo.k8s.nrt import NrtError, build_nrt
    from memtopo.k8s.podresources import PodResourcesError, read_pod_resources

    config_paths = (args.kubelet_config,) if args.kubelet_config else DEFAULT_CONFIG_PATHS
    pods: PodResourcesView | None = None
    try:
        with discovered(args.root) as (ctx, topo):
            kubelet = read_kubelet_facts(ctx.fs, config_paths)
    except DiscoveryError as exc:
        fail(exc)
        return exc.exit_code
    if args.root:
        # A capture has no kubelet to ask; this host's kubelet would describe another node.
        problem = "captured root"
    else:
        try:
            pods = read_pod_resources(args.pod_resources_socket)
            problem = ""
        except PodResourcesError as exc:
            problem = exc.reason
    name = args.node_name or os.environ.get("NODE_NAME") or topo.node_name
    try:
        obj = build_nrt(topo, name, kubelet=kubelet, pods=pods, pods_problem=problem)
    except NrtError as exc:
        fail(exc)
        return EXIT_USAGE
    sys.stdout.write(dump(obj, args.format))
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    k8s = sub.add_parser("k8s", help="Kubernetes: the NodeResourceTopology object of this node")
    ksub = k8s.add_subparsers(dest="k8s_command", metavar="SUBCOMMAND")
    k8s.set_defaults(func=show_help(k8s))
    nrt = ksub.add_parser("nrt", help="print this node's NodeResourceTopology (topology.node.k8s.io/v1alpha2)")
    nrt.add_argument("--root", help="read a captured root: a directory or a .tar.* archive")
    nrt.add_argument("--node-name", help="metadata.name (default: $NODE_NAME, else the discovered host name)")
    nrt.add_argument("--format", choices=("yaml", "json"), default="yaml")
    nrt.add_argument("--kubelet-config", help="KubeletConfiguration file on the node (read under --root; "
                                              f"default: the first of {', '.join(DEFAULT_CONFIG_PATHS)})")
    nrt.add_argument("--pod-resources-socket", default=DEFAULT_POD_RESOURCES_SOCKET,
                     help="the kubelet's PodResources socket (live host only; default %(default)s)")
    nrt.set_defaults(func=cmd_nrt)
