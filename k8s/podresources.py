"""Client of the kubelet's PodResources gRPC API (``v1.PodResourcesLister`` on a Unix socket).

``List`` gives what running containers hold exclusively (CPU ids, devices, memory, each with NUMA
affinity) and ``GetAllocatableResources`` what the kubelet can hand out; both become one
:class:`~k8s.facts.PodResourcesView`. Every failure (no socket, refused, timeout, an answer too big or
not a PodResources answer) is a :class:`PodResourcesError` with a short reason that is the same for
the same cause: the NRT object then says PodResources was unavailable and ``available`` equals
``allocatable``, and the agent logs it once, not once a poll.

Memory: a ``List`` answer near the kubelet's 16 MiB limit holds hundreds of thousands of containers.
Parsed whole, and turned into a grant per container, it took the agent from 178 to 766 MiB. Here the
answer stays bytes; its pods are parsed one at a time (upb) and folded into what the view needs as
they go: the set of exclusive CPUs, device ids per resource and NUMA nodes, memory per type and NUMA
nodes. A view is at most :data:`MAX_CPU_ID` CPUs and :data:`MAX_DEVICE_IDS` device ids; beyond that
the answer is refused as too large.
"""

from __future__ import annotations

import os
import stat
from array import array
from collections.abc import Iterable
from typing import Final

import grpc
from google.protobuf.message import DecodeError, Message

from memtopo.k8s import podfingerprint
from memtopo.k8s.api.podresources.v1 import podresources_pb2 as pr
from memtopo.k8s.defaults import DEFAULT_POD_RESOURCES_SOCKET
from memtopo.k8s.facts import DeviceGrant, MemoryGrant, PodResourcesView
from memtopo.text import excerpt, human_bytes
from memtopo.wire import length_delimited

DEFAULT_SOCKET = DEFAULT_POD_RESOURCES_SOCKET
# The kubelet's own server limit for these answers is 16 MiB (podresources.DefaultMaxMsgSize).
MAX_MESSAGE_BYTES = 16 << 20
DEFAULT_TIMEOUT_S = 5.0
# CPU ids and NUMA node ids at or above these are no CPU or node of a Linux host: left out.
MAX_CPU_ID: Final = 1 << 16
MAX_NODE_ID: Final = 1 << 16
# Distinct device ids a view may hold (an RDMA shared-device pool lists a thousand per NIC).
MAX_DEVICE_IDS: Final = 1 << 16
_SERVICE: Final = pr.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name
# ListPodResourcesResponse.pod_resources
_POD_RESOURCES_FIELD: Final = 1


