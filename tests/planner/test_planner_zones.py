"""planner/zones.py: memtopo's policies over a node's NUMA zones, choosing among what the kubelet accepts.

The device policies read counts per zone, never device ids: these tables check that the ring and half
rules give what ``planner.hccs`` and ``planner.xpu`` give for the same free counts, and that place never
leaves the placements it is given."""

from __future__ import annotations

import pytest

from memtopo.planner import hccs, xpu
from memtopo.planner.zones import ZoneFacts, ZoneRequest, choose, memory_fitness

RING0 = ("NPU0", "NPU1", "NPU2", "NPU3")
RING1 = ("NPU4", "NPU5", "NPU6", "NPU7")
HALF0 = ("XPU0", "XPU1", "XPU2", "XPU3")
HALF1 = ("XPU4", "XPU5", "XPU6", "XPU7")


def ascend(free: tuple[int, int], capacity: tuple[int, int] = (4, 4)) -> dict[int, ZoneFacts]:
    return {0: ZoneFacts(0, "DRAM", groups=(RING0,), devices=capacity[0], free_devices=free[0]),
            1: ZoneFacts(1, "DRAM", groups=(RING1,), devices=capacity[1], free_devices=free[1])}


@pytest.mark.parametrize("per_pod", [1, 2, 4])
@pytest.mark.parametrize("free", [(0, 0), (1, 4), (4, 1), (2, 3), (3, 3), (4, 4), (2, 0), (0, 3)])
def test_hccs_over_zones_agrees_with_the_hccs_policy(per_pod: int, free: tuple[int, int]) -> None:
    """Without the kubelet's own choice, the ring hccs takes and the node's score are the hccs policy's
    for a node with those free counts per ring."""
    ids = tuple(range(free[0])) + tuple(range(4, 4 + free[1]))
    result = hccs.evaluate(per_pod, hccs.Node("n", ids, 8))
    choice = choose(ZoneRequest("hccs", per_pod), ascend(free), [])
    if result.fit.score is None:
        assert choice.placement is None and "no HCCS ring can hold" in choice.reason
    else:
        assert choice.key == (float(result.fit.score),)
        assert choice.placement == ((0,) if result.fit.ring == 0 else (1,))


def test_hccs_judges_the_ring_of_the_kubelets_choice() -> None:
    zones = ascend((4, 1))
    # hccs would take ring 1 (exactly one free: group A); the kubelet takes zone 0: group D there.
    assert choose(ZoneRequest("hccs", 1), zones, [(0,), (1,)]).placement == (1,)
    kubelet = choose(ZoneRequest("hccs", 1), zones, [(0,), (1,)], kubelet_choice=(0,))
    assert kubelet.placement == (0,) and kubelet.key == (float(hccs.node_score(8, 3, 5)),)
    spans = choose(ZoneRequest("hccs", 2), zones, [], kubelet_choice=(0, 1))
    assert spans.placement is None and "spans NPU0–NPU3 and NPU4–NPU7" in spans.reason


def test_hccs_whole_node_and_rings_over_several_zones() -> None:
    # A ring spread over two zones (a four-NUMA server): its free count is the zones' sum.
    zones = {i: ZoneFacts(i, groups=(RING0 if i < 2 else RING1,), devices=2, free_devices=f)
             for i, f in enumerate((2, 2, 1, 2))}
    four = choose(ZoneRequest("hccs", 4), zones, [])
    assert four.placement == (0, 1) and "ring NPU0–NPU3 group A" in four.detail
    assert choose(ZoneRequest("hccs", 8), zones, []).placement is None
    whole = {i: ZoneFacts(i, groups=(RING0 if i < 2 else RING1,), devices=2, free_devices=2) for i in range(4)}
    assert choose(ZoneRequest("hccs", 8), whole, []).placement == (0, 1, 2, 3)
    small = choose(ZoneRequest("hccs", 8), ascend((2, 2), (2, 2)), [])
    assert small.placement is None and small.unresolvable


def test_a_zone_with_two_rings_cannot_be_counted() -> None:
    zones = {0: ZoneFacts(0, groups=(RING0, RING1), devices=8, free_devices=8)}
    found = choose(ZoneRequest("hccs", 1), zones, [])
    assert found.placement is None and found.unresolvable and "holds devices of 2 HCCS rings" in found.reason
    # One ring of eight (an Atlas A2's HCCS mesh) is not the 910's two rings of four.
    mesh = {i: ZoneFacts(i, groups=(RING0 + RING1,), devices=2, free_devices=2) for i in range(4)}
    found = choose(ZoneRequest("hccs", 2), mesh, [])
    assert found.unresolvable and "HCCS rings of 4 NPUs (ring NPU0–NPU7 has 8)" in found.reason
    # Without ring attributes (another publisher), each zone is taken as one ring.
    plain = {0: ZoneFacts(0, devices=4, free_devices=1), 1: ZoneFacts(1, devices=4, free_devices=4)}
    assert choose(ZoneRequest("hccs", 1), plain, []).placement == (0,)


def p800(free: tuple[int, int]) -> dict[int, ZoneFacts]:
    return {0: ZoneFacts(0, groups=(HALF0,), devices=4, free_devices=free[0]),
            1: ZoneFacts(1, groups=(HALF1,), devices=4, free_devices=free[1])}


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("free", [(4, 4), (3, 4), (1, 2), (2, 2), (0, 4), (3, 1), (0, 0)])
def test_xpu_over_zones_scores_as_the_xpu_policy(n: int, free: tuple[int, int]) -> None:
    used = ((1 << (4 - free[0])) - 1) | (((1 << (4 - free[1])) - 1) << 4)
    outcome = xpu.evaluate(n, used)
    choice = choose(ZoneRequest("xpu", n), p800(free), [])
    if not outcome.devices:
        assert choice.placement is None
    else:
        assert outcome.score is not None and choice.key[0] == float(outcome.score)
        if n < 8:
            half = 0 if outcome.devices[0] < 4 else 1
            # Ties between the halves go to the lower one, as the xpu policy's selector.
            assert choice.placement == (half,)


def test_xpu_needs_two_halves_of_four() -> None:
    odd = {0: ZoneFacts(0, devices=8, free_devices=8)}
    found = choose(ZoneRequest("xpu", 1), odd, [])
    assert found.placement is None and found.unresolvable and "two NUMA halves of 4" in found.reason


def test_place_never_leaves_the_accepted_placements_and_prefers_better_memory() -> None:
    zones = {0: ZoneFacts(0, "CXL", tier=2, read_bandwidth_mbps=30_000, read_latency_ns=300),
             1: ZoneFacts(1, "DRAM", tier=1, read_bandwidth_mbps=100_000, read_latency_ns=100),
             2: ZoneFacts(2, "DRAM", tier=1, read_bandwidth_mbps=100_000, read_latency_ns=100)}
    req = ZoneRequest("place")
    assert choose(req, zones, [(1,), (0,)]).placement == (1,)
    assert choose(req, zones, [(0, 2)]).placement == (0, 2)  # the only one accepted, part DRAM
    refused = choose(req, zones, [(0,)])
    assert refused.placement is None and refused.unresolvable and "allow_cxl_memory" in refused.reason
    assert choose(ZoneRequest("place", allow_cxl=True), zones, [(0,)]).placement == (0,)
    # Fewer zones rate higher: one DRAM zone beats two.
    assert memory_fitness(zones, (1,)) > memory_fitness(zones, (1, 2)) > 0
    # No accepted placement (the kubelet aligns nothing): any single zone or all of them.
    assert choose(req, zones, []).placement == (1,)
