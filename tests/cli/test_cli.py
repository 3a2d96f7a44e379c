"""``memtopo topo`` / ``memtopo gather`` end to end, on this host and on captured roots."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf import json_format

from memtopo.cli.main import main
from memtopo.cpulist import parse_cpulist
from memtopo.discovery.capture import CaptureError, open_root
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import HWLOC_XML, LAB_CAPTURES, REPO

MEMTOPO = [sys.executable, "-m", "memtopo.cli"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMTOPO, *args], capture_output=True, text=True, cwd=REPO, check=False)


def parse(text: str) -> pb.MemoryTopology:
    return json_format.Parse(text, pb.MemoryTopology())


def node_memtotals() -> dict[int, int]:
    """Each online node's MemTotal in bytes, as the kernel says now."""
    node_dir = Path("/sys/devices/system/node")
    totals = {}
    for node in parse_cpulist((node_dir / "online").read_text()):
        with (node_dir / f"node{node}/meminfo").open() as f:
            totals[node] = next(int(line.split()[3]) for line in f if "MemTotal" in line) * 1024
    return totals


def while_memory_holds_still[T](run: Callable[[], T]) -> tuple[T, dict[int, int]]:
    """``run()`` during a moment the host's node sizes did not change (some VMs resize memory all the time:
    seen here, node 0's MemTotal moved by hundreds of MB within a test); skips where they never hold still."""
    for _ in range(5):
        before = node_memtotals()
        result = run()
        if node_memtotals() == before:
            return result, before
    pytest.skip("this host's memory size changed during every attempt")


def test_host_json_parses_back_and_agrees_with_sys_and_proc() -> None:
    res, memtotals = while_memory_holds_still(lambda: run_cli("topo", "--format", "json"))
    assert res.returncode == 0, res.stderr
    raw = json.loads(res.stdout)
    assert "total_capacity_bytes" in raw and "numa_nodes" in raw  # snake_case names, as in the .proto
    topo = parse(res.stdout)
    node_dir = Path("/sys/devices/system/node")
    online_nodes = parse_cpulist((node_dir / "online").read_text())
    assert [n.id for n in topo.numa_nodes if n.state == pb.NUMA_NODE_STATE_ONLINE] == list(online_nodes)
    for n in topo.numa_nodes:
        if n.state == pb.NUMA_NODE_STATE_ONLINE:
            assert list(n.cpus) == list(parse_cpulist((node_dir / f"node{n.id}/cpulist").read_text()))
            assert n.memory_bytes == memtotals[n.id]
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    assert list(topo.allowed_cpus) == list(parse_cpulist(status["Cpus_allowed_list"]))
    assert list(topo.allowed_memory_nodes) == list(parse_cpulist(status["Mems_allowed_list"]))
    assert list(topo.cpus.online) == list(parse_cpulist(Path("/sys/devices/system/cpu/online").read_text()))
    assert topo.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert len(topo.fingerprint) == 64


def test_gather_then_topo_on_the_capture_gives_the_host_fingerprint(tmp_path: Path) -> None:
    out = tmp_path / "host.tar.gz"

    def gather_and_discover() -> pb.MemoryTopology:
        assert main(["gather", str(out)]) == 0
        return parse(run_cli("topo", "--format", "json").stdout)

    host, _ = while_memory_holds_still(gather_and_discover)
    res = run_cli("topo", "--root", str(out), "--format", "json")
    assert res.returncode == 0, res.stderr
    captured = parse(res.stdout)
    assert captured.fingerprint == host.fingerprint, _diff(host, captured)


def _diff(a: pb.MemoryTopology, b: pb.MemoryTopology) -> str:
    ja = json_format.MessageToDict(a, preserving_proto_field_name=True)
    jb = json_format.MessageToDict(b, preserving_proto_field_name=True)
    return "\n".join(f"{k}: {ja.get(k)!r:.300} != {jb.get(k)!r:.300}" for k in sorted(set(ja) | set(jb))
                     if ja.get(k) != jb.get(k) and k not in ("discovery_time", "fingerprint", "source_root"))


def test_topo_reads_a_tarball_root_and_an_hwloc_xml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "--root", str(LAB_CAPTURES / "dual-socket-cxl-tiered.tar.gz")]) == 0
    text = capsys.readouterr().out
    assert "cxl-attached" in text and "memory_tier22" in text and "region0" in text
    assert "possible-offline" not in text  # in -tiered node 3 is online
    assert main(["topo", "--hwloc-xml", str(HWLOC_XML / "nvidiaDGX2.xml"), "--format", "json"]) == 0
    topo = parse(capsys.readouterr().out)
    assert len([p for p in topo.pci_devices if p.kind == pb.PCI_DEVICE_KIND_GPU]) == 16


def test_bad_roots_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "--root", str(tmp_path / "missing")]) == 2
    assert "missing: no such file or directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("x")
    assert main(["topo", "--root", str(tmp_path / "notes.txt")]) == 2
    assert "neither a directory nor a tar archive" in capsys.readouterr().err
    bogus = tmp_path / "bogus.tar.gz"
    bogus.write_bytes(b"not a tarball")
    assert main(["topo", "--root", str(bogus)]) == 2
    assert main(["topo", "--hwloc-xml", str(tmp_path / "nope.xml")]) == 2


def test_tarball_with_path_traversal_is_refused(tmp_path: Path) -> None:
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tf:
        data = b"owned\n"
        info = tarfile.TarInfo("../../escaped")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(CaptureError), open_root(evil):
        pass
    assert not (tmp_path.parent / "escaped").exists()


def test_gather_keeps_what_the_probes_read(tmp_path: Path) -> None:
    out = tmp_path / "c.tar.gz"
    assert main(["gather", str(out)]) == 0
    with tarfile.open(out) as tf:
        names = set(tf.getnames())
    for needed in ("proc/self/status", "sys/devices/system/node/online", "sys/devices/system/cpu/online",
                   "proc/sys/kernel/random/boot_id"):
        assert needed in names
    assert not any(os.path.basename(n) in ("remove", "rescan", "reset") for n in names)
    assert not any(n.startswith(("/", "..")) for n in names)


def test_topo_process_writes_its_whole_output_before_its_quick_exit() -> None:
    """`topo` ends without the interpreter's teardown: what it wrote to a pipe still arrives whole,
    a short text that sits in the stream's buffer as well as a JSON document larger than it, with the
    same exit status and error line as before."""
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}

    def topo(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*MEMTOPO, "topo", *args], capture_output=True, text=True, cwd=REPO, env=buffered,
                              check=False)

    text = topo("--hwloc-xml", str(HWLOC_XML / "8intel64-4n2t-memattrs.xml"))
    assert text.returncode == 0, text.stderr
    assert 0 < len(text.stdout) < 8192 and text.stdout.endswith("\n")
    assert "total capacity 4.0 GiB in 4 domain(s)" in text.stdout
    res = topo("--hwloc-xml", str(HWLOC_XML / "nvidiaDGX2.xml"), "--format", "json")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout) > 16384 and json.loads(res.stdout)["sources"]
    bad = topo("--root", "/nonexistent/root")
    assert bad.returncode == 2
    assert bad.stderr == "memtopo: /nonexistent/root: no such file or directory\n"
