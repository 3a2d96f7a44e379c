"""extender/inflight.py: which pods a node's NodeResourceTopology does not count yet, and what they hold.

Pure functions over pod records and the node's read model: the fingerprint's candidate sets, the time
window without one, staleness, claims and their lifetime, overreserve for pods without a placement;
and the pod informer's transform against any JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.extender.inflight import (
    MAX_UNREFLECTED,
    Claim,
    InFlight,
    PodRecord,
    claim_label,
    in_flight,
    parse_claim,
    pod_record,
)
from memtopo.k8s import podfingerprint
from memtopo.k8s.nrt_read import NodeTopology, read_nrt
from tests.nrt_upstream import CPU, MEMORY, nrt, res_info, zone
from tests.strategies import json_like

NOW = 1_700_000_000.0


def node(fingerprint: str = "", method: str = "") -> NodeTopology:
    obj = nrt("n1", [zone("node-0", res_info(CPU, "8", "8"), res_info(MEMORY, "8Gi", "8Gi")),
                     zone("node-1", res_info(CPU, "8", "8"), res_info(MEMORY, "8Gi", "8Gi"))])
    attrs = []
    if fingerprint:
        attrs.append({"name": podfingerprint.ATTRIBUTE, "value": fingerprint})
    if method:
        attrs.append({"name": podfingerprint.METHOD_ATTRIBUTE, "value": method})
    obj["attributes"] = attrs
    return read_nrt(obj)


def rec(name: str, *, phase: str = "Running", age: float | None = 600.0, cpus: int = 2, exclusive: bool = True,
        claim: Claim | None = None, node_name: str = "n1") -> PodRecord:
    return PodRecord("default", name, node_name, phase, None if age is None else NOW - age, exclusive,
                     (("cpu", cpus),) if cpus else (), claim)


def sign(*names: str) -> str:
    return podfingerprint.sign(("default", n) for n in names)


def flight(topo: NodeTopology, bound: list[PodRecord], claiming: list[PodRecord] = (),  # type: ignore[assignment]
           quiet_for: float = 0.0, **kw: Any) -> InFlight:
    return in_flight(topo, bound, claiming, now=NOW, quiet_for=quiet_for, max_age=kw.pop("max_age", 120.0),
                     claim_ttl=kw.pop("claim_ttl", 30.0), **kw)


def test_a_matching_fingerprint_leaves_nothing_in_flight() -> None:
    pods = [rec("a"), rec("b")]
    f = flight(node(sign("a", "b")), pods)
    assert f.how == "fingerprint" and f.pods == () and f.reserved == {} and not f.stale


def test_the_most_recently_scheduled_pods_the_object_does_not_sign_are_in_flight() -> None:
    """The object signs a and b; c and d were scheduled after: both are in flight, each held in every
    zone (no placement: which zone the kubelet gave it cannot be known)."""
    pods = [rec("a", age=600), rec("b", age=500), rec("c", age=5, phase="Pending"), rec("d", age=1, cpus=3)]
    f = flight(node(sign("a", "b")), pods)
    assert f.how == "fingerprint" and {p.name for p in f.pods} == {"c", "d"}
    assert f.reserved == {0: {"cpu": 5}, 1: {"cpu": 5}}


def test_the_running_pods_alone_may_be_what_the_object_signs() -> None:
    pods = [rec("a"), rec("new", phase="Pending", age=700)]
    f = flight(node(sign("a")), pods)
    assert f.how == "fingerprint" and [p.name for p in f.pods] == ["new"]


def test_finished_pods_the_kubelet_still_lists_may_be_signed_too() -> None:
    pods = [rec("a"), rec("done", phase="Succeeded")]
    assert flight(node(sign("a", "done")), pods).pods == ()


def test_with_exclusive_resources_signs_only_pods_holding_some() -> None:
    pods = [rec("a"), rec("shared", exclusive=False, cpus=0), rec("b", age=1, phase="Pending")]
    f = flight(node(sign("a"), podfingerprint.METHOD_WITH_EXCLUSIVE_RESOURCES), pods)
    assert f.how == "fingerprint" and [p.name for p in f.pods] == ["b"]


def test_a_placed_pod_is_held_in_its_claimed_zones_only() -> None:
    claim = Claim("n1", (1,), ((1, "cpu", 4),), NOW - 3)
    f = flight(node(sign("a")), [rec("a"), rec("placed", age=3, phase="Pending", cpus=4, claim=claim)])
    assert f.reserved == {1: {"cpu": 4}}
    # A claim holds no more than the pod's spec asks, and what it leaves out is held in every zone: an
    # owner writing a placement cannot make a zone look fuller than the pod could.
    greedy = Claim("n1", (0, 1), ((0, "cpu", 100), (1, "memory", 1 << 40)), NOW - 3)
    f = flight(node(sign("a")), [rec("a"), rec("greedy", age=3, phase="Pending", cpus=2, claim=greedy)])
    assert f.reserved == {0: {"cpu": 2}}
    short = Claim("n1", (0,), ((0, "cpu", 1),), NOW - 3)
    f = flight(node(sign("a")), [rec("a"), rec("short", age=3, phase="Pending", cpus=3, claim=short)])
    assert f.reserved == {0: {"cpu": 3}, 1: {"cpu": 2}}
    # A claim written for another node does not say where this node holds it: every zone.
    elsewhere = Claim("n2", (1,), ((1, "cpu", 4),), NOW - 3)
    f = flight(node(sign("a")), [rec("a"), rec("moved", age=3, phase="Pending", claim=elsewhere)])
    assert f.reserved == {0: {"cpu": 2}, 1: {"cpu": 2}}


def test_without_a_fingerprint_recent_and_pending_pods_are_in_flight_until_max_age() -> None:
    pods = [rec("old", age=600), rec("recent", age=30), rec("pending", age=900, phase="Pending"),
            rec("unknown-time", age=None)]
    f = flight(node(), pods)
    assert f.how == "window" and {p.name for p in f.pods} == {"recent", "pending", "unknown-time"}
    # The answer holds until the recent pod's window closes.
    assert f.valid_until == pytest.approx(NOW - 30 + 120)
    assert not f.stale


def test_an_object_whose_fingerprint_matches_nothing_for_max_age_is_stale() -> None:
    pods = [rec("a"), rec("b")]
    fresh = flight(node(sign("a", "gone")), pods, quiet_for=10)
    assert fresh.how == "window" and not fresh.stale and fresh.valid_until == pytest.approx(NOW + 110)
    stale = flight(node(sign("a", "gone")), pods, quiet_for=121)
    assert "nodeTopologyPodsFingerprint counts none of the sets of the 2 pods" in stale.stale
    assert "--nrt-max-age 120 s" in stale.stale
    # A fingerprint of another version is no fingerprint: judged by time, never stale.
    assert not flight(node("pfp0v999abcdef0123456789"), pods, quiet_for=1e6).stale


def test_more_unreflected_pods_than_the_search_tries_fall_back_to_the_window() -> None:
    pods = [rec("base", age=10_000)] + [rec(f"p{i}", age=1000 - i) for i in range(MAX_UNREFLECTED + 1)]
    f = flight(node(sign("base")), pods, quiet_for=1)
    assert f.how == "window"
    assert flight(node(sign("base")), pods[:-1], quiet_for=1).how == "fingerprint"


def test_unbound_claims_hold_their_zones_for_claim_ttl() -> None:
    fresh = rec("binding", node_name="", cpus=4, claim=Claim("n1", (0,), ((0, "cpu", 4),), NOW - 10))
    old = rec("abandoned", node_name="", cpus=4, claim=Claim("n1", (1,), ((1, "cpu", 4),), NOW - 31))
    other = rec("other-node", node_name="", cpus=4, claim=Claim("n2", (0,), ((0, "cpu", 4),), NOW - 1))
    future = rec("future", node_name="", cpus=4, claim=Claim("n1", (1,), ((1, "cpu", 4),), NOW + 3600))
    f = flight(node(sign()), [], [fresh, old, other, future])
    assert f.reserved == {0: {"cpu": 4}} and [p.name for p in f.pods] == ["binding"]
    assert f.valid_until == pytest.approx(NOW + 20)
    # The pod a bind judges is left out of what is in flight.
    assert flight(node(sign()), [], [fresh], exclude="default/binding").reserved == {}


def _pod(**over: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "ns", "creationTimestamp": "2024-01-01T00:00:00Z"},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {
            "requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "1Gi"}}}]},
        "status": {"phase": "Running", "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2024-01-01T00:00:05Z"}]}}
    pod.update(over)
    return pod


def test_the_pod_record_keeps_what_reservations_need() -> None:
    r = pod_record(_pod())
    assert (r.namespace, r.name, r.node, r.phase) == ("ns", "p", "n1", "Running")
    assert r.scheduled_at == 1704067205.0 and r.exclusive and dict(r.demand) == {"cpu": 2, "memory": 1 << 30}
    # scheduler-plugins' IsExclusive: a Burstable pod holds no exclusive CPU, but any device is exclusive.
    burstable = _pod(spec={"containers": [{"resources": {"requests": {"cpu": "2"}}}]})
    assert not pod_record(burstable).exclusive and pod_record(burstable).demand == ()
    gpu = _pod(spec={"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]})
    assert pod_record(gpu).exclusive and pod_record(gpu).demand == (("nvidia.com/gpu", 1),)
    # Without PodScheduled, the creation time; a pod whose resources the kubelet cannot read holds nothing.
    assert pod_record(_pod(status={})).scheduled_at == 1704067200.0
    assert pod_record(_pod(spec={"containers": [{"resources": {"requests": {"cpu": "lots"}}}]})).demand == ()
    with pytest.raises(ValueError):
        pod_record({"metadata": {"namespace": "ns"}})


def test_claims_are_read_strictly_and_a_broken_one_is_none() -> None:
    good = {"node": "n1", "zones": [1], "claims": {"1": {"cpu": 4}}, "at": NOW}
    assert parse_claim(json.dumps(good)) == Claim("n1", (1,), ((1, "cpu", 4),), NOW)
    for bad in ({**good, "zones": [-1]}, {**good, "zones": [True]}, {**good, "claims": {"x": {"cpu": 1}}},
                {**good, "claims": {"1": {"cpu": -1}}}, {**good, "claims": {"1": {"cpu": 1.5}}},
                {**good, "at": "now"}, {**good, "claims": {"1": {"cpu": 1 << 70}}}, [good]):
        assert parse_claim(json.dumps(bad)) is None, bad
    assert parse_claim("x" * 70_000) is None and parse_claim("{") is None and parse_claim(None) is None
    assert len(claim_label("n" * 253)) <= 63


_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_POD_KEYS = st.sampled_from(["metadata", "name", "namespace", "spec", "nodeName", "containers", "initContainers",
                             "resources", "requests", "limits", "cpu", "memory", "nvidia.com/gpu", "status",
                             "phase", "conditions", "type", "status", "lastTransitionTime", "annotations",
                             "memtopo.io/placement", "restartPolicy", "qosClass"])
_CLAIM_KEYS = st.sampled_from(["node", "zones", "claims", "at", "0", "1", "cpu", "memory"])


@settings(max_examples=300, deadline=None)
@given(json_like(_SCALARS, _POD_KEYS, max_leaves=30))
def test_any_pod_json_is_a_record_or_a_value_error(doc: object) -> None:
    pod: dict[str, Any] = doc if isinstance(doc, dict) else {"metadata": doc}
    meta = pod.get("metadata")
    if isinstance(meta, dict):
        meta.setdefault("name", "p")
        meta.setdefault("namespace", "ns")
    try:
        r = pod_record(pod)
    except ValueError:
        return
    assert all(isinstance(q, int) and q > 0 for _, q in r.demand)


@settings(max_examples=300, deadline=None)
@given(json_like(_SCALARS, _CLAIM_KEYS, max_leaves=20))
def test_any_placement_text_is_a_claim_or_none(doc: object) -> None:
    found = parse_claim(json.dumps(doc))
    assert found is None or all(a >= 0 for _, _, a in found.amounts)
