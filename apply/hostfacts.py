"""The few host facts validation needs, read straight from the kernel's files: a command-line
apply of a plan without a fingerprint would otherwise run a whole discovery (hwloc, PCI, every
accelerator probe) for a list of online CPUs and memory nodes.

The facts are those discovery reports for the same files (apply/checks.py ``TopologyFacts``):
online CPUs from ``cpu/online``, nodes from ``node/{possible,online,has_memory}`` and their
``nodeN`` directories, what this process may use from ``/proc/self/status``, the node name from
the host name. Unified memory domains need the accelerator probes, so a plan with a memory
policy action (the only check that reads them) gets no light facts, and neither does a plan with
a fingerprint to compare; nor a host where one of these files is missing or does not parse.
``None`` says so: the caller falls back to a full discovery, whose answers and errors stay the
reference.
"""

from __future__ import annotations

from memtopo.apply.checks import TopologyFacts
from memtopo.cpulist import CpuListError, parse_cpulist
from memtopo.hostfs import HostFS, HostReadError
from memtopo.hostinfo import HOSTNAME_FILES, STATUS, allowed_lists, first_value
from memtopo.v1 import plan_pb2 as planpb

CPU_ONLINE = "sys/devices/system/cpu/online"
NODE_DIR = "sys/devices/system/node"


def needs_discovery(plan: planpb.BindingPlan) -> bool:
    """A fingerprint to compare, or a memory policy (Unified domains come from the accelerator
    probes): only a full discovery answers these."""
    return bool(plan.topology_fingerprint) or any(a.WhichOneof("action") == "memory_policy" for a in plan.actions)


def light_facts(plan: planpb.BindingPlan, fs: HostFS) -> TopologyFacts | None:
    """The facts for ``plan`` from a handful of files, or None when it needs a full discovery."""
    if needs_discovery(plan):
        return None
    try:
        return read_facts(fs)
    except (HostReadError, CpuListError):
        return None


def read_facts(fs: HostFS) -> TopologyFacts | None:
    """HostReadError/CpuListError on an unreadable file; None where the files do not say enough
    (no node directory, a mask missing), as discovery would then guess from hwloc."""
    online = fs.read_cpulist(CPU_ONLINE)
    if not online or not fs.is_dir(NODE_DIR):
        return None
    online_mask = frozenset(parse_cpulist(fs.read_attr(f"{NODE_DIR}/online")))
    has_memory = frozenset(parse_cpulist(fs.read_attr(f"{NODE_DIR}/has_memory")))
    possible = frozenset(parse_cpulist(fs.read_attr(f"{NODE_DIR}/possible"))) if fs.exists(f"{NODE_DIR}/possible") \
        else frozenset()
    listed = frozenset(int(e[4:]) for e in fs.listdir(NODE_DIR) if e.startswith("node") and e[4:].isdigit())
    if not online_mask <= listed:
        return None  # an online node without its directory: discovery asks hwloc about it
    nodes = possible | online_mask | listed
    online_nodes = online_mask
    memory = has_memory & online_nodes
    cpus_allowed, mems_allowed = _status(fs)
    online_cpus = frozenset(online)
    allowed = (cpus_allowed & online_cpus) if cpus_allowed is not None else online_cpus
    allowed_mems = (mems_allowed & memory) if mems_allowed is not None else memory
    return TopologyFacts(online_cpus, allowed or online_cpus, nodes, online_nodes, memory, allowed_mems or memory,
                         frozenset(), "", first_value(fs, HOSTNAME_FILES)[0])


def _status(fs: HostFS) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    found = {key: frozenset(parse_cpulist(value)) for key, value in allowed_lists(fs.read_text(STATUS)).items()}
    return found.get("Cpus_allowed_list"), found.get("Mems_allowed_list")
