"""What hwloc's Linux backend will parse, checked before it may load a root (discovery/hwloc_input.py).

Every case is a copy of a real numa-vm lab capture with one file made into something no kernel
writes; hwloc's own parsers are emulated here in Python (strtoul with base 0 into a C int, the list
loop of hwloc__read_path_as_cpulist) to show that what passes the check is what hwloc reads. The
fuzz tests at the end load what passes with the real hwloc, in a child process so that a crash is a
failure rather than the end of the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from memtopo import hostfs
from memtopo.cpulist import KERNEL_MAX_CPUS, KERNEL_MAX_NODES
from memtopo.discovery import capture, hwloc, hwloc_input
from memtopo.discovery.source import ProbeContext, State
from memtopo.hostfs import HostFS
from tests.fixtures import HWLOC_LINUX, LAB_CAPTURES, REPO, extracted, lab_root

NODE = "sys/devices/system/node"
CPU = "sys/devices/system/cpu"


def capture_copy(dest: Path, name: str = "single") -> Path:
    root = dest / "root"
    shutil.copytree(capture.find_root(extracted(LAB_CAPTURES / f"{name}.tar.gz")), root, symlinks=True)
    return root


def write(root: Path, rel: str, text: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    if (root / rel).is_symlink():
        (root / rel).unlink()
    (root / rel).write_text(text)


# ---- hwloc's parsers, in Python --------------------------------------------------------------------
def strtoul(text: str) -> tuple[int, int]:
    """C strtoul(text, &end, 0): (value as unsigned long, characters consumed; 0 when none)."""
    i = 0
    while i < len(text) and text[i] in " \t\n\v\f\r":
        i += 1
    sign = 1
    if i < len(text) and text[i] in "+-":
        sign = -1 if text[i] == "-" else 1
        i += 1
    base, start = 10, i
    if text[i:i + 2].lower() == "0x" and i + 2 < len(text) and text[i + 2] in "0123456789abcdefABCDEF":
        base, i = 16, i + 2
    elif text[i:i + 1] == "0":
        base = 8
    digits = "0123456789abcdef"[:base]
    j = i
    while j < len(text) and text[j].lower() in digits:
        j += 1
    if j == start or (base == 16 and j == i):
        return 0, 0
    value = int(text[i:j], base) if j > i else 0
    return (sign * value) % (1 << 64), j


def as_c_int(value: int) -> int:
    value %= 1 << 32
    return value - (1 << 32) if value >= 1 << 31 else value


def hwloc_list(text: str, universe: int) -> set[int] | None:
    """The ids hwloc__read_path_as_cpulist sets below ``universe``; None when it would set ids at or
    beyond it (an infinite or huge set)."""
    text = text.split("\0", 1)[0]
    cleared: list[tuple[int, int]] = []  # ranges hwloc clears out of a full set, -1 meaning "to the end"
    prevlast = -1
    for chunk in text.split(","):
        nextfirst_u, used = strtoul(chunk)
        nextfirst = as_c_int(nextfirst_u)
        rest = chunk[used:]
        nextlast = as_c_int(strtoul(rest[1:])[0]) if rest.startswith("-") else nextfirst
        if prevlast + 1 <= nextfirst - 1:
            cleared.append((prevlast + 1, nextfirst - 1))
        prevlast = nextlast
    cleared.append((prevlast + 1, -1))
    ids = set(range(universe))
    huge = True
    for lo, hi in cleared:
        if hi == -1:
            if lo <= universe:
                huge = False
            ids -= set(range(max(lo, 0), universe))
        else:
            ids -= set(range(max(lo, 0), min(hi + 1, universe)))
    return ids if not huge else None


# ---- the kernel's list form -------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "ranges"), [
    ("0-3,8,10-11\n", [(0, 3), (8, 8), (10, 11)]), ("\n", []), ("0", [(0, 0)]),
    ("-1", None), ("0x10", None), ("010", None), ("3-1", None), ("0-3,2", None), ("0, 1", None),
    ("4294967296", [(4294967296, 4294967296)]), ("0-3:1/2", None),
])
def test_only_the_kernels_own_list_form_is_accepted(text: str, ranges: list[tuple[int, int]] | None) -> None:
    assert hwloc_input.kernel_list(text) == ranges


@settings(max_examples=300)
@given(st.text(alphabet="0123456789-,x+ \n\0abf", max_size=24))
@example("0-65535")
@example("-1")
@example("4294967295")
@example("0-2147483647")
def test_an_accepted_list_is_what_hwloc_reads(text: str) -> None:
    """What hwloc's strtoul makes of an accepted list (the kernel's form, below its bound) is exactly
    its ranges; a list hwloc would read past the bound, or as no node at all (its weight is asserted
    to be at least 1), is refused."""
    ranges = hwloc_input.kernel_list(text)
    accepted = ranges is not None and (not ranges or ranges[-1][1] < KERNEL_MAX_NODES)
    hwloc_sees = hwloc_list(text, KERNEL_MAX_NODES + 2)
    if ranges is not None and accepted:
        assert hwloc_sees == {i for lo, hi in ranges for i in range(lo, hi + 1)} or (not ranges and hwloc_sees == {0})
    if hwloc_sees is None or hwloc_sees == set() or any(i >= KERNEL_MAX_NODES for i in hwloc_sees):
        assert not accepted


# ---- each file hwloc parses -------------------------------------------------------------------------
HOSTILE: dict[str, tuple[str, str, str]] = {
    # case: (file, content, what the reason says)
    "node/online 0-65535": (f"{NODE}/online", "0-65535\n", "MAX_NUMNODES"),
    "node/online -1": (f"{NODE}/online", "-1\n", "not a list the kernel writes"),
    "node/online 4294967295": (f"{NODE}/online", "4294967295\n", "MAX_NUMNODES"),
    "node/online 0-2147483647": (f"{NODE}/online", "0-2147483647\n", "MAX_NUMNODES"),
    "node/online hex": (f"{NODE}/online", "0x10\n", "not a list the kernel writes"),
    "node/online empty": (f"{NODE}/online", "\n", "no node is online"),
    "cpu/online 0-2147483647": (f"{CPU}/online", "0-2147483647\n", "nr_cpu_ids"),
    "cpu/possible 0-65535": (f"{CPU}/possible", "0-65535\n", "NR_CPUS"),
    "cpu/online beyond possible": (f"{CPU}/online", "0-5\n", "nr_cpu_ids 2"),
    "hybrid PMU cpus": ("sys/devices/cpu_core/cpus", "0-99999\n", "nr_cpu_ids"),
    "node0 cpumap beyond nr_cpu_ids": (f"{NODE}/node0/cpumap", "00000100\n", "CPU 8 beyond nr_cpu_ids 2"),
    "node0 MemTotal 2^60 kB": (f"{NODE}/node0/meminfo", f"Node 0 MemTotal: {1 << 60} kB\n", "not a size in 64 bits"),
    "MemTotal not a number": ("proc/meminfo", "MemTotal: 1e9 kB\n", "not a size in 64 bits"),
    "node0 distance -1": (f"{NODE}/node0/distance", "-1\n", "not a row of distances the kernel writes"),
    "node0 distance of 2000 columns": (f"{NODE}/node0/distance", "10 " * 2000 + "\n",
                                       "not a row of distances the kernel writes"),
    "cpuinfo of 10,000 processors": ("proc/cpuinfo", "".join(f"processor\t: {i}\n\n" for i in range(10_000)),
                                     "10000 processor entries"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_file_no_kernel_writes_keeps_hwloc_off_the_root(tmp_path: Path, case: str) -> None:
    root = capture_copy(tmp_path)
    rel, text, why = HOSTILE[case]
    write(root, rel, text)
    found = hwloc_input.problems(HostFS.at(root))
    assert any(p.startswith(rel) and why in p for p in found), found
    result = hwloc.probe(ProbeContext.at_root(root))
    assert result.status.state is State.DEGRADED
    assert result.status.reasons[0].startswith("hwloc not run on this root: ") and why in result.status.reasons[0]
    assert not result.data.loaded


@pytest.mark.parametrize(("entry", "why"), [
    ("cpu4000000000", "nr_cpu_ids"), ("cpu0x10", "not a name the kernel gives"), ("cpu-1", "not a name"),
    ("cpu08", "not a name"),
])
def test_a_cpu_directory_no_kernel_makes_keeps_hwloc_off_the_root(tmp_path: Path, entry: str, why: str) -> None:
    """hwloc turns each cpuN name into a bit of a bitmap: cpu4000000000 is 500 MB."""
    root = capture_copy(tmp_path)
    (root / CPU / entry).mkdir()
    found = hwloc_input.problems(HostFS.at(root))
    assert any(entry in p and why in p for p in found), found


def test_node_directories_beyond_max_numnodes_keep_hwloc_off_the_root(tmp_path: Path) -> None:
    """Without node/online hwloc counts the nodeN directories."""
    root = capture_copy(tmp_path)
    (root / NODE / "online").unlink()
    (root / NODE / "node5000").mkdir()
    assert any("node5000" in p and "MAX_NUMNODES" in p for p in hwloc_input.problems(HostFS.at(root)))


def test_a_cpumask_longer_than_a_kernel_prints_is_refused_by_the_tree_check(tmp_path: Path) -> None:
    """hwloc's sscanf loop over a mask costs its length squared: a 64 KiB cpumap per node would keep
    it busy for minutes. A kernel prints at most 2304 bytes (8192 CPUs)."""
    root = capture_copy(tmp_path)
    write(root, f"{NODE}/node0/cpumap", ",".join(["00000000"] * 7000) + ",00000003\n")
    found = HostFS.at(root).tree_problems
    assert any("node0/cpumap" in p and f"larger than {hostfs.MAX_CPUMASK_BYTES} bytes" in p for p in found)


@pytest.mark.parametrize("how", ["cgroup name", "mount point"])
def test_a_cgroup_path_out_of_the_root_keeps_hwloc_off_it(tmp_path: Path, how: str) -> None:
    """hwloc builds the cpuset file's path from /proc/self/cgroup and /proc/mounts and opens it
    relative to the root, so ``..`` there reaches the host's files."""
    root = capture_copy(tmp_path)
    if how == "cgroup name":
        write(root, "proc/self/cgroup", "0::/../../../../../../etc\n")
        write(root, "proc/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n")
    else:
        write(root, "proc/self/cgroup", "0::/\n")
        write(root, "proc/mounts", "cgroup2 /../../../../etc cgroup2 rw 0 0\n")
    assert any("climbs out of the root" in p for p in hwloc_input.problems(HostFS.at(root)))


