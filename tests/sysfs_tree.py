"""Build synthetic /sys and /proc trees for tests: ``{"rel/path": "content" | Link("target")}``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Link:
    """A symlink; ``target`` is written as given (relative targets, as sysfs uses)."""

    target: str


@dataclass(frozen=True)
class Dir:
    """An empty directory."""


def write_tree(root: Path, spec: Mapping[str, str | Link | Dir]) -> Path:
    for rel, value in spec.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(value, Link):
            os.symlink(value.target, path)
        elif isinstance(value, Dir):
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.write_text(value if value.endswith("\n") or value == "" else value + "\n")
    return root
