"""The content fingerprint: equal for equal topologies, whatever the time, generation or list order."""

from __future__ import annotations

import hashlib

from memtopo.v1 import topology_pb2 as pb


def fingerprint(topo: pb.MemoryTopology) -> str:
    """Hex SHA-256 of the topology with volatile fields cleared.

    Lists are already in canonical order (the assembler sorts them), and deterministic
    serialization fixes map order, so the bytes depend on content only.
    """
    content = pb.MemoryTopology()
    content.CopyFrom(topo)
    for name in ("generation", "fingerprint", "discovery_time", "source_root"):
        content.ClearField(name)
    for domain in content.domains:
        domain.ClearField("free_bytes")
    for src in content.sources:
        src.ClearField("duration_seconds")
    return hashlib.sha256(content.SerializeToString(deterministic=True)).hexdigest()