@pytest.mark.parametrize(("attr", "text", "why"), [
    ("cpuset.cpus.effective", "0-2147483647\n", "nr_cpu_ids"),
    ("cpuset.mems.effective", "0-65535\n", "MAX_NUMNODES"),
])
def test_the_cgroup_lists_hwloc_reads_are_checked(tmp_path: Path, attr: str, text: str, why: str) -> None:
    root = capture_copy(tmp_path)
    write(root, "proc/self/cgroup", "0::/work\n")
    write(root, "proc/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n")
    write(root, f"sys/fs/cgroup/work/{attr}", text)
    assert any(p.startswith(f"sys/fs/cgroup/work/{attr}") and why in p for p in hwloc_input.problems(HostFS.at(root)))


def test_a_cxl_decoder_name_that_is_a_path_keeps_hwloc_off_the_root(tmp_path: Path) -> None:
    root = capture_copy(tmp_path)
    write(root, "sys/bus/cxl/devices/region0/target0", "../../../../../etc\n")
    assert any("region0/target0" in p and "is a path" in p for p in hwloc_input.problems(HostFS.at(root)))


def test_problems_are_counted_past_the_first_few(tmp_path: Path) -> None:
    root = capture_copy(tmp_path)
    for i in range(hwloc_input.KEPT + 3):
        (root / CPU / f"cpu0x{i}").mkdir()
    found = hwloc_input.problems(HostFS.at(root))
    assert len(found) == hwloc_input.KEPT + 1 and found[-1] == "and 3 more"


