"""The kubelet side: its configuration read through a root (hostile files included), and the PodResources
client against a test gRPC server answering in the kubelet's format, and against raw bytes encoded here
with the kubelet's field numbers on its method paths (memtopo's own schema must read the kubelet's wire)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.kubelet_standin import HUGE_LIST
from bench.nrt_crd import assert_valid, res
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.hostfs import HostFS
from memtopo.k8s import podfingerprint as pfp
from memtopo.k8s.api.podresources.v1 import podresources_pb2 as pr
from memtopo.k8s.api.podresources.v1 import podresources_pb2_grpc as pr_grpc
from memtopo.k8s.facts import DeviceGrant, MemoryGrant
from memtopo.k8s.kubelet import facts_from_config, read_kubelet_facts
from memtopo.k8s.nrt import build_nrt
from memtopo.k8s.podresources import MAX_DEVICE_IDS, PodResourcesError, read_pod_resources, view_from_answers
from tests.fixtures import extracted

DATA = Path(__file__).parents[1] / "data" / "podresources"
SYNTH = Path(__file__).parents[1] / "fixtures"
REPO = Path(__file__).resolve().parents[2]

CONFIG = """\
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cpuManagerPolicy: static
memoryManagerPolicy: Static
topologyManagerPolicy: single-numa-node
topologyManagerScope: pod
reservedSystemCPUs: "0-1,4"
reservedMemory:
- numaNode: 0
  limits:
    memory: 1Gi
    hugepages-2Mi: 64Mi
- numaNode: 1
  limits:
    memory: "512M"
