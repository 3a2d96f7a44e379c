"""Hostile captured roots, hwloc input and tarballs: nothing leaks, nothing hangs, nothing crashes.

Every fixture is generated here in a temp dir from a real capture of the numa-vm lab (a copy, then
the one hostile change): links out of the root, FIFOs, devices, huge numbers, broken archives.
Discovery runs on a thread of its own where the old code would block, so a regression fails the
test (after a generous wait) instead of hanging the suite.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import pytest
from google.protobuf import json_format
from hypothesis import example, given, settings
from hypothesis import strategies as st

from memtopo import hostfs
from memtopo.cli.main import main
from memtopo.discovery import capture, sysfs_pci, sysfs_tiers
from memtopo.discovery.capture import CaptureError, open_root
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext, ProbeResult
from memtopo.hostfs import HostFS, HostReadError
from memtopo.k8s.nrt import MAX_OBJECT_BYTES, object_bytes
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import HWLOC_XML, LAB_CAPTURES, REPO, extracted
from tests.synth import numa_scale_host, tree, write_root

# Far above what any of these runs needs; only a hang (the old code) reaches it.
HANG_S = 300.0
SECRET = "TOPSECRET-" + "x" * 5000
NODE0 = "sys/devices/system/node/node0"
CPU = "sys/devices/system/cpu"


def capture_copy(dest: Path, name: str = "single") -> Path:
    """A private copy of a lab capture (single: 1 node, 2 CPUs; dual-socket-tiered: 3 nodes, HMAT,
    memory tiers) to make hostile."""
    src = capture.find_root(extracted(LAB_CAPTURES / f"{name}.tar.gz"))
    root = dest / "root"
    shutil.copytree(src, root, symlinks=True)
    return root


def replace(root: Path, rel: str, make: Callable[[Path], None]) -> None:
    path = root / rel
    if path.is_symlink() or path.exists():
        path.unlink()
    make(path)


def discover_bounded(ctx: ProbeContext) -> pb.MemoryTopology:
    box: list[pb.MemoryTopology | BaseException] = []

    def run() -> None:
        try:
            box.append(discover(ctx))
        except BaseException as exc:  # handed to the test thread
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), "discovery hung"
    (result,) = box
    if isinstance(result, BaseException):
        raise result
    return result


def topo_of(root: Path) -> pb.MemoryTopology:
    return discover_bounded(ProbeContext.at_root(root))


def source(topo: pb.MemoryTopology, name: str) -> pb.SourceStatus:
    return next(s for s in topo.sources if s.source == name)


def as_text(topo: pb.MemoryTopology) -> str:
    return json_format.MessageToJson(topo)


@pytest.fixture(params=["openat2", "walk"])
def lookup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both ways a captured root is walked: the kernel's RESOLVE_IN_ROOT and the O_NOFOLLOW walk
    used where openat2 is missing (old kernels, seccomp)."""
    if request.param == "walk":
        monkeypatch.setattr(hostfs, "_openat2", lambda: None)
    elif hostfs._openat2() is None:
        pytest.skip("openat2 is not available here")
    yield request.param


