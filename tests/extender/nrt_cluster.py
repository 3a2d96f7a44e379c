"""The extender over the API server's fleet, as its tests run it: a stand-in API server (bench/k8s_standin.py,
not a Kubernetes API server), the extender's listener started on it with a bearer token, its verbs called
as kube-scheduler calls them, and the NodeResourceTopologies and pods the tests put there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.k8s_standin import StandInApiServer
from memtopo.backoff import Backoff
from memtopo.cli.controller import listener_routes
from memtopo.cli.extender import ExtenderOptions
from memtopo.controller.server import RunningController, start_controller
from memtopo.extender.auth import Authenticator
from memtopo.k8s import podfingerprint
from memtopo.k8s.kubeapi import KubeApi
from tests.http_client import exchange, post
from tests.nrt_upstream import CPU, MEMORY, nrt, pod_by_resource_list, res_info, zone

TOKEN = "nrt-test-token-0123456789"


AUTH = f"Authorization: Bearer {TOKEN}\r\n"


FAST = {"backoff": Backoff(0.05, 0.2), "watch_seconds": 30, "min_watch_seconds": 0.0}


@pytest.fixture
def api() -> Iterator[StandInApiServer]:
    server = StandInApiServer()
    server.start_in_thread()
    yield server
    server.close()


def token_auth(tmp: Path) -> Authenticator:
    path = tmp / "token"
    path.write_text(TOKEN)
    return Authenticator(token_file=str(path))


@contextlib.asynccontextmanager
async def extender(api: StandInApiServer, tmp: Path, *, ready: bool = True, **options: Any) -> AsyncIterator[int]:
    """A controller serving the extender over ``api``'s NodeResourceTopologies; yields its HTTP port
    once /readyz says its view is synced (unless ``ready`` is False)."""
    opts = {"informer": FAST, **options}
    kube = KubeApi(api.url, timeout_s=5.0)
    running: RunningController = await start_controller(
        "127.0.0.1:0", http="127.0.0.1:0", kube=kube,
        http_routes=listener_routes(ExtenderOptions(fleet="nrt", kube=kube, auth=token_auth(tmp), **opts)))
    try:
        assert running.http is not None
        port = running.http.port
        if ready:
            await wait_ready(port)
        yield port
    finally:
        await running.stop(0)


async def readyz(port: int) -> tuple[int, dict[str, Any]]:
    status, _, raw = await exchange(port, b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return status, json.loads(raw)


async def wait_ready(port: int, want: int = 200, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status, doc = await readyz(port)
        if status == want:
            return doc
        assert time.monotonic() < deadline, doc
        await asyncio.sleep(0.05)


async def filter_ok(port: int, pod: dict[str, Any], names: list[str]) -> list[str]:
    """The names filter passes."""
    answer = await call(port, "filter", names_args(pod, names))
    passing: list[str] = answer["NodeNames"]
    return passing


async def failure(port: int, pod: dict[str, Any], name: str) -> str:
    """Why filter fails ``name`` ("" when it passes)."""
    answer = await call(port, "filter", names_args(pod, [name]))
    found: str = {**answer["FailedNodes"], **answer["FailedAndUnresolvableNodes"]}.get(name, "")
    return found


async def call(port: int, verb: str, doc: Any) -> Any:
    status, headers, raw = await exchange(port, post(f"/scheduler/{verb}", json.dumps(doc).encode(), AUTH))
    assert status == 200 and headers["content-type"] == "application/json", raw
    return json.loads(raw)


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def names_args(pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {"Pod": pod, "NodeNames": names}


def run(body: Awaitable[None]) -> None:
    asyncio.run(body)  # type: ignore[arg-type]


# ---- helpers for the cases below -------------------------------------------------------------------------
def two_zones(name: str, cpus: tuple[int, int] = (4, 4), *, policy: str = "single-numa-node", scope: str = "pod",
              fingerprint: str | None = None, extra: list[dict[str, str]] | None = None,
              zone_attrs: tuple[list[dict[str, str]], list[dict[str, str]]] = ([], []),
              managers: tuple[str, str] | None = None) -> dict[str, Any]:
    zones = []
    for i, free in enumerate(cpus):
        z = zone(f"node-{i}", res_info(CPU, "4", str(free)), res_info(MEMORY, "8Gi", "8Gi"), *(extra or []))
        z["costs"] = [{"name": "node-0", "value": 10 if i == 0 else 21},
                      {"name": "node-1", "value": 21 if i == 0 else 10}]
        if zone_attrs[i]:
            z["attributes"] = zone_attrs[i]
        zones.append(z)
    obj = nrt(name, zones)
    obj["attributes"] = [{"name": "topologyManagerPolicy", "value": policy},
                         {"name": "topologyManagerScope", "value": scope}]
    if fingerprint is not None:
        obj["attributes"].append({"name": podfingerprint.ATTRIBUTE, "value": fingerprint})
    if managers is not None:  # memtopo's publisher says which kubelet managers align at all
        obj["attributes"] += [{"name": "memtopo.io/cpu-manager-policy", "value": managers[0]},
                              {"name": "memtopo.io/memory-manager-policy", "value": managers[1]}]
    return obj


def gu_pod(name: str, cpus: int = 4, memory: str = "1Gi", **extra: str) -> dict[str, Any]:
    pod = pod_by_resource_list({CPU: str(cpus), MEMORY: memory, **extra})
    pod["metadata"] = {"name": name, "namespace": "default", "uid": f"uid-{name}"}
    pod["status"] = {"phase": "Pending"}
    return pod


def binding(name: str, node: str) -> dict[str, Any]:
    return {"PodName": name, "PodNamespace": "default", "PodUID": f"uid-{name}", "Node": node}


def placement_of(api: StandInApiServer, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(api.pods[("default", name)]["metadata"]["annotations"]["memtopo.io/placement"])
    return doc
