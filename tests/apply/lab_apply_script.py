"""The apply engine's lab scenarios, run *inside* one numa-vm guest (tests/apply/test_lab_apply.py boots it).

One boot covers everything: the guest starts with pure cgroup v2 (the lab default), runs the v2
scenarios, then moves the cpuset controller to a v1 hierarchy it mounts itself (a controller can be
rebound once no v2 cgroup uses it) and runs the v1 scenarios. Guest Python is 5-20x slower than the
host and each ``memtopo`` command pays about 10 s of imports, so ``memtopo apply``/``exec`` run as
commands where the issue asks for the command, and the rest run the same :class:`Engine` in this
process with one discovered topology.

This script only *observes*: every scenario returns the raw files, ``/proc`` texts and plan results
it saw, and ``tests/apply/test_lab_apply.py`` makes the assertions on the host. A scenario that raises
reports its traceback instead of stopping the others. The report is one JSON line on stdout after
:data:`MARK`; progress goes to stderr.

    numa-vm run -- .venv/bin/python tests/apply/lab_apply_script.py [SCENARIO ...]
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from google.protobuf import json_format  # noqa: E402

from memtopo.apply.config import ApplyConfig  # noqa: E402
from memtopo.apply.engine import Engine, Hook  # noqa: E402
from memtopo.apply.host import Host  # noqa: E402
from memtopo.cpulist import format_cpulist, parse_cpulist  # noqa: E402
from memtopo.discovery.discover import discover  # noqa: E402
from memtopo.discovery.source import ProbeContext  # noqa: E402
from memtopo.protojson import to_json  # noqa: E402
from memtopo.v1 import plan_pb2 as planpb  # noqa: E402
from memtopo.v1 import topology_pb2 as pb  # noqa: E402
from tests.apply_fakes import cpuset, irq, mempolicy, migrate, plan, threads  # noqa: E402

MARK = "MEMTOPO_LAB_APPLY_REPORT "
MEMTOPO = str(REPO / ".venv" / "bin" / "memtopo")
V2_ROOT = Path("/sys/fs/cgroup")
# Where the v1 cpuset hierarchy gets mounted once the controller leaves v2 (/run is guest tmpfs).
V1_MOUNT = Path("/run/memtopo-v1-cpuset")
# The lab's io share: writing here makes its virtio 9p "requests" vector fire.
IO_SHARE = Path("/run/numa-vm")
PREFIX = "memtopo"
CHILD_MIB = 64

Json = dict[str, Any]

# A target process: allocates and touches MiB of anonymous memory while running on the given CPUs
# (default policy: the pages land on those CPUs' node), widens its affinity back, starts named
# threads, prints {"pid", "tids"} and waits for a line on stdin.
CHILD = r"""
import ctypes, json, mmap, os, sys, threading
mib, alloc_cpus, nthreads = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
libc = ctypes.CDLL(None)
everything = os.sched_getaffinity(0)
if alloc_cpus:
    os.sched_setaffinity(0, {int(c) for c in alloc_cpus.split(",")})
buf = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for off in range(0, len(buf), 4096):
    buf[off] = 1
os.sched_setaffinity(0, everything)
stop = threading.Event()
tids = []
def run():
    libc.prctl(15, b"lab_worker", 0, 0, 0)
    tids.append(threading.get_native_id())
    stop.wait()
for _ in range(nthreads):
    threading.Thread(target=run, daemon=True).start()
while len(tids) < nthreads:
    pass
