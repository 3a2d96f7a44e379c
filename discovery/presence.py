"""Cheap "can this vendor's probe find anything here?" checks, so a host without the vendor's
devices never imports the vendor's probe module (tens of milliseconds of parsers and tables).

Each check returns the reason the source is unavailable, or None when the probe must run. The probe
itself starts with the same check, so a source reported from here reads exactly as the probe would
have reported it. A check only answers "absent" where that is certain; anything unclear runs the probe.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
from collections.abc import Sequence

from memtopo.discovery.parts import SysPci
from memtopo.discovery.pci_ids import VENDOR_KUNLUNXIN, classify
from memtopo.discovery.source import ProbeContext, ProbeResult
from memtopo.runner import RecordedRunner, SubprocessRunner

XML_ONLY = "input is an hwloc XML export"
NO_NVML_RECORDING = "captured root without an NVML recording"

KFD_NODES = "sys/class/kfd/kfd/topology/nodes"
XPUCTRL = "dev/xpuctrl"
PROC_GPUS = "proc/driver/nvidia/gpus"
# npu-smi's three views (device map, device list, topology), all the Ascend probe asks.
ASCEND_ARGVS = (("npu-smi", "info", "-m"), ("npu-smi", "info"), ("npu-smi", "info", "-t", "topo"))
# What pynvml's nvmlInit loads on Linux; its absence is NVML's LibraryNotFound, which the probe words
# as its NvmlCallError does (discovery/nvml.py, not imported here: it is the NVML side's weight).
LIBNVML = "libnvidia-ml.so.1"
NO_LIBNVML = "nvmlInit: LibraryNotFound"


def amd(ctx: ProbeContext) -> str | None:
    if not ctx.sysfs_available:
        return XML_ONLY
    if not ctx.fs.is_dir(KFD_NODES):
        return f"no AMD devices: {KFD_NODES} missing (amdgpu/KFD not loaded, or not in this capture)"
    return None


def ascend(ctx: ProbeContext, argvs: Sequence[Sequence[str]] = ASCEND_ARGVS) -> str | None:
    """Absent when every npu-smi call would be "not found": the runner's own words for it."""
    if not ctx.sysfs_available:
        return XML_ONLY
    runner = ctx.runner
    if isinstance(runner, RecordedRunner):
        missing = all(tuple(a) not in runner.recordings for a in argvs)
    elif isinstance(runner, SubprocessRunner):
        missing = all(shutil.which(a[0]) is None for a in argvs)
    else:
        return None  # another runner (a test's): only running the tool can tell
    return f"no Ascend devices/tool ({argvs[0][0]}: not found)" if missing else None


def kunlunxin_pci(pci: ProbeResult[SysPci] | None) -> dict[str, int] | None:
    """BDF → numa_node of the Kunlunxin accelerators in sysfs.pci's part; None without one (the probe
    then scans the bus itself). Baidu's storage functions share the vendor id, hence the class check."""
    if pci is None:
        return None
    return {d.bdf: d.numa_node for d in pci.data.devices
            if d.vendor_id == VENDOR_KUNLUNXIN and classify(d.vendor_id, d.device_id, d.class_code) == "xpu"}


def kunlunxin(ctx: ProbeContext, pci: ProbeResult[SysPci] | None) -> str | None:
    if not ctx.sysfs_available:
        return XML_ONLY
    found = kunlunxin_pci(pci)
    if found is None or found or ctx.fs.exists(XPUCTRL):
        return None
    return kunlunxin_absent()


def kunlunxin_absent() -> str:
    return f"no Kunlunxin devices (no PCI vendor 0x{VENDOR_KUNLUNXIN:04x} accelerator, no /{XPUCTRL})"


def nvidia_absent(nvml: str) -> str:
    return f"no NVIDIA GPUs in {PROC_GPUS} and NVML: {nvml}"


def nvidia(ctx: ProbeContext, *_needed: object) -> str | None:
    """Absent when the driver lists no GPU in procfs and NVML has nothing to say: no recording for a
    captured root, or (live) nvidia-ml-py installed but no libnvidia-ml to load. (The part the probe
    needs is not needed to tell.)"""
    if ctx.nvml_replay is not None:
        return None
    if ctx.sysfs_available and ctx.fs.exists(PROC_GPUS):
        return None
    if ctx.libraries_live:
        if importlib.util.find_spec("pynvml") is None:
            return None  # the probe words "no nvidia-ml-py" itself
        try:
            ctypes.CDLL(LIBNVML)
        except OSError:
            return nvidia_absent(NO_LIBNVML)
        return None
    if not ctx.sysfs_available:
        return nvidia_absent(XML_ONLY)
    return nvidia_absent(NO_NVML_RECORDING)