# ---- 1. reads stay inside the root ---------------------------------------------------------------------
@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_a_link_out_of_the_root_is_never_read(tmp_path: Path, lookup: str, target: str) -> None:
    """`ln -sf /etc/shadow C/…/node0/cpulist` put the whole file in sysfs.numa's reason."""
    root = capture_copy(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    link = str(secret) if target == "absolute" else "../" * 12 + "secret"
    replace(root, f"{NODE0}/cpulist", lambda p: os.symlink(link, p))
    replace(root, "proc/meminfo", lambda p: os.symlink(link, p))
    topo = topo_of(root)
    assert "TOPSECRET" not in as_text(topo)
    numa = source(topo, "sysfs.numa")
    assert numa.state == pb.SOURCE_STATE_DEGRADED
    assert f"{NODE0}/cpulist: missing" in numa.reasons
    # hwloc follows links against the real /: it is not pointed at this tree at all.
    hw = source(topo, "hwloc")
    assert hw.state == pb.SOURCE_STATE_DEGRADED
    assert "hwloc not run on this root" in hw.reasons[0] and "cpulist" in hw.reasons[0]


def test_links_inside_the_root_resolve_inside_it(tmp_path: Path, lookup: str) -> None:
    """sysfs's own links are relative and stay inside; an absolute one means that path in the
    capture, and ``..`` stops at the root, as for a process chrooted there."""
    root = tmp_path / "r"
    (root / "sys/devices/pci0000:00/0000:00:01.0").mkdir(parents=True)
    (root / "sys/devices/pci0000:00/0000:00:01.0/numa_node").write_text("1\n")
    (root / "sys/bus/pci/devices").mkdir(parents=True)
    os.symlink("../../../devices/pci0000:00/0000:00:01.0", root / "sys/bus/pci/devices/0000:00:01.0")
    os.symlink("/sys/devices/pci0000:00/0000:00:01.0/numa_node", root / "abs")
    os.symlink("../../../../../../sys/devices/pci0000:00/0000:00:01.0/numa_node", root / "sys/up")
    (root / "fifo").mkdir()  # a directory where a FIFO could be: harmless
    fs = HostFS.at(root)
    assert fs.read_int("sys/bus/pci/devices/0000:00:01.0/numa_node") == 1
    assert fs.read_int("abs") == 1
    assert fs.read_int("sys/up") == 1
    assert fs.resolve("sys/bus/pci/devices/0000:00:01.0") == "sys/devices/pci0000:00/0000:00:01.0"
    assert fs.resolve("abs") == "sys/devices/pci0000:00/0000:00:01.0/numa_node"
    assert fs.readlink("sys/bus/pci/devices/0000:00:01.0") == "../../../devices/pci0000:00/0000:00:01.0"
    assert fs.listdir("sys/bus/pci/devices/0000:00:01.0") == ["numa_node"]
    assert fs.is_dir("sys/bus/pci/devices/0000:00:01.0") and not fs.is_dir("abs")
    os.symlink("loop", root / "loop")
    with pytest.raises(HostReadError, match="symbolic links"):
        fs.read_text("loop")


def test_a_parser_error_quotes_a_short_escaped_excerpt(tmp_path: Path) -> None:
    root = capture_copy(tmp_path)
    (root / NODE0 / "cpulist").write_text("\x1b[2J" + "garbage," * 1000)
    numa = source(topo_of(root), "sysfs.numa")
    (reason,) = [r for r in numa.reasons if "cpulist" in r]
    assert len(reason) < 200
    assert "\\x1b[2J" in reason and "\x1b" not in reason and "(8004 chars)" in reason


def gh200_copy(dest: Path, host: str = "gh200") -> Path:
    """A synthesized host (tests/fixtures): gh200 has an NVML replay, ascend-a2-8x910b recorded tools."""
    src = capture.find_root(extracted(REPO / f"tests/fixtures/{host}/root.tar.gz"))
    root = dest / "root"
    shutil.copytree(src, root, symlinks=True)
    return root


@pytest.mark.parametrize("what", ["nvml.json", "tools"])
def test_recordings_linked_out_of_the_root_are_not_replayed(tmp_path: Path, what: str) -> None:
    """The NVML replay and recorded tool outputs are read inside the root like any other file."""
    root = gh200_copy(tmp_path, "gh200" if what == "nvml.json" else "ascend-a2-8x910b")
    outside = tmp_path / "outside"
    shutil.copytree(root / ".memtopo", outside)
    if what == "nvml.json":
        doc = json.loads((outside / "nvml.json").read_text())
        doc["devices"][0]["name"] = "TOPSECRET GPU"
        (outside / "nvml.json").write_text(json.dumps(doc))
        replace(root, ".memtopo/nvml.json", lambda p: os.symlink(outside / "nvml.json", p))
    else:
        for f in (outside / "tools").iterdir():
            if f.name != "argv.json":
                f.write_text(f.read_text().replace("910B", "TOPSECRET"))
        shutil.rmtree(root / ".memtopo/tools")
        os.symlink(outside / "tools", root / ".memtopo/tools")
    topo = topo_of(root)
    assert "TOPSECRET" not in as_text(topo)


def test_a_fifo_as_the_nvml_replay_is_not_waited_on(tmp_path: Path) -> None:
    root = gh200_copy(tmp_path)
    replace(root, ".memtopo/nvml.json", lambda p: os.mkfifo(p))
    topo = topo_of(root)
    nvidia = source(topo, "nvidia")
    assert nvidia.state == pb.SOURCE_STATE_DEGRADED
    assert "without an NVML recording" in nvidia.reasons[0]


# ---- 2. no hangs, no unbounded reads ---------------------------------------------------------------------
FIFO_PLACES = [f"{NODE0}/meminfo", f"{NODE0}/distance", f"{CPU}/online", "sys/bus/pci/devices/0000:00:01.0/numa_node"]


@pytest.mark.parametrize("rel", FIFO_PLACES)
def test_a_fifo_in_the_root_is_an_error_not_a_wait(tmp_path: Path, lookup: str, rel: str) -> None:
    root = capture_copy(tmp_path)
    replace(root, rel, lambda p: os.mkfifo(p))
    topo = topo_of(root)
    reasons = [r for s in topo.sources for r in s.reasons]
    assert f"{rel}: not a regular file (a FIFO)" in reasons
    assert "not a regular file (a FIFO)" in source(topo, "hwloc").reasons[0]


@pytest.mark.parametrize("rel,device", [(f"{CPU}/online", "/dev/zero"), ("proc/cpuinfo", "/dev/urandom"),
                                        (f"{NODE0}/cpulist", "/dev/zero")])
def test_device_links_and_nodes_are_never_read(tmp_path: Path, lookup: str, rel: str, device: str) -> None:
    """/dev/zero as cpu/online reached 4.1 GB; /dev/urandom as proc/cpuinfo kept hwloc reading."""
    root = capture_copy(tmp_path)
    replace(root, rel, lambda p: os.symlink(device, p))
    topo = topo_of(root)
    assert source(topo, "hwloc").state == pb.SOURCE_STATE_DEGRADED
    if os.geteuid() != 0:
        return
    dev = os.stat(device).st_rdev
    replace(root, rel, lambda p: os.mknod(p, 0o644 | stat.S_IFCHR, dev))
    topo = topo_of(root)
    reasons = [r for s in topo.sources for r in s.reasons]
    assert "not a regular file (a character device)" in source(topo, "hwloc").reasons[0]
    if rel != "proc/cpuinfo":  # no probe of ours reads cpuinfo
        assert f"{rel}: not a regular file (a character device)" in reasons


def test_an_oversized_file_is_refused_unread(tmp_path: Path) -> None:
    root = capture_copy(tmp_path)
    with open(root / CPU / "online", "wb") as f:  # sparse: costs no disk
        f.truncate(hostfs.MAX_TREE_FILE_BYTES + 1)
    topo = topo_of(root)
    assert f"{CPU}/online: larger than {hostfs.MAX_RECORD_BYTES} bytes ({hostfs.MAX_TREE_FILE_BYTES + 1})" \
        in source(topo, "sysfs.numa").reasons
    assert "larger than" in source(topo, "hwloc").reasons[0]


def test_a_flood_of_dangling_pci_entries_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """100,000 dangling PCI links took over 60 s. The bound (16384 functions) is lowered here so
    the test stays small; what is checked is that the work stops at it."""
    monkeypatch.setattr(sysfs_pci, "MAX_PCI_FUNCTIONS", 64)
    monkeypatch.setitem(hostfs.DIR_LIMITS, "sys/bus/pci/devices", 64)
    root = capture_copy(tmp_path)
    bus = root / "sys/bus/pci/devices"
    for i in range(300):
        os.symlink(f"../../../devices/pci0001:00/0001:00:{i // 8:02x}.{i % 8}", bus / f"0001:{i // 256:02x}:"
                   f"{i % 256 // 8:02x}.{i % 8}")
    topo = topo_of(root)
    pci = source(topo, "sysfs.pci")
    assert pci.reasons[0].startswith("sys/bus/pci/devices: ") and "read the first 64" in pci.reasons[0]
    # One problem per dangling link, and only the first 50 of them spelled out.
    assert pci.reasons[-1].startswith("and ") and len(pci.reasons) == 51
    assert "'sys/bus/pci/devices': more than 64 entries" in source(topo, "hwloc").reasons[0]


def test_a_probe_past_its_deadline_is_reported_and_left_behind(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root = capture_copy(tmp_path)
    release = threading.Event()
    real = sysfs_tiers.probe

    def stuck(ctx: ProbeContext) -> ProbeResult[object]:
        release.wait(HANG_S)
        return real(ctx)

    monkeypatch.setattr(sysfs_tiers, "probe", stuck)
    try:
        topo = discover_bounded(ProbeContext.at_root(root, deadline_s=0.5))
    finally:
        release.set()
    tiers = source(topo, "sysfs.memory_tiers")
    assert tiers.state == pb.SOURCE_STATE_UNAVAILABLE
    assert "did not finish within its deadline of 0.5 s" in tiers.reasons[0]
    # The probes after it still ran.
    assert source(topo, "sysfs.pci").state == pb.SOURCE_STATE_OK
    assert list(topo.cpus.online) == [0, 1]


# ---- 3. what hwloc parses in C ---------------------------------------------------------------------------
def memtopo(*args: str, tmpdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
    return subprocess.run([sys.executable, "-m", "memtopo.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_S, env=env, check=False)


def as_tarball(root: Path, out: Path) -> Path:
    with tarfile.open(out, "w:gz") as tf:
        tf.add(root, arcname="capture")
    return out


@pytest.mark.parametrize("online", ["0-65535", "-1", "4294967295", "0-2147483647"])
@pytest.mark.parametrize("packed", ["directory", "tarball"])
def test_a_node_list_that_crashed_hwloc_degrades_its_source(tmp_path: Path, online: str, packed: str) -> None:
    """node/online = 0-65535 corrupted hwloc's heap (a SIGSEGV in `topo`, "free(): invalid next size"
    in `k8s nrt`); -1, 2^32-1 and 0-2^31-1 aborted on hwloc's assertion. Now hwloc is kept off the
    root and says why, the kernel's files still give the node, and no extraction is left behind."""
    root = capture_copy(tmp_path)
    (root / "sys/devices/system/node/online").write_text(online + "\n")
    given = str(root) if packed == "directory" else str(as_tarball(root, tmp_path / "root.tar.gz"))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    res = memtopo("topo", "--root", given, "--format", "json", tmpdir=scratch)
    assert res.returncode == 0, res.stderr[-600:]
    topo = json_format.Parse(res.stdout, pb.MemoryTopology())
    hw = source(topo, "hwloc")
    assert hw.state == pb.SOURCE_STATE_DEGRADED
    assert hw.reasons[0].startswith("hwloc not run on this root: sys/devices/system/node/online: ")
    assert [n.id for n in topo.numa_nodes] == [0] and list(topo.cpus.online) == [0, 1]
    res = memtopo("k8s", "nrt", "--root", given, "--node-name", "lab-1", "--format", "json", tmpdir=scratch)
    assert res.returncode == 0, res.stderr[-600:]
    assert [z["name"] for z in json.loads(res.stdout)["zones"]] == ["node-0"]
    assert not list(scratch.iterdir())


# ---- 4. numbers the schema cannot carry ------------------------------------------------------------------
BIG = str(1 << 80)
OUT_OF_RANGE = {
    "meminfo": (f"{NODE0}/meminfo", None, "sysfs.numa"),
    "distance": (f"{NODE0}/distance", f"10 {BIG} 17", "sysfs.numa"),
    "hmat bandwidth": ("sys/devices/system/node/node2/access1/initiators/read_bandwidth", BIG, "sysfs.numa"),
    "node id": ("sys/devices/system/node/node99999999999/meminfo", None, "sysfs.numa"),
    "tier id": ("sys/devices/virtual/memory_tiering/memory_tier99999999999/nodelist", "0", "sysfs.memory_tiers"),
    "pci numa_node": ("sys/bus/pci/devices/0000:00:01.0/numa_node", BIG, "sysfs.pci"),
    "link width": ("sys/bus/pci/devices/0000:00:01.0/current_link_width", BIG, "sysfs.pci"),
    "sriov_numvfs": ("sys/bus/pci/devices/0000:00:01.0/sriov_numvfs", BIG, "sysfs.pci"),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_an_out_of_range_integer_degrades_its_source(tmp_path: Path, case: str) -> None:
    """Each of these ended discovery in ``ValueError: Value out of range`` from the assembly."""
    root = capture_copy(tmp_path, "dual-socket-tiered")
    rel, text, src = OUT_OF_RANGE[case]
    if text is None:  # a meminfo
        node = rel.split("/")[-2][4:]
        text = f"Node {node} MemTotal: {BIG} kB\nNode {node} MemFree: 1024 kB\n"
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text + "\n")
    topo = topo_of(root)
    status = source(topo, src)
    assert status.state != pb.SOURCE_STATE_OK
    assert any("out of range" in r for r in status.reasons), status.reasons
    # The rest of the machine is still there.
    assert topo.domains and list(topo.cpus.online) == [0, 1, 2, 3]


def test_a_recorded_nvml_answer_of_2_to_the_128_degrades_nvml(tmp_path: Path) -> None:
    root = gh200_copy(tmp_path)
    path = root / ".memtopo/nvml.json"
    doc = json.loads(path.read_text())
    doc["devices"][0]["memory_total"] = 1 << 128
    doc["devices"][0]["c2c_links"][0]["max_bw_mbps"] = 1 << 128
    path.write_text(json.dumps(doc))
    topo = topo_of(root)
    nvml = source(topo, "nvidia")
    assert nvml.state == pb.SOURCE_STATE_DEGRADED
    assert any(r.startswith("AcceleratorPart.devices[0].memory_bytes = '340282366920938463463374607431768211456'"
                            ": out of range") for r in nvml.reasons), nvml.reasons
    assert topo.domains


def test_an_xml_local_memory_of_1e26_degrades_hwloc(tmp_path: Path) -> None:
    text = (HWLOC_XML / "8intel64-4n2t-memattrs.xml").read_text()
    text, n = re.subn(r'local_memory="\d+"', 'local_memory="100000000000000000000000000"', text, count=1)
    assert n == 1
    xml = tmp_path / "big.xml"
    xml.write_text(text)
    topo = discover_bounded(ProbeContext.at_root("/", hwloc_xml=xml))
    hw = source(topo, "hwloc")
    assert hw.state == pb.SOURCE_STATE_DEGRADED
    assert any("local_memory" in r and "out of range" in r for r in hw.reasons)
    assert len(topo.numa_nodes) == 4


def test_cpus_no_cpu_directory_has_are_implausible(tmp_path: Path) -> None:
    root = capture_copy(tmp_path)
    for name in ("online", "present", "possible"):
        (root / CPU / name).write_text("0-65535\n")
    topo = topo_of(root)
    numa = source(topo, "sysfs.numa")
    assert numa.state == pb.SOURCE_STATE_DEGRADED
    assert f"{CPU}/online: CPUs 2-65535 have no cpuN directory; left out" in numa.reasons
    assert list(topo.cpus.online) == [0, 1]


# ---- 5. tarball roots ------------------------------------------------------------------------------------
def tarball(path: Path, members: dict[str, bytes], mode: Literal["w", "w:gz"] = "w:gz") -> Path:
    with tarfile.open(path, mode) as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_a_truncated_tarball_is_a_capture_error(tmp_path: Path) -> None:
    whole = (LAB_CAPTURES / "single.tar.gz").read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CaptureError, match="not a readable tar archive"), open_root(cut):
        pass
    assert main(["topo", "--root", str(cut)]) == 2


def test_a_deep_member_is_a_capture_error(tmp_path: Path) -> None:
    deep = tarball(tmp_path / "deep.tar", {"/".join(["d"] * 10_000) + "/f": b"x"}, "w")
    with pytest.raises(CaptureError, match="nested too deep"), open_root(deep):
        pass


@pytest.mark.parametrize("cap,members", [
    ("MAX_MEMBER_BYTES", {"sys/big": b"\0" * 4096}),
    ("MAX_EXTRACTED_BYTES", {f"sys/f{i}": b"\0" * 1000 for i in range(5)}),
    ("MAX_MEMBERS", {f"sys/f{i}": b"" for i in range(5)}),
])
def test_extraction_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: str,
                              members: dict[str, bytes]) -> None:
    """A 3 GiB member compressed to 3 MB was extracted whole. The caps are lowered here."""
    monkeypatch.setattr(capture, cap, 3 if cap == "MAX_MEMBERS" else 2048)
    bomb = tarball(tmp_path / "bomb.tar.gz", members)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(CaptureError, match=r"at most|more than"), open_root(bomb):
        pass
    assert not list(tmp_path.glob("memtopo-root-*"))


def test_sigterm_during_extraction_removes_the_temporary_tree(tmp_path: Path) -> None:
    big = tmp_path / "many.tar.gz"
    with gzip.open(big, "wb", compresslevel=1) as gz, tarfile.open(fileobj=gz, mode="w") as tf:
        for i in range(60_000):
            tf.addfile(tarfile.TarInfo(f"sys/d{i // 1000}/f{i}"), io.BytesIO(b""))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "memtopo.cli", "topo", "--root", str(big)], cwd=REPO,
                            env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + HANG_S
    while not list(tmp.glob("memtopo-root-*/sys")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not list(tmp.iterdir())
    assert b"Traceback" not in err


def test_a_missing_root_says_it_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "--root", str(tmp_path / "nothere")]) == 2
    assert capsys.readouterr().err == f"memtopo: {tmp_path / 'nothere'}: no such file or directory\n"


# ---- 6. an hwloc XML that is not one ---------------------------------------------------------------------
@pytest.mark.parametrize("content,why", [
    (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "not an hwloc XML export"),
    (b'{"topology": []}\n', "not an hwloc XML export"),
    (None, "malformed or truncated XML"),
])
def test_an_xml_hwloc_cannot_read_exits_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 content: bytes | None, why: str) -> None:
    if content is None:
        content = (HWLOC_XML / "8intel64-4n2t-memattrs.xml").read_bytes()[:1500]
    xml = tmp_path / "in.xml"
    xml.write_bytes(content)
    assert main(["topo", "--hwloc-xml", str(xml)]) == 2
    captured = capsys.readouterr()
    assert why in captured.err and captured.out == ""
    assert len(captured.err) < 400


