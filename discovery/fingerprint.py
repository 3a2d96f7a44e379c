"""The content fingerprint: equal for equal topologies, whatever the time, generation or list order."""

from __future__ import annotations

import hashlib

from memtopo.v1 import topology_pb2 as pb


def fingerprint(topo: pb.MemoryTopology) -> str:
    """Hex SHA-256 of the topology with volatile fields cleared.

    Volatile fields: generation, the fingerprint itself, discovery time, source root, free bytes and
    probe durations. Lists are already in canonical order (the assembler sorts them), and deterministic
    serialization fixes map order, so the bytes depend on content only.
    """
    # Clear in place and restore rather than copy: the message can hold thousands of links.
    saved_top = (topo.generation, topo.fingerprint, topo.source_root)
    saved_time = pb.MemoryTopology(discovery_time=topo.discovery_time)
    saved_free = [d.free_bytes for d in topo.domains]
    saved_durations = [s.duration_seconds for s in topo.sources]
    try:
        topo.generation, topo.fingerprint, topo.source_root = 0, "", ""
        topo.ClearField("discovery_time")
        for domain in topo.domains:
            domain.free_bytes = 0
        for src in topo.sources:
            src.duration_seconds = 0.0
        return hashlib.sha256(topo.SerializeToString(deterministic=True)).hexdigest()
    finally:
        topo.generation, topo.fingerprint, topo.source_root = saved_top
        if saved_time.HasField("discovery_time"):
            topo.discovery_time.CopyFrom(saved_time.discovery_time)
        for domain, free in zip(topo.domains, saved_free, strict=True):
            domain.free_bytes = free
        for src, dur in zip(topo.sources, saved_durations, strict=True):
            src.duration_seconds = dur
