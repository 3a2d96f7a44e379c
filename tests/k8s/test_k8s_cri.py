"""The CRI client (k8s/cri.py) against a real containerd driven as the kubelet drives it, and against
hostile runtimes: no socket, not a socket, a server that hangs, one that speaks no HTTP/2, one that
answers garbage protobuf or more than the cap. Each is a CriError with a short reason."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from bench.containerd import Containerd, cgroup_cpuset, proc_allowed
from memtopo.k8s import cri
from memtopo.k8s.api.cri.v1 import cri_pb2 as pb

SERVICE = "runtime.v1.RuntimeService"


# ---- a real containerd -----------------------------------------------------------------------------
def test_version_names_the_runtime(containerd: Containerd) -> None:
    with cri.CriClient(containerd.endpoint) as client:
        v = client.version()
    assert v.runtime_name == "containerd" and v.api_version == "v1" and v.runtime_version


def test_list_by_the_kubelets_labels(containerd: Containerd) -> None:
    k = containerd.kubelet()
    a = k.run_pod("list-a", ["app", "sidecar"])
    b = k.run_pod("list-b", ["app"])
    try:
        with cri.CriClient(containerd.endpoint) as client:
            mine = client.list_containers({cri.POD_UID_LABEL: a.uid})
            apps = client.list_containers({cri.CONTAINER_NAME_LABEL: "app", cri.POD_NAMESPACE_LABEL: "default"})
            everything = client.list_containers(state=None)
        assert {c.id for c in mine} == set(a.containers.values())
        assert {(c.name, c.pod_name, c.pod_namespace, c.pod_uid) for c in mine} == {
            ("app", "list-a", "default", a.uid), ("sidecar", "list-a", "default", a.uid)}
        assert all(c.state == cri.RUNNING and c.sandbox_id == a.sandbox_id for c in mine)
        assert {a.containers["app"], b.containers["app"]} <= {c.id for c in apps}
        assert a.containers["sidecar"] not in {c.id for c in apps}
        # The sandboxes are not containers to the CRI: only the three workload containers are listed.
        assert set(a.containers.values()) | set(b.containers.values()) <= {c.id for c in everything}
    finally:
        k.remove_pod(a.uid)
        k.remove_pod(b.uid)


def test_status_gives_the_task_pid(containerd: Containerd) -> None:
    k = containerd.kubelet()
    pod = k.run_pod("status", ["app"])
    try:
        cid = pod.containers["app"]
        with cri.CriClient(containerd.endpoint) as client:
            detail = client.container_status(cid)
        assert detail.state == cri.RUNNING and detail.pid is not None
        assert cid in Path(f"/proc/{detail.pid}/cgroup").read_text()
        # The task's pid is runc's init until it has exec'd the command (StartContainer may return first).
        cmdline = Path(f"/proc/{detail.pid}/cmdline")
        for _ in range(600):
            if cmdline.read_bytes().split(b"\0")[:2] == [b"/bin/sleep", b"100000"]:
                break
            time.sleep(0.05)
        assert cmdline.read_bytes().split(b"\0")[:2] == [b"/bin/sleep", b"100000"]
    finally:
        k.remove_pod(pod.uid)


def _cpu_file(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hier, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return Path(f"/sys/fs/cgroup/cpu{path}/{name}").read_text().strip()
    pytest.skip("no cgroup v1 cpu controller here")


def test_update_sets_the_cpuset_and_leaves_quota_and_shares(containerd: Containerd) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    k = containerd.kubelet()
    pod = k.run_pod("update", {"app": {"cpu_shares": 512, "cpu_quota": 50000, "cpu_period": 100000}})
    try:
        cid = pod.containers["app"]
        with cri.CriClient(containerd.endpoint) as client:
            pid = client.container_status(cid).pid
            assert pid is not None
            before = proc_allowed(pid)
            for target in ([cpus[-1]], [cpus[0]]):
                client.update_cpuset(cid, target, [0])
                want = str(target[0])
                assert proc_allowed(pid) == (want, "0")
                assert cgroup_cpuset(pid) == (want, "0")
                assert client.container_status(cid).cpuset_cpus == want
            # Only the cpuset changed: the kubelet's CPU quota and shares are as the container was made.
            if Path("/sys/fs/cgroup/cpu").is_dir():
                assert _cpu_file(pid, "cpu.shares") == "512"
                assert _cpu_file(pid, "cpu.cfs_quota_us") == "50000"
            # CPUs alone: the memory nodes stay.
            client.update_cpuset(cid, cpus)
            assert proc_allowed(pid)[1] == "0"
            assert proc_allowed(pid)[0] == before[0]
    finally:
        k.remove_pod(pod.uid)


def test_a_container_that_is_gone_is_not_found(containerd: Containerd) -> None:
    k = containerd.kubelet()
    pod = k.run_pod("gone", ["app"])
    cid = pod.containers["app"]
    k.remove_container(cid)
    try:
        with cri.CriClient(containerd.endpoint) as client:
            with pytest.raises(cri.CriError) as status:
                client.container_status(cid)
            with pytest.raises(cri.CriError) as update:
                client.update_cpuset(cid, [0])
        assert status.value.not_found and update.value.not_found
        assert cid[:12] in update.value.reason and len(update.value.reason) < 300
    finally:
        k.remove_pod(pod.uid)


def test_events_are_unimplemented_on_containerd_1_6(containerd: Containerd) -> None:
    with cri.CriClient(containerd.endpoint) as client:
        version = client.version().runtime_version
        if not version.startswith("1.6"):
            pytest.skip(f"containerd {version} has container events")
        with pytest.raises(cri.CriError) as err:
            next(iter(client.events()))
    assert err.value.unimplemented


def test_an_empty_cpu_set_is_refused_not_sent(containerd: Containerd) -> None:
    with cri.CriClient(containerd.endpoint) as client, pytest.raises(cri.CriError) as err:
        client.update_cpuset("anything", [])
    assert err.value.code == "INVALID_ARGUMENT"


# ---- hostile runtimes ------------------------------------------------------------------------------
def test_no_socket(tmp_path: Path) -> None:
    with pytest.raises(cri.CriError) as err:
        cri.CriClient(f"unix://{tmp_path}/none.sock")
    # The reason quotes a shortened path: how much of it shows depends on where the test runs.
    assert err.value.code == "NO_SOCKET" and err.value.reason.startswith("no socket at /")


def test_not_a_socket(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    for name in ("file", "fifo"):
        with pytest.raises(cri.CriError) as err:
            cri.CriClient(f"unix://{tmp_path}/{name}")
        assert err.value.code == "NOT_SOCKET"


@pytest.mark.parametrize("endpoint", ["tcp://10.0.0.1:1234", "relative.sock", "unix://rel/x.sock", "/a\0b"])
def test_only_local_unix_endpoints(endpoint: str) -> None:
    with pytest.raises(cri.CriError) as err:
        cri.CriClient(endpoint)
    assert err.value.code == "BAD_ENDPOINT"


def test_resolve_endpoint_takes_the_first_socket_that_exists(tmp_path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "crio.sock"))
    try:
        found = cri.resolve_endpoint("", (f"unix://{tmp_path}/containerd.sock", f"unix://{tmp_path}/crio.sock"))
        assert found == f"unix://{tmp_path}/crio.sock"
        assert cri.resolve_endpoint("unix:///x.sock") == "unix:///x.sock"
        assert cri.resolve_endpoint("", (f"unix://{tmp_path}/a.sock",)) == f"unix://{tmp_path}/a.sock"
    finally:
        s.close()


@contextlib.contextmanager
def raw_server(path: Path, handlers: Mapping[str, Callable[[bytes, grpc.ServicerContext], bytes]]) -> Iterator[None]:
    """A gRPC server on ``path`` answering the named RuntimeService methods with raw bytes."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_send_message_length", 64 << 20)])
    generic = grpc.method_handlers_generic_handler(SERVICE, {
        name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in handlers.items()})
    server.add_generic_rpc_handlers((generic,))
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        yield
    finally:
        server.stop(0)


