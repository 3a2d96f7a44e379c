"""Client of the container runtime's CRI gRPC API (``runtime.v1.RuntimeService`` on a Unix socket).

What the node's enforcement needs, and nothing more: ``Version``; ``ListContainers`` filtered by the
kubelet's labels; ``ContainerStatus`` (verbose, for the task's pid); ``UpdateContainerResources`` with
the cpuset fields only — the CPU quota, period and shares are the kubelet's, and a zero field means
"unchanged" to containerd and CRI-O, so they travel as zero; and ``GetContainerEvents`` where the
runtime has it (containerd 1.6 answers UNIMPLEMENTED: the caller polls).

The calls block (the agent makes them from a worker thread). Every call has a deadline and every
answer a size cap; every failure — no socket, not a socket, a runtime that hangs, answers garbage or
too much, a container that vanished — is a :class:`CriError` whose ``reason`` is short and safe to
log and whose ``code`` is the gRPC status name (or ``NO_SOCKET``/``NOT_SOCKET``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Final

import grpc

from memtopo.cpulist import format_cpulist
from memtopo.k8s.api.cri.v1 import cri_pb2 as cri
from memtopo.k8s.api.cri.v1 import cri_pb2_grpc as cri_grpc
from memtopo.k8s.jsonvalue import json_object_or_none
from memtopo.text import excerpt, shorten

# containerd's socket, then CRI-O's: the kubelet's usual --container-runtime-endpoint values.
DEFAULT_ENDPOINTS: Final = ("unix:///run/containerd/containerd.sock", "unix:///var/run/crio/crio.sock")
# The kubelet's own client limit for CRI answers (remote.maxMsgSize).
MAX_MESSAGE_BYTES: Final = 16 << 20
DEFAULT_TIMEOUT_S: Final = 5.0
# The verbose `info` JSON is a debugging aid; more than this is not a status any runtime sends.
MAX_INFO_BYTES: Final = 1 << 20
MAX_PID: Final = 1 << 22  # the kernel's PID_MAX_LIMIT

POD_UID_LABEL: Final = "io.kubernetes.pod.uid"
POD_NAME_LABEL: Final = "io.kubernetes.pod.name"
POD_NAMESPACE_LABEL: Final = "io.kubernetes.pod.namespace"
CONTAINER_NAME_LABEL: Final = "io.kubernetes.container.name"

CREATED: Final = "created"
RUNNING: Final = "running"
EXITED: Final = "exited"
UNKNOWN: Final = "unknown"
_STATES: Final = {cri.CONTAINER_CREATED: CREATED, cri.CONTAINER_RUNNING: RUNNING,
                  cri.CONTAINER_EXITED: EXITED, cri.CONTAINER_UNKNOWN: UNKNOWN}
_STATE_VALUES: Final = {v: k for k, v in _STATES.items()}
_EVENTS: Final = {cri.CONTAINER_CREATED_EVENT: "created", cri.CONTAINER_STARTED_EVENT: "started",
                  cri.CONTAINER_STOPPED_EVENT: "stopped", cri.CONTAINER_DELETED_EVENT: "deleted"}


class CriError(Exception):
    """The runtime could not be asked or did not answer usefully; ``reason`` is short and safe to log,
    ``code`` the gRPC status name (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``NOT_FOUND`` …) or
    ``NO_SOCKET``/``NOT_SOCKET``/``BAD_ANSWER``."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}" if reason else code)
        self.code = code
        self.reason = reason

    @property
    def unimplemented(self) -> bool:
        return self.code == "UNIMPLEMENTED"

    @property
    def not_found(self) -> bool:
        return self.code == "NOT_FOUND"


@dataclass(frozen=True)
class RuntimeVersion:
    runtime_name: str
    runtime_version: str
    api_version: str


@dataclass(frozen=True)
class RuntimeContainer:
    """One container as ``ListContainers`` gives it, with the kubelet's labels picked out ("" when a
    container lacks one: not the kubelet's)."""

    id: str
    sandbox_id: str
    name: str
    state: str  # created | running | exited | unknown
    created_ns: int
    pod_uid: str
    pod_name: str
    pod_namespace: str


@dataclass(frozen=True)
class ContainerDetail:
    """``ContainerStatus``: the state, the task's pid (None when the runtime did not say, or the
    container is not running), and the cpuset the runtime reports (None where it reports none)."""

    id: str
    state: str
    pid: int | None
    cpuset_cpus: str | None
    cpuset_mems: str | None


@dataclass(frozen=True)
class ContainerEvent:
    container_id: str
    kind: str  # created | started | stopped | deleted
    created_ns: int


def socket_path(endpoint: str) -> str:
    """``unix:///run/x.sock`` or ``/run/x.sock`` → ``/run/x.sock``; CriError for anything else (the
    CRI is a local Unix socket: a TCP endpoint would put the node's containers on the network)."""
    path = endpoint.removeprefix("unix://")
    if not path.startswith("/") or "\0" in path:
        raise CriError("BAD_ENDPOINT", f"not a unix socket endpoint: {excerpt(endpoint)}")
    return path


