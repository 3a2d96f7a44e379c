"""Fleet nodes for the planner's and the controller's tests: topologies discovered from fixture hosts,
an Ascend 910 x8 node (the synthesized A2 host's tree with the real 910A x8 ``npu-smi info``
capture replayed) and the synthesized Kunlunxin P800 host, each decoded afresh so a test may edit it."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.planner import fleet
from memtopo.runner import RecordedRunner, ToolResult
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import SHARED, SYNTH, extracted

NPU_SMI_910A_X8 = SHARED / "fixtures" / "ascend910" / "npu-smi_info_910A_x8.txt"


@cache
def _ascend910() -> bytes:
    argv = ("npu-smi", "info")
    runner = RecordedRunner({argv: ToolResult(argv, 0, NPU_SMI_910A_X8.read_text(), "", None)})
    topo = discover(ProbeContext.at_root(extracted(SYNTH / "ascend-a2-8x910b" / "root.tar.gz"), runner=runner))
    return topo.SerializeToString()


@cache
def _p800() -> bytes:
    root = extracted(SYNTH / "kunlunxin-p800-8xpu" / "root.tar.gz")
    return discover(ProbeContext.at_root(root)).SerializeToString()


def node(kind: str, name: str, edit: Callable[[pb.MemoryTopology], None] | None = None,
         connected: bool = True) -> fleet.FleetNode:
    topo = pb.MemoryTopology.FromString(_ascend910() if kind == "910" else _p800())
    topo.node_name = name
    if edit is not None:
        edit(topo)
    return fleet.FleetNode(name, topo, connected)


def npu(i: int, **attrs: str) -> Callable[[pb.MemoryTopology], None]:
    def edit(topo: pb.MemoryTopology) -> None:
        acc = next(a for a in topo.accelerators if a.id == f"NPU{i}")
        for key, value in attrs.items():
            if key == "health":
                acc.health = value
            else:
                acc.attributes[key] = value
    return edit
