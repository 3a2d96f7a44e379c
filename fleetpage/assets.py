"""The fleet page's static files (``assets/``: two HTML shells, a stylesheet, a script, an icon), read
once from the package on first use. Self-contained (no asset from anywhere else) and fixed: nothing
from a node is ever spliced into them, except the escaped name and API path ``page.node_html`` puts
into the node shell's ``{name}`` and ``{api}``.

The script builds every element with ``createElement`` and ``textContent`` (via ``el``): no
``innerHTML``, no string-built markup, no ``eval``; the Content-Security-Policy the server sends
forbids inline script, so even a successful injection would not run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from typing import Final

# Polled by the page: a killed agent's row must turn "disconnected" within a few seconds.
POLL_MS: Final = 1000

_TYPES: Final = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".svg": "image/svg+xml"}
# Served under /static/ by name; the HTML shells are templates the routes fill in.
STATIC_FILES: Final = ("fleet.css", "fleet.js", "favicon.svg")


@dataclass(frozen=True)
class Assets:
    fleet_html: str
    node_html: str  # str.format template: {name} and {api}, both escaped by page.node_html
    # /static/NAME → (content type, bytes)
    static: dict[str, tuple[str, bytes]]

    @property
    def js(self) -> str:
        return self.static["/static/fleet.js"][1].decode()


def _read(name: str) -> str:
    return (resources.files(__package__ or "memtopo.fleetpage") / "assets" / name).read_text(encoding="utf-8")


@functools.cache
def assets() -> Assets:
    """The files, read once per process."""
    static: dict[str, tuple[str, bytes]] = {}
    for name in STATIC_FILES:
        text = _read(name)
        if name == "fleet.js":
            text = text.replace("__POLL_MS__", str(POLL_MS))
        static["/static/" + name] = (_TYPES[name[name.rindex("."):]], text.encode())
    return Assets(_read("fleet.html"), _read("node.html"), static)
