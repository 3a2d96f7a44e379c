"""A command's discovery of a captured root, an hwloc export or this host, in a child process
(discovery.isolated), with its two failures told apart: an input that cannot be read (exit 2, as
for a wrong option) and a discovery that gave no topology (exit 1)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from memtopo.cli.output import EXIT_FAILURE, EXIT_USAGE

if TYPE_CHECKING:
    from memtopo.discovery.source import ProbeContext
    from memtopo.v1 import topology_pb2 as pb


class DiscoveryError(Exception):
    """Why no topology came back, and the command's exit status for it."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextmanager
def discovered(root: str | None, hwloc_xml: str | None = None) -> Iterator[tuple[ProbeContext, pb.MemoryTopology]]:
    """The context of ``root`` (None: this host) or ``hwloc_xml``, and its topology, while the context
    is open (a captured tarball stays extracted). A CaptureError raised in the block is the input's
    failure too."""
    from memtopo.discovery.capture import CaptureError, context_for
    from memtopo.discovery.isolated import IsolatedDiscoveryError, discover_apart

    try:
        with context_for(root, hwloc_xml) as ctx:
            yield ctx, discover_apart(ctx)
    except CaptureError as exc:
        raise DiscoveryError(str(exc), EXIT_USAGE) from None
    except IsolatedDiscoveryError as exc:
        raise DiscoveryError(str(exc), EXIT_FAILURE) from None
