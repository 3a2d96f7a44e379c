from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.discovery.pci_ids import KINDS, classify


@pytest.mark.parametrize(
    ("vendor", "device", "cls", "kind"),
    [
        (0x10DE, 0x1DB1, 0x030200, "gpu"),  # V100 SXM2: 3D controller, not in the id table
        (0x10DE, 0x2330, 0x030200, "gpu"),  # H100 SXM5
        (0x1013, 0x00B8, 0x030000, "gpu"),  # Cirrus VGA
        (0x1002, 0x7408, 0x038000, "gpu"),  # MI250X: "other display"
        (0x1002, 0x74A1, 0x120000, "gpu"),  # MI300X: processing accelerator class, but a known GPU
        (0x1002, 0x7FFF, 0x120000, "accelerator"),  # unknown AMD part in class 0x1200
        (0x19E5, 0xD802, 0x120000, "npu"),  # Ascend 910B
        (0x19E5, 0xD9FF, 0x120001, "npu"),  # future Ascend: vendor + class family decide
        (0x19E5, 0xD802, 0x000000, "npu"),  # known Ascend id even with a bogus class
        (0x19E5, 0x1822, 0x020000, "nic"),  # Huawei Hi1822 NIC is not an NPU
        (0x1D22, 0x3684, 0x120000, "xpu"),  # Kunlunxin R200
        (0x1D22, 0x3688, 0x120000, "xpu"),  # P800
        (0x1D22, 0x9999, 0x120000, "xpu"),  # unknown Kunlunxin accelerator
        (0x1D22, 0x1380, 0x018000, "storage"),  # Baidu cloud storage device, same vendor id
        (0x1DA3, 0x1020, 0x120000, "accelerator"),  # Gaudi2
        (0x1BCF, 0x001C, 0x0B4000, "accelerator"),  # NEC Vector Engine (co-processor)
        (0x15B3, 0x101B, 0x020700, "infiniband"),  # ConnectX-6 in IB mode
        (0x15B3, 0x101B, 0x020000, "nic"),  # the same part in Ethernet mode
        (0x15B3, 0x1003, 0x028000, "nic"),  # ConnectX-3 VPI: "other network controller"
        (0x1077, 0x7322, 0x0C0600, "infiniband"),  # QLogic qib HCA: InfiniBand serial bus
        (0x1B36, 0x0010, 0x010802, "nvme"),
        (0x8086, 0x0953, 0x010801, "storage"),  # NVMHCI prog-if is not NVMe
        (0x8086, 0x2922, 0x010601, "storage"),  # AHCI
        (0x8086, 0x0D93, 0x050210, "cxl_memory"),
        (0x8086, 0x0D93, 0x050200, "other"),  # vendor-specific CXL interface, not a type-3 memdev
        (0x8086, 0x0D93, 0x050000, "other"),  # RAM controller
        (0x1B36, 0x000C, 0x060400, "bridge"),
        (0x8086, 0x29C0, 0x060000, "bridge"),
        (0x8086, 0x3C20, 0x088000, "other"),  # ioatdma
        (0x1AF4, 0x1005, 0x00FF00, "other"),  # virtio-rng
    ],
)
def test_classify_table(vendor: int, device: int, cls: int, kind: str) -> None:
    assert classify(vendor, device, cls) == kind


def test_classify_ignores_bits_above_24() -> None:
    # A class read with junk above the 24-bit code must not change the family.
    assert classify(0x10DE, 0x1DB1, 0xFF030200) == "gpu"


@settings(max_examples=200)
@given(st.integers(), st.integers(), st.integers())
def test_classify_is_total(vendor: int, device: int, cls: int) -> None:
    assert classify(vendor, device, cls) in KINDS
