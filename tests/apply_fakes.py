"""Fake hosts for the apply engine: a /proc + cgroup + /proc/irq tree in the kernel's formats, a
kernel that records its calls, and a HostFiles that behaves like kernfs on writes.

The standard machine (``FakeMachine``): CPUs 0-7 online (8-9 present, offline); NUMA nodes 0
(CPUs 0-3) and 1 (CPUs 4-7) with memory, 2 online without memory, 3 possible but offline, 4 a
CPU-less node with memory in a Unified domain (GH200-style). cgroup v1 cpuset at
/sys/fs/cgroup/cpuset (or v2 at /sys/fs/cgroup). Processes: 1 systemd, 2 kthreadd (kernel thread),
100 "worker" (threads 100-110: worker, acl_thread, release_thread, …) in cpuset /memtopo/job,
200 "other" in the root cpuset, 4242 the agent itself. IRQs 24 (ACPI:Ged), 36 (nvme0q1, managed:
EPERM), 40-42 (mlx5_comp*, msi of 0000:3b:00.0), 50/51 (sq_send_trigger_irq / cq_update_irq,
msi of 0000:c1:00.0); 0000:00:1f.0 has no MSI (INTx 10).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

from memtopo.apply.config import ApplyConfig
from memtopo.apply.engine import Engine, Hook
from memtopo.apply.host import Affinities, Host, HostFiles, Ids
from memtopo.cpulist import format_cpulist, parse_cpulist
from memtopo.hostfs import HostFS
from memtopo.runner import ToolResult
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

ONLINE_CPUS = tuple(range(8))
SELF_PID = 4242
V1_MOUNT = "sys/fs/cgroup/cpuset"
V2_MOUNT = "sys/fs/cgroup"


# ---- kernel ----------------------------------------------------------------------------------------
@dataclass
class FailRule:
    method: str
    nth: int
    code: int
    tid: int | None = None


class FakeKernel:
    """Thread masks in memory; every call recorded; ``fail_on`` makes the Nth call of a method fail.

    A thread's mask is always intersected with its cpuset (``allowed``), as the kernel does.
    """

    MUTATING = ("set_affinities", "migrate_pages", "set_mempolicy")

    def __init__(self, root: Path | None = None, online: Sequence[int] = ONLINE_CPUS) -> None:
        self.root = root
        self.online = frozenset(online)
        self.masks: dict[int, set[int]] = {}
        self.allowed: dict[int, set[int]] = {}
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.counts: dict[str, int] = {}
        self.rules: list[FailRule] = []
        self.not_moved = 0
        self.mempolicy: tuple[int, Ids] = (0, ())

    def add_threads(self, tids: Iterable[int], mask: Iterable[int] = ONLINE_CPUS) -> None:
        for t in tids:
            self.masks[t] = set(mask)

    def fail_on(self, method: str, nth: int = 1, code: int = errno.EINVAL, tid: int | None = None) -> None:
        self.rules.append(FailRule(method, nth, code, tid))

    def mutations(self) -> list[tuple[str, tuple[object, ...]]]:
        return [c for c in self.calls if c[0] in self.MUTATING]

    def _count(self, method: str) -> int:
        self.counts[method] = self.counts.get(method, 0) + 1
        return self.counts[method]

    def _rule(self, method: str, n: int, tid: int | None = None) -> int | None:
        for r in self.rules:
            if r.method == method and r.nth == n and (r.tid is None or r.tid == tid):
                return r.code
        return None

    def get_affinities(self, tids: Sequence[int]) -> Affinities:
        self.calls.append(("get_affinities", (tuple(tids),)))
        n = self._count("get_affinities")
        code = self._rule("get_affinities", n)
        masks: list[set[int] | None] = []
        errors: dict[int, int] = {}
        for t in tids:
            if code is not None or t not in self.masks:
                masks.append(None)
                errors[t] = code if code is not None else errno.ESRCH
            else:
                masks.append(set(self.masks[t]))
        return Affinities(masks, errors)

    def set_affinities(self, tids: Sequence[int], cpus: AbstractSet[int]) -> dict[int, int]:
        self.calls.append(("set_affinities", (tuple(tids), frozenset(cpus))))
        n = self._count("set_affinities")
        errors: dict[int, int] = {}
        for t in tids:
            code = self._rule("set_affinities", n, t)
            if code is not None:
                errors[t] = code
                continue
            if t not in self.masks:
                errors[t] = errno.ESRCH
                continue
            new = set(cpus) & self.online & self.allowed.get(t, set(self.online))
            if not new:
                errors[t] = errno.EINVAL
                continue
            self.masks[t] = new
        return errors

    def migrate_pages(self, pid: int, old_nodes: Iterable[int], new_nodes: Iterable[int]) -> int:
        old, new = tuple(old_nodes), tuple(new_nodes)
        self.calls.append(("migrate_pages", (pid, old, new)))
        n = self._count("migrate_pages")
        code = self._rule("migrate_pages", n)
        if code is not None:
            from memtopo.apply.errors import KernelCallError
            raise KernelCallError("migrate_pages", code)
        if self.root is not None:
            path = self.root / f"proc/{pid}/numa_maps"
            if path.exists():
                path.write_text(_migrate_numa_maps(path.read_text(), old, new))
        return self.not_moved

    def set_mempolicy(self, mode: int, nodes: Iterable[int]) -> None:
        nodes_t = tuple(nodes)
        self.calls.append(("set_mempolicy", (mode, nodes_t)))
        n = self._count("set_mempolicy")
        code = self._rule("set_mempolicy", n)
        if code is not None:
            from memtopo.apply.errors import KernelCallError
            raise KernelCallError("set_mempolicy", code)
        self.mempolicy = (mode, nodes_t)

    def get_mempolicy(self) -> tuple[int, Ids]:
        self.calls.append(("get_mempolicy", ()))
        return self.mempolicy


def _migrate_numa_maps(text: str, old: Ids, new: Ids) -> str:
    """What migrate_pages does to numa_maps: pages on old[i] move to new[i] (or new[0] when the
    sets differ in size), preserving relative placement like node_remap."""
    def target(node: int) -> int:
        if node not in old:
            return node
        return new[old.index(node)] if len(old) == len(new) else new[0]

    out = []
    for line in text.split("\n"):
        toks = line.split(" ")
        pages: dict[int, int] = {}
        rest = []
        for tok in toks:
            if tok.startswith("N") and "=" in tok and tok[1:].split("=")[0].isdigit():
                node_s, count = tok[1:].split("=")
                d = target(int(node_s))
                pages[d] = pages.get(d, 0) + int(count)
            else:
                rest.append(tok)
        if pages:
            kp = [t for t in rest if t.startswith("kernelpagesize_kB=")]
            rest = [t for t in rest if not t.startswith("kernelpagesize_kB=")]
            rest += [f"N{nd}={c}" for nd, c in sorted(pages.items())] + kp
        out.append(" ".join(rest))
    return "\n".join(out)


# ---- files -----------------------------------------------------------------------------------------
class FakeFiles(HostFiles):
    """kernfs-like writes on a fake tree: cgroup.procs moves a process (and rewrites its
    /proc/PID/cgroup), a new cgroup directory gets its control files, rmdir of a populated cgroup
    is EBUSY, managed IRQs refuse affinity writes with EPERM, an offline-only mask is EINVAL."""

    def __init__(self, root: Path, cgroup_version: int = 1, managed_irqs: Iterable[int] = (36,),
                 online: Sequence[int] = ONLINE_CPUS) -> None:
        super().__init__(HostFS.at(root))
        self.root = root.resolve()
        self.cgroup_version = cgroup_version
        self.mount = V1_MOUNT if cgroup_version == 1 else V2_MOUNT
        self.managed = set(managed_irqs)
        self.online = set(online)
        self.fail_rules: list[tuple[str, int, int]] = []
        # v2: a partition the kernel cannot grant reads back as "<value> invalid (<reason>)".
        self.invalid_partition: str | None = None
        self.write_counts: dict[str, int] = {}
        self.writes: list[tuple[str, str]] = []

    def fail_write(self, pattern: str, code: int = errno.EINVAL, nth: int = 1) -> None:
        """The nth write to a root-relative path matching the glob fails with ``code``."""
        self.fail_rules.append((pattern, nth, code))

    def _rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def _write(self, path: str, data: bytes) -> None:
        rel = self._rel(path)
        text = data.decode()
        for pattern in {p for p, _, _ in self.fail_rules if fnmatch.fnmatch(rel, p)}:
            self.write_counts[pattern] = self.write_counts.get(pattern, 0) + 1
        for pattern, nth, code in self.fail_rules:
            if fnmatch.fnmatch(rel, pattern) and self.write_counts[pattern] == nth:
                raise OSError(code, os.strerror(code))
        if not os.path.exists(path):
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
        self.writes.append((rel, text))
        parts = rel.split("/")
        if rel.startswith("proc/irq/") and parts[-1] == "smp_affinity_list":
            irq = int(parts[2])
            if irq in self.managed:
                raise OSError(errno.EPERM, os.strerror(errno.EPERM))
            cpus = set(parse_cpulist(text))
            if not cpus & self.online:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            Path(path).write_text(format_cpulist(cpus) + "\n")
            Path(path).with_name("effective_affinity_list").write_text(f"{min(cpus & self.online)}\n")
            return
        if parts[-1] == "cgroup.procs":
            self._move(int(text.strip()), Path(path).parent)
            return
        if parts[-1] == "cgroup.subtree_control":
            now = set(Path(path).read_text().split())
            for tok in text.split():
                (now.add if tok.startswith("+") else now.discard)(tok[1:])
            Path(path).write_text(" ".join(sorted(now)) + "\n")
            return
        if parts[-1] in ("cpuset.cpus", "cpuset.mems"):
            if self.cgroup_version == 1 and parts[-1] == "cpuset.cpus" and not set(parse_cpulist(text)) <= self.online:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            Path(path).write_text(text.strip() + "\n")
            eff = {"cpuset.cpus": ("cpuset.effective_cpus", "cpuset.cpus.effective"),
                   "cpuset.mems": ("cpuset.effective_mems", "cpuset.mems.effective")}[parts[-1]]
            Path(path).with_name(eff[self.cgroup_version - 1]).write_text(text.strip() + "\n")
            return
        if parts[-1] == "cpuset.cpus.partition" and self.invalid_partition is not None and text.strip() != "member":
            text = f"{text.strip()} invalid ({self.invalid_partition})"
        Path(path).write_text(text if text.endswith("\n") else text + "\n")

    def _move(self, pid: int, cgroup_dir: Path) -> None:
        if not (self.root / f"proc/{pid}").is_dir():
            raise OSError(errno.ESRCH, os.strerror(errno.ESRCH))
        if self.cgroup_version == 1:
            cpus = (cgroup_dir / "cpuset.cpus").read_text().strip()
            mems = (cgroup_dir / "cpuset.mems").read_text().strip()
            if not cpus or not mems:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        mount = self.root / self.mount
        for procs in mount.rglob("cgroup.procs"):
            pids = [p for p in procs.read_text().split() if p != str(pid)]
            procs.write_text("".join(f"{p}\n" for p in pids))
        # The kernel lists members in no defined order; sorted keeps snapshots comparable.
        target = cgroup_dir / "cgroup.procs"
        members = sorted({*map(int, target.read_text().split()), pid})
        target.write_text("".join(f"{p}\n" for p in members))
        cg_path = "/" + str(cgroup_dir.relative_to(mount)).strip(".").strip("/")
        cg_file = self.root / f"proc/{pid}/cgroup"
        lines = cg_file.read_text().splitlines()
        key = "3:cpuset:" if self.cgroup_version == 1 else "0::"
        lines = [f"{key}{cg_path}" if line.startswith(key) else line for line in lines]
        cg_file.write_text("\n".join(lines) + "\n")

    def _mkdir(self, path: str) -> None:
        os.mkdir(path)
        d = Path(path)
        if self.cgroup_version == 1:
            for name in ("cpuset.cpus", "cpuset.mems", "cpuset.effective_cpus", "cpuset.effective_mems",
                         "cgroup.procs", "tasks"):
                (d / name).write_text("")
            (d / "cpuset.memory_migrate").write_text("0\n")
        else:
            parent_controls = (d.parent / "cgroup.subtree_control").read_text().split()
            (d / "cgroup.procs").write_text("")
            (d / "cgroup.subtree_control").write_text("")
            (d / "cgroup.controllers").write_text(" ".join(parent_controls) + "\n")
            if "cpuset" in parent_controls:
                (d / "cpuset.cpus").write_text("\n")
                (d / "cpuset.mems").write_text("\n")
                (d / "cpuset.cpus.partition").write_text("member\n")
                for name in ("cpuset.cpus.effective", "cpuset.mems.effective"):
                    src = d.parent / name
                    (d / name).write_text(src.read_text() if src.exists() else "\n")

    def _rmdir(self, path: str) -> None:
        if (Path(path) / "cgroup.procs").read_text().strip():
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        if any(p.is_dir() for p in Path(path).iterdir()):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        shutil.rmtree(path)


class FakeRunner:
    """Records tool calls (systemctl); answers ok unless told otherwise."""

    def __init__(self, fail: Mapping[tuple[str, ...], str] | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.fail = dict(fail or {})

    def run(self, argv: Sequence[str], timeout: float = 10.0) -> ToolResult:
        args = tuple(argv)
        self.calls.append(args)
        if args in self.fail:
            return ToolResult(args, 1, "", failure=self.fail[args])
        return ToolResult(args, 0, "")


# ---- the tree --------------------------------------------------------------------------------------
@dataclass
class FakeProc:
    pid: int
    comm: str
    threads: dict[int, str] = field(default_factory=dict)
    cgroup: str = "/"
    kthread: bool = False
    state: str = "S"
    starttime: int = 1000
    numa: dict[int, int] = field(default_factory=dict)
    tgid: int | None = None


def _stat(pid: int, comm: str, state: str, flags: int, threads: int, starttime: int) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    # cutime cstime priority nice num_threads itrealvalue starttime …
    return (f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 {threads} 0 {starttime} "
            "0 0 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n")


def standard_procs() -> list[FakeProc]:
    worker_threads = {100: "worker", 101: "acl_thread", 102: "release_thread"}
    worker_threads.update({t: "worker" for t in range(103, 111)})
    return [
        FakeProc(1, "systemd", {1: "systemd"}),
        FakeProc(2, "kthreadd", {2: "kthreadd"}, kthread=True),
        FakeProc(100, "worker", worker_threads, cgroup="/memtopo/job", starttime=5000,
                 numa={0: 8213, 1: 837}),
        FakeProc(200, "other", {200: "other", 201: "other"}, starttime=6000, numa={0: 100}),
        FakeProc(SELF_PID, "memtopo", {SELF_PID: "memtopo", SELF_PID + 1: "memtopo"}, starttime=7000),
        # /proc/TID of a thread answers like a process whose Tgid is its process.
        FakeProc(SELF_PID + 1, "memtopo", {SELF_PID + 1: "memtopo"}, starttime=7000, tgid=SELF_PID),
        FakeProc(77, "zombie", {77: "zombie"}, state="Z", starttime=900),
    ]


@dataclass
class FakeIrq:
    irq: int
    name: str
    chip: str = "PCI-MSIX-0000:00:02.0   1-edge"
    affinity: Ids = ONLINE_CPUS


def standard_irqs() -> list[FakeIrq]:
    return [
        FakeIrq(24, "ACPI:Ged", "IO-APIC   5-edge"),
        FakeIrq(36, "nvme0q1", "PCI-MSIX-0000:00:04.0   1-edge"),
        FakeIrq(40, "mlx5_comp0@pci:0000:3b:00.0", "PCI-MSIX-0000:3b:00.0   0-edge"),
        FakeIrq(41, "mlx5_comp1@pci:0000:3b:00.0", "PCI-MSIX-0000:3b:00.0   1-edge"),
        FakeIrq(42, "mlx5_comp2@pci:0000:3b:00.0", "PCI-MSIX-0000:3b:00.0   2-edge"),
        FakeIrq(50, "sq_send_trigger_irq", "PCI-MSIX-0000:c1:00.0   0-edge"),
        FakeIrq(51, "cq_update_irq", "PCI-MSIX-0000:c1:00.0   1-edge"),
    ]


def write_root(root: Path, procs: Sequence[FakeProc], irqs: Sequence[FakeIrq], cgroup_version: int = 1,
               irqbalance_pid: int | None = None) -> Path:
    def put(rel: str, text: str) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    # CPUs and nodes
    put("sys/devices/system/cpu/online", "0-7\n")
    put("sys/devices/system/cpu/present", "0-9\n")
    put("sys/devices/system/node/online", "0-2,4\n")
    put("sys/devices/system/node/has_memory", "0-1,4\n")
    # cgroups
    mount = V1_MOUNT if cgroup_version == 1 else V2_MOUNT
    if cgroup_version == 1:
        put("proc/self/mountinfo",
            "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
            "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
            "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
            "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
        put("sys/fs/cgroup/unified/cgroup.controllers", "hugetlb\n")
        dirs = {"": ("0-7", "0-1,4"), "memtopo": ("0-7", "0-1,4"), "memtopo/job": ("0-3", "0")}
        for d, (cpus, mems) in dirs.items():
            base = f"{mount}/{d}".rstrip("/")
            for name, value in (("cpuset.cpus", cpus), ("cpuset.mems", mems), ("cpuset.effective_cpus", cpus),
                                ("cpuset.effective_mems", mems), ("cpuset.memory_migrate", "0"),
                                ("tasks", ""), ("cgroup.procs", "")):
                put(f"{base}/{name}", value + "\n" if value else "")
    else:
        put("proc/self/mountinfo",
            "31 23 0:28 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n")
        put(f"{mount}/cgroup.controllers", "cpuset cpu io memory pids\n")
        put(f"{mount}/cgroup.subtree_control", "cpuset cpu memory\n")
        put(f"{mount}/cgroup.procs", "")
        put(f"{mount}/cpuset.cpus.effective", "0-7\n")
        put(f"{mount}/cpuset.mems.effective", "0-1,4\n")
        put(f"{mount}/memtopo/cgroup.procs", "")
        put(f"{mount}/memtopo/cgroup.subtree_control", "cpuset\n")
        put(f"{mount}/memtopo/cgroup.controllers", "cpuset cpu memory\n")
        for name, value in (("cpuset.cpus", ""), ("cpuset.mems", ""), ("cpuset.cpus.effective", "0-7"),
                            ("cpuset.mems.effective", "0-1,4"), ("cpuset.cpus.partition", "member")):
            put(f"{mount}/memtopo/{name}", value + "\n")
        put(f"{mount}/memtopo/job/cgroup.procs", "")
        put(f"{mount}/memtopo/job/cgroup.subtree_control", "")
        put(f"{mount}/memtopo/job/cgroup.controllers", "cpuset cpu memory\n")
        for name, value in (("cpuset.cpus", "0-3"), ("cpuset.mems", "0"), ("cpuset.cpus.effective", "0-3"),
                            ("cpuset.mems.effective", "0"), ("cpuset.cpus.partition", "member")):
            put(f"{mount}/memtopo/job/{name}", value + "\n")
    # processes
    members: dict[str, list[int]] = {}
    for p in procs:
        flags = 0x00200000 if p.kthread else 0x00400100
        put(f"proc/{p.pid}/stat", _stat(p.pid, p.comm, p.state, flags, len(p.threads) or 1, p.starttime))
        put(f"proc/{p.pid}/comm", p.comm + "\n")
        put(f"proc/{p.pid}/status", f"Name:\t{p.comm}\nState:\t{p.state}\nTgid:\t{p.tgid or p.pid}\n"
                                    f"Pid:\t{p.pid}\nCpus_allowed_list:\t0-7\nMems_allowed_list:\t0-1,4\n")
        cg = f"3:cpuset:{p.cgroup}\n0::/\n" if cgroup_version == 1 else f"0::{p.cgroup}\n"
        put(f"proc/{p.pid}/cgroup", f"9:name=systemd:/\n{cg}")
        for tid, name in (p.threads or {p.pid: p.comm}).items():
            put(f"proc/{p.pid}/task/{tid}/comm", name + "\n")
        if p.numa:
            nodes = " ".join(f"N{n}={c}" for n, c in sorted(p.numa.items()))
            put(f"proc/{p.pid}/numa_maps",
                f"55eb62189000 default heap anon=4 dirty=4 {nodes} kernelpagesize_kB=4\n"
                "7f6eec2ce000 default file=/usr/lib/locale/C.utf8/LC_CTYPE mapped=32 mapmax=22 N0=32 "
                "kernelpagesize_kB=4\n")
        if not p.kthread:
            members.setdefault(p.cgroup, []).append(p.pid)
    for cg, pids in members.items():
        rel = f"{mount}/{cg.strip('/')}".rstrip("/") + "/cgroup.procs"
        if (root / rel).exists():
            (root / rel).write_text("".join(f"{pid}\n" for pid in sorted(pids)))
    if irqbalance_pid is not None:
        put(f"proc/{irqbalance_pid}/stat", _stat(irqbalance_pid, "irqbalance", "S", 0x00400100, 1, 3000))
        put(f"proc/{irqbalance_pid}/comm", "irqbalance\n")
        put(f"proc/{irqbalance_pid}/cgroup", "9:name=systemd:/system.slice/irqbalance.service\n3:cpuset:/\n")
        put(f"proc/{irqbalance_pid}/task/{irqbalance_pid}/comm", "irqbalance\n")
    # IRQs
    header = "           " + "".join(f"CPU{c:<8}" for c in ONLINE_CPUS) + "\n"
    lines = [header]
    for q in irqs:
        counts = "".join(f"{(q.irq * 7 + c) % 97:>11}" for c in ONLINE_CPUS)
        lines.append(f"{q.irq:>4}:{counts} {q.chip}      {q.name}\n")
        put(f"proc/irq/{q.irq}/smp_affinity_list", format_cpulist(q.affinity) + "\n")
        put(f"proc/irq/{q.irq}/effective_affinity_list", f"{q.affinity[0]}\n")
        put(f"proc/irq/{q.irq}/node", "0\n")
        (root / f"proc/irq/{q.irq}/{q.name}").mkdir(parents=True, exist_ok=True)
        put(f"sys/kernel/irq/{q.irq}/actions", q.name + "\n")
    lines.append(f"NMI:{''.join(f'{0:>11}' for _ in ONLINE_CPUS)}   Non-maskable interrupts\n")
    put("proc/interrupts", "".join(lines))
    put("proc/irq/default_smp_affinity", "ff\n")
    for bdf, vectors in (("0000:3b:00.0", (40, 41, 42)), ("0000:c1:00.0", (50, 51))):
        for v in vectors:
            put(f"sys/bus/pci/devices/{bdf}/msi_irqs/{v}", "msix\n")
        put(f"sys/bus/pci/devices/{bdf}/irq", f"{vectors[0]}\n")
    put("sys/bus/pci/devices/0000:00:1f.0/irq", "10\n")
    return root


def topology(unified_node: bool = True) -> pb.MemoryTopology:
    """The standard machine as discovery would report it."""
    t = pb.MemoryTopology(node_name="fakehost", fingerprint="f" * 64)
    t.cpus.online.extend(ONLINE_CPUS)
    t.cpus.present.extend(range(10))
    t.cpus.possible.extend(range(10))
    t.cpus.offline.extend((8, 9))
    t.allowed_cpus.extend(ONLINE_CPUS)
    t.allowed_memory_nodes.extend((0, 1, 4))
    for nid, cpus, mem in ((0, range(4), True), (1, range(4, 8), True), (2, (), False), (4, (), True)):
        t.numa_nodes.add(id=nid, state=pb.NUMA_NODE_STATE_ONLINE, cpus=list(cpus), has_cpu=bool(cpus),
                         has_memory=mem, has_normal_memory=mem, memory_bytes=(1 << 34) if mem else 0)
    t.numa_nodes.add(id=3, state=pb.NUMA_NODE_STATE_POSSIBLE_OFFLINE)
    t.domains.add(id=0, type=pb.MEMORY_DOMAIN_TYPE_DRAM, numa_nodes=[0], attached_cpus=list(range(4)))
    t.domains.add(id=1, type=pb.MEMORY_DOMAIN_TYPE_DRAM, numa_nodes=[1], attached_cpus=list(range(4, 8)))
    t.domains.add(id=2, type=pb.MEMORY_DOMAIN_TYPE_UNIFIED if unified_node else pb.MEMORY_DOMAIN_TYPE_HBM,
                  numa_nodes=[4])
    return t


@dataclass
class FakeMachine:
    root: Path
    kernel: FakeKernel
    files: FakeFiles
    runner: FakeRunner
    host: Host
    state_dir: Path
    topo: pb.MemoryTopology

    def engine(self, hook: Hook | None = None, **config: object) -> Engine:
        config.setdefault("self_pid", SELF_PID)
        return Engine(self.host, lambda: self.topo, self.state_dir, ApplyConfig(**config), hook=hook)  # type: ignore[arg-type]

    def snapshot(self) -> dict[str, str]:
        """Every file and directory of the fake root, for "host unchanged" assertions."""
        out: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            out[rel + "/"] = ""
            for f in filenames:
                p = os.path.join(dirpath, f)
                text = ("-> " + os.readlink(p)) if os.path.islink(p) else Path(p).read_text()
                out[os.path.relpath(p, self.root)] = text
            for d in dirnames:
                p = os.path.join(dirpath, d)
                if os.path.islink(p):
                    out[os.path.relpath(p, self.root)] = "-> " + os.readlink(p)
        return out

    def read(self, rel: str) -> str:
        return (self.root / rel).read_text()


def machine(tmp: Path, cgroup_version: int = 1, irqbalance_pid: int | None = None,
            procs: Sequence[FakeProc] | None = None, irqs: Sequence[FakeIrq] | None = None) -> FakeMachine:
    root = tmp / "root"
    root.mkdir()
    procs = list(procs if procs is not None else standard_procs())
    write_root(root, procs, list(irqs if irqs is not None else standard_irqs()), cgroup_version, irqbalance_pid)
    kernel = FakeKernel(root)
    for p in procs:
        kernel.add_threads(p.threads or [p.pid])
    files = FakeFiles(root, cgroup_version)
    runner = FakeRunner()
    host = Host(kernel, files, runner)
    return FakeMachine(root, kernel, files, runner, host, tmp / "state", topology())


# ---- plans -----------------------------------------------------------------------------------------
def plan(plan_id: str, *actions: planpb.PlanAction) -> planpb.BindingPlan:
    p = planpb.BindingPlan(plan_id=plan_id, policy="test")
    p.actions.extend(actions)
    return p


def threads(aid: str, pid: int, cpus: Iterable[int], *, all: bool = False, tids: Iterable[int] = (),
            name: str = "", main: bool = False, required: bool = True) -> planpb.PlanAction:
    a = planpb.PlanAction(id=aid, required=required)
    ta = a.thread_affinity
    ta.pid = pid
    ta.cpus.extend(cpus)
    if all:
        ta.threads.all = True
    elif name:
        ta.threads.name_pattern = name
    elif main:
        ta.threads.main_thread = True
    else:
        ta.threads.tids.tids.extend(tids)
    return a


def cpuset(aid: str, path: str = "", *, pid: int = 0, cpus: Iterable[int] = (), mems: Iterable[int] = (),
           create: bool = False, attach: Iterable[int] = (), partition: str = "", required: bool = True
           ) -> planpb.PlanAction:
    a = planpb.PlanAction(id=aid, required=required)
    cs = a.cpuset
    if path:
        cs.cgroup_path = path
    elif pid:
        cs.pid_cgroup = pid
    cs.cpus.extend(cpus)
    cs.mems.extend(mems)
    cs.create = create
    cs.attach_pids.extend(attach)
    cs.partition = partition
    return a


def irq(aid: str, cpus: Iterable[int], *, number: int | None = None, bdf: str = "", name: str = "",
        required: bool = True) -> planpb.PlanAction:
    a = planpb.PlanAction(id=aid, required=required)
    ia = a.irq_affinity
    if number is not None:
        ia.irq = number
    elif bdf:
        ia.pci_bdf = bdf
    elif name:
        ia.name_pattern = name
    ia.cpus.extend(cpus)
    return a


def migrate(aid: str, pid: int, frm: Iterable[int], to: Iterable[int], required: bool = True) -> planpb.PlanAction:
    a = planpb.PlanAction(id=aid, required=required)
    a.page_migration.pid = pid
    a.page_migration.from_nodes.extend(frm)
    a.page_migration.to_nodes.extend(to)
    return a


def mempolicy(aid: str, pid: int, nodes: Iterable[int], *, mode: int = planpb.MemoryPolicy.MODE_BIND,
              migrate_existing: bool = False, unified: bool = False, required: bool = True) -> planpb.PlanAction:
    a = planpb.PlanAction(id=aid, required=required)
    mp = a.memory_policy
    mp.pid = pid
    mp.mode = mode  # type: ignore[assignment]
    mp.nodes.extend(nodes)
    mp.migrate_existing = migrate_existing
    mp.apply_on_unified = unified
    return a
