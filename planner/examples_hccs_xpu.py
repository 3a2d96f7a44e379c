"""Synthetic fleets for the hccs and xpu policies: the benchmark's and the tests' request builders.

Each returns the JSON request ``memtopo plan``/``controller place`` would read, so a caller times
``parse_request`` and ``rank`` separately. Deterministic for a given ``seed``.
"""

from __future__ import annotations

import random
from typing import Any


def hccs_example_fleet(n: int, seed: int, request: int = 2) -> dict[str, Any]:
    """``n`` Ascend 910 nodes in assorted states: mostly healthy, some with a bad chip, partly used.

    Ids are listed ascending on most nodes (as the device plugin writes them) and shuffled on a
    quarter of them (as after allocations and releases), so the NPU choice sees both.
    """
    rng = random.Random(seed)  # noqa: S311 -- reproducible synthetic data, not a secret
    nodes: list[dict[str, Any]] = []
    for k in range(n):
        healthy = list(range(8))
        if rng.random() < 0.1:
            healthy.remove(rng.randrange(8))
        used = set(rng.sample(healthy, rng.randrange(len(healthy) + 1)))
        available = [i for i in healthy if i not in used]
        if rng.random() < 0.25:
            rng.shuffle(available)
        node: dict[str, Any] = {"name": f"node-{k:05d}", "available": available}
        if len(healthy) != len(available) or rng.random() < 0.5:
            node["capacity"] = len(healthy)
        nodes.append(node)
    return {"request": request, "nodes": nodes}


def xpu_example_fleet(n: int, seed: int, request: int = 2) -> dict[str, Any]:
    """``n`` Kunlunxin P800 nodes with random occupancy, half given as ``used`` and half as ``occupancy``."""
    rng = random.Random(seed)  # noqa: S311 -- reproducible synthetic data, not a secret
    nodes: list[dict[str, Any]] = []
    for k in range(n):
        occupancy = rng.randrange(256)
        node: dict[str, Any] = {"name": f"node-{k:05d}"}
        if k % 2:
            node["occupancy"] = format(occupancy, "08b")
        else:
            node["used"] = [i for i in range(8) if occupancy >> i & 1]
        nodes.append(node)
    return {"request": request, "nodes": nodes}
