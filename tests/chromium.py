"""Headless Chromium (Debian's ``chromium``, driven by playwright) for the tests that load memtopo's
pages in a real browser. Where Chromium or playwright is missing the test skips, saying why;
``tools/setup.sh`` installs both."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    return os.environ.get("MEMTOPO_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.contextmanager
def chromium(*flags: str) -> Iterator[Any]:
    """A launched browser (playwright's sync Browser) with ``flags`` beside the usual ones."""
    executable = chromium_path()
    if executable is None:
        pytest.skip("Chromium is not installed (tools/setup.sh installs Debian's chromium when run as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=[*CHROMIUM_FLAGS, *flags])
        try:
            yield b
        finally:
            b.close()