print(json.dumps({"pid": os.getpid(), "tids": sorted(tids)}), flush=True)
sys.stdin.readline()
"""

# What `memtopo exec` runs: allocate, then report where the pages went and what the kernel holds.
EXEC_CHILD = r"""
import ctypes, json, mmap, os, sys
buf = mmap.mmap(-1, int(sys.argv[1]) << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for off in range(0, len(buf), 4096):
    buf[off] = 1
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
print(json.dumps({"addr": addr, "numa_maps": open("/proc/self/numa_maps").read(),
                  "affinity": sorted(os.sched_getaffinity(0)),
                  "mems_allowed": status["Mems_allowed_list"].strip()}))
"""


def log(msg: str) -> None:
    print(f"[lab-apply {time.monotonic():8.1f}] {msg}", file=sys.stderr, flush=True)


def read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def status(pid: int) -> Json:
    text = read(f"/proc/{pid}/status") or ""
    keep = ("Cpus_allowed_list", "Mems_allowed_list")
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if k in keep}


def node_cpus(node: int) -> list[int]:
    return list(parse_cpulist(read(f"/sys/devices/system/node/node{node}/cpulist") or ""))


def result_dict(res: planpb.PlanResult) -> Json:
    return json_format.MessageToDict(res, preserving_proto_field_name=True)


# ---- processes ---------------------------------------------------------------------------------------
@dataclass
class Child:
    proc: subprocess.Popen[str]
    tids: list[int]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def masks(self) -> dict[str, list[int]]:
        return {str(t): sorted(os.sched_getaffinity(t)) for t in sorted({self.pid, *self.tids})}

    def snapshot(self) -> Json:
        return {"status": status(self.pid), "cgroup": read(f"/proc/{self.pid}/cgroup"),
                "numa_maps": read(f"/proc/{self.pid}/numa_maps"), "masks": self.masks()}


@contextlib.contextmanager
def child(mib: int = CHILD_MIB, alloc_cpus: list[int] | None = None, nthreads: int = 0) -> Iterator[Child]:
    cpus = ",".join(map(str, alloc_cpus or []))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(mib), cpus, str(nthreads)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited before reporting (status {proc.wait()})")
        yield Child(proc, json.loads(line)["tids"])
    finally:
        proc.kill()
        proc.wait()


def cli(*args: str) -> Json:
    t0 = time.monotonic()
    res = subprocess.run([MEMTOPO, *args], capture_output=True, text=True, timeout=600, check=False)
    out: Json = {"argv": list(args), "rc": res.returncode, "stdout": res.stdout, "stderr": res.stderr[-4000:],
                 "seconds": round(time.monotonic() - t0, 2)}
    with contextlib.suppress(ValueError):
        out["json"] = json.loads(res.stdout)
    return out


def write_plan(p: planpb.BindingPlan) -> str:
    fd, path = tempfile.mkstemp(prefix=f"{p.plan_id}.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(to_json(p))
    return path


class Lab:
    """The guest as the scenarios see it: its topology (discovered once) and a state dir per engine."""

    def __init__(self) -> None:
        self.topo: pb.MemoryTopology = discover(ProbeContext.live())
        self.state = Path(tempfile.mkdtemp(prefix="memtopo-lab-state."))
        self.node0 = node_cpus(0)
        self.node1 = node_cpus(1)
        self.cpus = sorted(os.sched_getaffinity(0))

    def engine(self, name: str, hook: Hook | None = None) -> Engine:
        return Engine(Host.live(), lambda: self.topo, self.state / name,
                      ApplyConfig(cgroup_prefixes=(PREFIX,), irqbalance="leave"), hook=hook)


# ---- IRQs ------------------------------------------------------------------------------------------
def interrupts() -> dict[int, Json]:
    """Per-IRQ counts by CPU and the action name, from /proc/interrupts (numeric rows only)."""
    lines = (read("/proc/interrupts") or "").splitlines()
    cpus = [int(tok[3:]) for tok in lines[0].split()] if lines else []
    out: dict[int, Json] = {}
    for line in lines[1:]:
        head, _, rest = line.partition(":")
        if not head.strip().isdigit():
            continue
        toks = rest.split()
        out[int(head)] = {"counts": {str(c): int(toks[i]) for i, c in enumerate(cpus)}, "name": toks[-1]}
    return out


def irq_files(n: int) -> Json:
    return {"smp_affinity_list": (read(f"/proc/irq/{n}/smp_affinity_list") or "").strip(),
            "effective_affinity_list": (read(f"/proc/irq/{n}/effective_affinity_list") or "").strip()}


def named(pattern: str) -> list[int]:
    return sorted(n for n, row in interrupts().items() if re.fullmatch(pattern, row["name"]))


def io_traffic(rounds: int = 200) -> None:
    """Writes through the io 9p share: each is a virtio request, answered by an interrupt."""
    f = IO_SHARE / "lab-apply-irq-traffic"
    for i in range(rounds):
        f.write_text(str(i))
    f.unlink()


def other_cpu(current: str, cpus: list[int]) -> int:
    now = set(parse_cpulist(current)) if current else set()
    return next((c for c in reversed(cpus) if c not in now), cpus[0])


# ---- scenarios -------------------------------------------------------------------------------------
def s_cli_migration(lab: Lab) -> Json:
    """``memtopo apply`` of a page_migration 0 → 1 on a process whose pages are on node 0, then
    ``memtopo rollback`` (which moves them back only if nothing lived on node 1 before)."""
    state = str(lab.state / "cli")
    with child(alloc_cpus=lab.node0) as c:
        before = read(f"/proc/{c.pid}/numa_maps")
        path = write_plan(plan("lab-mig", migrate("mig", c.pid, [0], [1])))
        applied = cli("apply", path, "--format", "json", "--state-dir", state)
        after = read(f"/proc/{c.pid}/numa_maps")
        rolled = cli("rollback", "lab-mig", "--format", "json", "--state-dir", state)
        back = read(f"/proc/{c.pid}/numa_maps")
    return {"pid": c.pid, "numa_maps_before": before, "apply": applied, "numa_maps_after": after,
            "rollback": rolled, "numa_maps_after_rollback": back}


def s_exec(lab: Lab) -> Json:
    """``memtopo exec --membind 1`` (with --cpus of node 1) and ``--interleave 0,1``."""
    out: Json = {}
    runs = {"membind": ["--cpus", format_cpulist(lab.node1), "--membind", "1"], "interleave": ["--interleave", "0,1"]}
    for name, flags in runs.items():
        res = cli("exec", *flags, "--", sys.executable, "-c", EXEC_CHILD, str(CHILD_MIB))
        out[name] = res
    return out


def s_cpuset(lab: Lab, version: int) -> Json:
    """A cpuset with the CPUs of node 1 and mems=1, created with the child attached; then rolled back."""
    eng = lab.engine(f"cpuset-v{version}")
    mount = V2_ROOT if version == 2 else V1_MOUNT
    path = f"{PREFIX}/lab-v{version}"
    d = mount / path
    names = (("cpuset.cpus", "cpuset.mems", "cpuset.cpus.effective", "cpuset.mems.effective") if version == 2 else
             ("cpuset.cpus", "cpuset.mems", "cpuset.effective_cpus", "cpuset.effective_mems", "cpuset.memory_migrate"))
    with child(alloc_cpus=lab.node0) as c:
        before = c.snapshot()
        root_control = read(V2_ROOT / "cgroup.subtree_control") if version == 2 else None
        res = eng.apply(plan(f"lab-cs-v{version}", cpuset("cs", path, cpus=lab.node1, mems=[1], create=True,
                                                         attach=[c.pid])))
        files: Json = {n: (read(d / n) or "").strip() for n in names}
        files["cgroup.procs"] = (read(d / "cgroup.procs") or "").split()
        during = c.snapshot()
        rb = eng.rollback(f"lab-cs-v{version}")
        after = c.snapshot()
        return {"pid": c.pid, "path": str(d), "before": before, "result": result_dict(res), "files": files,
                "during": during, "rollback": result_dict(rb), "after": after, "dir_exists_after": d.exists(),
                "prefix_exists_after": (mount / PREFIX).exists(), "root_subtree_control_before": root_control,
                "root_subtree_control_after": read(V2_ROOT / "cgroup.subtree_control") if version == 2 else None}


def s_mempolicy_v1_cli(lab: Lab) -> Json:
    """``memtopo apply`` of memory_policy bind 1 with migrate_existing on a process in the root cpuset
    (v1: the engine gives it its own cpuset under the prefix), then ``memtopo rollback``."""
    state = str(lab.state / "cli-mp")
    with child(alloc_cpus=lab.node0) as c:
        before = c.snapshot()
        path = write_plan(plan("lab-mp-v1", mempolicy("mp", c.pid, [1], migrate_existing=True)))
        applied = cli("apply", path, "--format", "json", "--state-dir", state)
        during = c.snapshot()
        managed = V1_MOUNT / PREFIX / f"pid-{c.pid}"
        files = {n: (read(managed / n) or "").strip() for n in ("cpuset.cpus", "cpuset.mems")}
        rolled = cli("rollback", "lab-mp-v1", "--format", "json", "--state-dir", state)
        after = c.snapshot()
        return {"pid": c.pid, "before": before, "apply": applied, "during": during, "files": files,
                "rollback": rolled, "after": after, "managed_exists_after": managed.exists()}


def s_mempolicy_v2(lab: Lab) -> Json:
    """v2: the process must already be in a cgroup under the prefix (moving it would move every
    controller), so one plan places it, a second binds it to node 1 with migrate_existing."""
    eng = lab.engine("mempolicy-v2")
    path = f"{PREFIX}/mp-v2"
    with child(alloc_cpus=lab.node0) as c:
        before = c.snapshot()
        placed = eng.apply(plan("lab-mp-v2-place", cpuset("place", path, cpus=lab.cpus, mems=[0, 1], create=True,
                                                        attach=[c.pid])))
        placed_snap = c.snapshot()
        res = eng.apply(plan("lab-mp-v2", mempolicy("mp", c.pid, [1], migrate_existing=True)))
        during = c.snapshot()
        mems = (read(V2_ROOT / path / "cpuset.mems") or "").strip()
        rb = eng.rollback("lab-mp-v2")
        mems_after = (read(V2_ROOT / path / "cpuset.mems") or "").strip()
        rb_place = eng.rollback("lab-mp-v2-place")
        after = c.snapshot()
        return {"pid": c.pid, "before": before, "place": result_dict(placed), "placed": placed_snap,
                "result": result_dict(res), "during": during, "cpuset_mems": mems, "rollback": result_dict(rb),
                "cpuset_mems_after_rollback": mems_after, "rollback_place": result_dict(rb_place), "after": after,
                "dir_exists_after": (V2_ROOT / path).exists()}


def s_irq(lab: Lab) -> Json:
    """The 9p shares' request vectors moved to one CPU by name pattern: read back, interrupts counted
    on that CPU while the io share is written, then restored by rollback."""
    eng = lab.engine("irq")
    vectors = named(r"virtio\d+-requests")
    if not vectors:
        raise RuntimeError(f"no virtio requests vector in /proc/interrupts: {sorted(interrupts())}")
    before = {n: irq_files(n) for n in vectors}
    effective = {c for f in before.values() for c in parse_cpulist(f["effective_affinity_list"] or "")}
    target = next((c for c in reversed(lab.cpus) if c not in effective), lab.cpus[0])
    counts_before = {n: interrupts()[n]["counts"] for n in vectors}
    res = eng.apply(plan("lab-irq", irq("virtio", [target], name=r"virtio\d+-requests")))
    io_traffic()
    time.sleep(0.2)
    after = {n: irq_files(n) for n in vectors}
    counts_after = {n: interrupts()[n]["counts"] for n in vectors}
    rb = eng.rollback("lab-irq")
    restored = {n: irq_files(n) for n in vectors}
    return {"vectors": vectors, "target": target, "before": before, "counts_before": counts_before,
            "result": result_dict(res), "after": after, "counts_after": counts_after, "rollback": result_dict(rb),
            "restored": restored}


def s_irq_managed(lab: Lab) -> Json:
    """A managed NVMe queue vector (required action): refused by the kernel, reported, host untouched.
    Then the whole NVMe controller by PCI address: its admin vector moves, the queue vectors stay."""
    eng = lab.engine("irq-managed")
    queues = named(r"nvme\d+q[1-9]\d*")
    if not queues:
        raise RuntimeError("no NVMe queue vector in /proc/interrupts")
    n = queues[0]
    before = irq_files(n)
    res = eng.apply(plan("lab-irq-managed", irq("managed", [other_cpu(before["smp_affinity_list"], lab.cpus)],
                                                 number=n)))
    after = irq_files(n)
    out: Json = {"irq": n, "name": interrupts()[n]["name"], "before": before, "result": result_dict(res),
                 "after": after}
    ctrl = re.fullmatch(r"(nvme\d+)q\d+", out["name"])
    assert ctrl is not None
    bdf = os.path.basename(os.readlink(f"/sys/class/nvme/{ctrl.group(1)}/device"))
    msi = sorted(int(x) for x in os.listdir(f"/sys/bus/pci/devices/{bdf}/msi_irqs"))
    admin = next(v for v in msi if interrupts().get(v, {}).get("name", "").endswith("q0"))
    dev_before = {v: irq_files(v) for v in msi}
    target = other_cpu(dev_before[admin]["smp_affinity_list"], lab.cpus)
    dev_res = eng.apply(plan("lab-irq-bdf", irq("nvme", [target], bdf=bdf)))
    dev_after = {v: irq_files(v) for v in msi}
    dev_rb = eng.rollback("lab-irq-bdf")
    out.update({"bdf": bdf, "msi_irqs": msi, "names": {v: interrupts().get(v, {}).get("name") for v in msi},
                "admin": admin, "target": target, "device_before": dev_before, "device_result": result_dict(dev_res),
                "device_after": dev_after, "device_rollback": result_dict(dev_rb),
                "device_restored": {v: irq_files(v) for v in msi}})
    return out


def s_failure(lab: Lab, version: int) -> Json:
    """A plan whose last required action fails after three others changed the host (threads pinned,
    an IRQ moved, a cpuset created with the process in it): the victim process of the fourth action
    is killed once the third has applied, and everything must come back."""
    mount = V2_ROOT if version == 2 else V1_MOUNT
    path = f"{PREFIX}/fail-v{version}"
    vector = named(r"virtio\d+-config")[0]
    with child(mib=16, alloc_cpus=lab.node0, nthreads=3) as c, child(mib=1) as victim:
        irq_before = irq_files(vector)
        irq_target = other_cpu(irq_before["smp_affinity_list"], lab.node1)
        before = c.snapshot()
        mid: Json = {}

        def kill_victim(event: str, action: planpb.PlanAction) -> None:
            # What the first three actions did to the host, seen before the fourth fails.
            if event == "after_action" and action.id == "cs":
                mid.update(c.snapshot(), irq=irq_files(vector), dir_exists=(mount / path).exists())
                victim.proc.kill()
                victim.proc.wait()

        eng = lab.engine(f"failure-v{version}", hook=kill_victim)
        pin = lab.node1[:1]
        res = eng.apply(plan(f"lab-fail-v{version}",
                             threads("pin", c.pid, pin, all=True),
                             irq("irq", [irq_target], number=vector),
                             cpuset("cs", path, cpus=lab.node1, mems=[1], create=True, attach=[c.pid]),
                             threads("victim", victim.pid, pin, all=True)))
        after = c.snapshot()
        return {"pid": c.pid, "irq": vector, "irq_target": irq_target, "pin": pin, "irq_before": irq_before,
                "before": before, "mid": mid, "result": result_dict(res), "irq_after": irq_files(vector),
                "after": after, "dir_exists_after": (mount / path).exists(),
                "prefix_exists_after": (mount / PREFIX).exists()}


def move_cpuset_to_v1() -> Json:
    """Take cpuset off the v2 root's subtree_control and mount it as a v1 hierarchy."""
    (V2_ROOT / "cgroup.subtree_control").write_text("-cpuset")
    V1_MOUNT.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "cgroup", "-o", "cpuset", "cpuset", str(V1_MOUNT)], check=True,
                   capture_output=True, text=True)
    return {"mountinfo": [line for line in (read("/proc/self/mountinfo") or "").splitlines() if "cgroup" in line],
            "v2_subtree_control": read(V2_ROOT / "cgroup.subtree_control"),
            "v1_root": {n: (read(V1_MOUNT / n) or "").strip() for n in ("cpuset.cpus", "cpuset.mems")}}


