"""A real containerd for the tests, driven through the CRI as the kubelet drives it.

``Containerd.start(workdir)`` builds a tiny OCI image from the host's static busybox (no network),
starts ``containerd`` as a child with its own root, state, sockets and runc root under ``workdir``,
imports the image with ``ctr`` and uses it as both the sandbox (pause) image and the workload image.
``Kubelet`` then runs pods as the kubelet's cgroupfs driver would: a host-network sandbox without a
hostname, cgroup parent ``/kubepods/pod<uid>``, containers labelled with the kubelet's labels.

Settings these machines need: ``restrict_oom_score_adj`` (no
CAP_SYS_RESOURCE, so runc cannot write a negative ``oom_score_adj``), no CNI (host network only).

``stop`` removes everything a run leaves behind: every sandbox (which stops the shims), the pod
cgroups containerd leaves for the kubelet to remove, ``/run/containerd/s`` when this run created it,
any shim still serving this run's socket (by pid, found by that socket in its command line), and the
containerd child itself, reaped.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from memtopo.k8s import cri as crimod
from memtopo.k8s.api.cri.v1 import cri_pb2 as cri
from memtopo.k8s.api.cri.v1 import cri_pb2_grpc as cri_grpc

IMAGE = "docker.io/memtopo/busybox:test"
TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr")
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
SHIM_SOCKETS = Path("/run/containerd/s")
CGROUP_ROOT = Path("/sys/fs/cgroup")
KUBEPODS = "kubepods"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}


def unavailable_reason() -> str | None:
    """Why a real containerd cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "containerd needs root (cgroups, mounts, namespaces)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"not installed: {', '.join(missing)} (tools/setup.sh installs Debian's containerd and "
                "runc when run as root)")
    if busybox() is None:
        return "no static busybox for the test image (Debian's busybox-static)"
    if not (CGROUP_ROOT / "cpuset").is_dir() and not (CGROUP_ROOT / "cgroup.controllers").is_file():
        return "no cgroup cpuset hierarchy mounted"
    return None


def busybox() -> Path | None:
    for c in BUSYBOX_CANDIDATES:
        p = Path(c)
        if p.is_file():
            out = subprocess.run(["file", "-L", str(p)], capture_output=True, text=True, check=False).stdout \
                if shutil.which("file") else "statically linked"
            if "statically linked" in out or "static-pie" in out:
                return p
    return None


# ---- the image -------------------------------------------------------------------------------------
def _blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def build_image(out: Path) -> Path:
    """An OCI image archive (``oci-layout``, ``index.json``, blobs) of one uncompressed layer holding
    the static busybox as ``/bin/busybox`` with ``sh`` and ``sleep`` links; returns the tar's path."""
    bb = busybox()
    assert bb is not None
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "tmp", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        data = bb.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
        for name in ("sh", "sleep", "cat", "true"):
            link = tarfile.TarInfo(f"bin/{name}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    layout = out / "layout"
    layer_digest, layer_size = _blob(layout, layer.getvalue())
    config = {
        "architecture": _ARCH.get(os.uname().machine, os.uname().machine), "os": "linux",
        "config": {"Cmd": ["/bin/sleep", "100000"], "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    config_digest, config_size = _blob(layout, json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest,
                   "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer_size}],
    }
    manifest_digest, manifest_size = _blob(layout, json.dumps(manifest).encode())
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest, "size": manifest_size,
        "annotations": {"io.containerd.image.name": IMAGE, "org.opencontainers.image.ref.name": "test"}}]}
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    archive = out / "image.tar"
    with tarfile.open(archive, "w") as tar:
        for p in sorted(layout.rglob("*")):
            tar.add(p, arcname=str(p.relative_to(layout)), recursive=False)
    return archive


# ---- containerd ------------------------------------------------------------------------------------
def _config(work: Path) -> str:
    cri_plugin = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{work}/root"
state = "{work}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{work}/c.sock"
[ttrpc]
  address = "{work}/c.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{work}/opt"
[{cri_plugin}]
  sandbox_image = "{IMAGE}"
  restrict_oom_score_adj = true
  [{cri_plugin}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri_plugin}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri_plugin}.containerd.runtimes.runc.options]
        Root = "{work}/runc"
        SystemdCgroup = false
  [{cri_plugin}.cni]
    bin_dir = "{work}/cni/bin"
    conf_dir = "{work}/cni/conf"
