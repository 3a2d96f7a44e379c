"""The NVML calls the nvidia probe makes, as one interface (:class:`NvmlApi`) with three sides: the
live library (discovery/nvml_live.py), a recording replayed with a captured root
(discovery/nvml_replay.py) and the recorder that writes one (discovery/nvml_record.py).

**Errors**: an :class:`NvmlApi` raises only :class:`NvmlCallError` (the NVML call, and the error name
as pynvml spells its classes, ``NVMLError_<Name>``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from memtopo.discovery.parts import Ids
from memtopo.discovery.source import ProbeContext
from memtopo.hostfs import HostReadError

NODE_POSSIBLE = "sys/devices/system/node/possible"
CPU_POSSIBLE = "sys/devices/system/cpu/possible"

_DEFAULT_NODES = 1024
_DEFAULT_CPUS = 8192

# NvmlApi method → the NVML function it records (for reasons and the replay's error answers).
CALLS: Mapping[str, str] = {
    "init": "nvmlInit",
    "device_count": "nvmlDeviceGetCount",
    "open": "nvmlDeviceGetHandleByIndex",
    "name": "nvmlDeviceGetName",
    "uuid": "nvmlDeviceGetUUID",
    "pci_bus_id": "nvmlDeviceGetPciInfo",
    "memory_total": "nvmlDeviceGetMemoryInfo",
    "numa_node_id": "nvmlDeviceGetNumaNodeId",
    "memory_affinity": "nvmlDeviceGetMemoryAffinity",
    "cpu_affinity": "nvmlDeviceGetCpuAffinityWithinScope",
    "c2c_enabled": "nvmlDeviceGetC2cModeInfoV",
    "c2c_links": "nvmlDeviceGetFieldValues",
    "addressing_mode": "nvmlDeviceGetAddressingMode",
    "mig_mode": "nvmlDeviceGetMigMode",
    "nvlinks": "nvmlDeviceGetNvLinkState",
}


class NvidiaParseError(ValueError):
    """A numa_status file or an NVML recording that does not parse."""


class NvmlCallError(Exception):
    """One NVML call failed. ``error`` is pynvml's class suffix: NotSupported, FunctionNotFound …"""

    def __init__(self, call: str, error: str, detail: str = "") -> None:
        super().__init__(f"{call}: {error}" + (f" ({detail})" if detail else ""))
        self.call = call
        self.error = error
        self.detail = detail


# ---- the NVML interface ------------------------------------------------------------------------------
@dataclass(frozen=True)
class C2cLink:
    active: bool
    max_bw_mbps: int  # NVML_FI_DEV_C2C_LINK_GET_MAX_BW: MB/s of an active link


@dataclass(frozen=True)
class NvLinkPeer:
    remote_bdf: str  # normalised, "" when NVML's bus id does not parse
    remote_type: str  # GPU, SWITCH, IBMNPU, or "" when NVML cannot say


class NvmlApi(Protocol):
    """The NVML calls this probe makes, by device index. Every method raises only NvmlCallError."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def open(self, index: int) -> None: ...
    def name(self, index: int) -> str: ...
    def uuid(self, index: int) -> str: ...
    def pci_bus_id(self, index: int) -> str: ...
    def memory_total(self, index: int) -> int: ...
    def numa_node_id(self, index: int) -> int: ...
    def memory_affinity(self, index: int, max_nodes: int) -> Ids: ...
    def cpu_affinity(self, index: int, max_cpus: int) -> Ids: ...
    def c2c_enabled(self, index: int) -> bool: ...
    def c2c_links(self, index: int) -> tuple[C2cLink, ...]: ...
    def addressing_mode(self, index: int) -> int: ...
    def mig_mode(self, index: int) -> tuple[int, int]: ...
    def nvlinks(self, index: int) -> tuple[NvLinkPeer | None, ...]: ...


def _span(ctx: ProbeContext, rel: str, default: int) -> int:
    if not ctx.sysfs_available:
        return default
    try:
        ids = ctx.fs.read_cpulist(rel)
    except HostReadError:
        return default
    return max(ids) + 1 if ids else default


def id_spans(ctx: ProbeContext) -> tuple[int, int]:
    """How many node ids and CPU ids the affinity calls ask for: the root's possible ones."""
    return _span(ctx, NODE_POSSIBLE, _DEFAULT_NODES), _span(ctx, CPU_POSSIBLE, _DEFAULT_CPUS)
