"""The host layer: write confinement, the parsers of /proc files (real formats, and garbage), the
cgroup hierarchy detection, the irqbalance protocol, undo records, and the real system calls."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo import hostfs
from memtopo.apply import cgroups, irqbalance
from memtopo.apply.errors import HostWriteError, PathEscapeError
from memtopo.apply.host import (
    MPOL_DEFAULT,
    HostFiles,
    LinuxKernel,
    Procs,
    nodemask,
    nodes_of,
    parse_numa_maps,
    parse_stat,
)
from memtopo.apply.irqs import parse_interrupts
from memtopo.apply.undo import (
    AffinityUndo,
    AttachUndo,
    BanUndo,
    FileUndo,
    MigrateUndo,
    MkdirUndo,
    ServiceUndo,
    UndoFormatError,
    from_json,
    to_json,
)
from memtopo.hostfs import HostFS
from memtopo.mounts import parse_proc_cgroup
from tests.sysfs_tree import write_tree

# ---- write confinement -----------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    write_tree(root, {"sys/fs/cgroup/cpuset/memtopo/cpuset.cpus": "0-1", "proc/irq/24/smp_affinity_list": "0-1",
                      "etc/passwd": "root:x:0:0", "proc/sys/kernel/numa_balancing": "1"})
    os.symlink("../../../../etc", root / "sys/fs/cgroup/cpuset/memtopo/link")
    os.symlink("/etc", root / "sys/fs/cgroup/cpuset/abs")
    return root


@pytest.mark.parametrize(("rel", "why"), [
    ("etc/passwd", "not below a writable prefix"),
    ("proc/sys/kernel/numa_balancing", "not below a writable prefix"),
    ("sys/fs/cgroup/cpuset/../../../etc/passwd", "'..'"),
    ("/etc/passwd", "absolute path"),
    ("sys/fs/cgroup/cpuset/memtopo/link/passwd", "resolves outside"),
    ("sys/fs/cgroup/cpuset/abs/passwd", "resolves outside"),
    ("sys/fs/cgroup/cpuset//x", "empty"),
    ("proc/irq/24\0/x", "NUL"),
    ("sys/fs/cgroup/cpusetX/evil", "not below a writable prefix"),
])
def test_writes_outside_the_prefixes_are_refused(tree: Path, rel: str, why: str) -> None:
    files = HostFiles(HostFS.at(tree), ["sys/fs/cgroup/cpuset", "proc/irq"])
    before = (tree / "etc/passwd").read_text()
    with pytest.raises(PathEscapeError, match=why):
        files.write(rel, "pwned")
    with pytest.raises(PathEscapeError):
        files.mkdir(rel)
    assert (tree / "etc/passwd").read_text() == before


def test_writes_inside_work_and_errors_are_typed(tree: Path) -> None:
    files = HostFiles(HostFS.at(tree), ["sys/fs/cgroup/cpuset", "proc/irq"])
    files.write("proc/irq/24/smp_affinity_list", "1")
    assert (tree / "proc/irq/24/smp_affinity_list").read_text() == "1"
    with pytest.raises(HostWriteError) as exc:
        files.write("proc/irq/99/smp_affinity_list", "1")  # never created: no O_CREAT
    assert exc.value.errno == errno.ENOENT and "ENOENT" in exc.value.reason
    files.mkdir("sys/fs/cgroup/cpuset/memtopo/new")
    files.rmdir("sys/fs/cgroup/cpuset/memtopo/new")
    assert not (tree / "sys/fs/cgroup/cpuset/memtopo/new").exists()


def test_write_read_is_confined_like_a_write(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_read (the IRQ write) opens a path without symlinks in one openat2 where it can, and
    takes the component walk for any other: a link that stays below a prefix is followed, one that
    leaves is refused, and nothing outside changes."""
    files = HostFiles(HostFS.at(tree), ["sys/fs/cgroup/cpuset", "proc/irq"])
    os.symlink("24", tree / "proc/irq/25")  # below the prefix: allowed, as for write()
    assert files.write_read("proc/irq/25/smp_affinity_list", "1").strip() == "1"
    assert (tree / "proc/irq/24/smp_affinity_list").read_text() == "1"
    before = (tree / "etc/passwd").read_text()
    with pytest.raises(PathEscapeError, match="resolves outside"):
        files.write_read("sys/fs/cgroup/cpuset/memtopo/link/passwd", "pwned")
    with pytest.raises(PathEscapeError, match="not below a writable prefix"):
        files.write_read("etc/passwd", "pwned")
    assert (tree / "etc/passwd").read_text() == before
    with pytest.raises(HostWriteError) as exc:
        files.write_read("proc/irq/99/smp_affinity_list", "1")  # never created: no O_CREAT
    assert exc.value.errno == errno.ENOENT
    if hostfs._openat2() is not None:
        # No symlink on the way: the kernel's check alone, no walk.
        def no_walk(rel: str) -> str:
            raise AssertionError(f"walked {rel}")

        monkeypatch.setattr(files, "_target", no_walk)
        assert files.write_read("proc/irq/24/smp_affinity_list", "0-1").strip() == "0-1"