"""


def write(root: Path, rel: str, text: str) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_kubelet_config_facts(tmp_path: Path) -> None:
    write(tmp_path, "var/lib/kubelet/config.yaml", CONFIG)
    write(tmp_path, "sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages", "512\n")
    write(tmp_path, "sys/devices/system/node/node0/hugepages/hugepages-1048576kB/nr_hugepages", "0\n")
    write(tmp_path, "sys/devices/system/node/node1/hugepages/hugepages-1048576kB/nr_hugepages", "4\n")
    write(tmp_path, "sys/devices/system/node/node1/hugepages/hugepages-2048kB/nr_hugepages", "garbage\n")
    f = read_kubelet_facts(HostFS.at(tmp_path))
    assert f.readable and f.config_path == "/var/lib/kubelet/config.yaml"
    assert (f.topology_manager_policy, f.topology_manager_scope) == ("single-numa-node", "pod")
    assert (f.cpu_manager_policy, f.memory_manager_policy) == ("static", "Static")
    assert f.reserved_cpus == (0, 1, 4)
    assert f.reserved_memory == {0: {"memory": 1 << 30, "hugepages-2Mi": 64 << 20}, 1: {"memory": 512 * 10**6}}
    assert f.hugepages == {0: {"hugepages-2Mi": 1 << 30}, 1: {"hugepages-1Gi": 4 << 30}}


def test_no_config_is_said_and_defaults_are_not_claimed(tmp_path: Path) -> None:
    f = read_kubelet_facts(HostFS.at(tmp_path))
    assert not f.readable and "no kubelet config" in f.problem
    topo = discover(ProbeContext.at_root(extracted(SYNTH / "gh200" / "root.tar.gz")))
    attrs = {a["name"]: a["value"] for a in build_nrt(topo, "n", kubelet=f)["attributes"]}
    assert "topologyManagerPolicy" not in attrs and attrs["memtopo.io/kubelet-config"].startswith("unreadable")


@pytest.mark.parametrize(("text", "problem"), [
    ("a: [1, 2\n", "not valid YAML at line"),
    ("- just\n- a list\n", "not a KubeletConfiguration mapping"),
    ("kind: Pod\n", "not KubeletConfiguration"),
    ("reservedSystemCPUs: 5-1\n", "reservedSystemCPUs"),
    ("reservedSystemCPUs: [0, 1]\n", "reservedSystemCPUs"),
    ("reservedMemory:\n- numaNode: -1\n  limits: {memory: 1Gi}\n", "numaNode"),
    ("reservedMemory:\n- numaNode: 0\n  limits: {memory: lots}\n", "not a quantity"),
    ("reservedMemory: {a: b}\n", "not a list"),
    ("topologyManagerPolicy: " + "x" * 100 + "\n", "not a short string"),
    ("[" * 10000 + "]" * 10000 + "\n", "YAML"),
])
def test_bad_config_is_a_problem_not_an_exception(tmp_path: Path, text: str, problem: str) -> None:
    write(tmp_path, "var/lib/kubelet/config.yaml", text)
    f = read_kubelet_facts(HostFS.at(tmp_path))
    assert not f.readable and problem in f.problem
    assert len(f.problem) < 200


def test_hostile_files_are_refused_without_blocking(tmp_path: Path) -> None:
    (tmp_path / "var/lib/kubelet").mkdir(parents=True)
    os.mkfifo(tmp_path / "var/lib/kubelet/config.yaml")  # an open() of a FIFO would block forever
    assert read_kubelet_facts(HostFS.at(tmp_path)).problem.startswith("not a regular file")
    os.unlink(tmp_path / "var/lib/kubelet/config.yaml")
    outside = write(tmp_path.parent / f"{tmp_path.name}-outside", "config.yaml", CONFIG)
    os.symlink(outside, tmp_path / "var/lib/kubelet/config.yaml")
    # Under a root an absolute link means a path inside that root, where this one names nothing:
    # the file outside is never read.
    linked = read_kubelet_facts(HostFS.at(tmp_path))
    assert not linked.readable and linked.problem == "missing"
    os.unlink(tmp_path / "var/lib/kubelet/config.yaml")
    with open(tmp_path / "var/lib/kubelet/config.yaml", "wb") as fh:
        fh.truncate((1 << 20) + 1)
    assert "larger than" in read_kubelet_facts(HostFS.at(tmp_path)).problem


def test_an_explicit_config_path_is_read_under_the_root(tmp_path: Path) -> None:
    write(tmp_path, "etc/k/kubelet.yaml", "topologyManagerPolicy: restricted\n")
    f = read_kubelet_facts(HostFS.at(tmp_path), ("/etc/k/kubelet.yaml",))
    assert f.readable and f.topology_manager_policy == "restricted"


# ---- PodResources ------------------------------------------------------------------------------------

class RecordedKubelet(pr_grpc.PodResourcesListerServicer):
    """A test server speaking memtopo's schema of the PodResources API, answering in the kubelet's format."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.set(doc)
        self.fail: grpc.StatusCode | None = None

    def set(self, doc: dict[str, Any]) -> None:
        # The answers are written in the kubelet's full format; memtopo's schema omits container names.
        self.listed = json_format.ParseDict(doc["list"], pr.ListPodResourcesResponse(), ignore_unknown_fields=True)
        self.allocatable = json_format.ParseDict(doc["get_allocatable_resources"],
                                                 pr.AllocatableResourcesResponse())

    def List(self, request: pr.ListPodResourcesRequest,  # noqa: N802 - the proto's name
             context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
        if self.fail is not None:
            context.abort(self.fail, "podresources disabled")
        return self.listed

    def GetAllocatableResources(self, request: pr.AllocatableResourcesRequest,  # noqa: N802
                                context: grpc.ServicerContext) -> pr.AllocatableResourcesResponse:
        if self.fail is not None:
            context.abort(self.fail, "podresources disabled")
        return self.allocatable


def recorded(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    return doc


@pytest.fixture
def kubelet_socket() -> Iterator[tuple[str, RecordedKubelet]]:
    # A short directory: a Unix socket path may have at most 107 bytes.
    d = tempfile.mkdtemp(prefix="mtpr")
    path = f"{d}/kubelet.sock"
    servicer = RecordedKubelet(recorded("ascend-a2-8x910b"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pr_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        yield path, servicer
    finally:
        server.stop(None)
        shutil.rmtree(d, ignore_errors=True)


def test_available_follows_the_kubelets_answers(kubelet_socket: tuple[str, RecordedKubelet]) -> None:
    path, _ = kubelet_socket
    view = read_pod_resources(path)
    assert view.pods == 3 and len(view.assigned_cpus) == 12
    topo = discover(ProbeContext.at_root(extracted(SYNTH / "ascend-a2-8x910b" / "root.tar.gz")))
    obj = build_nrt(topo, "a2-1", pods=view)
    assert_valid(obj)
    # node 0: CPUs 0-1 reserved (not allocatable), 2-9 and NPUs 1 and 3 held by train-0, 16Gi of 63Gi.
    assert res(obj, "node-0", "cpu") == ("24", "22", "14")
    assert res(obj, "node-0", "huawei.com/Ascend910") == ("2", "2", "0")
    assert res(obj, "node-0", "memory") == ("64Gi", "63Gi", "47Gi")
    # node 6: infer-0 holds 4 CPUs, NPU0 and 8Gi; its sidecar holds nothing exclusively.
    assert res(obj, "node-6", "cpu") == ("24", "24", "20")
    assert res(obj, "node-6", "huawei.com/Ascend910") == ("2", "2", "1")
    assert res(obj, "node-6", "memory") == ("64Gi", "64Gi", "56Gi")
    assert res(obj, "node-4", "huawei.com/Ascend910") == ("2", "2", "2")
    attrs = {a["name"]: a["value"] for a in obj["attributes"]}
    assert attrs["memtopo.io/pod-resources"] == "kubelet: 3 pods"
    assert attrs["nodeTopologyPodsFingerprint"] == pfp.sign([("ml", "train-0"), ("ml", "infer-0"), ("default", "web")])


def test_a_failing_kubelet_is_a_typed_error(kubelet_socket: tuple[str, RecordedKubelet]) -> None:
    path, servicer = kubelet_socket
    servicer.fail = grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(PodResourcesError, match="UNIMPLEMENTED"):
        read_pod_resources(path)


def test_no_socket_or_not_a_socket(tmp_path: Path) -> None:
    with pytest.raises(PodResourcesError, match="no socket"):
        read_pod_resources(str(tmp_path / "kubelet.sock"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(PodResourcesError, match="not a socket"):
        read_pod_resources(str(tmp_path / "file"))


def test_a_socket_nobody_answers_times_out() -> None:
    d = tempfile.mkdtemp(prefix="mtpr")
    try:
        s = socket.socket(socket.AF_UNIX)
        s.bind(f"{d}/k.sock")  # bound, never listening: connections are refused
        with pytest.raises(PodResourcesError, match=r"UNAVAILABLE|DEADLINE_EXCEEDED"):
            read_pod_resources(f"{d}/k.sock", timeout=2.0)
        s.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- the kubelet's wire format, encoded without memtopo's schema ---------------------------------------
# Field numbers of the kubelet's PodResources v1 messages, written here rather than read from the generated
# code: a renumbered or retyped field in proto/memtopo/k8s/api/podresources/v1/podresources.proto fails below. The
# answers also carry fields memtopo's schema leaves out (container names, a dynamic resource claim), which
# must be skipped.

def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _int(num: int, value: int) -> bytes:
    return _varint(num << 3) + _varint(value)


def _len(num: int, payload: bytes | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else payload
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def _topology(*nodes: int) -> bytes:  # TopologyInfo{nodes = 1: NUMANode{ID = 1}}
    return b"".join(_len(1, _int(1, n)) for n in nodes)


def _devices(resource: str, ids: list[str], *nodes: int) -> bytes:
    # ContainerDevices{resource_name = 1, device_ids = 2, topology = 3}
    return _len(1, resource) + b"".join(_len(2, i) for i in ids) + _len(3, _topology(*nodes))


def _memory(kind: str, size: int, *nodes: int) -> bytes:
    # ContainerMemory{memory_type = 1, size = 2 (uint64), topology = 3}
    return _len(1, kind) + _int(2, size) + _len(3, _topology(*nodes))


# ContainerResources{name = 1, devices = 2, cpu_ids = 3 (packed int64), memory = 4, dynamic_resources = 5}
_WORKER = (_len(1, "worker") + _len(2, _devices("nvidia.com/gpu", ["GPU-a", "GPU-b"], 1))
           + _len(3, b"".join(_varint(c) for c in (4, 5, 6, 300)))
           + _len(4, _memory("hugepages-1Gi", 3 << 32, 0, 1)) + _len(5, _len(2, "claim-0") + _len(3, "ml")))
# ListPodResourcesResponse{pod_resources = 1: PodResources{name = 1, namespace = 2, containers = 3}}
WIRE_LIST = (_len(1, _len(1, "train-0") + _len(2, "ml") + _len(3, _WORKER) + _len(3, _len(1, "sidecar")))
             + _len(1, _len(1, "idle") + _len(2, "ml")))
# AllocatableResourcesResponse{devices = 1, cpu_ids = 2 (packed int64), memory = 3}
WIRE_ALLOCATABLE = (_len(1, _devices("nvidia.com/gpu", ["GPU-a", "GPU-b", "GPU-c"], 1))
                    + _len(1, _devices("example.com/fpga", ["f0"]))
                    + _len(2, b"".join(_varint(c) for c in range(2, 400)))
                    + _len(3, _memory("memory", 64 << 30, 0)) + _len(3, _memory("memory", 32 << 30, 1)))


# What the wire stand-in answers, by method (a test may swap an answer).
_WIRE_ANSWERS: dict[str, bytes] = {}


@pytest.fixture
def wire_kubelet() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """A stand-in kubelet that answers the kubelet's method paths with the raw bytes above."""
    d = tempfile.mkdtemp(prefix="mtpr")
    path = f"{d}/kubelet.sock"
    calls: list[tuple[str, bytes]] = []

    def answer(method: str) -> grpc.RpcMethodHandler[bytes, bytes]:
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            calls.append((method, request))
            return _WIRE_ANSWERS[method]
        return grpc.unary_unary_rpc_method_handler(handle)  # no (de)serializers: bytes in, bytes out

    _WIRE_ANSWERS.update(List=WIRE_LIST, GetAllocatableResources=WIRE_ALLOCATABLE)
    handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
        "List": answer("List"), "GetAllocatableResources": answer("GetAllocatableResources")})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        yield path, calls
    finally:
        server.stop(None)
        shutil.rmtree(d, ignore_errors=True)


def test_the_kubelets_wire_format_is_read_on_its_method_paths(
        wire_kubelet: tuple[str, list[tuple[str, bytes]]]) -> None:
    path, calls = wire_kubelet
    view = read_pod_resources(path)
    assert sorted(calls) == [("GetAllocatableResources", b""), ("List", b"")]  # both requests are empty
    assert view.pods == 2
    assert view.assigned_cpus == (4, 5, 6, 300)
    assert view.assigned_devices == (DeviceGrant("nvidia.com/gpu", ("GPU-a", "GPU-b"), (1,)),)
    assert view.assigned_memory == (MemoryGrant("hugepages-1Gi", 3 << 32, (0, 1)),)
    assert view.allocatable_cpus == tuple(range(2, 400))
    assert view.allocatable_devices == (DeviceGrant("nvidia.com/gpu", ("GPU-a", "GPU-b", "GPU-c"), (1,)),
                                        DeviceGrant("example.com/fpga", ("f0",), ()))
    assert view.allocatable_memory == (MemoryGrant("memory", 64 << 30, (0,)), MemoryGrant("memory", 32 << 30, (1,)))
    # NFD's pods fingerprint: every pod List names, by namespace and name.
    assert view.pods_fingerprint == pfp.sign([("ml", "idle"), ("ml", "train-0")])


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30)
_KEYS = st.sampled_from(["kind", "topologyManagerPolicy", "topologyManagerScope", "cpuManagerPolicy",
                         "reservedSystemCPUs", "reservedMemory", "memoryManagerPolicy"])


@settings(deadline=None, max_examples=300)
@given(st.dictionaries(_KEYS, _JSONISH | st.lists(st.fixed_dictionaries(
    {"numaNode": _JSONISH, "limits": st.dictionaries(st.text(max_size=14), _JSONISH, max_size=3)}), max_size=3)))
def test_any_config_document_gives_facts_or_a_short_problem(doc: dict[str, Any]) -> None:
    f = facts_from_config(doc, "/var/lib/kubelet/config.yaml")
    assert f.readable or (f.problem and len(f.problem) < 200)
    if f.readable:
        assert all(v >= 0 for per in f.reserved_memory.values() for v in per.values())


# ---- answers that are garbage or huge ------------------------------------------------------------------
def test_a_garbage_answer_is_one_short_error_and_nothing_in_the_log(wire_kubelet: tuple[str, list[tuple[str, bytes]]],
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """grpc logged a traceback ("Exception deserializing message!") for every poll of a kubelet answering
    garbage; the answer is parsed here instead, into the same short reason every time."""
    path, _ = wire_kubelet
    for garbage in (b"\x0a\xff\xff\xff\xff\x0f garbage", b"\x0a\x05\x1a\x03\xff\xff\xff", b"\x07" * 100):
        _WIRE_ANSWERS["List"] = garbage
        reasons = set()
        for _ in range(3):
            with pytest.raises(PodResourcesError) as info:
                read_pod_resources(path)
            reasons.add(info.value.reason)
        assert reasons == {f"List: not a PodResources answer ({len(garbage)} B)"}  # the same words each poll
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_an_answer_near_the_kubelets_limit_is_counted_in_place(tmp_path: Path) -> None:
    """A 14 MB List of 264,000 containers, served by another process: the client's peak RSS grows by a
    small multiple of the answer (the answer was parsed whole and turned into 264,000 grants: +300 MiB)."""
    out = subprocess.run([sys.executable, "-c", HUGE_LIST, str(tmp_path)], capture_output=True, text=True,
                         cwd=REPO, timeout=600, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    size, pods, grants, grown = map(int, out.stdout.split())
    assert pods == 33_000 and grants == 8 and size > 13 << 20
    assert grown <= 5 * size, f"peak RSS grew {grown >> 20} MiB for a {size >> 20} MiB answer"


def test_too_many_device_ids_are_refused_and_the_rest_is_folded() -> None:
    def container(ids: list[str], node: int, cpus: list[int], mem: int) -> bytes:
        return (_len(2, _devices("nvidia.com/gpu", ids, node)) + _len(3, b"".join(_varint(c) for c in cpus))
                + _len(4, _memory("memory", mem, node)))

    pod = _len(1, _len(1, "p") + _len(3, container(["a", "b"], 0, [1, 2, 70000], 10))
               + _len(3, container(["b", "c"], 0, [2], 5)) + _len(3, container(["z"], 1, [], 1)))
    view = view_from_answers(pod + pod, b"")
    assert view.pods == 2 and view.assigned_cpus == (1, 2)  # 70000 is no CPU
    assert set(view.assigned_devices) == {DeviceGrant("nvidia.com/gpu", ("a", "b", "c"), (0,)),
                                          DeviceGrant("nvidia.com/gpu", ("z",), (1,))}
    assert set(view.assigned_memory) == {MemoryGrant("memory", 30, (0,)), MemoryGrant("memory", 2, (1,))}
    many = _len(1, _len(3, _len(2, _devices("rdma/hca", [f"d{i}" for i in range(MAX_DEVICE_IDS + 1)], 0))))
    with pytest.raises(PodResourcesError, match="too large: more than 65536 device ids"):
        view_from_answers(many, b"")




@settings(deadline=None, max_examples=300)
@given(st.binary(max_size=200), st.binary(max_size=60))
def test_any_bytes_are_a_view_or_a_short_error(listed: bytes, allocatable: bytes) -> None:
    try:
        view = view_from_answers(listed, allocatable)
    except PodResourcesError as exc:
        assert len(exc.reason) < 200 and exc.reason.isprintable()
    else:
        assert view.pods >= 0 and all(0 <= c < 1 << 16 for c in view.assigned_cpus)
