"""What kind of device a PCI function is, decided from data tables rather than code paths.

The class code decides the family, the vendor (and for a few parts the device id) decides what the
class code cannot: an Ascend NPU and an AMD Instinct both say "processing accelerator", and Huawei
also ships NICs that must never count as NPUs. Unknown ids still classify by class code, so a new
GPU generation shows up as "gpu" or "accelerator" before anyone edits these tables.

Kinds are the names of the proto enum PciDeviceKind (lower case, without the prefix).
"""

from __future__ import annotations

from collections.abc import Mapping

KINDS: tuple[str, ...] = (
    "gpu", "nic", "infiniband", "nvme", "npu", "xpu", "accelerator", "cxl_memory", "bridge", "storage", "other",
)

VENDOR_NVIDIA = 0x10DE
VENDOR_AMD = 0x1002
VENDOR_HUAWEI = 0x19E5
VENDOR_KUNLUNXIN = 0x1D22
VENDOR_MELLANOX = 0x15B3
VENDOR_INTEL = 0x8086
VENDOR_HABANA = 0x1DA3

# Full 24-bit codes where the programming interface changes the meaning: 0x010801 is NVMHCI, not
# NVMe; 0x050200 is a vendor-specific CXL memory interface that cxl_pci does not bind.
CLASS_NVME = 0x010802
CLASS_CXL_MEMORY = 0x050210

# Class families (class >> 8) whose meaning does not depend on the vendor.
FAMILY_KIND: Mapping[int, str] = {
    0x0300: "gpu",  # VGA-compatible
    0x0301: "gpu",  # XGA
    0x0302: "gpu",  # 3D controller (NVIDIA data-center parts)
    0x0380: "gpu",  # other display (AMD MI250X "Aldebaran")
    0x1200: "accelerator",  # processing accelerator
    0x0B40: "accelerator",  # co-processor (NEC Vector Engine, Xeon Phi)
    0x0207: "infiniband",  # ConnectX in IB mode
    0x0C06: "infiniband",  # InfiniBand serial bus: QLogic/Intel qib HCAs report this
    0x0200: "nic",  # Ethernet
}

# Whole base classes (class >> 16) after the families above had their say.
BASE_KIND: Mapping[int, str] = {
    0x01: "storage",
    # "Other network controller" (0x0280): ConnectX-3 VPI cards report it in IB and Ethernet mode.
    0x02: "nic",
    0x06: "bridge",
}

# Ascend parts (ids from Huawei's own tooling, not in public pci.ids). Listed so that an NPU still
# counts as one even if a firmware reports a class other than 0x1200.
HUAWEI_NPU_DEVICES: frozenset[int] = frozenset({0xD100, 0xD500, 0xD801, 0xD802, 0xD803, 0xD806})

# Kunlunxin/Baidu also has a "Cloud Storage Device" (0x1380) under the same vendor id, so the
# vendor alone is not enough: a known accelerator id, or an accelerator/display class.
KUNLUNXIN_XPU_DEVICES: frozenset[int] = frozenset({0x3684, 0x3685, 0x3688})
XPU_FAMILIES: frozenset[int] = frozenset({0x1200, 0x0B40, 0x0300, 0x0302, 0x0380})

# Devices whose kind is known whatever class they report. AMD Instinct parts use class 0x1200 yet
# are what schedulers call GPUs (amdgpu driver, amd.com/gpu), so they are GPUs here.
KNOWN_DEVICES: Mapping[tuple[int, int], str] = {
    # NVIDIA data-center GPUs
    (VENDOR_NVIDIA, 0x2330): "gpu",  # H100 SXM5 80GB
    (VENDOR_NVIDIA, 0x2331): "gpu",  # H100 PCIe
    (VENDOR_NVIDIA, 0x2335): "gpu",  # H200 SXM
    (VENDOR_NVIDIA, 0x233B): "gpu",  # H200 NVL
    (VENDOR_NVIDIA, 0x2342): "gpu",  # GH200 120GB/480GB
    (VENDOR_NVIDIA, 0x2348): "gpu",  # GH200 144G HBM3e
    (VENDOR_NVIDIA, 0x2901): "gpu",  # B200
    (VENDOR_NVIDIA, 0x2941): "gpu",  # HGX GB200
    (VENDOR_NVIDIA, 0x31C2): "gpu",  # GB300
    (VENDOR_NVIDIA, 0x31C3): "gpu",  # GB300
    # AMD Instinct
    (VENDOR_AMD, 0x74A0): "gpu",  # MI300A
    (VENDOR_AMD, 0x74A1): "gpu",  # MI300X
    (VENDOR_AMD, 0x74A2): "gpu",  # MI308X
    (VENDOR_AMD, 0x74A5): "gpu",  # MI325X
    (VENDOR_AMD, 0x74B5): "gpu",  # MI300X VF
    (VENDOR_AMD, 0x75A0): "gpu",  # MI350X
    (VENDOR_AMD, 0x75A3): "gpu",  # MI355X
    (VENDOR_AMD, 0x7408): "gpu",  # MI250X
    (VENDOR_AMD, 0x740C): "gpu",  # MI250X
    (VENDOR_AMD, 0x740F): "gpu",  # MI210
    # Habana (Intel) Gaudi
    (VENDOR_HABANA, 0x1020): "accelerator",  # Gaudi2
    (VENDOR_HABANA, 0x1060): "accelerator",  # Gaudi3
    **{(VENDOR_HUAWEI, dev): "npu" for dev in HUAWEI_NPU_DEVICES},
    **{(VENDOR_KUNLUNXIN, dev): "xpu" for dev in KUNLUNXIN_XPU_DEVICES},
}


# Server management controllers put a VGA-class display on the bus (ASPEED AST2x00, Matrox G200e);
# counting it as a GPU would give every server one phantom accelerator.
BMC_DISPLAY_VENDORS: frozenset[int] = frozenset({0x1A03, 0x102B})


def classify(vendor_id: int, device_id: int, class_code: int) -> str:
    """The PciDeviceKind name of a function; total: any ints in, one of :data:`KINDS` out."""
    code = class_code & 0xFFFFFF
    family = code >> 8
    known = KNOWN_DEVICES.get((vendor_id, device_id))
    if known is not None:
        return known
    if vendor_id in BMC_DISPLAY_VENDORS and code >> 16 == 0x03:
        return "other"
    if code == CLASS_CXL_MEMORY:
        return "cxl_memory"
    if vendor_id == VENDOR_HUAWEI and family == 0x1200:
        return "npu"
    if vendor_id == VENDOR_KUNLUNXIN and family in XPU_FAMILIES:
        return "xpu"
    kind = FAMILY_KIND.get(family)
    if kind is not None:
        return kind
    if code == CLASS_NVME:
        return "nvme"
    return BASE_KIND.get(code >> 16, "other")
