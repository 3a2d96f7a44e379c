"""The enforcement's decisions (k8s/enforcement.py), pure: placements read and validated, CPUs chosen
within the NUMA nodes a stale placement named, adoption after a restart, the shared pool, on a
two-socket model with hyper-threads (the host the containerd tests run on has one NUMA node)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memtopo.cpulist import parse_cpulist
from memtopo.k8s import enforcement as ef
from memtopo.k8s.cputopo import CpuPlace, CpuTopology

# 2 sockets = 2 NUMA nodes, 4 cores each with 2 threads: node 0 = 0-3,8-11; node 1 = 4-7,12-15.
TOPO = CpuTopology.of({c: CpuPlace(c % 8, (c % 8) // 4, (c % 8) // 4) for c in range(16)})
NODE = ef.NodeFacts("n1", TOPO, frozenset({0, 8}), frozenset({0, 1, 2}))


def cpus(text: str) -> frozenset[int]:
    return frozenset(parse_cpulist(text))


def pod(uid: str, counts: dict[str, int], placement: dict[str, Any] | str | None = None,
        created: str = "2026-01-01T00:00:00Z", phase: str = "Running") -> dict[str, Any]:
    annotations = {}
    if placement is not None:
        annotations[ef.PLACEMENT_ANNOTATION] = placement if isinstance(placement, str) else json.dumps(placement)
    res = {n: {"limits": {"cpu": str(c), "memory": "1Gi"}} for n, c in counts.items()}
    return {"metadata": {"uid": uid, "name": uid, "namespace": "ns", "creationTimestamp": created,
                         "annotations": annotations, "generation": 3},
            "spec": {"containers": [{"name": n, "resources": r} for n, r in res.items()]},
            "status": {"phase": phase}}


def view(*args: Any, **kw: Any) -> ef.PodView:
    v = ef.pod_view(pod(*args, **kw))
    assert v is not None
    return v


def test_a_usable_placement_is_taken_as_it_is() -> None:
    v = view("a", {"x": 2, "y": 2}, {"node": "n1", "cpus": "4,5,12,13", "memory": {"nodes": "1,2"}})
    a = ef.assign(NODE, v, [])
    assert (a.cpus, a.mems, a.how) == (cpus("4,5,12,13"), (1, 2), "placement")
    assert a.shares == {"x": cpus("4,12"), "y": cpus("5,13")}  # whole cores per container


def test_memory_nodes_fall_back_to_the_memory_policy_then_the_cpus_nodes() -> None:
    v = view("a", {"x": 1}, {"cpus": "4", "memory_policy": {"mode": "bind", "nodes": "2"}})
    assert ef.assign(NODE, v, []).mems == (2,)
    assert ef.assign(NODE, view("b", {"x": 1}, {"cpus": "4"}), []).mems == (1,)


def test_a_stale_placement_is_chosen_again_within_its_numa_nodes() -> None:
    held = ef.Assignment("old", cpus("4,12"), {"x": cpus("4,12")}, (1,), "placement")
    v = view("a", {"x": 2}, {"node": "n1", "cpus": "4,12", "memory": {"nodes": "1"}})
    a = ef.assign(NODE, v, [held])
    assert a.how == "chosen" and a.cpus <= TOPO.cpus_in("numa", 1) and not a.cpus & held.cpus
    assert "placement CPUs 4,12 are held by another pod or reserved" in a.note and a.mems == (1,)
    wrong_count = ef.assign(NODE, view("b", {"x": 4}, {"cpus": "5"}), [])
    assert "placement names 1 CPUs, the pod asks 4" in wrong_count.note and len(wrong_count.cpus) == 4


def test_reserved_cpus_in_a_placement_are_not_handed_out() -> None:
    a = ef.assign(NODE, view("a", {"x": 2}, {"cpus": "0,8"}), [])
    assert not a.cpus & NODE.reserved and a.how == "chosen"


def test_without_a_placement_the_kubelets_rule_chooses() -> None:
    a = ef.assign(NODE, view("a", {"x": 8}), [])
    assert a.cpus == TOPO.cpus_in("numa", 1) and a.mems == (1,)  # the whole free socket


@pytest.mark.parametrize(("placement", "why"), [
    ("nope", "not JSON"), ("[]", "not a JSON object"), ('{"cpus": 3}', "cpus is not a CPU list"),
    ('{"cpus": ""}', "names no CPUs"), ('{"cpus": "1", "memory": 5}', "memory is not an object"),
    ('{"cpus": "1", "node": 5}', "node is not a string"), ('{"cpus": "5-3"}', "descending range"),
])
def test_what_is_not_a_placement(placement: str, why: str) -> None:
    v = view("a", {"x": 1}, placement)
    assert why in v.problem
    with pytest.raises(ef.AssignError, match=r"memtopo\.io/placement"):
        ef.assign(NODE, v, [])


@given(st.text(max_size=200) | st.binary(max_size=100).map(lambda b: b.decode("latin-1")))
def test_parse_placement_raises_only_its_own_error(raw: str) -> None:
    try:
        p = ef.parse_placement(raw)
    except ef.PlacementError as exc:
        assert len(str(exc)) < 200
    else:
        assert p.cpus


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=20))
def test_any_json_memory_is_refused_or_read(doc: Any) -> None:
    """Whatever JSON sits under ``memory``: a PlacementError naming it, or the CPUs read as written."""
    try:
        p = ef.parse_placement(json.dumps({"cpus": "1", "memory": doc}))
    except ef.PlacementError as exc:
        assert str(exc).startswith("memory")
    else:
        assert p.cpus == {1} and all(isinstance(n, int) for n in p.mems)


def test_pods_that_are_not_ours() -> None:
    assert ef.pod_view({"metadata": {"name": "x"}}) is None
    assert ef.pod_view(pod("a", {"x": 1}, phase="Succeeded")) is None
    assert ef.pod_view(pod("a", {"x": 1})) is not None


def test_decide_gives_pinned_and_shared_targets_and_keeps_first_come_first() -> None:
    old = view("old", {"x": 8}, created="2026-01-01T00:00:00Z")
    new = view("new", {"x": 8}, created="2026-01-02T00:00:00Z")
    running = [ef.RunningContainer("c-old", "old", "x"), ef.RunningContainer("c-new", "new", "x"),
               ef.RunningContainer("c-be", "be", "web")]
    d = ef.decide(NODE, [new, old], running, {})
    assert d.outcomes["old"].state == ef.APPLIED and d.outcomes["new"].state == ef.FAILED
    assert d.outcomes["new"].reason == ("asks 8 exclusive CPUs; 6 can be handed out "
                                        "(16 allocatable, 2 reserved, 8 held by 1 pods)")
    pool = TOPO.cpus - d.assignments["old"].cpus
    # A pod that could not be pinned runs on the shared pool like every other container.
    assert d.shared == {c: ef.Target(pool, (0, 1, 2)) for c in ("c-new", "c-be")} and d.pool == pool
    assert d.pinned == {"old": {"c-old": ef.Target(d.assignments["old"].cpus, d.assignments["old"].mems)}}


def test_decide_says_pending_until_every_pinned_container_runs() -> None:
    v = view("a", {"x": 1, "y": 1})
    d = ef.decide(NODE, [v], [ef.RunningContainer("c1", "a", "x")], {})
    assert d.outcomes["a"].state == ef.PENDING and "1 of 2 pinned containers running" in d.outcomes["a"].reason


def test_decide_keeps_what_it_holds_and_releases_pods_that_left() -> None:
    v = view("a", {"x": 2})
    d1 = ef.decide(NODE, [v], [], {})
    d2 = ef.decide(NODE, [v], [], d1.assignments)
    assert d2.assignments == d1.assignments
    assert ef.decide(NODE, [], [], d1.assignments).assignments == {}


def test_adopt_takes_over_disjoint_sets_of_the_right_size_only() -> None:
    pods = [view("a", {"x": 2}, created="1"), view("b", {"x": 2}, created="2"), view("c", {"x": 2}, created="3"),
            view("d", {"x": 1}, created="4")]
    seen = {
        "a": {"x": ef.Observed(cpus("4,12"), frozenset({1}))},
        "b": {"x": ef.Observed(cpus("12,13"), frozenset({1}))},  # overlaps a: not adopted
        "c": {"x": ef.Observed(cpus("0-15"), frozenset({0, 1, 2}))},  # the whole node: never pinned
        "d": {"x": ef.Observed(cpus("8"), None)},  # a reserved CPU: not adoptable
    }
    got = ef.adopt(NODE, pods, seen)
    assert set(got) == {"a"} and got["a"].mems == (1,) and got["a"].how == "adopted"


def test_needs_update() -> None:
    t = ef.Target(cpus("4"), (1,))
    assert not ef.needs_update(t, ef.Observed(cpus("4"), frozenset({1})), pinned=True)
    assert ef.needs_update(t, ef.Observed(cpus("4"), frozenset({0, 1})), pinned=True)
    assert not ef.needs_update(t, ef.Observed(cpus("4"), frozenset({0, 1})), pinned=False)
    assert ef.needs_update(t, ef.Observed(None, None), pinned=False)


def test_status_annotation_is_compact_json() -> None:
    a = ef.Assignment("u", cpus("4,12"), {"x": cpus("4,12")}, (1,), "placement")
    doc = json.loads(ef.status_annotation(ef.Outcome(ef.APPLIED, "", a, 7)))
    assert doc == {"state": "applied", "cpus": "4,12", "mems": "1", "source": "placement",
                   "containers": {"x": "4,12"}, "generation": 7}


def test_the_extenders_placement_json_is_read() -> None:
    """What the extender (extender/agents.py) writes at bind (the place policy's decision as JSON) is a placement."""
    from memtopo.planner import place

    decision = place.PlaceDecision(
        node="n1", cpus=(4, 5, 12, 13), gpus=(), gpu_ids=(), domains=(place.DomainUse(1, "DRAM", (4, 5, 12, 13), ()),),
        co_located=True, memory=(place.MemoryUse(1, 1, "DRAM", 1 << 30), place.MemoryUse(2, 2, "CXL", 1 << 30)),
        memory_policy=place.MemoryPolicyChoice("bind", (1, 2), False, "test"), beta=0.5, gpu_link_fitness=1.0,
        memory_locality_fitness=1.0, intra_node_fitness=1.0)
    got = ef.parse_placement(json.dumps(decision.to_json(), separators=(",", ":")))
    assert got == ef.Placement("n1", cpus("4,5,12,13"), (1, 2))


def test_memory_is_moved_only_off_the_nodes_a_pinned_container_may_not_use() -> None:
    # NODE's memory nodes are 0, 1 and 2 (2 without CPUs).
    assert ef.memory_move(ef.Target(cpus("4"), (1,)), NODE) == ((0, 2), (1,))
    assert ef.memory_move(ef.Target(cpus("4"), (2, 1)), NODE) == ((0,), (1, 2))
    assert ef.memory_move(ef.Target(cpus("4"), (0, 1, 2)), NODE) is None  # on every node: nothing is wrong
    assert ef.memory_move(ef.Target(cpus("4")), NODE) is None  # memory nodes left as they are


def test_the_status_says_how_moving_memory_went_once_it_has() -> None:
    a = ef.Assignment("a", cpus("4"), {"x": cpus("4")}, (1,), "chosen")
    outcome = ef.Outcome(ef.APPLIED, "", a, 3)
    assert "memory" not in json.loads(ef.status_annotation(outcome))
    assert json.loads(ef.status_annotation(outcome, "failed: x"))["memory"] == "failed: x"
