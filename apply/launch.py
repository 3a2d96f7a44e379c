"""``memtopo exec``: start a command with a CPU set and a memory policy, like numactl.

The policy is set on this process with set_mempolicy(2) and the CPUs with sched_setaffinity(2),
both verified, then the command replaces this process through execvp (no shell): both survive
exec and are inherited by the command's threads and children. Policies, as the vendor-neutral
memory topology design names them: ``local`` | ``interleave=NODES`` (or ``all``) | ``preferred=NODE`` | ``bind=NODES``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from memtopo.apply.errors import CommandNotStartedError, KernelCallError, LaunchError
from memtopo.apply.host import MPOL_BIND, MPOL_INTERLEAVE, MPOL_LOCAL, MPOL_PREFERRED, HostFiles, Ids, Kernel
from memtopo.cpulist import CpuListError, format_cpulist, parse_cpulist
from memtopo.hostfs import HostReadError

_MODES = {"local": MPOL_LOCAL, "interleave": MPOL_INTERLEAVE, "preferred": MPOL_PREFERRED, "bind": MPOL_BIND}
_NAMES = {v: k for k, v in _MODES.items()}


@dataclass(frozen=True)
class MemPolicySpec:
    mode: int
    nodes: Ids
    # `all` for interleave: resolved to the nodes with memory at launch.
    all_nodes: bool = False

    def describe(self) -> str:
        name = _NAMES.get(self.mode, str(self.mode))
        if self.mode == MPOL_LOCAL:
            return name
        return f"{name}={'all' if self.all_nodes else format_cpulist(self.nodes)}"


def parse_policy(text: str) -> MemPolicySpec:
    """``local``, ``interleave=0-1``, ``interleave=all``, ``preferred=1``, ``bind=0,2``."""
    name, sep, arg = text.strip().partition("=")
    mode = _MODES.get(name.strip())
    if mode is None:
        raise LaunchError(f"memory policy {text!r}: expected local, interleave=NODES, preferred=NODE or bind=NODES")
    if mode == MPOL_LOCAL:
        if sep:
            raise LaunchError("memory policy local takes no nodes")
        return MemPolicySpec(mode, ())
    if not arg.strip():
        raise LaunchError(f"memory policy {name} needs nodes ({name}=NODES)")
    if mode == MPOL_INTERLEAVE and arg.strip() == "all":
        return MemPolicySpec(mode, (), all_nodes=True)
    try:
        nodes = parse_cpulist(arg)
    except CpuListError as exc:
        raise LaunchError(f"memory policy {text!r}: {exc}") from exc
    if not nodes:
        raise LaunchError(f"memory policy {name} needs at least one node")
    if mode == MPOL_PREFERRED and len(nodes) != 1:
        raise LaunchError("memory policy preferred takes exactly one node")
    return MemPolicySpec(mode, nodes)


def _host_ids(files: HostFiles, rel: str) -> set[int] | None:
    try:
        return set(files.read_ids(rel))
    except HostReadError:
        return None


def resolve(policy: MemPolicySpec | None, cpus: Ids | None, files: HostFiles) -> MemPolicySpec | None:
    """Check the request against the host (CPUs online, nodes online with memory); ``all`` → nodes."""
    online_cpus = _host_ids(files, "sys/devices/system/cpu/online")
    if cpus is not None:
        if not cpus:
            raise LaunchError("--cpus: empty CPU set")
        if online_cpus is not None and not set(cpus) <= online_cpus:
            raise LaunchError(f"--cpus: CPU {format_cpulist(set(cpus) - online_cpus)} not online "
                              f"(online: {format_cpulist(online_cpus)})")
    if policy is None:
        return None
    memory = (_host_ids(files, "sys/devices/system/node/has_memory")
              or _host_ids(files, "sys/devices/system/node/online"))
    if policy.all_nodes:
        if not memory:
            raise LaunchError("interleave=all: cannot read the nodes with memory")
        return MemPolicySpec(policy.mode, tuple(sorted(memory)), all_nodes=True)
    if memory is not None and not set(policy.nodes) <= memory:
        raise LaunchError(f"memory policy {policy.describe()}: node {format_cpulist(set(policy.nodes) - memory)} "
                          f"has no memory or is offline (nodes with memory: {format_cpulist(memory)})")
    return policy


def prepare(kernel: Kernel, policy: MemPolicySpec | None, cpus: Ids | None) -> None:
    """Set and verify the policy and the CPU set on the calling thread (the one that will exec)."""
    if policy is not None:
        try:
            kernel.set_mempolicy(policy.mode, policy.nodes)
            mode, nodes = kernel.get_mempolicy()
        except KernelCallError as exc:
            raise LaunchError(f"memory policy {policy.describe()}: {exc}") from exc
        # Kernels before MPOL_LOCAL existed report local as preferred with no nodes.
        local_ok = policy.mode == MPOL_LOCAL and mode == MPOL_PREFERRED and not nodes
        if not local_ok and (mode != policy.mode or (policy.mode != MPOL_LOCAL and tuple(nodes) != policy.nodes)):
            raise LaunchError(f"memory policy {policy.describe()} did not hold: the kernel reports mode {mode} "
                              f"nodes {format_cpulist(nodes) or 'none'}")
    if cpus is not None:
        errors = kernel.set_affinities([0], set(cpus))
        if errors:
            raise LaunchError(f"--cpus {format_cpulist(cpus)}: sched_setaffinity: {os.strerror(errors[0])}")
        got = kernel.get_affinities([0]).masks[0]
        if got is None or set(got) != set(cpus):
            raise LaunchError(f"--cpus {format_cpulist(cpus)}: the kernel holds "
                              f"{format_cpulist(got or ())} (the cpuset does not allow all of them)")


def launch(argv: Sequence[str], policy: MemPolicySpec | None, cpus: Ids | None, kernel: Kernel, files: HostFiles,
           execvp: Callable[[str, list[str]], object] = os.execvp) -> NoReturn:
    if not argv:
        raise LaunchError("no command to run (memtopo exec [options] -- CMD ...)")
    policy = resolve(policy, cpus, files)
    prepare(kernel, policy, cpus)
    try:
        execvp(argv[0], list(argv))
    except OSError as exc:
        raise CommandNotStartedError(f"{argv[0]}: {exc.strerror or exc}", exc.errno or 0) from exc
    # Only a test's execvp returns.
    raise LaunchError(f"{argv[0]}: exec returned")
