"""``memtopo completion bash|zsh`` and ``memtopo man``: shell completion and the manual page, both
made from the parser itself, so they know every command and option the installed memtopo has.

Completion is shtab's (it writes bash's and zsh's completion functions from an argparse parser). The
manual page is each command's own ``--help``, in the order of the command tree, as roff that ``man``
formats: what the page says is what ``--help`` says.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Final

SHELLS: Final = ("bash", "zsh")
# --help text is laid out for the terminal's width; the page is laid out once, at man's usual 80.
PAGE_COLUMNS: Final = 80


def commands(parser: argparse.ArgumentParser) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command under ``parser`` (itself first) with its words after the program name:
    (), ("topo",), ("plan", "cpu-binding") …, depth first in the order of their --help."""
    yield (), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for words, found in commands(sub):
                    yield (name, *words), found


def add_commands(subparsers: Any, root: argparse.ArgumentParser) -> None:
    """Register ``completion`` and ``man``; both describe ``root``, the whole command line."""
    comp = subparsers.add_parser(
        "completion", help="print the shell completion script (bash or zsh)",
        description="Print a completion script for every memtopo command and option.",
        epilog="bash: eval \"$(memtopo completion bash)\" in ~/.bashrc, or\n"
               "      memtopo completion bash > /etc/bash_completion.d/memtopo\n"
               "zsh:  memtopo completion zsh > \"${fpath[1]}/_memtopo\" (then compinit)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    comp.add_argument("shell", choices=SHELLS)
    comp.set_defaults(func=_handler(cmd_completion, root))
    man = subparsers.add_parser(
        "man", help="print the manual page (roff), e.g. memtopo man | man -l -",
        description="Print memtopo(1): every command's --help, as a manual page.",
        epilog="memtopo man | man -l -                                   # read it now\n"
               "memtopo man > /usr/local/share/man/man1/memtopo.1        # then: man memtopo",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    man.set_defaults(func=_handler(cmd_man, root))


def _handler(run: Callable[[argparse.ArgumentParser, argparse.Namespace], int],
             root: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    return lambda args: run(root, args)


def cmd_completion(root: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import shtab

    sys.stdout.write(shtab.complete(root, shell=args.shell))
    return 0


def cmd_man(root: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    sys.stdout.write(manpage(root))
    return 0


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def roff_text(text: str) -> str:
    """Text that roff prints as written: backslashes escaped, minus signs as minus (so an option
    copied from the page still works), and no line that roff would read as a request."""
    out = []
    for line in text.replace("\\", "\\e").replace("-", "\\-").splitlines():
        out.append("\\&" + line if line.startswith((".", "'")) else line)
    return "\n".join(out)


def manpage(root: argparse.ArgumentParser) -> str:
    """memtopo(1) in roff. The same parser gives the same bytes (no date: the version says which)."""
    from memtopo import __version__

    prog = root.prog
    with _columns(PAGE_COLUMNS):
        usage = root.format_usage().removeprefix("usage: ")
        parts = [
            f'.TH {prog.upper()} 1 "" "{prog} {__version__}" "User Commands"',
            ".SH NAME",
            f"{prog} \\- {roff_text(root.description or '')}",
            ".SH SYNOPSIS", ".nf", roff_text(usage), ".fi",
            ".SH DESCRIPTION",
            f"Each command below is shown as its \\fB\\-\\-help\\fR prints it. {roff_text(root.epilog or '')}",
        ]
        for words, parser in commands(root):
            if not words:
                continue
            parts += [f'.SH "{roff_text(" ".join((prog, *words)).upper())}"', ".nf",
                      roff_text(parser.format_help().rstrip()), ".fi"]
    return "\n".join(parts) + "\n"