@pytest.mark.parametrize("root", [*sorted(p.name for p in HWLOC_LINUX.glob("*.tar.bz2")), "lab"])
def test_every_real_capture_passes(root: str) -> None:
    """No false alarm: hwloc's own captures of real machines and the lab's all pass."""
    path = lab_root("dual-socket-cxl-tiered") if root == "lab" else extracted(HWLOC_LINUX / root)
    fs = HostFS.at(path)
    assert fs.tree_problems == () and hwloc_input.problems(fs) == []


# ---- fuzz: what passes, hwloc reads without harm ------------------------------------------------------
# The real hwloc loads each root that passes, in a child (a crash there is this test's failure).
LOAD = r"""
import json, sys
from memtopo.discovery import hwloc
from memtopo.discovery.source import ProbeContext
result = hwloc.probe(ProbeContext.at_root(sys.argv[1]))
print(json.dumps({"nodes": len(result.data.nodes), "reasons": result.status.reasons}))
"""

_NUMBERS = st.one_of(st.integers(0, 3), st.integers(0, 2000), st.sampled_from([65535, 2**31 - 1, 2**32 - 1, 2**32]))
_LISTS = st.one_of(
    st.lists(st.tuples(_NUMBERS, _NUMBERS), max_size=3).map(
        lambda rs: ",".join(f"{a}" if a == b else f"{min(a, b)}-{max(a, b)}" for a, b in rs)),
    st.sampled_from(["-1", "0x3", "01", "0-", ",", "0,,1", " 0", "0\n1"]),
)


