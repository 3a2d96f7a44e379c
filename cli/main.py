"""``memtopo`` command line: the parser of every command, and ``topo`` / ``gather``.

The parser is built from the standard library alone; each handler imports what it needs, so a
command loads only its own machinery (``--help`` loads no protobuf, grpc, discovery or planner).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from memtopo import __version__
from memtopo.cli import apply as apply_cli
from memtopo.cli import controller as controller_cli
from memtopo.cli import k8s as k8s_cli
from memtopo.cli import manual
from memtopo.cli import plan as plan_cli
from memtopo.cli import query as query_cli
from memtopo.cli.output import EXIT_USAGE, fail, show_help, write_text


def cmd_topo(args: argparse.Namespace) -> int:
    from memtopo.cli.discovering import DiscoveryError, discovered
    from memtopo.discovery.capture import CaptureError
    from memtopo.v1 import topology_pb2 as pb

    try:
        with discovered(args.root, args.hwloc_xml) as (_, topo):
            if args.hwloc_xml is not None:
                # The export is the whole input: one hwloc could not read is an error, not an empty machine.
                hw = next((s for s in topo.sources if s.source == "hwloc"), None)
                if hw is not None and hw.state == pb.SOURCE_STATE_UNAVAILABLE:
                    raise CaptureError("; ".join(hw.reasons) or f"{args.hwloc_xml}: hwloc could not read it")
    except DiscoveryError as exc:
        fail(exc)
        return exc.exit_code
    if args.root:
        topo.source_root = args.root  # the temporary extraction path means nothing to the reader
    if args.links:
        from memtopo.cli.render import render_links

        write_text(render_links(topo))
    elif args.format == "json":
        from memtopo.cli.output import message_json

        sys.stdout.write(message_json(topo, defaults=True) + "\n")
    elif args.format == "svg":
        from memtopo.draw.svg import topology_svg

        sys.stdout.write(topology_svg(topo))
    else:
        from memtopo.cli.render import render

        write_text(render(topo, all_sources=args.sources))
    return 0


# What gather writes (discovery.capture picks the compression from the name); any other name would
# get an uncompressed tar that its suffix misdescribes.
GATHER_SUFFIXES = (".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar")


def cmd_gather(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from memtopo.discovery.capture import CaptureError, gather
    from memtopo.discovery.record import recordings
    from memtopo.discovery.source import ProbeContext

    out = Path(args.out)
    root = Path(args.root)
    suffix = next((s for s in GATHER_SUFFIXES if out.name.endswith(s)), None)
    if suffix is None:
        fail(f"{args.out!r}: gather writes {', '.join(GATHER_SUFFIXES)} archives; name the output with one of "
             "these suffixes")
        return EXIT_USAGE
    if not out.parent.is_dir():
        fail(f"{args.out!r}: directory {str(out.parent)!r} does not exist")
        return EXIT_USAGE
    if (out.exists() or out.is_symlink()) and not args.force:
        fail(f"{args.out!r} exists; gather replaces it only with --force")
        return EXIT_USAGE
    # Tools and NVML answer for this host only; a gather of another root records none.
    recorded = recordings(ProbeContext.live()) if root == Path("/") else None
    # Written beside it under another name, then moved into place: a failed gather leaves neither a
    # half-written archive under the name nor a damaged earlier one.
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name.removesuffix(suffix)}-", suffix=suffix)
    tmp = Path(tmp_name)
    try:
        os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)  # as an archive opened under its own name would be
        count = gather(tmp, root, recorded)
        if args.force:
            tmp.replace(out)
        else:
            os.link(tmp, out)  # never over a file that appeared meanwhile
    except (CaptureError, OSError) as exc:
        fail(exc if isinstance(exc, CaptureError) else f"{args.out!r}: cannot write: {exc.strerror or exc}")
        return EXIT_USAGE
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    print(f"wrote {out} ({count} entries)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memtopo", description="Memory topology node agent",
        epilog="`memtopo COMMAND --help` shows a command's options; `bash tools/run.sh` in a checkout runs the "
               "agent with a controller. README.md has the whole picture.")
    parser.add_argument("--version", action="version", version=f"memtopo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(func=show_help(parser))

    topo = sub.add_parser("topo", help="discover and print the memory topology")
    src = topo.add_mutually_exclusive_group()
    src.add_argument("--root", help="read a captured root: a directory or a .tar.* archive")
    src.add_argument("--hwloc-xml", help="read an hwloc XML export instead of a filesystem root")
    topo.add_argument("--format", choices=("text", "json", "svg"), default="text",
                      help="svg: a self-contained drawing of the node (open it in a browser)")
    topo.add_argument("--links", action="store_true",
                      help="print the accelerator link matrix (nvidia-smi topo -m vocabulary)")
    topo.add_argument("--sources", action="store_true",
                      help="text: list every source with its reasons (default: unavailable ones on one line)")
    topo.set_defaults(func=cmd_topo)

    g = sub.add_parser("gather", help="capture this host's /sys and /proc topology files into a tarball")
    g.add_argument("out", help="output archive (.tar.gz, .tgz, .tar.xz, .txz or .tar)")
    g.add_argument("--force", action="store_true", help="replace OUT if it exists")
    g.add_argument("--root", default="/", help=argparse.SUPPRESS)
    g.set_defaults(func=cmd_gather)

    apply_cli.add_commands(sub)
    plan_cli.add_commands(sub)
    query_cli.add_commands(sub)
    controller_cli.add_commands(sub)
    k8s_cli.add_commands(sub)
    manual.add_commands(sub, parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return _dispatch(build_parser().parse_args(argv))


def _dispatch(args: argparse.Namespace) -> int:
    try:
        rc: int = args.func(args)
    except BrokenPipeError:
        return 0
    return rc


# Commands whose process has nothing left to do once their output is written: what they opened is
# closed by its with-block (a temporary root is removed) and their threads hold nothing to save (a
# probe past its deadline is abandoned either way). Python's teardown of the ~250 modules a
# discovery loads costs 15-35 ms on a 2-core host, as much as discovery itself.
QUICK_EXIT = frozenset({"topo"})


def run() -> NoReturn:
    """The program (``memtopo``, ``python -m memtopo.cli``): ``main``, then the process's exit."""
    args = build_parser().parse_args()
    rc = _dispatch(args)
    if args.command in QUICK_EXIT:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream: the ordinary exit reports it as it always did
        else:
            os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    run()