"""


@dataclass
class Containerd:
    """A containerd child serving CRI on ``socket``."""

    work: Path
    process: subprocess.Popen[bytes]
    shim_dir_was_there: bool
    log: Path
    kubelets: list[Kubelet] = field(default_factory=list)

    @property
    def socket(self) -> str:
        return str(self.work / "c.sock")

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    @classmethod
    def start(cls, work: Path | None = None, ready_s: float = 30.0) -> Containerd:
        # Unix socket paths are limited to 108 bytes: a short private directory of our own.
        work = Path(tempfile.mkdtemp(prefix="mt-ctrd-", dir="/tmp")) if work is None else work
        (work / "cni" / "bin").mkdir(parents=True, exist_ok=True)
        (work / "cni" / "conf").mkdir(parents=True, exist_ok=True)
        (work / "config.toml").write_text(_config(work))
        log = work / "containerd.log"
        shim_dir_was_there = SHIM_SOCKETS.exists()
        with open(log, "wb") as out:
            process = subprocess.Popen(["containerd", "--config", str(work / "config.toml"), "--log-level", "warn"],
                                       stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        ctrd = cls(work, process, shim_dir_was_there, log)
        try:
            ctrd._wait_ready(ready_s)
            archive = build_image(work)
            subprocess.run(["ctr", "-a", ctrd.socket, "-n", "k8s.io", "images", "import", "--no-unpack=false",
                            str(archive)], check=True, capture_output=True, timeout=60)
        except BaseException:
            ctrd.stop()
            raise
        return ctrd

    def _wait_ready(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"containerd exited {self.process.returncode}: {self.log_tail()}")
            if Path(self.socket).exists():
                try:
                    with crimod.CriClient(self.endpoint, timeout=2.0) as c:
                        c.version()
                    return
                except crimod.CriError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"containerd not ready in {limit_s} s: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stub(self) -> tuple[grpc.Channel, cri_grpc.RuntimeServiceStub]:
        channel = grpc.insecure_channel(self.endpoint)
        return channel, cri_grpc.RuntimeServiceStub(channel)

    def kubelet(self) -> Kubelet:
        k = Kubelet(self)
        self.kubelets.append(k)
        return k

    def _shim_pids(self) -> list[int]:
        """Shims serving this containerd: started for it, and named by its socket in their arguments."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if args and args[0].endswith(b"containerd-shim-runc-v2") and self.socket.encode() in args:
                pids.append(int(entry.name))
        return pids

    def stop(self) -> None:
        for k in self.kubelets:
            k.remove_all()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        for pid in self._shim_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for k in self.kubelets:
            k.remove_cgroups()
        if not self.shim_dir_was_there:
            with contextlib.suppress(OSError):
                SHIM_SOCKETS.rmdir()
        # The overlay snapshots and the shims' mounts are gone with the containers; what is left is files.
        subprocess.run(["umount", "-R", "-l", str(self.work)], capture_output=True, check=False)
        shutil.rmtree(self.work, ignore_errors=True)


@dataclass(frozen=True)
class Pod:
    uid: str
    name: str
    namespace: str
    sandbox_id: str
    config: cri.PodSandboxConfig
    containers: Mapping[str, str]  # container name → id

    @property
    def cgroup_parent(self) -> str:
        return f"/{KUBEPODS}/pod{self.uid}"


