"""The light host-facts read (apply/hostfacts.py) that lets a command-line apply validate without a
full discovery: on real captured roots it answers exactly what discovery's facts say, it declines
(None: discover instead) wherever it cannot be sure, and the engine uses it only when it answers."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.apply.checks import TopologyFacts
from memtopo.apply.hostfacts import light_facts, needs_discovery, read_facts
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.hostfs import HostFS
from memtopo.v1 import plan_pb2 as planpb
from tests.apply_fakes import FakeMachine, machine, mempolicy, plan, threads
from tests.fixtures import LAB_CAPTURES, lab_root

CAPTURES = sorted(p.name.removesuffix(".tar.gz") for p in LAB_CAPTURES.glob("*.tar.gz"))
P = planpb.PlanResult


def _without_discovery_only(facts: TopologyFacts) -> TopologyFacts:
    """What the light read cannot know: Unified domains (accelerator probes) and the fingerprint."""
    return dataclasses.replace(facts, unified_nodes=frozenset(), fingerprint="")


@pytest.mark.parametrize("name", CAPTURES)
def test_light_facts_are_discoverys_on_captured_roots(name: str) -> None:
    ctx = ProbeContext.at_root(lab_root(name))
    light = read_facts(ctx.fs)
    assert light is not None
    assert light == _without_discovery_only(TopologyFacts.of(discover(ctx)))
    assert len(light.memory_nodes) >= 1 and light.online_cpus


def _small_root(tmp_path: Path) -> Path:
    """The few files the light read takes, as a two-node kernel writes them (a stand-in)."""
    root = tmp_path / "root"
    files = {"sys/devices/system/cpu/online": "0-7\n", "sys/devices/system/node/online": "0-1\n",
             "sys/devices/system/node/possible": "0-3\n", "sys/devices/system/node/has_memory": "0-1\n",
             "sys/devices/system/node/node0/cpulist": "0-3\n", "sys/devices/system/node/node1/cpulist": "4-7\n",
             "proc/self/status": "Name:\tpython\nCpus_allowed_list:\t0-5\nMems_allowed_list:\t0-1\n",
             "proc/sys/kernel/hostname": "# comment\nnode-a\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_stand_in_root_reads_as_expected(tmp_path: Path) -> None:
    got = read_facts(HostFS(_small_root(tmp_path)))
    assert got == TopologyFacts(frozenset(range(8)), frozenset(range(6)), frozenset(range(4)), frozenset({0, 1}),
                                frozenset({0, 1}), frozenset({0, 1}), frozenset(), "", "node-a")


@pytest.mark.parametrize("hostname", ["node\x07bell\n", "\n\n", "# only a comment\n"])
def test_the_node_name_is_the_identity_probes_even_for_an_unusable_hostname(tmp_path: Path, hostname: str) -> None:
    """A control character or no name at all in proc's hostname: both readers go on to /etc/hostname
    (absent here, so no name), as the identity probe always did."""
    from memtopo.discovery import identity

    root = _small_root(tmp_path)
    (root / "proc/sys/kernel/hostname").write_text(hostname)
    got = read_facts(HostFS(root))
    assert got is not None
    assert got.node_name == identity.probe(ProbeContext.at_root(root)).data.node_name == ""
    (root / "etc").mkdir()
    (root / "etc/hostname").write_text("node-b\n")
    got = read_facts(HostFS(root))
    assert got is not None and got.node_name == "node-b"


def test_a_plan_with_a_fingerprint_or_a_memory_policy_needs_discovery(tmp_path: Path) -> None:
    fs = HostFS(lab_root("dual-socket-cxl"))
    pin = plan("p", threads("t", 100, [0], all=True))
    assert not needs_discovery(pin) and light_facts(pin, fs) is not None
    pin.topology_fingerprint = "f" * 64
    assert needs_discovery(pin) and light_facts(pin, fs) is None
    # Unified memory domains (what a memory policy is checked against) come from the accelerator probes.
    assert light_facts(plan("m", mempolicy("m", 100, [0])), fs) is None


@pytest.mark.parametrize("damage", ["cpu online missing", "node online garbage", "no status", "online node without dir",
                                    "no node dir"])
def test_light_facts_decline_what_they_cannot_read(tmp_path: Path, damage: str) -> None:
    root = _small_root(tmp_path)
    node = root / "sys/devices/system/node"
    if damage == "cpu online missing":
        (root / "sys/devices/system/cpu/online").unlink()
    elif damage == "node online garbage":
        (node / "online").write_text("0-1,\x00zz\n")
    elif damage == "no status":
        (root / "proc/self/status").unlink()
    elif damage == "online node without dir":
        (node / "online").write_text("0-1,7\n")
    else:
        shutil.rmtree(node)
    assert light_facts(plan("p", threads("t", 100, [0], all=True)), HostFS(root)) is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), which=st.sampled_from(["cpu/online", "node/online", "node/has_memory",
                                                         "node/possible"]))
def test_garbage_masks_give_facts_or_none_never_a_traceback(tmp_path_factory: pytest.TempPathFactory, text: str,
                                                           which: str) -> None:
    root = _small_root(tmp_path_factory.mktemp("g"))
    (root / "sys/devices/system" / which).write_text(text)
    got = light_facts(plan("p", threads("t", 100, [0], all=True)), HostFS(root))
    assert got is None or isinstance(got, TopologyFacts)


def _engine(m: FakeMachine, facts: TopologyFacts | None, calls: list[str]) -> object:
    from memtopo.apply.config import ApplyConfig
    from memtopo.apply.engine import Engine
    from tests.apply_fakes import SELF_PID

    def topology() -> object:
        calls.append("discover")
        return m.topo

    def provider(p: planpb.BindingPlan) -> TopologyFacts | None:
        calls.append("light")
        return facts

    return Engine(m.host, topology, m.state_dir, ApplyConfig(self_pid=SELF_PID),  # type: ignore[arg-type]
                  facts_provider=provider)


def test_the_engine_discovers_only_when_the_light_read_declines(tmp_path: Path) -> None:
    m = machine(tmp_path)
    light = dataclasses.replace(TopologyFacts.of(m.topo), node_name="from-hostname")
    calls: list[str] = []
    res = _engine(m, light, calls).apply(plan("a", threads("t", 100, [1], all=True)))  # type: ignore[attr-defined]
    assert res.state == P.STATE_APPLIED and res.node_name == "from-hostname"
    assert calls == ["light"]
    calls.clear()
    res = _engine(m, None, calls).apply(plan("b", threads("t", 100, [2], all=True)))  # type: ignore[attr-defined]
    assert res.state == P.STATE_APPLIED and res.node_name == m.topo.node_name
    assert calls == ["light", "discover"]


def test_light_facts_reject_what_discovery_rejects(tmp_path: Path) -> None:
    """The same plan, the same rejection text, whichever facts validate it."""
    m = machine(tmp_path)
    calls: list[str] = []
    bad = plan("c", threads("t", 100, [9], all=True))  # CPU 9 is present but offline
    with_light = _engine(m, TopologyFacts.of(m.topo), calls).apply(bad)  # type: ignore[attr-defined]
    with_topo = m.engine().apply(bad)
    assert with_light.state == P.STATE_REJECTED
    assert list(with_light.rejections) == list(with_topo.rejections)


def test_the_engine_keeps_a_topologys_facts_only_while_it_is_the_same_topology(tmp_path: Path) -> None:
    """The facts are built once per topology the provider hands out: a new topology (the agent's
    next generation) is validated against its own facts, never the last one's."""
    m = machine(tmp_path)
    from memtopo.v1 import topology_pb2 as pb

    second = pb.MemoryTopology()
    second.CopyFrom(m.topo)
    second.fingerprint = "e" * 64
    del second.cpus.online[:]
    second.cpus.online.extend([0, 1])  # CPU 2 went offline
    topos = [m.topo, m.topo, second]
    engine = m.engine()
    engine.topology = lambda: topos.pop(0)
    assert engine.apply(plan("a", threads("t", 100, [2], all=True))).state == P.STATE_APPLIED
    assert engine.apply(plan("b", threads("t", 100, [1, 2], all=True))).state == P.STATE_APPLIED
    res = engine.apply(plan("c", threads("t", 100, [2, 3], all=True)))
    assert res.state == P.STATE_REJECTED and "not online" in res.rejections[0]