def test_resolve_inside_checks_the_existing_part(tree: Path) -> None:
    files = HostFiles(HostFS.at(tree))
    mount = "sys/fs/cgroup/cpuset"
    assert files.resolve_inside(f"{mount}/memtopo/a/b/c", mount) is None
    assert "symlink" in (files.resolve_inside(f"{mount}/memtopo/link/x", mount) or "")
    assert files.resolve_inside(f"{mount}/../x", mount) is not None


# ---- parsers: real formats -------------------------------------------------------------------------
def test_parse_stat_with_parentheses_in_the_name() -> None:
    text = ("4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 7 0 123456 0 0 "
            "18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n")
    st_ = parse_stat(text)
    assert st_ is not None
    assert (st_.pid, st_.comm, st_.state, st_.ppid, st_.num_threads, st_.starttime) == (
        4242, "my (odd) name", "S", 1, 7, 123456)
    assert not st_.is_kernel_thread


def test_parse_stat_of_this_process_and_of_kthreadd() -> None:
    me = parse_stat(Path("/proc/self/stat").read_text())
    assert me is not None and me.pid == os.getpid() and not me.is_kernel_thread
    kthreadd = parse_stat(Path("/proc/2/stat").read_text())
    assert kthreadd is not None and kthreadd.is_kernel_thread  # PF_KTHREAD in the flags


def test_procs_stat_of_a_threaded_process_is_its_own(tmp_path: Path) -> None:
    """Procs.stat reads the main thread's task/PID/stat (the kernel does not sum every thread's
    counters for it): the fields the engine checks are those of /proc/PID/stat."""
    stop = threading.Event()
    workers = [threading.Thread(target=stop.wait, daemon=True) for _ in range(8)]
    for w in workers:
        w.start()
    try:
        got = Procs(HostFiles(HostFS.at(Path("/")))).stat(os.getpid())
        whole = parse_stat(Path(f"/proc/{os.getpid()}/stat").read_text())
        assert got is not None and whole is not None
        assert (got.pid, got.comm, got.ppid, got.flags, got.num_threads, got.starttime) == (
            whole.pid, whole.comm, whole.ppid, whole.flags, whole.num_threads, whole.starttime)
        assert got.num_threads >= 9
        kthreadd = Procs(HostFiles(HostFS.at(Path("/")))).stat(2)
        assert kthreadd is not None and kthreadd.is_kernel_thread
    finally:
        stop.set()
    # A root without the task directory (a capture, a stand-in) is read through /proc/PID/stat.
    (tmp_path / "proc/77").mkdir(parents=True)
    (tmp_path / "proc/77/stat").write_text("77 (x) S 1 77 77 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 3 0 555 0 0\n")
    st_ = Procs(HostFiles(HostFS.at(tmp_path))).stat(77)
    assert st_ is not None and (st_.num_threads, st_.starttime) == (3, 555)
    assert Procs(HostFiles(HostFS.at(tmp_path))).stat(78) is None