def check_socket(path: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CriError("NO_SOCKET", f"no socket at {shorten(path)}") from None
    except OSError as exc:
        raise CriError("NO_SOCKET", f"{shorten(path)}: {exc.strerror or type(exc).__name__}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise CriError("NOT_SOCKET", f"{shorten(path)} is not a socket")


def resolve_endpoint(configured: str = "", candidates: Iterable[str] = DEFAULT_ENDPOINTS) -> str:
    """``configured`` when set, else the first of ``candidates`` whose socket exists (else the first)."""
    if configured:
        return configured
    listed = list(candidates)
    for endpoint in listed:
        try:
            check_socket(socket_path(endpoint))
        except CriError:
            continue
        return endpoint
    return listed[0]


def _rpc_error(exc: grpc.RpcError, what: str) -> CriError:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    detail = (exc.details() if isinstance(exc, grpc.Call) else "") or ""
    name = code.name if code is not None else type(exc).__name__
    return CriError(name, f"{what}: {excerpt(detail, 120)}" if detail else what)


def _text(value: str, limit: int = 253) -> str:
    """A name or id from the runtime, as far as memtopo uses it: printable and bounded."""
    return value if len(value) <= limit and value.isprintable() else shorten(value, limit)


def _pid_from_info(info: Mapping[str, str]) -> int | None:
    doc = json_object_or_none(info.get("info"), MAX_INFO_BYTES)
    pid = doc.get("pid") if doc is not None else None
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < MAX_PID:
        return None
    return pid


def _container(c: cri.Container) -> RuntimeContainer:
    labels = c.labels
    return RuntimeContainer(
        id=_text(c.id), sandbox_id=_text(c.pod_sandbox_id),
        name=_text(labels.get(CONTAINER_NAME_LABEL) or c.metadata.name),
        state=_STATES.get(c.state, UNKNOWN), created_ns=int(c.created_at),
        pod_uid=_text(labels.get(POD_UID_LABEL, "")), pod_name=_text(labels.get(POD_NAME_LABEL, "")),
        pod_namespace=_text(labels.get(POD_NAMESPACE_LABEL, "")))


class CriClient:
    """One channel to the runtime at ``endpoint`` (``unix:///path``); close it (or use ``with``)."""

    def __init__(self, endpoint: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.endpoint = endpoint
        self.path = socket_path(endpoint)
        self.timeout = timeout
        check_socket(self.path)
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.enable_http_proxy", 0),
                   # A runtime that restarts comes back within seconds; do not wait minutes to retry it.
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
        self._channel = grpc.insecure_channel(f"unix://{self.path}", options=options)
        self._stub = cri_grpc.RuntimeServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _failed(self, exc: grpc.RpcError, what: str) -> CriError:
        # A runtime that went away shows as UNAVAILABLE; say which of the two it was.
        err = _rpc_error(exc, what)
        if err.code == "UNAVAILABLE":
            try:
                check_socket(self.path)
            except CriError as gone:
                return gone
        return err

    def version(self) -> RuntimeVersion:
        try:
            r = self._stub.Version(cri.VersionRequest(version="v1"), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._failed(exc, "Version") from None
        return RuntimeVersion(_text(r.runtime_name), _text(r.runtime_version), _text(r.runtime_api_version))

    def list_containers(self, labels: Mapping[str, str] | None = None,
                        state: str | None = RUNNING) -> list[RuntimeContainer]:
        """Containers whose labels include every pair of ``labels``, in ``state`` (None: any)."""
        flt = cri.ContainerFilter(label_selector=dict(labels or {}))
        if state is not None:
            flt.state.state = _STATE_VALUES[state]
        try:
            r = self._stub.ListContainers(cri.ListContainersRequest(filter=flt), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._failed(exc, "ListContainers") from None
        return [_container(c) for c in r.containers]

    def container_status(self, container_id: str) -> ContainerDetail:
        try:
            r = self._stub.ContainerStatus(cri.ContainerStatusRequest(container_id=container_id, verbose=True),
                                           timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._failed(exc, f"ContainerStatus {shorten(container_id[:12])}") from None
        s = r.status
        linux = s.resources.linux if s.HasField("resources") and s.resources.HasField("linux") else None
        state = _STATES.get(s.state, UNKNOWN)
        return ContainerDetail(
            id=_text(s.id or container_id), state=state,
            pid=_pid_from_info(r.info) if state == RUNNING else None,
            cpuset_cpus=_text(linux.cpuset_cpus, 4096) if linux is not None else None,
            cpuset_mems=_text(linux.cpuset_mems, 4096) if linux is not None else None)

    def update_cpuset(self, container_id: str, cpus: Iterable[int], mems: Iterable[int] = ()) -> None:
        """Set the container's cpuset CPUs (and memory nodes, when ``mems`` names any); nothing else of
        its resources changes. An empty ``cpus`` is refused: to the runtime it means "unchanged"."""
        cpu_text, mem_text = format_cpulist(sorted(set(cpus))), format_cpulist(sorted(set(mems)))
        if not cpu_text:
            raise CriError("INVALID_ARGUMENT", "an empty CPU set would leave the container as it is")
        req = cri.UpdateContainerResourcesRequest(
            container_id=container_id, linux=cri.LinuxContainerResources(cpuset_cpus=cpu_text, cpuset_mems=mem_text))
        try:
            self._stub.UpdateContainerResources(req, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._failed(exc, f"UpdateContainerResources {shorten(container_id[:12])}") from None

    def events(self) -> Iterator[ContainerEvent]:
        """The runtime's container events as they happen (no deadline: a stream; ``close`` ends it).
        CriError with ``unimplemented`` where the runtime has none (containerd 1.6): poll instead."""
        stream = self._stub.GetContainerEvents(cri.GetEventsRequest())
        try:
            for e in stream:
                yield ContainerEvent(_text(e.container_id), _EVENTS.get(e.container_event_type, "unknown"),
                                     int(e.created_at))
        except grpc.RpcError as exc:
            raise self._failed(exc, "GetContainerEvents") from None
        finally:
            stream.cancel()
