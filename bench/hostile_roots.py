"""Peak RSS and wall time of `memtopo topo` on hostile inputs: captured roots with links out of the
root, FIFOs, devices, huge numbers, node lists that crashed hwloc, a flood of dangling PCI entries;
broken tarballs; hwloc XML that is not one. Each fixture is a copy of a numa-vm lab capture (or a lab
tarball, or an hwloc XML fixture) with one hostile change, generated in a temporary directory.

And roots of many NUMA nodes (tests.synth.numa_scale_host): 1,024, the kernel's MAX_NUMNODES, where
`topo --format json` and `k8s nrt` are held to targets: at most 5 s and 300 MiB each, and an object of
at most 1.5 MB; and 1,100, more than a kernel has, which must end in a clear answer.

    .venv/bin/python bench/hostile_roots.py [--keep DIR] [--timeout S] [NAME ...]

Every run is a child process (`python -m memtopo.cli topo …`), killed at --timeout (default 120 s):
a hang shows as "killed". Its peak RSS is the largest of it and its children (the discovery
child included). Device nodes are made only when run as root.

Targets, the house rule for bad input (a clear answer, never a traceback, a hang, a crash or
unbounded memory): each fixture ends with exit status 0 (discovered, the hostile part a degraded
source) or 2 (refused, saying why) and no traceback; the slowest within 10 s; the largest peak RSS
<= 100 MiB (a clean capture takes about 30).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import Report  # noqa: E402
from bench.roots import HWLOC_XML, LAB_CAPTURES, extracted  # noqa: E402
from memtopo.discovery.capture import find_root  # noqa: E402
from memtopo.k8s.nrt import MAX_OBJECT_BYTES, object_bytes  # noqa: E402
from tests.synth import numa_scale_host, tree, write_root  # noqa: E402

NODE0 = "sys/devices/system/node/node0"
CPU = "sys/devices/system/cpu"
BIG = str(1 << 80)
XML = "8intel64-4n2t-memattrs.xml"


class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def _swap(rel: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        p = root / rel
        if p.is_symlink() or p.exists():
            p.unlink()
        make(p)
    return change


def _write(rel: str, text: str) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        (root / rel).write_text(text)
    return change


def _node_online(text: str) -> Callable[[Path], None]:
    return _write("sys/devices/system/node/online", text + "\n")


def _online_everything(root: Path) -> None:
    for name in ("online", "present", "possible"):
        (root / CPU / name).write_text("0-65535\n")


def _dangling(root: Path) -> None:
    bus = root / "sys/bus/pci/devices"
    for i in range(100_000):
        os.symlink(f"../../../devices/pci0001:00/x{i}",
                   bus / f"{1 + i // 65536:04x}:{(i // 256) % 256:02x}:{(i // 8) % 32:02x}.{i % 8}")


def _chr(device: str) -> Callable[[Path], None]:
    return lambda p: os.mknod(p, 0o644 | stat.S_IFCHR, os.stat(device).st_rdev)


ROOTS: dict[str, Callable[[Path], None]] = {
    "link-shadow": _swap(f"{NODE0}/cpulist", lambda p: os.symlink("/etc/shadow", p)),
    "fifo-meminfo": _swap(f"{NODE0}/meminfo", os.mkfifo),
    "fifo-distance": _swap(f"{NODE0}/distance", os.mkfifo),
    "fifo-online": _swap(f"{CPU}/online", os.mkfifo),
    "fifo-numa_node": _swap("sys/bus/pci/devices/0000:00:01.0/numa_node", os.mkfifo),
    "link-dev-zero-online": _swap(f"{CPU}/online", lambda p: os.symlink("/dev/zero", p)),
    "link-urandom-cpuinfo": _swap("proc/cpuinfo", lambda p: os.symlink("/dev/urandom", p)),
    "node-dev-zero-online": _swap(f"{CPU}/online", _chr("/dev/zero")),
    "node-urandom-cpuinfo": _swap("proc/cpuinfo", _chr("/dev/urandom")),
    "dangling-pci-100k": _dangling,
    "memtotal-2^80": _write(f"{NODE0}/meminfo", f"Node 0 MemTotal: {BIG} kB\nNode 0 MemFree: 1 kB\n"),
    "pci-numa-2^80": _write("sys/bus/pci/devices/0000:00:01.0/numa_node", BIG + "\n"),
    "online-0-65535": _online_everything,
    "online-nodes-0-65535": _node_online("0-65535"),
    "online-nodes--1": _node_online("-1"),
    "online-nodes-0-2147483647": _node_online("0-2147483647"),
}
# Generated whole rather than changed from a capture: (node count, held to the targets).
SCALE = {"numa-1024": (1024, True), "numa-1100": (1100, False)}
TARGET_S = 5.0
TARGET_MIB = 300.0


def _files(out: Path) -> dict[str, Path]:
    whole = (LAB_CAPTURES / "single.tar.gz").read_bytes()
    made = {"truncated.tar.gz": out / "truncated.tar.gz", "deep.tar": out / "deep.tar",
            "bomb-3GiB.tar.gz": out / "bomb-3GiB.tar.gz", "garbage.xml": out / "garbage.xml",
            "json.xml": out / "json.xml", "truncated.xml": out / "truncated.xml",
            "local-memory-1e26.xml": out / "local-memory-1e26.xml"}
    made["truncated.tar.gz"].write_bytes(whole[: len(whole) // 2])
    with tarfile.open(made["deep.tar"], "w") as tf:
        info = tarfile.TarInfo("/".join(["d"] * 10_000) + "/f")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    with gzip.open(made["bomb-3GiB.tar.gz"], "wb", compresslevel=1) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tf:
        info = tarfile.TarInfo("sys/zeros")
        info.size = 3 << 30
        tf.addfile(info, io.BufferedReader(_Zeros(3 << 30), 1 << 20))
    made["garbage.xml"].write_bytes(os.urandom(4096))
    made["json.xml"].write_text('{"topology": []}\n')
    xml = (HWLOC_XML / XML).read_text()
    made["truncated.xml"].write_text(xml[:1500])
    made["local-memory-1e26.xml"].write_text(
        re.sub(r'local_memory="\d+"', 'local_memory="100000000000000000000000000"', xml, count=1))
    return made


def _run(args: list[str], timeout: float, command: tuple[str, ...] = ("topo", "--format", "json"),
         out: Path | None = None) -> tuple[str, float, float, str]:
    """rc (or "killed"), wall seconds, peak RSS MiB, first stderr line; stdout to ``out``."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err, open(out or os.devnull, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "memtopo.cli", *command, *args],
                                cwd=REPO, stdout=sink, stderr=err)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        first = err.read().decode("utf-8", "replace").splitlines()[:1]
    rc = "killed" if wall > timeout else str(proc.returncode)
    return rc, wall, usage.ru_maxrss / 1024, (first[0] if first else "")[:100]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", help="generate the fixtures here and keep them")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    return Report.run("hostile_roots", lambda report: measure(args, report))