def environment(lab: Lab) -> Json:
    return {"kernel": os.uname().release, "cpus": lab.cpus, "node0_cpus": lab.node0, "node1_cpus": lab.node1,
            "has_memory": (read("/sys/devices/system/node/has_memory") or "").strip(),
            "cgroup_mounts": [line for line in (read("/proc/self/mountinfo") or "").splitlines() if "cgroup" in line],
            "migratepages": bool(subprocess.run(["sh", "-c", "command -v migratepages"], capture_output=True,
                                                check=False).stdout)}


# Run order matters: the v2 scenarios first, then cpuset moves to v1 for good.
SCENARIOS: list[tuple[str, Callable[[Lab], Json]]] = [
    ("environment", environment),
    ("cli_migration", s_cli_migration),
    ("exec", s_exec),
    ("irq", s_irq),
    ("irq_managed", s_irq_managed),
    ("cpuset_v2", lambda lab: s_cpuset(lab, 2)),
    ("mempolicy_v2", s_mempolicy_v2),
    ("failure_v2", lambda lab: s_failure(lab, 2)),
    ("switch_to_v1", lambda lab: move_cpuset_to_v1()),
    ("cpuset_v1", lambda lab: s_cpuset(lab, 1)),
    ("mempolicy_v1_cli", s_mempolicy_v1_cli),
    ("failure_v1", lambda lab: s_failure(lab, 1)),
]


def main(argv: list[str]) -> int:
    wanted = set(argv)
    t0 = time.monotonic()
    lab = Lab()
    log(f"discovered the guest topology in {time.monotonic() - t0:.1f} s")
    report: Json = {}
    for name, fn in SCENARIOS:
        if wanted and name not in wanted and name != "switch_to_v1":
            continue
        t = time.monotonic()
        log(f"{name} …")
        try:
            report[name] = fn(lab)
        except Exception:
            report[name] = {"error": traceback.format_exc()}
            log(f"{name} raised:\n{report[name]['error']}")
        report[name]["seconds"] = round(time.monotonic() - t, 2)
        log(f"{name} done in {report[name]['seconds']} s")
    print(MARK + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