def test_parse_numa_maps_notes_example() -> None:
    # Two lines recorded from a real numa_maps, plus a policy with a space and a path with a space.
    text = ("55eb62189000 default heap anon=4 dirty=4 active=0 N0=4 kernelpagesize_kB=4\n"
            "7f6eec2ce000 default file=/usr/lib/locale/C.utf8/LC_CTYPE mapped=32 mapmax=22 N0=32 kernelpagesize_kB=4\n"
            "7f0000000000 weighted interleave:0-1 anon=10 N0=5 N1=5 kernelpagesize_kB=4\n"
            "7f1000000000 prefer (many):1 file=/tmp/a b mapped=2 N1=2 kernelpagesize_kB=4\n")
    assert parse_numa_maps(text) == {0: 41, 1: 7}


def test_parse_numa_maps_of_this_process() -> None:
    pages = parse_numa_maps(Path("/proc/self/numa_maps").read_text())
    assert pages and all(n >= 0 and c > 0 for n, c in pages.items())


def test_parse_interrupts_live_format() -> None:
    # An excerpt recorded from a dev VM's real /proc/interrupts
    text = ("           CPU0       CPU1       \n"
            " 24:          1          0  IO-APIC   5-edge      ACPI:Ged\n"
            " 36:          0      49943 PCI-MSIX-0000:00:02.0   1-edge      virtio1-req.0\n"
            "NMI:          0          0   Non-maskable interrupts\n"
            "ERR:          0\n")
    parsed = parse_interrupts(text)
    assert set(parsed) == {24, 36}
    assert parsed[36].counts == {0: 0, 1: 49943}
    assert parsed[36].tail.endswith("virtio1-req.0")


def test_parse_interrupts_maps_columns_through_the_header() -> None:
    # CPU1 offline: its column is missing, so the second count belongs to CPU2.
    parsed = parse_interrupts("      CPU0 CPU2\n 5: 10 20 GICv3 27 Level arch_timer\n")
    assert parsed[5].counts == {0: 10, 2: 20}
    assert parsed[5].tail == "GICv3 27 Level arch_timer"


def test_parse_proc_cgroup_hybrid_and_v2() -> None:
    hybrid = "9:name=systemd:/\n4:memory:/x\n3:cpuset:/memtopo/job\n0::/\n"
    assert parse_proc_cgroup(hybrid) == (parse_proc_cgroup(hybrid).__class__)("/memtopo/job", "/")
    v2 = parse_proc_cgroup("0::/kubepods/pod1 (deleted)\n")
    assert v2.v2 == "/kubepods/pod1" and v2.v1_cpuset is None


# ---- parsers: garbage ------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_stat_parser_never_raises(text: str) -> None:
    parse_stat(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("N0123456789= \n:-abk_")), max_size=400))
def test_numa_maps_parser_never_raises_and_counts_are_non_negative(text: str) -> None:
    assert all(c >= 0 and n >= 0 for n, c in parse_numa_maps(text).items())


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("CPU0123456789: \n-abcdefx")), max_size=400))
def test_interrupts_parser_never_raises(text: str) -> None:
    for irq, line in parse_interrupts(text).items():
        assert irq >= 0 and all(c >= 0 for c in line.counts.values())


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_proc_cgroup_and_setup_parsers_never_raise(text: str) -> None:
    parse_proc_cgroup(text)
    assert all(i >= 0 for i in irqbalance.parse_setup(text))


@given(st.sets(st.integers(min_value=0, max_value=4095), max_size=40))
def test_nodemask_roundtrip(nodes: set[int]) -> None:
    mask, maxnode = nodemask(nodes)
    assert maxnode == 4097
    assert nodes_of(mask) == tuple(sorted(nodes))


# ---- cgroup hierarchy detection --------------------------------------------------------------------
def _mountinfo(root: Path, text: str, extra: dict[str, str] | None = None) -> HostFiles:
    write_tree(root, {"proc/self/mountinfo": text, **(extra or {})})
    return HostFiles(HostFS.at(root))