@settings(max_examples=25)
@given(node_online=_LISTS, cpu_online=_LISTS, cpu_dir=st.sampled_from(["", "cpu7", "cpu9000", "cpu0x1"]))
@example(node_online="0-65535", cpu_online="0-1", cpu_dir="")
@example(node_online="-1", cpu_online="0-1", cpu_dir="")
def test_what_passes_the_check_hwloc_loads_without_harm(node_online: str, cpu_online: str, cpu_dir: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = capture_copy(Path(tmp))
        write(root, f"{NODE}/online", node_online + "\n")
        write(root, f"{CPU}/online", cpu_online + "\n")
        if cpu_dir:
            (root / CPU / cpu_dir).mkdir()
        fs = HostFS.at(root)
        passed = not fs.tree_problems and not hwloc_input.problems(fs)
        if passed:
            assert hwloc_list(node_online, KERNEL_MAX_NODES + 1) is not None
            assert max(hwloc_list(node_online, KERNEL_MAX_NODES + 1) or {0}) < KERNEL_MAX_NODES
            assert max(hwloc_list(cpu_online, KERNEL_MAX_CPUS + 1) or {0}) < KERNEL_MAX_CPUS
        # MALLOC_CHECK_: glibc aborts at once on a corrupted heap instead of maybe later.
        res = subprocess.run([sys.executable, "-c", LOAD, str(root)], cwd=REPO, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "MALLOC_CHECK_": "3"})
        assert res.returncode == 0, (node_online, cpu_online, cpu_dir, res.returncode, res.stderr[-500:])
        loaded = json.loads(res.stdout.splitlines()[-1])
        refused = [r for r in loaded["reasons"] if r.startswith("hwloc not run on this root")]
        assert (loaded["nodes"] >= 1 and not refused) if passed else (refused and loaded["nodes"] == 0)