class Kubelet:
    """Runs pods on a containerd the way the kubelet's cgroupfs driver does (the calls and labels a
    kubelet makes; no API server, no admission: a stand-in for the kubelet's runtime side)."""

    def __init__(self, ctrd: Containerd) -> None:
        self.ctrd = ctrd
        self.channel, self.stub = ctrd.stub()
        self.pods: dict[str, Pod] = {}

    def run_pod(self, name: str, containers: Mapping[str, Mapping[str, str | int]] | list[str],
                namespace: str = "default", uid: str | None = None, timeout: float = 60.0,
                commands: Mapping[str, Sequence[str]] | None = None) -> Pod:
        """A running pod with the named containers; a container's mapping may set ``cpu_shares``,
        ``cpu_quota``, ``cpu_period``, ``cpuset_cpus``, ``cpuset_mems`` at creation, ``commands`` what
        a container runs (busybox applets; a long sleep by default)."""
        uid = uid or str(uuid.uuid4())
        specs: Mapping[str, Mapping[str, str | int]] = (
            {c: {} for c in containers} if isinstance(containers, list) else containers)
        meta = cri.PodSandboxMetadata(name=name, uid=uid, namespace=namespace)
        labels = {crimod.POD_UID_LABEL: uid, crimod.POD_NAME_LABEL: name, crimod.POD_NAMESPACE_LABEL: namespace}
        host = cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.NODE)
        config = cri.PodSandboxConfig(
            metadata=meta, labels=labels, log_directory=str(self.ctrd.work / "logs" / uid),
            linux=cri.LinuxPodSandboxConfig(cgroup_parent=f"/{KUBEPODS}/pod{uid}",
                                            security_context=cri.LinuxSandboxSecurityContext(namespace_options=host)))
        sandbox = self.stub.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=timeout).pod_sandbox_id
        pod = Pod(uid, name, namespace, sandbox, config, {})
        self.pods[uid] = pod
        ids: dict[str, str] = {}
        for cname, spec in specs.items():
            ids[cname] = self.add_container(pod, cname, spec, timeout, (commands or {}).get(cname))
        pod = Pod(uid, name, namespace, sandbox, config, ids)
        self.pods[uid] = pod
        return pod

    def add_container(self, pod: Pod, cname: str, spec: Mapping[str, str | int] | None = None,
                      timeout: float = 60.0, command: Sequence[str] | None = None) -> str:
        spec = spec or {}
        res = cri.LinuxContainerResources(**{k: v for k, v in spec.items()})  # type: ignore[arg-type]
        labels = {**pod.config.labels, crimod.CONTAINER_NAME_LABEL: cname}
        cfg = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=cname), image=cri.ImageSpec(image=IMAGE),
            command=list(command or ("/bin/sleep", "100000")), labels=labels, log_path=f"{cname}/0.log",
            linux=cri.LinuxContainerConfig(resources=res, security_context=cri.LinuxContainerSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.NODE, pid=cri.CONTAINER, ipc=cri.NODE))))
        cid = self.stub.CreateContainer(cri.CreateContainerRequest(
            pod_sandbox_id=pod.sandbox_id, config=cfg, sandbox_config=pod.config), timeout=timeout).container_id
        self.stub.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=timeout)
        current = self.pods.get(pod.uid, pod)
        self.pods[pod.uid] = Pod(pod.uid, pod.name, pod.namespace, pod.sandbox_id, pod.config,
                                 {**current.containers, cname: cid})
        return cid

    def remove_container(self, cid: str, timeout: float = 60.0) -> None:
        self.stub.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=timeout)
        self.stub.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=timeout)

    def remove_pod(self, uid: str, timeout: float = 60.0) -> None:
        pod = self.pods.get(uid)
        if pod is None:
            return
        with contextlib.suppress(grpc.RpcError):
            self.stub.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id), timeout=timeout)
        with contextlib.suppress(grpc.RpcError):
            self.stub.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox_id), timeout=timeout)

    def remove_all(self) -> None:
        if self.ctrd.process.poll() is None:
            for uid in list(self.pods):
                self.remove_pod(uid)
        self.channel.close()

    def remove_cgroups(self) -> None:
        """The pod-level cgroups containerd leaves for the kubelet (every hierarchy), and ``/kubepods``
        where it is left empty."""
        for uid in self.pods:
            for d in _cgroup_dirs(f"{KUBEPODS}/pod{uid}"):
                _rmdir_tree(d)
        for d in _cgroup_dirs(KUBEPODS):
            with contextlib.suppress(OSError):
                d.rmdir()


def _cgroup_dirs(rel: str) -> Iterator[Path]:
    if (CGROUP_ROOT / "cgroup.controllers").is_file():
        yield CGROUP_ROOT / rel
        return
    for hier in sorted(CGROUP_ROOT.iterdir()):
        if hier.is_dir() and not hier.is_symlink():
            yield hier / rel


def _rmdir_tree(top: Path) -> None:
    if not top.is_dir():
        return
    # Children first: a cgroup directory can only be removed once it has none.
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


def proc_allowed(pid: int) -> tuple[str, str]:
    """``Cpus_allowed_list`` and ``Mems_allowed_list`` of a process, as /proc writes them."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Cpus_allowed_list", "Mems_allowed_list"):
            found[key] = value.strip()
    return found["Cpus_allowed_list"], found["Mems_allowed_list"]


def cgroup_cpuset(pid: int) -> tuple[str, str]:
    """The ``cpuset.cpus`` and ``cpuset.mems`` files of the process's cpuset cgroup (v1 or v2)."""
    v1 = v2 = None
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and controllers == "":
            v2 = path
        elif "cpuset" in controllers.split(","):
            v1 = path
    base = CGROUP_ROOT / "cpuset" / (v1 or "").lstrip("/") if v1 is not None else CGROUP_ROOT / (v2 or "").lstrip("/")
    return (base / "cpuset.cpus").read_text().strip(), (base / "cpuset.mems").read_text().strip()
