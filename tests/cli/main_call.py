"""``memtopo``'s main() called in this process, the way the entry point calls it."""

from __future__ import annotations

import io
from collections.abc import Sequence

import pytest

import memtopo.cli.main


# ---- through `memtopo` itself --------------------------------------------------------------------------
def memtopo_main(monkeypatch: pytest.MonkeyPatch, argv: Sequence[str], stdin: str = "") -> tuple[int, str]:
    """``memtopo.cli.main.main(argv)`` with ``stdin``; (exit status, stdout text)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.stdin", io.StringIO(stdin))
        mp.setattr("sys.stdout", out)
        rc = memtopo.cli.main.main(list(argv))
    return rc, out.getvalue()
