"""sysfs.memory_tiers against the lab captures, synthetic trees and this host."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.cpulist import parse_cpulist
from memtopo.discovery import sysfs_tiers
from memtopo.discovery.parts import SysTiers
from memtopo.discovery.source import ProbeContext, State
from tests.fixtures import LAB_CAPTURES, hwloc_root, lab_root
from tests.sysfs_tree import Dir, write_tree

T = "sys/devices/virtual/memory_tiering"
D = "sys/kernel/mm/numa/demotion_enabled"


def run(root: Path) -> tuple[SysTiers, State, tuple[str, ...]]:
    res = sysfs_tiers.probe(ProbeContext.at_root(root))
    return res.data, res.status.state, res.status.reasons


@pytest.mark.parametrize("profile", ["single", "dual-socket-cxl", "dual-socket-tiered", "dual-socket-cxl-tiered"])
def test_lab_capture_matches_facts(profile: str) -> None:
    facts = json.loads((LAB_CAPTURES / f"{profile}.facts.json").read_text())
    data, state, reasons = run(lab_root(profile))
    assert state is State.OK, reasons
    want = {int(k.removeprefix("memory_tier")): parse_cpulist(v) for k, v in facts["memory_tiers"].items()}
    assert {t.id: t.nodes for t in data.tiers} == want
    assert [t.id for t in data.tiers] == sorted(want)
    assert data.demotion_enabled is (facts["demotion_enabled"] == "true")


def test_lab_readme_tiers() -> None:
    cxl, _, _ = run(lab_root("dual-socket-cxl"))
    assert [(t.id, t.nodes) for t in cxl.tiers] == [(4, (0, 1, 2))]
    tiered, _, _ = run(lab_root("dual-socket-cxl-tiered"))
    assert [(t.id, t.nodes) for t in tiered.tiers] == [(4, (0, 1, 2)), (22, (3,))]
    legacy, _, _ = run(lab_root("dual-socket-tiered"))
    assert [(t.id, t.nodes) for t in legacy.tiers] == [(4, (0, 1)), (22, (2,))]


def test_hwloc_dumps_have_no_tiering_dir() -> None:
    res = sysfs_tiers.probe(ProbeContext.at_root(hwloc_root("fakeheteromemtiers")))
    assert res.status.state is State.UNAVAILABLE
    assert T in res.status.reasons[0]
    assert res.data.tiers == ()


def test_demotion_true_and_sparse_tier_ids(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        f"{T}/memory_tier1/nodelist": "4", f"{T}/memory_tier4/nodelist": "0-1",
        f"{T}/memory_tier18/nodelist": "2-3", f"{T}/power": Dir(), f"{T}/uevent": "", D: "true",
    })
    data, state, _ = run(root)
    assert state is State.OK
    assert [(t.id, t.nodes) for t in data.tiers] == [(1, (4,)), (4, (0, 1)), (18, (2, 3))]
    assert data.demotion_enabled is True


def test_demotion_absent_is_none_not_a_problem(tmp_path: Path) -> None:
    data, state, _ = run(write_tree(tmp_path, {f"{T}/memory_tier4/nodelist": "0"}))
    assert (state, data.demotion_enabled) == (State.OK, None)


def test_xml_input_is_unavailable() -> None:
    res = sysfs_tiers.probe(ProbeContext.at_root("/", hwloc_xml=Path("a.xml")))
    assert res.status.state is State.UNAVAILABLE


@pytest.mark.skipif(not os.path.isdir(f"/{T}"), reason="host kernel has no memory tiers")
def test_live_host() -> None:
    data, state, reasons = run(Path("/"))
    assert state is State.OK, reasons
    want = {int(e.removeprefix("memory_tier")): parse_cpulist(Path(f"/{T}/{e}/nodelist").read_text())
            for e in os.listdir(f"/{T}") if e.startswith("memory_tier")}
    assert {t.id: t.nodes for t in data.tiers} == want
    if os.path.exists(f"/{D}"):
        assert data.demotion_enabled is (Path(f"/{D}").read_text().strip() == "true")


garbage = st.one_of(
    st.tuples(st.text(max_size=30), st.sampled_from(["x", "-", "\u0662", "::"]), st.text(max_size=30))
    .map(lambda t: (t[0] + t[1] + t[2]).encode()),
    st.binary(max_size=40).map(lambda b: b"\xff" + b),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rel=st.sampled_from([f"{T}/memory_tier22/nodelist", D]), content=garbage)
def test_garbage_degrades_and_names_the_file(tmp_path_factory: pytest.TempPathFactory, rel: str,
                                             content: bytes) -> None:
    root = write_tree(tmp_path_factory.mktemp("t"), {
        f"{T}/memory_tier4/nodelist": "0-1", f"{T}/memory_tier22/nodelist": "2", D: "false"})
    (root / rel).write_bytes(content)
    data, state, reasons = run(root)
    assert state is State.DEGRADED
    assert any(rel in r for r in reasons)
    assert (4, (0, 1)) in [(t.id, t.nodes) for t in data.tiers]