def test_detect_hybrid_prefers_the_v1_cpuset(tmp_path: Path) -> None:
    files = _mountinfo(tmp_path, Path("/proc/self/mountinfo").read_text()
                       if "cpuset" in Path("/proc/self/mountinfo").read_text() else
                       "34 31 0:31 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n"
                       "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    h = cgroups.detect(files)
    assert isinstance(h, cgroups.Hierarchy)
    assert (h.version, h.mount, h.cpus_file, h.effective_cpus_file) == (
        1, "sys/fs/cgroup/cpuset", "cpuset.cpus", "cpuset.effective_cpus")


def test_detect_pure_v2(tmp_path: Path) -> None:
    files = _mountinfo(tmp_path, "31 23 0:28 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                       {"sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids"})
    h = cgroups.detect(files)
    assert isinstance(h, cgroups.Hierarchy)
    assert (h.version, h.mount, h.effective_cpus_file) == (2, "sys/fs/cgroup", "cpuset.cpus.effective")


def test_detect_v2_without_cpuset_and_nothing_mounted(tmp_path: Path) -> None:
    files = _mountinfo(tmp_path / "a", "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
                       {"sys/fs/cgroup/unified/cgroup.controllers": "hugetlb"})
    assert "no cpuset controller" in str(cgroups.detect(files))
    files = _mountinfo(tmp_path / "b", "22 1 0:20 / /proc rw - proc proc rw\n")
    assert "no cgroup mount" in str(cgroups.detect(files))


def test_detect_v1_noprefix_and_container_mount_root(tmp_path: Path) -> None:
    files = _mountinfo(tmp_path,
                       "34 31 0:31 /kubepods/pod1 /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset,noprefix\n")
    h = cgroups.detect(files)
    assert isinstance(h, cgroups.Hierarchy)
    assert h.cpus_file == "cpus"
    assert h.from_proc("/kubepods/pod1/c1") == "c1"
    assert h.from_proc("/elsewhere") is None


@pytest.mark.parametrize(("path", "problem"), [
    ("memtopo/a", None), ("/memtopo/a/", None), ("memtopo", None),
    ("", "hierarchy root"), ("memtopo/../x", "'..'"), ("memtopo//x", "empty"), ("memtopox", "outside"),
    ("memtopo/x\n", "newline"), ("memtopo/" + "a" * 300, "255"),
])
def test_cgroup_path_rules(path: str, problem: str | None) -> None:
    got = cgroups.path_problem(path, ("memtopo",))
    assert (got is None) if problem is None else (problem in (got or ""))


# ---- irqbalance ------------------------------------------------------------------------------------
def test_setup_reply_and_ban_command_formats() -> None:
    # irqbalance.c: "SLEEP %d " then "IRQ %d LOAD %lu DIFF %lu CLASS %d " per banned IRQ, then "BANNED <mask>".
    reply = "SLEEP 10 IRQ 43 LOAD 0 DIFF 0 CLASS 0 IRQ 44 LOAD 12 DIFF 3 CLASS 4 BANNED 00000000"
    assert irqbalance.parse_setup(reply) == (43, 44)
    assert irqbalance.ban_command([44, 43, 43]) == "settings ban irqs 43 44"
    assert irqbalance.ban_command([]) == "settings ban irqs NONE"
    with pytest.raises(irqbalance.IrqbalanceError, match="499-byte"):
        irqbalance.ban_command(range(1000, 1200))


def test_irqbalance_detected_by_its_socket_and_unit(tmp_path: Path) -> None:
    from memtopo.apply.host import Procs
    write_tree(tmp_path, {
        "proc/555/stat": "555 (irqbalance) S 1 555 555 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 777 0 0\n",
        "proc/555/cgroup": "1:name=systemd:/system.slice/irqbalance.service\n",
        "run/irqbalance/irqbalance555.sock": "",
        "proc/1/stat": "1 (systemd) S 0 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0\n",
    })
    ib = irqbalance.detect(Procs(HostFiles(HostFS.at(tmp_path))))
    assert ib == irqbalance.Irqbalance(555, 777, "run/irqbalance/irqbalance555.sock", "irqbalance.service")


def test_irqbalance_absent(tmp_path: Path) -> None:
    from memtopo.apply.host import Procs
    write_tree(tmp_path, {"proc/1/stat": "1 (systemd) S 0 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0\n"})
    assert irqbalance.detect(Procs(HostFiles(HostFS.at(tmp_path)))) is None


def test_irqbalance_client_error_is_typed(tmp_path: Path) -> None:
    with pytest.raises(irqbalance.IrqbalanceError, match="irqbalance socket"):
        irqbalance.Client(str(tmp_path / "none.sock"), timeout=0.2).banned()


# ---- undo records ----------------------------------------------------------------------------------
OPS = [
    AffinityUndo(100, 5000, (((0, 1, 2), (100, 101)), ((3,), (102,)))),
    FileUndo("proc/irq/24/smp_affinity_list", "0-7", "list"),
    MkdirUndo("sys/fs/cgroup/cpuset/memtopo/x", "sys/fs/cgroup/cpuset/memtopo/cgroup.procs"),
    AttachUndo(200, 6000, "sys/fs/cgroup/cpuset/cgroup.procs"),
    MigrateUndo(100, 5000, (0,), (1,), True),
    BanUndo(300, 3000, "/run/irqbalance/irqbalance300.sock", (7, 24)),
    ServiceUndo("irqbalance.service"),
]


@pytest.mark.parametrize("op", OPS, ids=lambda o: type(o).__name__)
def test_undo_ops_roundtrip_through_json(op: object) -> None:
    import json
    assert from_json(json.loads(json.dumps(to_json(op)))) == op  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [
    {}, {"op": "file"}, {"op": "affinity", "pid": 1, "starttime": 1, "groups": [["x", [1]]]},
    {"op": "file", "path": "a", "value": "b", "kind": "exec"}, {"op": "shell"},
    {"op": "service", "unit": "sshd.service"},
    {"op": "irqbalance_ban", "pid": 1, "starttime": 1, "address": "/run/docker.sock", "banned": []}])
def test_malformed_undo_ops_raise_a_typed_error(bad: dict[str, object]) -> None:
    with pytest.raises(UndoFormatError):
        from_json(bad)


# ---- the real system calls (this process, harmless) ------------------------------------------------
def test_real_affinity_calls_on_a_thread_of_ours() -> None:
    kernel = LinuxKernel()
    ready, done = threading.Event(), threading.Event()
    tids: list[int] = []

    def body() -> None:
        tids.append(threading.get_native_id())
        ready.set()
        done.wait(60)

    t = threading.Thread(target=body)
    t.start()
    try:
        assert ready.wait(60)
        tid = tids[0]
        mine = os.sched_getaffinity(tid)
        one = {min(mine)}
        assert kernel.set_affinities([tid], one) == {}
        got = kernel.get_affinities([tid, 2 ** 22 + 7])  # the second tid does not exist
        assert got.masks[0] == one and got.masks[1] is None
        assert got.errors == {2 ** 22 + 7: errno.ESRCH}
        assert kernel.set_affinities([tid, 2 ** 22 + 7], mine) == {2 ** 22 + 7: errno.ESRCH}
        assert os.sched_getaffinity(tid) == mine  # the good one was still set
    finally:
        done.set()
        t.join()


def test_real_mempolicy_calls_in_a_child() -> None:
    """set_mempolicy acts on the calling thread: do it in a child, report back."""
    import subprocess
    import sys
    code = ("from memtopo.apply.host import LinuxKernel, MPOL_BIND\n"
            "k = LinuxKernel()\nprint(k.get_mempolicy())\nk.set_mempolicy(MPOL_BIND, [0])\nprint(k.get_mempolicy())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.splitlines()
    assert out[0] == f"({MPOL_DEFAULT}, ())"
    assert out[1] == "(2, (0,))"


def test_real_migrate_pages_on_ourselves_returns_a_count() -> None:
    left = LinuxKernel().migrate_pages(0, [0], [0])
    assert left >= 0
