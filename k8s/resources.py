"""Kubernetes resource names memtopo meets, in one table: the kubelet's own (``cpu``, ``memory``,
``hugepages-<size>``) and the device plugins' extended resources for the accelerators it discovers.

The device-plugin names are each vendor's plugin's: NVIDIA's and AMD's GPU plugins, Huawei's Ascend
plugin (which names 310P and 310 cards apart and every 910 variant — 910, 910B*, 910_93 —
``huawei.com/Ascend910``) and Kunlunxin's XPU plugin.
"""

from __future__ import annotations

from typing import Final

from memtopo.k8s.quantity import format_bytes
from memtopo.v1 import topology_pb2 as pb

CPU: Final = "cpu"
MEMORY: Final = "memory"
HUGEPAGES_PREFIX: Final = "hugepages-"
EPHEMERAL_STORAGE: Final = "ephemeral-storage"

NVIDIA_GPU: Final = "nvidia.com/gpu"
AMD_GPU: Final = "amd.com/gpu"
ASCEND_910: Final = "huawei.com/Ascend910"
ASCEND_310P: Final = "huawei.com/Ascend310P"
ASCEND_310: Final = "huawei.com/Ascend310"
KUNLUNXIN_XPU: Final = "kunlunxin.com/xpu"

GPU_RESOURCES: Final = (NVIDIA_GPU, AMD_GPU)
ACCELERATOR_RESOURCES: Final = (NVIDIA_GPU, AMD_GPU, ASCEND_910, ASCEND_310P, ASCEND_310, KUNLUNXIN_XPU)
# The pod annotation Kunlunxin's device plugin reads the extender's chosen XPU indexes from
# (Ascend's plugin reads an annotation named like its resource, ASCEND_910).
XPU_DEVICE_ANNOTATION: Final = "BAIDU_COM_DEVICE_IDX"


def hugepage_resource(size_bytes: int) -> str:
    """``hugepages-2Mi`` for 2 MiB pages: the kubelet's resource name for a page size."""
    return HUGEPAGES_PREFIX + format_bytes(size_bytes)


def is_hugepages(name: str) -> bool:
    return name.startswith(HUGEPAGES_PREFIX)


def is_native(name: str) -> bool:
    """A resource of Kubernetes itself (no domain, or ``kubernetes.io/``), as opposed to an extended one."""
    return "/" not in name or name.startswith("kubernetes.io/")


def accelerator_resource(acc: pb.Accelerator) -> str | None:
    """The device plugin's extended resource for an accelerator, or None when no plugin is known."""
    vendor = acc.vendor.lower()
    if vendor == "nvidia":
        return NVIDIA_GPU
    if vendor == "amd":
        return AMD_GPU
    if vendor == "huawei":
        model = acc.model.upper().replace(" ", "")
        if "310P" in model:
            return ASCEND_310P
        if "310" in model:
            return ASCEND_310
        return ASCEND_910
    if vendor == "kunlunxin":
        return KUNLUNXIN_XPU
    return None


def device_plugin_id(resource: str, index: int) -> str | None:
    """How the vendor's device plugin names device ``index`` in PodResources answers, where the name
    is derived from the index (Ascend: ``Ascend910-3``); None where the plugin uses UUIDs or addresses."""
    if resource.startswith("huawei.com/"):
        return f"{resource.removeprefix('huawei.com/')}-{index}"
    return None
