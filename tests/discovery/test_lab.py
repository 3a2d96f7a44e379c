"""``memtopo topo`` inside the numa-vm lab (a real 6.1 kernel with several NUMA nodes, HMAT and CXL)
agrees with discovery on the lab's own capture of the same profile.

Boots two guests in parallel (about 20 s here). Runs when MEMTOPO_LAB=1 (tools/test.sh sets it after
`numa-vm setup` succeeded); skipped otherwise, e.g. when pytest is run by hand without the lab.
"""

from __future__ import annotations

import subprocess
from typing import Any

from google.protobuf import json_format

from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import REPO, lab_root
from tests.lab import NUMA_VM, lab_marks

PROFILES = ("dual-socket-cxl", "dual-socket-cxl-tiered")

pytestmark = lab_marks


def shape(t: pb.MemoryTopology) -> dict[str, Any]:
    """What must agree between a live guest and its capture (sizes vary by kernel reservations)."""
    return {
        "domains": [(list(d.numa_nodes), d.type, list(d.attached_cpus), d.kernel_tier, d.subtype,
                     list(d.distances), d.local_performance.read_bandwidth_mbps,
                     d.local_performance.read_latency_ns, d.movable_only) for d in t.domains],
        "nodes": [(n.id, n.state, list(n.cpus), n.has_memory, list(n.initiator_nodes)) for n in t.numa_nodes],
        "links": [(i.domain_a, i.domain_b, i.link_type, i.distance_a_to_b, i.a_to_b.source,
                   i.a_to_b.read_latency_ns) for i in t.interconnects],
        "tiers": [(m.id, m.source, list(m.numa_nodes)) for m in t.memory_tiers],
        "pci": sorted((p.bdf, p.numa_node, p.kind, p.vendor_id, p.device_id) for p in t.pci_devices
                      if not p.bdf.startswith("0000:00:")),  # bus 0 holds the per-run 9p shares
        "cxl": [(c.name, c.host, c.numa_node, c.pmem_size_bytes) for c in t.cxl_devices],
        "regions": [(r.name, r.numa_node, r.size_bytes, list(r.memdevs)) for r in t.cxl_regions],
        "cpus": list(t.cpus.online),
    }


def test_memtopo_in_the_guest_agrees_with_the_capture() -> None:
    procs = {
        profile: subprocess.Popen(
            [str(NUMA_VM), "run", "--profile", profile, "--timeout", "240", "--",
             str(REPO / ".venv/bin/memtopo"), "topo", "--format", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        for profile in PROFILES
    }
    for profile, proc in procs.items():
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, f"{profile}: exit {proc.returncode}\n{err[-2000:]}"
        live = json_format.Parse(out, pb.MemoryTopology())
        captured = discover(ProbeContext.at_root(lab_root(profile)))
        assert shape(live) == shape(captured), profile
        for d_live, d_cap in zip(live.domains, captured.domains, strict=True):
            assert abs(d_live.capacity_bytes - d_cap.capacity_bytes) < 64 << 20
        assert all(s.state != pb.SOURCE_STATE_UNSPECIFIED for s in live.sources)
