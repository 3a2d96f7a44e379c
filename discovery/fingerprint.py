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
    # Clear in place and restore rather than copy: the message can hold thousands of links. Each
    # repeated field is walked once (every walk makes a wrapper per element) and only what is set
    # is saved: this runs on every discovery.
    saved_top = (topo.generation, topo.fingerprint, topo.source_root)
    saved_time = pb.MemoryTopology(discovery_time=topo.discovery_time) if topo.HasField("discovery_time") else None
    domains = [d for d in topo.domains if d.free_bytes]
    saved_free = [d.free_bytes for d in domains]
    sources = [s for s in topo.sources if s.duration_seconds]
    saved_durations = [s.duration_seconds for s in sources]
    try:
        topo.generation, topo.fingerprint, topo.source_root = 0, "", ""
        if saved_time is not None:
            topo.ClearField("discovery_time")
        for domain in domains:
            domain.free_bytes = 0
        for src in sources:
            src.duration_seconds = 0.0
        return hashlib.sha256(topo.SerializeToString(deterministic=True)).hexdigest()
    finally:
        topo.generation, topo.fingerprint, topo.source_root = saved_top
        if saved_time is not None:
            topo.discovery_time.CopyFrom(saved_time.discovery_time)
        for domain, free in zip(domains, saved_free, strict=True):
            domain.free_bytes = free
        for src, dur in zip(sources, saved_durations, strict=True):
            src.duration_seconds = dur
