"""What every command prints: proto3 JSON, aligned tables, the JSON error document and the one-line
message a user can act on."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

    from google.protobuf.message import Message

EXIT_FAILURE = 1
EXIT_USAGE = 2


def message_json(msg: Message, *, defaults: bool = False, indent: int | None = 2) -> str:
    """A message as proto3 JSON (snake_case names); the encoding itself lives beside the schema."""
    from memtopo.protojson import to_json

    return to_json(msg, defaults=defaults, indent=indent)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = indent + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*headers).rstrip()] + [fmt.format(*r).rstrip() for r in rows]


def error_document(code: str, message: str, **extra: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message, **extra}}


def fail(message: object) -> None:
    """The one line a user reads when a command cannot do what was asked (escaped: it may quote what a
    server or a file said)."""
    from memtopo.text import escaped

    print(f"memtopo: {escaped(str(message))}", file=sys.stderr)


def write_text(text: str, flush: bool = False) -> None:
    """A view on stdout, every character a terminal would act on (a name with U+202E or U+0085 from a
    node, an agent or a tool) escaped; newlines and the tabs between columns stay."""
    from memtopo.text import escaped

    sys.stdout.write(escaped(text, keep="\n\t"))
    if flush:
        sys.stdout.flush()


def write_document(doc: Mapping[str, Any]) -> None:
    import json

    # Indented for a person at a terminal, one line for a program: indenting takes json's pure-Python
    # encoder, 4-5 times slower on a 10,000-node ranking. ASCII escapes keep the output valid
    # whatever the stream's encoding.
    indent = 2 if sys.stdout.isatty() else None
    sys.stdout.write(json.dumps(doc, indent=indent) + "\n")


def show_help(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """The handler of a command given without its sub-command (``memtopo``, ``memtopo plan``): that
    command's help on stdout, and the usage exit status, since nothing was done."""
    def handler(_: argparse.Namespace) -> int:
        parser.print_help(sys.stdout)
        return EXIT_USAGE
    return handler