def test_a_runtime_that_hangs_hits_the_deadline(tmp_path: Path) -> None:
    release = threading.Event()

    def hang(_req: bytes, _ctx: grpc.ServicerContext) -> bytes:
        release.wait(30)
        return b""

    with raw_server(tmp_path / "hang.sock", {"Version": hang, "ListContainers": hang}):
        try:
            with cri.CriClient(f"unix://{tmp_path}/hang.sock", timeout=0.5) as client:
                for call in (client.version, client.list_containers):
                    with pytest.raises(cri.CriError) as err:
                        call()
                    assert err.value.code == "DEADLINE_EXCEEDED"
        finally:
            release.set()


def test_garbage_protobuf_is_a_typed_error(tmp_path: Path) -> None:
    garbage = b"\xff\xff\xff\xff\x0f" + bytes(range(256))
    handlers = {m: (lambda _r, _c: garbage) for m in ("Version", "ListContainers", "ContainerStatus")}
    with raw_server(tmp_path / "g.sock", handlers), cri.CriClient(f"unix://{tmp_path}/g.sock", timeout=5) as client:
        for call in (client.version, client.list_containers, lambda: client.container_status("x")):
            with pytest.raises(cri.CriError) as err:
                call()
            assert err.value.code == "INTERNAL" and len(str(err.value)) < 300


