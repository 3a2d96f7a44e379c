"""memtopo/wire.py: a serialized topology embedded in another message without encoding it again, and
found again in what arrived without a second encoding; garbage never raises."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import topology_pb2 as pb
from memtopo.wire import embed, field_bytes

SNAPSHOT = apb.AgentMessage.DESCRIPTOR.fields_by_name["snapshot"].number


def _topology(name: str, nodes: int) -> pb.MemoryTopology:
    topo = pb.MemoryTopology(node_name=name, generation=nodes, fingerprint="f" * 64)
    for i in range(nodes):
        topo.numa_nodes.add(id=i)
    return topo


@settings(max_examples=100)
@given(name=st.text(max_size=30), nodes=st.integers(0, 300), seconds=st.integers(0, 1 << 40))
def test_an_embedded_snapshot_is_the_message_with_it_set_and_found_again(name: str, nodes: int,
                                                                         seconds: int) -> None:
    topo = _topology(name, nodes)
    payload = topo.SerializeToString()
    head = apb.AgentMessage()
    head.sent.seconds = seconds
    data = embed(head.SerializeToString(), SNAPSHOT, payload)
    expected = apb.AgentMessage()
    expected.CopyFrom(head)
    expected.snapshot.CopyFrom(topo)
    assert apb.AgentMessage.FromString(data) == expected
    assert field_bytes(data, SNAPSHOT) == payload
    assert field_bytes(expected.SerializeToString(), SNAPSHOT) == payload
    assert field_bytes(head.SerializeToString(), SNAPSHOT) is None  # no snapshot in it


def test_a_field_sent_twice_is_not_one_slice() -> None:
    """Protobuf merges two occurrences of a message field: no single slice holds the value."""
    a, b = _topology("a", 1).SerializeToString(), _topology("b", 2).SerializeToString()
    data = embed(embed(b"", SNAPSHOT, a), SNAPSHOT, b)
    assert field_bytes(data, SNAPSHOT) is None


@settings(max_examples=300)
@given(data=st.binary(max_size=200), field=st.integers(1, 20))
def test_garbage_gives_none_or_a_slice_never_an_error(data: bytes, field: int) -> None:
    found = field_bytes(data, field)
    assert found is None or found in data


def test_a_cut_message_gives_none() -> None:
    data = embed(b"", SNAPSHOT, _topology("n", 50).SerializeToString())
    assert field_bytes(data[:-1], SNAPSHOT) is None
