"""Synthesized hosts: a declarative spec → a sysfs/procfs tree (and its checked-in tarball) + tool replays.

Hardware we do not have (GH200, MI300A, Ascend A3 …) is tested against trees written here in the
kernel's real formats. Each host lives in ``tests/fixtures/<name>/``: ``host.py`` defines ``HOST``
(a :class:`SynthHost`); ``tools/`` holds recorded tool outputs with ``tools/argv.json`` naming the
argv of each file (see ``RecordedRunner.from_dir``); ``nvml.json`` the NVML replay, if any;
``root.tar.gz`` is the tree built from all of it (regenerate with
``python -m tests.synth tests/fixtures/<name>``; a test checks it is current), which
``memtopo topo --root`` reads like any capture; ``README.md`` says the files are synthesized and
from which formats.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import sys
import tarfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from memtopo.cpulist import format_cpulist
from memtopo.discovery.source import RECORDED_NVML
from memtopo.runner import RECORDED_TOOLS_DIR

Content = str  # file body; a "-> target" prefix makes a symlink (relative target, as sysfs uses)


def link(target: str) -> Content:
    return f"-> {target}"


@dataclass(frozen=True)
class SynthNode:
    id: int
    cpus: Sequence[int]
    memory_bytes: int
    distances: Sequence[int]  # SLIT row, one entry per node of the host in id order
    package: int = 0


@dataclass(frozen=True)
class SynthPci:
    bdf: str  # "0000:3b:00.0"
    vendor: int
    device: int
    class_code: int  # 24-bit, e.g. 0x030200
    numa_node: int = -1
    driver: str = ""
    subsystem_vendor: int = 0
    subsystem_device: int = 0
    link_speed: str = "16.0 GT/s PCIe"
    link_width: int = 16
    msi_irqs: Sequence[int] = ()
    # Extra attribute files in the device directory: {"mem_info_vram_total": "…"}.
    attrs: Mapping[str, Content] = field(default_factory=dict)


@dataclass(frozen=True)
class SynthHost:
    name: str
    nodes: Sequence[SynthNode]
    threads_per_core: int = 2
    pci: Sequence[SynthPci] = ()
    # Anything else, by root-relative path (proc/driver/nvidia/…, sys/class/kfd/…).
    files: Mapping[str, Content] = field(default_factory=dict)
    # The process's allowed CPUs (default: all).
    allowed_cpus: Sequence[int] | None = None
    hostname: str = "synth"


def _mask(ids: Sequence[int], width: int) -> str:
    """Kernel %*pb bitmap: comma-separated 32-bit words, most significant first."""
    words = max(1, (width + 31) // 32)
    bits = [0] * words
    for i in ids:
        bits[i // 32] |= 1 << (i % 32)
    return ",".join(f"{w:08x}" for w in reversed(bits))


def tree(host: SynthHost) -> dict[str, Content]:
    """Every file of the host's root, by relative path."""
    files: dict[str, Content] = {}
    all_cpus = sorted(c for n in host.nodes for c in n.cpus)
    width = (max(all_cpus) + 1) if all_cpus else 1
    node_ids = [n.id for n in host.nodes]
    cpu_dir, node_dir = "sys/devices/system/cpu", "sys/devices/system/node"
    for key in ("online", "possible", "present"):
        files[f"{cpu_dir}/{key}"] = format_cpulist(all_cpus)
    for key in ("online", "possible", "has_cpu", "has_memory", "has_normal_memory"):
        ids = {
            "has_cpu": [n.id for n in host.nodes if n.cpus],
            "has_memory": [n.id for n in host.nodes if n.memory_bytes],
            "has_normal_memory": [n.id for n in host.nodes if n.memory_bytes],
        }.get(key, node_ids)
        files[f"{node_dir}/{key}"] = format_cpulist(ids)
    tpc = host.threads_per_core
    for node in host.nodes:
        base = f"{node_dir}/node{node.id}"
        files[f"{base}/cpulist"] = format_cpulist(node.cpus)
        files[f"{base}/cpumap"] = _mask(node.cpus, width)
        files[f"{base}/distance"] = " ".join(str(d) for d in node.distances)
        kb = node.memory_bytes // 1024
        files[f"{base}/meminfo"] = (f"Node {node.id} MemTotal:       {kb} kB\n"
                                    f"Node {node.id} MemFree:        {kb // 2} kB\n"
                                    f"Node {node.id} MemUsed:        {kb - kb // 2} kB\n")
        cpus = sorted(node.cpus)
        package_cpus = sorted(c for n in host.nodes if n.package == node.package for c in n.cpus)
        # Sibling threads are numbered core-major within a node: cpus[k*tpc : (k+1)*tpc] share a core.
        for k, cpu in enumerate(cpus):
            core = k // tpc
            siblings = cpus[core * tpc:(core + 1) * tpc]
            t = f"{cpu_dir}/cpu{cpu}/topology"
            files[f"{t}/physical_package_id"] = str(node.package)
            files[f"{t}/die_id"] = "0"
            files[f"{t}/core_id"] = str(core + 1000 * node.id)
            files[f"{t}/thread_siblings_list"] = format_cpulist(siblings)
            files[f"{t}/core_cpus_list"] = format_cpulist(siblings)
            files[f"{t}/thread_siblings"] = _mask(siblings, width)
            files[f"{t}/core_siblings_list"] = format_cpulist(package_cpus)
            files[f"{t}/package_cpus_list"] = format_cpulist(package_cpus)
            files[f"{t}/core_siblings"] = _mask(package_cpus, width)
            files[f"{cpu_dir}/cpu{cpu}/node{node.id}"] = link(f"../../node/node{node.id}")
            files[f"{cpu_dir}/cpu{cpu}/online"] = "1"
    for dev in host.pci:
        root_bus = dev.bdf.rsplit(":", 2)[0] + ":" + dev.bdf.split(":")[-2]
        path = f"sys/devices/pci{root_bus}/{dev.bdf}"
        local = [c for n in host.nodes if n.id == dev.numa_node for c in n.cpus] or all_cpus
        attrs: dict[str, Content] = {
            "vendor": f"0x{dev.vendor:04x}", "device": f"0x{dev.device:04x}",
            "subsystem_vendor": f"0x{dev.subsystem_vendor:04x}",
            "subsystem_device": f"0x{dev.subsystem_device:04x}",
            "class": f"0x{dev.class_code:06x}", "numa_node": str(dev.numa_node),
            "local_cpulist": format_cpulist(local), "local_cpus": _mask(local, width),
            "current_link_speed": dev.link_speed, "current_link_width": str(dev.link_width),
            "max_link_speed": dev.link_speed, "max_link_width": str(dev.link_width),
            "uevent": "\n".join(filter(None, [
                f"DRIVER={dev.driver}" if dev.driver else "",
                f"PCI_CLASS={dev.class_code:X}",
                f"PCI_ID={dev.vendor:04X}:{dev.device:04X}",
                f"PCI_SUBSYS_ID={dev.subsystem_vendor:04X}:{dev.subsystem_device:04X}",
                f"PCI_SLOT_NAME={dev.bdf}",
            ])),
            **dev.attrs,
        }
        if dev.driver:
            attrs["driver"] = link(f"../../../bus/pci/drivers/{dev.driver}")
        for irq in dev.msi_irqs:
            attrs[f"msi_irqs/{irq}"] = "msix"
        for name, body in attrs.items():
            files[f"{path}/{name}"] = body
        files[f"sys/bus/pci/devices/{dev.bdf}"] = link(f"../../../devices/pci{root_bus}/{dev.bdf}")
    allowed = list(host.allowed_cpus) if host.allowed_cpus is not None else all_cpus
    files["proc/self/status"] = (
        "Name:\tmemtopo\nState:\tR (running)\n"
        f"Cpus_allowed:\t{_mask(allowed, width)}\nCpus_allowed_list:\t{format_cpulist(allowed)}\n"
        f"Mems_allowed_list:\t{format_cpulist([n.id for n in host.nodes if n.memory_bytes])}\n"
    )
    files["proc/sys/kernel/hostname"] = host.hostname
    digest = hashlib.sha256(host.name.encode()).hexdigest()
    files["etc/machine-id"] = digest[:32]
    files["proc/sys/kernel/random/boot_id"] = str(uuid.UUID(digest[32:64]))
    # A plain cgroup v2 host, process in the root cgroup: nothing narrower than the tree itself.
    files["proc/self/cgroup"] = "0::/"
    files["proc/mounts"] = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"
    files["proc/self/mountinfo"] = ("35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9"
                                    " - cgroup2 cgroup2 rw\n")
    files["sys/fs/cgroup/cgroup.controllers"] = "cpuset cpu io memory pids"
    files["sys/fs/cgroup/cpuset.cpus.effective"] = format_cpulist(all_cpus)
    files["sys/fs/cgroup/cpuset.mems.effective"] = format_cpulist([n.id for n in host.nodes if n.memory_bytes])
    files.update(host.files)
    return files