def test_an_xml_fifo_is_refused_unopened_by_hwloc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "in.xml"
    os.mkfifo(fifo)
    assert main(["topo", "--hwloc-xml", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err


# ---- 7. offline CPUs and CPUs in several nodes -----------------------------------------------------------
def test_offline_cpus_from_per_cpu_files(tmp_path: Path) -> None:
    """A kernel without cpu/online: each cpuN/online says (cpu0 has none: it cannot go offline)."""
    root = capture_copy(tmp_path, "dual-socket-tiered")
    (root / CPU / "online").unlink()
    (root / CPU / "cpu3/online").write_text("0\n")
    (root / CPU / "cpu2/online").write_text("1\n")
    (root / CPU / "cpu0/online").unlink(missing_ok=True)
    topo = topo_of(root)
    assert list(topo.cpus.online) == [0, 1, 2]
    assert list(topo.cpus.offline) == [3]
    node1 = next(n for n in topo.numa_nodes if n.id == 1)
    assert list(node1.cpus) == [2]


def test_a_cpu_in_several_nodes_degrades_sysfs_numa(tmp_path: Path) -> None:
    """Firmware that lists every CPU in every node: each CPU keeps one node, the one its own
    cpuN/nodeM link names (else the lowest), and the source says so."""
    root = capture_copy(tmp_path, "dual-socket-tiered")
    for n in (0, 1, 2):
        (root / f"sys/devices/system/node/node{n}/cpulist").write_text("0-3\n")
    topo = topo_of(root)
    numa = source(topo, "sysfs.numa")
    assert numa.state == pb.SOURCE_STATE_DEGRADED
    listed = [r for r in numa.reasons if "are listed in nodes" in r]
    assert listed, numa.reasons
    cpus = {n.id: list(n.cpus) for n in topo.numa_nodes if n.id <= 2}
    assert sorted(c for cs in cpus.values() for c in cs) == [0, 1, 2, 3]
    has_links = (root / CPU / "cpu2/node1").exists()
    assert cpus == ({0: [0, 1], 1: [2, 3], 2: []} if has_links else {0: [0, 1, 2, 3], 1: [], 2: []})


# ---- the two in-root walks, and the check hwloc's trees pass -----------------------------------------------
_NAMES = st.sampled_from(["a", "b", "c"])
_TARGETS = st.lists(st.sampled_from(["a", "b", "c", "..", "."]), min_size=0, max_size=5).map("/".join)
_TREES = st.lists(st.tuples(st.lists(_NAMES, min_size=1, max_size=3).map("/".join),
                            st.one_of(st.just("dir"), st.just("file"), _TARGETS,
                                      _TARGETS.map(lambda t: "/" + t))),
                  max_size=8)
_LOOKUPS = st.lists(st.sampled_from(["a", "b", "c", "..", "."]), min_size=1, max_size=6).map("/".join)


def _build(root: Path, entries: list[tuple[str, str]]) -> None:
    for rel, what in entries:
        path = root / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if what == "dir":
                path.mkdir()
            elif what == "file":
                path.write_text(rel)
            else:
                os.symlink(what or ".", path)
        except OSError:
            continue  # a parent that is a file or a link: that entry does not exist


def _answers(fs: HostFS, rel: str) -> tuple[str, str]:
    """What reading and listing ``rel`` give (the text, the names, or the error)."""
    out: list[str] = []
    reads: tuple[Callable[[], str], ...] = (lambda: fs.read_text(rel), lambda: ",".join(fs.listdir(rel)))
    for fn in reads:
        try:
            out.append(fn())
        except HostReadError as exc:
            out.append(f"error: {exc.reason}")
    return out[0], out[1]


@settings(deadline=None, max_examples=150)
@given(entries=_TREES, lookups=st.lists(_LOOKUPS, min_size=1, max_size=4))
def test_the_component_walk_answers_as_the_kernels_in_root_walk(
        entries: list[tuple[str, str]], lookups: list[str]) -> None:
    """The O_NOFOLLOW walk (old kernels) resolves every lookup exactly as openat2(RESOLVE_IN_ROOT)."""
    if hostfs._openat2() is None:
        pytest.skip("openat2 is not available here")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        (root / "outside-marker").write_text("inside")
        _build(root, entries)
        fs = HostFS.at(root)
        fs.__dict__["_confined_known"] = True  # the confined path, whatever the tree
        for rel in lookups:
            if ".." in rel.split("/"):
                continue  # refused before any lookup
            kernel = _answers(fs, rel)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(hostfs, "_openat2", lambda: None)
                walked = _answers(fs, rel)
            assert walked == kernel, rel


def _dir_answers(fs: HostFS, directory: str, rel: str) -> tuple[str, ...]:
    """What reading ``rel`` below ``directory`` gives, through the directory held open (HostDir)
    and by the joined path (HostFS), side by side: the record, the listing, the link, the integer,
    or the error and the path it names."""
    def answer(fn: Callable[[], object]) -> str:
        try:
            return repr(fn())
        except HostReadError as exc:
            return f"error at {exc.path}: {exc.reason}"

    joined = f"{directory}/{rel}"
    try:
        held = fs.open_dir(directory)
    except HostReadError as exc:
        return (f"no directory: {exc.path}: {exc.reason}",)
    with held:
        through = (answer(lambda: held.read_record(rel)), answer(lambda: held.listdir(rel)),
                   answer(lambda: held.readlink(rel)), answer(lambda: held.read_int(rel)))
    by_path = (answer(lambda: fs.read_record(joined)), answer(lambda: fs.listdir(joined)),
               answer(lambda: fs.readlink(joined)), answer(lambda: fs.read_int(joined)))
    return through if through == by_path else (*through, "≠", *by_path)


@settings(deadline=None, max_examples=150)
@given(entries=_TREES, directory=st.sampled_from(["a", "a/b", "c"]),
       lookups=st.lists(st.sampled_from(["a", "b", "c", "a/b", "b/c", "../a", "b/../c"]), min_size=1, max_size=4),
       confined=st.booleans())
def test_a_directory_held_open_answers_as_its_paths_do(
        entries: list[tuple[str, str]], directory: str, lookups: list[str], confined: bool) -> None:
    """HostDir (a PCI function's directory, read by name) gives what HostFS gives for the joined
    path, error and the path it names included: in a tree that passed the check (reads relative to
    the held descriptor) and in one whose lookups are confined (HostFS's own walk)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        _build(root, entries)
        fs = HostFS.at(root)
        if confined:
            fs.__dict__["_confined_known"] = True
        elif hostfs.check_tree(root):
            return  # plain lookups are only for trees that passed
        for rel in lookups:
            answers = _dir_answers(fs, directory, rel)
            assert "≠" not in answers, (directory, rel, answers)


def _climbs_above(rel: str) -> bool:
    """Whether ``rel``'s own names (``..``; links aside) reach above where it starts."""
    depth = 0
    for part in rel.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


@settings(deadline=None, max_examples=150)
@given(entries=_TREES, lookups=st.lists(_LOOKUPS.map(lambda p: "a/b/" + p), min_size=1, max_size=4))
@example(entries=[], lookups=["a/b/../.././.."])  # climbs by name, not through a link: not the question
def test_a_tree_that_passes_the_check_cannot_be_left_by_plain_lookups(
        entries: list[tuple[str, str]], lookups: list[str]) -> None:
    """What hwloc does (plain opens following every link) stays below a root check_tree passed."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        (root / "a/b").mkdir(parents=True)
        _build(root, entries)
        if hostfs.check_tree(root):
            return
        real_root = os.path.realpath(root)
        for rel in lookups:
            # hwloc's own paths never climb above the root by name: only links are in question.
            if _climbs_above(rel):
                continue
            real = os.path.realpath(root / rel)
            assert real == real_root or real.startswith(real_root + "/"), (rel, real)


# ---- 8. many NUMA nodes ---------------------------------------------------------------------------------
# 1,024 nodes took `topo --format json` 46 s, 4.3 GB and 415 MB of output (523,776 interconnects), and
# `k8s nrt` 117 s for a 35 MB object, more than etcd takes; 10,000 crashed at 7.5 GB. How long and
# how much memory they take is bench/hostile_roots.py's to judge; here, what they give.
@pytest.fixture(scope="module")
def numa_1024(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_root(tmp_path_factory.mktemp("numa") / "root", tree(numa_scale_host(1024)))


def test_1024_nodes_as_json_carry_each_slit_row_but_no_million_pairs(numa_1024: Path) -> None:
    res = memtopo("topo", "--root", str(numa_1024), "--format", "json")
    assert res.returncode == 0, res.stderr[-600:]
    # Three SLIT matrices (each node's row with its columns, each domain's) and no pair list.
    assert len(res.stdout) < 64 << 20
    topo = json_format.Parse(res.stdout, pb.MemoryTopology())
    assert len(topo.numa_nodes) == len(topo.domains) == 1024
    assert not topo.interconnects and topo.slit_only_pairs_omitted == 1024 * 1023 // 2
    assert topo.domains[5].distances[7] == 12 and topo.domains[5].distances[8] == 32
    assert all(s.state != pb.SOURCE_STATE_DEGRADED for s in topo.sources if s.source in ("hwloc", "sysfs.numa"))


def test_1024_nodes_as_text_and_svg_summarise_the_matrix(numa_1024: Path) -> None:
    text = memtopo("topo", "--root", str(numa_1024))
    assert text.returncode == 0, text.stderr[-600:]
    assert "NUMA distances (SLIT) of 1024 nodes" in text.stdout and len(text.stdout) < 1 << 20
    assert "and 523776 pairs with SLIT distances only" in text.stdout
    svg = memtopo("topo", "--root", str(numa_1024), "--format", "svg")
    assert svg.returncode == 0, svg.stderr[-600:]
    # 128 packages of 8 nodes: 128 × 28 pairs inside one, the rest between two.
    assert "1024 domains: no matrix above" in svg.stdout
    assert "SLIT 12: 3584 pairs" in svg.stdout and "SLIT 32: 520192 pairs" in svg.stdout
    assert len(svg.stdout) < 2 << 20


def test_1024_nodes_make_an_object_the_api_server_stores(numa_1024: Path) -> None:
    res = memtopo("k8s", "nrt", "--root", str(numa_1024), "--node-name", "big-1", "--format", "json")
    assert res.returncode == 0, res.stderr[-600:]
    obj = json.loads(res.stdout)
    assert object_bytes(obj) <= MAX_OBJECT_BYTES
    assert len(obj["zones"]) == 1024 and not any("costs" in z for z in obj["zones"])
    left_out = {a["name"]: a["value"] for a in obj["attributes"]}["memtopo.io/left-out"]
    assert left_out.startswith("costs (the SLIT rows of 1024 zones, 1048576 entries")
    # What the scheduler counts is all there.
    assert all({r["name"] for r in z["resources"]} == {"cpu", "memory"} for z in obj["zones"])


def test_more_nodes_than_the_kernel_allows_is_a_clear_answer(tmp_path: Path) -> None:
    root = write_root(tmp_path / "root", tree(numa_scale_host(1100, cpus_per_node=1)))
    res = memtopo("topo", "--root", str(root), "--format", "json")
    assert res.returncode == 0, res.stderr[-600:]
    topo = json_format.Parse(res.stdout, pb.MemoryTopology())
    numa, hw = source(topo, "sysfs.numa"), source(topo, "hwloc")
    assert numa.state == hw.state == pb.SOURCE_STATE_DEGRADED
    assert "sys/devices/system/node/online: nodes 1024-1099 beyond the kernel's MAX_NUMNODES (1024); left out" \
        in numa.reasons
    assert "MAX_NUMNODES 1024" in hw.reasons[0]
    assert [n.id for n in topo.numa_nodes] == list(range(1024))
