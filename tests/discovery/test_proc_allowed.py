"""proc.allowed: status + cpuset cgroup, on the hwloc cgroup dumps, lab captures, synthetic trees, this host."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.cpulist import parse_cpulist
from memtopo.discovery import proc_allowed
from memtopo.discovery.parts import Allowed
from memtopo.discovery.source import ProbeContext, State
from tests.fixtures import hwloc_root, lab_root
from tests.sysfs_tree import write_tree


def run(root: Path) -> tuple[Allowed, State, tuple[str, ...]]:
    res = proc_allowed.probe(ProbeContext.at_root(root))
    return res.data, res.status.state, res.status.reasons


def cl(text: str) -> tuple[int, ...]:
    return parse_cpulist(text)


def test_cgroup_v1_cpuset_restricted() -> None:
    # 16amd64-8n2c-cpusets: the legacy cpuset fs at /dev/cpuset (files `cpus`, `mems`), path from
    # proc/self/cpuset. cpus = 0-6,12-15 but CPU 4 is offline, so 0-3,5-6,12-15 as hwloc says.
    data, state, reasons = run(hwloc_root("16amd64-8n2c-cpusets"))
    assert (data.cgroup_version, data.cgroup_path) == (1, "/dummy")
    assert data.cpus == cl("0-3,5-6,12-15") == data.effective_cpus
    assert data.mems == (1, 2, 3, 4) == data.effective_mems
    # The dump has no proc/self/status: the answer stands on the cgroup alone, and says so.
    assert state is State.DEGRADED and reasons == ("proc/self/status: missing",)


def test_cgroup_v2_cpuset_restricted() -> None:
    # 32amd64-4s2n4c-cgroup2: cgroup2 at /cgroup/unified (proc/mounts), cpuset in its controllers.
    data, state, reasons = run(hwloc_root("32amd64-4s2n4c-cgroup2"))
    assert (data.cgroup_version, data.cgroup_path) == (2, "/uid_2008/job_15389/step_0")
    assert data.cpus == (0, 1, 2, 3, 4, 5) == data.effective_cpus
    assert data.mems == (0, 1, 2, 3, 4, 5)  # INDEX: 6 NUMA nodes allowed, P#0-P#5
    assert state is State.DEGRADED and reasons == ("proc/self/status: missing",)


def test_cgroup_v1_noprefix_mount_walks_up() -> None:
    # 40intel64: v1 mounted with `noprefix`; the job's dir has an empty `cpus`, so its parent's applies.
    data, _, reasons = run(hwloc_root("40intel64-2g2n4c+pcilocality"))
    assert (data.cgroup_version, data.cgroup_path) == (1, "/torque/513099.master.cm.cluster")
    assert data.cpus == tuple(range(40)) and data.mems == (0, 1, 2, 3)
    assert reasons == ("proc/self/status: missing",)


def test_lab_capture_status_and_unreadable_v2_root() -> None:
    data, state, reasons = run(lab_root("dual-socket-cxl"))
    assert data.cpus == (0, 1, 2, 3) and data.mems == (0, 1, 2)
    assert (data.cgroup_version, data.cgroup_path) == (2, "/")
    # /sys/fs/cgroup was not captured, so whether cpuset restricts anything is unknown.
    assert data.effective_cpus == ()
    assert state is State.DEGRADED and reasons == ("sys/fs/cgroup/cgroup.controllers: missing",)


V2 = {
    "proc/self/status": "Name:\tx\nCpus_allowed:\tff\nCpus_allowed_list:\t0-7\nMems_allowed_list:\t0-1\n",
    "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
    "proc/self/mountinfo": "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
                           "31 1 0:27 / /proc rw - proc proc rw\n",
    "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids",
    "sys/fs/cgroup/kubepods/pod1/cpuset.cpus.effective": "2-5",
    "sys/fs/cgroup/kubepods/pod1/cpuset.mems.effective": "1",
    "sys/fs/cgroup/kubepods/pod1/ctr/cgroup.procs": "1",
}


def test_v2_intersection_and_inherited_parent(tmp_path: Path) -> None:
    # ctr has no cpuset files (controller not enabled below pod1): pod1's sets apply.
    data, state, reasons = run(write_tree(tmp_path, V2))
    assert state is State.OK, reasons
    assert (data.cgroup_version, data.cgroup_path) == (2, "/kubepods/pod1/ctr")
    assert data.effective_cpus == (2, 3, 4, 5) and data.effective_mems == (1,)
    assert data.cpus == (2, 3, 4, 5) and data.mems == (1,)


def test_status_narrower_than_cgroup(tmp_path: Path) -> None:
    spec = dict(V2, **{"proc/self/status": "Cpus_allowed_list:\t3-4,7\nMems_allowed_list:\t0-1\n"})
    data, _, _ = run(write_tree(tmp_path, spec))
    assert data.cpus == (3, 4)  # taskset-style affinity ∩ cpuset


def test_hybrid_v1_cpuset_wins_over_v2_without_cpuset(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "proc/self/status": "Cpus_allowed_list:\t0-3\nMems_allowed_list:\t0\n",
        "proc/self/cgroup": "9:name=systemd:/\n3:cpuset:/job\n0::/\n",
        "proc/self/mountinfo":
            "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
            "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
        "sys/fs/cgroup/unified/cgroup.controllers": "hugetlb",
        "sys/fs/cgroup/cpuset/job/cpuset.effective_cpus": "1-2",
        "sys/fs/cgroup/cpuset/job/cpuset.effective_mems": "0",
    })
    data, state, reasons = run(root)
    assert state is State.OK, reasons
    assert (data.cgroup_version, data.cgroup_path, data.cpus) == (1, "/job", (1, 2))


def test_container_mount_root_is_not_repeated(tmp_path: Path) -> None:
    # Without a cgroup namespace a container sees its own cgroup bind-mounted at /sys/fs/cgroup/cpuset.
    root = write_tree(tmp_path, {
        "proc/self/status": "Cpus_allowed_list:\t0-7\nMems_allowed_list:\t0\n",
        "proc/self/cgroup": "3:cpuset:/docker/abc\n",
        "proc/self/mountinfo": "34 31 0:31 /docker/abc /sys/fs/cgroup/cpuset ro - cgroup cgroup rw,cpuset\n",
        "sys/fs/cgroup/cpuset/cpuset.effective_cpus": "6-7",
        "sys/fs/cgroup/cpuset/cpuset.effective_mems": "0",
    })
    data, state, reasons = run(root)
    assert state is State.OK, reasons
    assert data.cpus == (6, 7)


def test_no_cgroup_at_all(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"proc/self/status": "Cpus_allowed_list:\t0-1\nMems_allowed_list:\t0\n",
                                 "proc/mounts": "proc /proc proc rw 0 0\n"})
    data, state, reasons = run(root)
    assert (data.cpus, data.mems, data.cgroup_version) == ((0, 1), (0,), 0)
    assert state is State.DEGRADED and any("no cgroup" in r for r in reasons)


def test_xml_input_is_unavailable() -> None:
    assert proc_allowed.probe(ProbeContext.at_root("/", hwloc_xml=Path("x.xml"))).status.state \
        is State.UNAVAILABLE


def test_live_host_agrees_with_status() -> None:
    data, state, reasons = run(Path("/"))
    assert state is State.OK, reasons
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
                  if ":" in line)
    status_cpus = cl(fields["Cpus_allowed_list"])
    assert set(data.cpus) <= set(status_cpus)
    if data.effective_cpus:
        assert data.cpus == tuple(c for c in status_cpus if c in set(data.effective_cpus))
    else:
        assert data.cpus == status_cpus
    assert data.cgroup_version in (1, 2)


garbage = st.one_of(
    st.tuples(st.text(max_size=30), st.sampled_from(["x", "--", "\u0663", ",,"]), st.text(max_size=30))
    .map(lambda t: (t[0] + t[1] + t[2]).encode()),
    st.binary(max_size=40).map(lambda b: b + b"\xfe"),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["status-value", "status-file", "effective"]), content=garbage)
def test_garbage_degrades_and_names_the_file(tmp_path_factory: pytest.TempPathFactory, which: str,
                                             content: bytes) -> None:
    root = write_tree(tmp_path_factory.mktemp("a"), V2)
    if which == "status-value":
        rel = "proc/self/status"
        (root / rel).write_bytes(b"Cpus_allowed_list:\t" + content.replace(b"\n", b" ") + b"\nMems_allowed_list:\t0\n")
    elif which == "status-file":
        rel = "proc/self/status"
        (root / rel).write_bytes(content.replace(b"allowed", b""))
    else:
        rel = "sys/fs/cgroup/kubepods/pod1/cpuset.cpus.effective"
        (root / rel).write_bytes(content)
    data, state, reasons = run(root)
    assert state is State.DEGRADED
    assert any(rel in r for r in reasons), reasons
    assert data.cgroup_path == "/kubepods/pod1/ctr"