def test_an_oversized_answer_is_refused(tmp_path: Path) -> None:
    big = pb.ListContainersResponse(containers=[
        pb.Container(id=f"{i:064x}", labels={"pad": "x" * 4096}) for i in range(cri.MAX_MESSAGE_BYTES // 4096 + 16)])
    data = big.SerializeToString()
    assert len(data) > cri.MAX_MESSAGE_BYTES
    with (raw_server(tmp_path / "big.sock", {"ListContainers": lambda _r, _c: data}),
          cri.CriClient(f"unix://{tmp_path}/big.sock", timeout=30) as client, pytest.raises(cri.CriError) as err):
        client.list_containers()
    assert err.value.code == "RESOURCE_EXHAUSTED"


def test_hostile_names_and_info_are_bounded(tmp_path: Path) -> None:
    hostile = pb.ListContainersResponse(containers=[pb.Container(
        id="a" * 10_000, labels={cri.POD_UID_LABEL: "\x1b[31m\n" * 100, cri.CONTAINER_NAME_LABEL: "ok"})])
    statuses = [{"info": '{"pid": -1}'}, {"info": '{"pid": true}'}, {"info": "[" * 100_000},
                {"info": '{"pid": 99999999999}'}, {"info": "x" * (cri.MAX_INFO_BYTES + 1)}, {}]
    seen: list[int] = []

    def status(_r: bytes, _c: grpc.ServicerContext) -> bytes:
        info = statuses[len(seen)]
        seen.append(1)
        return pb.ContainerStatusResponse(status=pb.ContainerStatus(id="c", state=pb.CONTAINER_RUNNING),
                                          info=info).SerializeToString()

    handlers = {"ListContainers": lambda _r, _c: hostile.SerializeToString(), "ContainerStatus": status}
    with raw_server(tmp_path / "h.sock", handlers), cri.CriClient(f"unix://{tmp_path}/h.sock") as client:
        [c] = client.list_containers()
        assert len(c.id) <= 253 and c.pod_uid.isprintable() and len(c.pod_uid) <= 253 and c.name == "ok"
        for _ in statuses:
            assert client.container_status("c").pid is None


def test_a_socket_that_speaks_no_http2(tmp_path: Path) -> None:
    path = tmp_path / "junk.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(8)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with contextlib.suppress(OSError):
                conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + os.urandom(4096))
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with cri.CriClient(f"unix://{path}", timeout=2) as client, pytest.raises(cri.CriError) as err:
            client.version()
        assert err.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL")
    finally:
        stop.set()
        t.join(5)
        srv.close()


def test_a_runtime_that_goes_away_says_so(tmp_path: Path) -> None:
    path = tmp_path / "gone.sock"
    with raw_server(path, {"Version": lambda _r, _c: pb.VersionResponse(runtime_name="x").SerializeToString()}):
        client = cri.CriClient(f"unix://{path}", timeout=2)
        assert client.version().runtime_name == "x"
    path.unlink(missing_ok=True)
    try:
        with pytest.raises(cri.CriError) as err:
            client.version()
        assert err.value.code == "NO_SOCKET"
    finally:
        client.close()
