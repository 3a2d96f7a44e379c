"""``memtopo`` command line."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from google.protobuf import json_format

from agent.apply_cli import add_commands as add_apply_commands
from agent.plan_cli import add_commands as add_plan_commands
from agent.query_cli import add_commands as add_agent_commands
from agent.render import render, render_links
from controller.cli import add_commands as add_controller_commands
from discovery.capture import CaptureError, gather, open_root
from discovery.discover import discover
from discovery.record import recordings
from discovery.source import ProbeContext
from memtopo.v1 import topology_pb2 as pb

EXIT_USAGE = 2


def to_json(msg: pb.MemoryTopology) -> str:
    """proto3 JSON with the .proto's snake_case names and every field present, defaults included."""
    return json_format.MessageToJson(msg, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True, indent=2)


@contextlib.contextmanager
def context_for(root: str | None, hwloc_xml: str | None) -> Iterator[ProbeContext]:
    if hwloc_xml is not None:
        xml = Path(hwloc_xml)
        if not xml.exists():
            raise CaptureError(f"{xml}: no such file")
        yield ProbeContext.at_root("/", hwloc_xml=xml.absolute())
        return
    if root is None:
        yield ProbeContext.live()
        return
    with open_root(root) as path:
        yield ProbeContext.at_root(path)


def cmd_topo(args: argparse.Namespace) -> int:
    with context_for(args.root, args.hwloc_xml) as ctx:
        topo = discover(ctx)
    if args.hwloc_xml is not None:
        # The export is the whole input: one hwloc could not read is an error, not an empty machine.
        hw = next((s for s in topo.sources if s.source == "hwloc"), None)
        if hw is not None and hw.state == pb.SOURCE_STATE_UNAVAILABLE:
            raise CaptureError("; ".join(hw.reasons) or f"{args.hwloc_xml}: hwloc could not read it")
    if args.root:
        topo.source_root = args.root  # the temporary extraction path means nothing to the reader
    if args.links:
        sys.stdout.write(render_links(topo))
    else:
        sys.stdout.write(to_json(topo) + "\n" if args.format == "json" else render(topo))
    return 0


def cmd_gather(args: argparse.Namespace) -> int:
    out = Path(args.out)
    root = Path(args.root)
    # Tools and NVML answer for this host only; a gather of another root records none.
    recorded = recordings(ProbeContext.live()) if root == Path("/") else None
    count = gather(out, root, recorded)
    print(f"wrote {out} ({count} entries)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memtopo", description="Memory topology node agent")
    sub = parser.add_subparsers(dest="command", required=True)

    topo = sub.add_parser("topo", help="discover and print the memory topology")
    src = topo.add_mutually_exclusive_group()
    src.add_argument("--root", help="read a captured root: a directory or a .tar.* archive")
    src.add_argument("--hwloc-xml", help="read an hwloc XML export instead of a filesystem root")
    topo.add_argument("--format", choices=("text", "json"), default="text")
    topo.add_argument("--links", action="store_true",
                      help="print the accelerator link matrix (nvidia-smi topo -m vocabulary)")
    topo.set_defaults(func=cmd_topo)

    g = sub.add_parser("gather", help="capture this host's /sys and /proc topology files into a tarball")
    g.add_argument("out", help="output archive (.tar.gz, .tar.xz or .tar)")
    g.add_argument("--root", default="/", help=argparse.SUPPRESS)
    g.set_defaults(func=cmd_gather)

    add_apply_commands(sub)
    add_plan_commands(sub)
    add_agent_commands(sub)
    add_controller_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except CaptureError as exc:
        print(f"memtopo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return 0
    return rc


if __name__ == "__main__":
    sys.exit(main())
