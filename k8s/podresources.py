"""Client of the kubelet's PodResources gRPC API (``v1.PodResourcesLister`` on a Unix socket).

``List`` gives what running containers hold exclusively (CPU ids, devices, memory, each with NUMA
affinity) and ``GetAllocatableResources`` what the kubelet can hand out; both become one
:class:`~k8s.facts.PodResourcesView`. Every failure (no socket, refused, timeout, an answer too big)
is a :class:`PodResourcesError` with a short reason: the NRT object then says PodResources was
unavailable and ``available`` equals ``allocatable``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

import grpc

from memtopo.k8s.api.podresources.v1 import podresources_pb2 as pr
from memtopo.k8s.api.podresources.v1 import podresources_pb2_grpc as pr_grpc
from memtopo.k8s.defaults import DEFAULT_POD_RESOURCES_SOCKET
from memtopo.k8s.facts import DeviceGrant, MemoryGrant, PodResourcesView

DEFAULT_SOCKET = DEFAULT_POD_RESOURCES_SOCKET
# The kubelet's own server limit for these answers is 16 MiB (podresources.DefaultMaxMsgSize).
MAX_MESSAGE_BYTES = 16 << 20
DEFAULT_TIMEOUT_S = 5.0


class PodResourcesError(Exception):
    """The PodResources API could not be read; ``reason`` is short and safe to log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _nodes(topology: pr.TopologyInfo) -> tuple[int, ...]:
    return tuple(sorted({int(n.ID) for n in topology.nodes if 0 <= n.ID < 1 << 16}))


def _devices(devs: Iterable[pr.ContainerDevices]) -> list[DeviceGrant]:
    return [DeviceGrant(d.resource_name, tuple(d.device_ids), _nodes(d.topology)) for d in devs]


def _memory(mems: Iterable[pr.ContainerMemory]) -> list[MemoryGrant]:
    return [MemoryGrant(m.memory_type, int(m.size), _nodes(m.topology)) for m in mems]


def view_from(listed: pr.ListPodResourcesResponse,
              allocatable: pr.AllocatableResourcesResponse) -> PodResourcesView:
    """The view of one ``List`` and one ``GetAllocatableResources`` answer."""
    cpus: set[int] = set()
    devices: list[DeviceGrant] = []
    memory: list[MemoryGrant] = []
    for pod in listed.pod_resources:
        for c in pod.containers:
            cpus.update(int(x) for x in c.cpu_ids if x >= 0)
            devices.extend(_devices(c.devices))
            memory.extend(_memory(c.memory))
    return PodResourcesView(
        allocatable_cpus=tuple(sorted({int(x) for x in allocatable.cpu_ids if x >= 0})),
        allocatable_devices=tuple(_devices(allocatable.devices)),
        allocatable_memory=tuple(_memory(allocatable.memory)),
        assigned_cpus=tuple(sorted(cpus)), assigned_devices=tuple(devices), assigned_memory=tuple(memory),
        pods=len(listed.pod_resources))


def _check_socket(path: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise PodResourcesError(f"no socket at {path}") from None
    except OSError as exc:
        raise PodResourcesError(f"{path}: {exc.strerror or type(exc).__name__}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise PodResourcesError(f"{path} is not a socket")


def read_pod_resources(socket_path: str = DEFAULT_SOCKET, timeout: float = DEFAULT_TIMEOUT_S) -> PodResourcesView:
    """Ask the kubelet at ``socket_path`` (blocking; the agent calls it from a worker thread)."""
    _check_socket(socket_path)
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.enable_http_proxy", 0)]
    with grpc.insecure_channel(f"unix://{socket_path}", options=options) as channel:
        stub = pr_grpc.PodResourcesListerStub(channel)
        try:
            allocatable = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=timeout)
            listed = stub.List(pr.ListPodResourcesRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            detail = (exc.details() if isinstance(exc, grpc.Call) else "") or ""
            name = code.name if code is not None else type(exc).__name__
            raise PodResourcesError(f"{name}: {detail[:120]!r}") from None
    return view_from(listed, allocatable)
