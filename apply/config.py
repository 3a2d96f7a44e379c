"""What the operator decides for the apply engine: which cgroups it may touch, which processes it
may bind, what it does about irqbalance, and the size limits every plan must respect."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from memtopo.apply.defaults import DEFAULT_STATE_DIR, IRQBALANCE_POLICIES, IrqbalancePolicy

__all__ = ["DEFAULT_STATE_DIR", "IRQBALANCE_POLICIES", "ApplyConfig", "IrqbalancePolicy"]


@dataclass(frozen=True)
class ApplyConfig:
    # cgroup paths (relative to the cpuset hierarchy root) the engine may create, write and move
    # processes into. The hierarchy root itself is never writable through a plan.
    cgroup_prefixes: tuple[str, ...] = ("memtopo",)
    # Where a running process's memory policy gets its own cpuset when its current one is the root
    # or outside the prefixes (cgroup v1 only: on v2 moving it would move every controller).
    managed_cgroup: str = "memtopo"
    allow_init: bool = False
    allow_kernel_threads: bool = False
    allow_self: bool = False
    # leave: report it; ban: exclude the plan's IRQs through its socket (the runtime --banirq);
    # stop: `systemctl stop` its unit, started again on rollback.
    irqbalance: IrqbalancePolicy = "ban"
    # Detecting irqbalance reads every process's name; the answer is reused this long across plans.
    irqbalance_cache_s: float = 10.0
    # 0 = detect from the mount table; 1 or 2 forces a hierarchy.
    cgroup_version: int = 0
    max_actions: int = 1024
    # Above any real machine's CPU or node count (the kernel's NR_CPUS tops out at 8192).
    max_ids: int = 8192
    max_tids: int = 1 << 16
    max_attach_pids: int = 1024
    max_pattern_len: int = 256
    # The agent's own pid, refused as a target unless allow_self; injectable for tests.
    self_pid: int = field(default_factory=os.getpid)
    # Other memtopo processes refused the same way: the running agent, as `memtopo apply` finds it
    # through the lock on its socket (apply.host.flock_holders).
    protected_pids: tuple[int, ...] = ()
    # How long apply/rollback wait for another process holding the state directory.
    lock_timeout_s: float = 30.0