class PodResourcesError(Exception):
    """The PodResources API could not be read; ``reason`` is short and safe to log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _nodes(topology: pr.TopologyInfo) -> tuple[int, ...]:
    return tuple(sorted({int(n.ID) for n in topology.nodes if 0 <= n.ID < MAX_NODE_ID}))


def _devices(devs: Iterable[pr.ContainerDevices]) -> list[DeviceGrant]:
    return [DeviceGrant(d.resource_name, tuple(d.device_ids), _nodes(d.topology)) for d in devs]


def _memory(mems: Iterable[pr.ContainerMemory]) -> list[MemoryGrant]:
    return [MemoryGrant(m.memory_type, int(m.size), _nodes(m.topology)) for m in mems]


class _Assigned:
    """What running containers hold, folded as the pods are read: no per-container objects are kept."""

    def __init__(self) -> None:
        self.cpus: set[int] = set()
        self.devices: dict[tuple[str, tuple[int, ...]], set[str]] = {}
        self.memory: dict[tuple[str, tuple[int, ...]], int] = {}
        self.device_ids = 0
        self.pods = 0
        # Each pod's fingerprint hash (8 bytes a pod), as NFD's topology-updater counts them: every pod
        # the answer names, whatever it holds.
        self.hashes = array("Q")

    def add(self, pod: pr.PodResources) -> None:
        self.pods += 1
        self.hashes.append(podfingerprint.pod_hash(pod.namespace, pod.name))
        for c in pod.containers:
            self.cpus.update(x for x in c.cpu_ids if 0 <= x < MAX_CPU_ID)
            for d in c.devices:
                ids = self.devices.setdefault((d.resource_name, _nodes(d.topology)), set())
                before = len(ids)
                ids.update(d.device_ids)
                self.device_ids += len(ids) - before
                if self.device_ids > MAX_DEVICE_IDS:
                    raise PodResourcesError(f"List: too large: more than {MAX_DEVICE_IDS} device ids")
            for m in c.memory:
                key = (m.memory_type, _nodes(m.topology))
                self.memory[key] = self.memory.get(key, 0) + int(m.size)

    def grants(self) -> tuple[tuple[DeviceGrant, ...], tuple[MemoryGrant, ...]]:
        devices = tuple(DeviceGrant(res, tuple(sorted(ids)), nodes) for (res, nodes), ids in self.devices.items())
        memory = tuple(MemoryGrant(kind, size, nodes) for (kind, nodes), size in self.memory.items())
        return devices, memory


def view_from_answers(listed: bytes, allocatable: bytes) -> PodResourcesView:
    """The view of one ``List`` and one ``GetAllocatableResources`` answer, as the bytes the kubelet sent."""
    try:
        alloc = pr.AllocatableResourcesResponse.FromString(allocatable)
    except DecodeError:
        raise PodResourcesError(f"GetAllocatableResources: not a PodResources answer: {excerpt(allocatable)}") from None
    assigned = _Assigned()
    try:
        for payload in length_delimited(memoryview(listed), _POD_RESOURCES_FIELD):  # one pod's bytes at a time
            assigned.add(pr.PodResources.FromString(payload))
    except (ValueError, DecodeError):
        # The same words for the same fault every poll (no offsets): it is logged once.
        raise PodResourcesError(f"List: not a PodResources answer ({human_bytes(len(listed))})") from None
    devices, memory = assigned.grants()
    return PodResourcesView(
        allocatable_cpus=tuple(sorted({int(x) for x in alloc.cpu_ids if 0 <= x < MAX_CPU_ID})),
        allocatable_devices=tuple(_devices(alloc.devices)),
        allocatable_memory=tuple(_memory(alloc.memory)),
        assigned_cpus=tuple(sorted(assigned.cpus)), assigned_devices=devices, assigned_memory=memory,
        pods=assigned.pods, pods_fingerprint=podfingerprint.sign_hashes(assigned.hashes))


def _check_socket(path: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise PodResourcesError(f"no socket at {path}") from None
    except OSError as exc:
        raise PodResourcesError(f"{path}: {exc.strerror or type(exc).__name__}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise PodResourcesError(f"{path} is not a socket")


def _serialize(request: Message) -> bytes:
    return request.SerializeToString()


def _call(method: str, call: grpc.UnaryUnaryMultiCallable[Message, bytes], request: Message, timeout: float) -> bytes:
    try:
        return call(request, timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise PodResourcesError(f"{method}: too large: the answer is over "
                                    f"{human_bytes(MAX_MESSAGE_BYTES)}") from None
        detail = (exc.details() if isinstance(exc, grpc.Call) else "") or ""
        name = code.name if code is not None else type(exc).__name__
        raise PodResourcesError(f"{name}: {excerpt(detail, 120)}") from None


def read_pod_resources(socket_path: str = DEFAULT_SOCKET, timeout: float = DEFAULT_TIMEOUT_S) -> PodResourcesView:
    """Ask the kubelet at ``socket_path`` (blocking; the agent calls it from a worker thread)."""
    _check_socket(socket_path)
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.enable_http_proxy", 0)]
    with grpc.insecure_channel(f"unix://{socket_path}", options=options) as channel:
        # Answers as bytes (no deserializer): grpc would log a traceback for every answer it cannot
        # parse, and a parsed whole List is what the memory went to.
        get_allocatable: grpc.UnaryUnaryMultiCallable[Message, bytes] = channel.unary_unary(
            f"/{_SERVICE}/GetAllocatableResources", request_serializer=_serialize)
        list_pods: grpc.UnaryUnaryMultiCallable[Message, bytes] = channel.unary_unary(
            f"/{_SERVICE}/List", request_serializer=_serialize)
        allocatable = _call("GetAllocatableResources", get_allocatable, pr.AllocatableResourcesRequest(), timeout)
        listed = _call("List", list_pods, pr.ListPodResourcesRequest(), timeout)
    if not isinstance(listed, bytes) or not isinstance(allocatable, bytes):
        raise PodResourcesError("the channel did not answer bytes")
    view = view_from_answers(listed, allocatable)
    del listed  # the view is all that is kept
    return view