TARGET_WALL_S = 10.0
TARGET_RSS_MIB = 100.0


def measure(args: argparse.Namespace, report: Report) -> None:
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="memtopo-hostile-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        base = find_root(extracted(LAB_CAPTURES / "single.tar.gz"))
        inputs: dict[str, list[str]] = {}
        for name, change in ROOTS.items():
            if args.names and name not in args.names:
                continue
            if name.startswith("node-") and os.geteuid() != 0:
                continue
            root = out / name
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(base, root, symlinks=True)
            change(root)
            inputs[name] = ["--root", str(root)]
        for name, path in _files(out).items():
            if not args.names or name in args.names:
                inputs[name] = ["--hwloc-xml" if name.endswith(".xml") else "--root", str(path)]
        scale = {}
        for name, (nodes, _) in SCALE.items():
            if not args.names or name in args.names:
                root = out / name
                shutil.rmtree(root, ignore_errors=True)
                scale[name] = write_root(root, tree(numa_scale_host(nodes)))
                if not SCALE[name][1]:
                    inputs[name] = ["--root", str(root)]
        print(f"{'fixture':<24} {'rc':>6} {'wall s':>7} {'peak RSS MiB':>12}  stderr (first line)")
        results = []
        for name, argv in inputs.items():
            rc, wall, rss, first = _run(argv, args.timeout)
            results.append((name, rc, wall, rss, first))
            print(f"{name:<24} {rc:>6} {wall:>7.2f} {rss:>12.1f}  {first}", flush=True)
        _scale_targets({name: root for name, root in scale.items() if SCALE[name][1]}, out, args.timeout, report)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(f"(peak RSS of each child process; killed = still running after {args.timeout:g} s)")
    unclear = [f"{name} ({rc})" for name, rc, _, _, first in results
               if rc not in ("0", "2") or first.startswith("Traceback")]
    figure = f"{len(results) - len(unclear)} of {len(results)}" + (f"; not: {', '.join(unclear)}" if unclear else "")
    report.check("fixtures with a clear answer (exit status 0 or 2, no traceback)", not unclear, figure,
                 f"{len(results)} of {len(results)}")
    if results:
        slowest = max(results, key=lambda r: r[2])
        report.judge(f"slowest fixture ({slowest[0]}): wall", slowest[2], "<=", TARGET_WALL_S, "s")
        largest = max(results, key=lambda r: r[3])
        report.judge(f"largest peak RSS ({largest[0]})", largest[3], "<=", TARGET_RSS_MIB, "MiB", 1)


def _scale_targets(roots: dict[str, Path], out: Path, timeout: float, report: Report) -> None:
    """The many-node roots against their targets: each command within TARGET_S and TARGET_MIB, the
    NRT object within what the API server stores."""
    for name, root in roots.items():
        for label, command in (("topo --format json", ("topo", "--format", "json")),
                               ("k8s nrt --format json", ("k8s", "nrt", "--node-name", "scale", "--format", "json"))):
            dest = out / f"{name}.{command[0]}.out"
            rc, wall, rss, first = _run(["--root", str(root)], timeout, command, dest)
            print(f"{name:<24} {rc:>6} {wall:>7.2f} {rss:>12.1f}  {label}: {dest.stat().st_size / 1e6:.2f} MB out "
                  f"{first}", flush=True)
            report.check(f"{name} {label}: exit status", rc == "0", rc, "0")
            report.judge(f"{name} {label}: wall", wall, "<=", TARGET_S, "s")
            report.judge(f"{name} {label}: peak RSS", rss, "<=", TARGET_MIB, "MiB", 1)
            if command[0] == "k8s" and rc == "0":
                size = object_bytes(json.loads(dest.read_text()))
                report.judge(f"{name}: NRT object", size / 1e6, "<=", MAX_OBJECT_BYTES / 1e6, "MB", 2)


if __name__ == "__main__":
    sys.exit(main())
