"""memtopo.protojson: long integer lists spliced into json_format's text give exactly json_format's text.

Compared on every shared capture's topology, on a synthesized 128-node one, and on generated
messages with lists on both sides of the fast path's length, maps, and fields set and unset.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st

from memtopo.discovery.capture import context_for
from memtopo.discovery.discover import discover
from memtopo.protojson import LONG_LIST, to_json
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import HWLOC_LINUX, HWLOC_XML, extracted
from tests.synth import numa_scale_host, tree, write_root

INPUTS = sorted(HWLOC_XML.glob("*.xml")) + sorted(HWLOC_LINUX.glob("*.tar.bz2")) \
    + sorted(Path(p) for p in glob.glob(str(Path(__file__).parents[1] / "fixtures/*/root.tar.gz")))


def reference(msg: Message, defaults: bool, indent: int | None) -> str:
    return json_format.MessageToJson(msg, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=defaults, indent=indent)


def same_text_and_message_kept(msg: Message) -> None:
    before = msg.SerializeToString(deterministic=True)
    for defaults in (True, False):
        for indent in (2, None):
            assert to_json(msg, defaults=defaults, indent=indent) == reference(msg, defaults, indent)
    assert msg.SerializeToString(deterministic=True) == before


@pytest.mark.parametrize("path", INPUTS, ids=lambda p: p.parent.name if p.name == "root.tar.gz" else p.name)
def test_every_captured_topology_prints_as_json_format_prints_it(path: Path) -> None:
    xml = path.suffix == ".xml"
    with context_for(None if xml else extracted(path), hwloc_xml=path if xml else None) as ctx:
        same_text_and_message_kept(discover(ctx))


def test_a_128_node_topology_prints_as_json_format_prints_it(tmp_path: Path) -> None:
    with context_for(write_root(tmp_path / "root", tree(numa_scale_host(128)))) as ctx:
        topo = discover(ctx)
    assert len(topo.numa_nodes[0].distances) == 128 >= LONG_LIST  # the fast path is taken
    same_text_and_message_kept(topo)


_IDS = st.lists(st.integers(0, 2**32 - 1), max_size=2 * LONG_LIST)


@st.composite
def topologies(draw: st.DrawFn) -> pb.MemoryTopology:
    topo = pb.MemoryTopology(node_name=draw(st.text(max_size=5)), allowed_cpus=draw(_IDS))
    for _ in range(draw(st.integers(0, 3))):
        topo.numa_nodes.add(id=draw(st.integers(0, 9)), distances=draw(_IDS), distance_nodes=draw(_IDS),
                            cpus=draw(_IDS), memory_bytes=draw(st.integers(0, 2**64 - 1)))
    for _ in range(draw(st.integers(0, 2))):
        acc = topo.accelerators.add(id=draw(st.text(max_size=4)), local_cpus=draw(_IDS))
        acc.attributes.update(draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=4)))
    if draw(st.booleans()):
        topo.slit_only_pairs_omitted = draw(st.integers(0, 2**32 - 1))
    return topo


@given(topologies())
def test_any_topology_prints_as_json_format_prints_it(topo: pb.MemoryTopology) -> None:
    same_text_and_message_kept(topo)


@given(st.lists(st.integers(-2**31, 2**31 - 1), max_size=2 * LONG_LIST))
def test_signed_lists_print_as_json_format_prints_them(values: list[int]) -> None:
    """The plan schema's int32 lists take the fast path too (a thread list of a big process)."""
    plan = planpb.BindingPlan(plan_id="p")
    plan.actions.add(id="a").thread_affinity.threads.tids.tids.extend(values)
    same_text_and_message_kept(plan)
