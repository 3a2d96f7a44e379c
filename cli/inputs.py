"""Where a command's topology comes from: this host, a captured root (a directory or a tarball) or an
hwloc XML export. ``topo`` and ``plan`` open their input here, so neither command imports the other."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memtopo.discovery.source import ProbeContext


@contextlib.contextmanager
def context_for(root: str | None, hwloc_xml: str | None) -> Iterator[ProbeContext]:
    """The probe context of ``hwloc_xml``, else of ``root``, else of this host; a root that is a
    tarball is extracted for the with-block and removed after it. CaptureError for an input that
    cannot be opened."""
    from pathlib import Path

    from memtopo.discovery.capture import CaptureError, open_root
    from memtopo.discovery.source import ProbeContext

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