def numa_scale_host(nodes: int, cpus_per_node: int = 2, nodes_per_package: int = 8) -> SynthHost:
    """A host of ``nodes`` NUMA nodes, every one online with memory and CPUs, for scale (1,024 is the
    kernel's MAX_NUMNODES; more is a hostile root): SLIT 10 to itself, 12 within its package of
    ``nodes_per_package``, 32 beyond."""
    def row(i: int) -> list[int]:
        return [10 if i == j else 12 if i // nodes_per_package == j // nodes_per_package else 32
                for j in range(nodes)]
    return SynthHost(f"numa-{nodes}", [
        SynthNode(i, list(range(i * cpus_per_node, (i + 1) * cpus_per_node)), 4 << 30, row(i),
                  package=i // nodes_per_package)
        for i in range(nodes)])


def write_root(dest: Path, entries: Mapping[str, Content]) -> Path:
    """A tree's files under ``dest`` (links as links), as its tarball would extract."""
    for rel, body in entries.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if body.startswith("-> "):
            path.symlink_to(body[3:])
        else:
            path.write_text(body if body.endswith("\n") or not body else body + "\n")
    return dest


def fixture_files(fixture_dir: Path) -> dict[str, Content]:
    """The host's tree plus what is recorded with it: ``tools/`` and ``nvml.json`` go under
    ``.memtopo/``, where ``ProbeContext.at_root`` replays them from."""
    files = tree(load_host(fixture_dir))
    tools = fixture_dir / "tools"
    if tools.is_dir():
        for f in sorted(tools.iterdir()):
            files[f"{RECORDED_TOOLS_DIR}/{f.name}"] = f.read_text()
    if (fixture_dir / "nvml.json").is_file():
        files[RECORDED_NVML] = (fixture_dir / "nvml.json").read_text()
    return files


def tarball_bytes(entries: Mapping[str, Content]) -> bytes:
    """A deterministic .tar.gz of a tree (sorted, zero mtimes), so a rebuild is byte-identical."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for rel in sorted(entries):
            parts = rel.split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
            body = entries[rel]
            info = tarfile.TarInfo(rel)
            if body.startswith("-> "):
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, body[3:], 0o777
                tar.addfile(info)
            else:
                # Tool recordings keep their bytes exactly (upstream mocks have no trailing newline).
                verbatim = rel.startswith(".memtopo/")
                data = (body if verbatim or body.endswith("\n") or not body else body + "\n").encode()
                info.size, info.mode = len(data), 0o444
                tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def load_module(path: Path, name: str) -> ModuleType:
    """The Python file at ``path`` as the module ``name``, executed once per process: fixture files
    live outside any package (each host's host.py, and the layouts several hosts share)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs, as an import does
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_host(fixture_dir: Path) -> SynthHost:
    host = load_module(fixture_dir / "host.py", f"synth_{fixture_dir.name}").HOST
    assert isinstance(host, SynthHost)
    return host


def main(argv: Sequence[str]) -> int:
    for d in argv or sorted(str(p.parent) for p in Path(__file__).parent.glob("fixtures/*/host.py")):
        fixture = Path(d)
        (fixture / "root.tar.gz").write_bytes(tarball_bytes(fixture_files(fixture)))
        print(f"wrote {fixture / 'root.tar.gz'}")
    return 0


if __name__ == "__main__":
    # Through the importable module: host.py imports tests.synth, and its SynthHost must be the
    # same class as the one load_host checks against (not __main__'s copy).
    from tests.synth import main as _main

    sys.exit(_main(sys.argv[1:]))
