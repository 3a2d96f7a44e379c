"""The CPU enforcement on a real containerd, fed by the API server: how soon a started container is
pinned, how soon drift is put back, and what enforcement costs the agent in memory.

A private containerd (bench/containerd.py, as the tests start it) runs the pods; the real agent runs as
its own process (``memtopo serve``, this host's root, ``kubernetes.enforce = true``) with its own pod
source and reporter (agent/k8s_pods.py): an informer on the pods bound to its node, from the STAND-IN
API server (bench/k8s_standin.py, real HTTP list/watch, here in this process's thread; no Kubernetes
API server runs here), and status annotations and Events written back to it. Each round: the pod is
bound in the stand-in (as a bind reaches the informer before the kubelet starts anything), its
container is started through CRI, and the clock runs from StartContainer's return until the
container's cgroup has its exclusive CPU; then the pod is deleted. Nothing tells the agent that the
container started but its own pass (``enforce_interval_seconds``, 1 s by default; containerd 1.6 has
no container events), unless the pod's status update arrives first: ``--kubelet-status`` writes the
kubelet's status update (container started) to the stand-in, which the informer's watch delivers.

Drift: at a random point of the interval the pinned container is moved onto every CPU through CRI
by someone else, and the clock runs until its cgroup is back. RSS: the agent process's VmRSS with
enforcement off and with it on after the rounds, same host, same run; both publish the node's
NodeResourceTopology to the stand-in, as the DaemonSet's agent does with or without enforcement.

    .venv/bin/python bench/enforce.py [--pods 50] [--drifts 20] [--interval 1.0] [--kubelet-status]

Prints the figures and PASS/FAIL against: every container pinned; every pod's status annotation in
the API server; every drift restored; enforcement adds at most 15 % to the agent's RSS.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.containerd import Containerd, cgroup_cpuset, unavailable_reason  # noqa: E402
from bench.enforce_standins import NODE, resources  # noqa: E402
from bench.k8s_standin import StandInApiServer  # noqa: E402
from bench.procstat import memory_kib  # noqa: E402
from memtopo.cpulist import parse_cpulist  # noqa: E402
from memtopo.k8s import cri  # noqa: E402
from memtopo.k8s import enforcement as ef  # noqa: E402

RSS_RATIO_TARGET = 1.15


def applied(server: StandInApiServer, name: str) -> bool:
    """Whether the pod's status annotation in the API server says its CPUs are applied."""
    def read() -> str:
        value: str = server.pods[("default", name)]["metadata"].get("annotations", {}).get(ef.STATUS_ANNOTATION, "")
        return value
    return '"state":"applied"' in server.call(read)


def bound_pod(name: str, uid: str, cpu: str | None) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "uid": uid, "generation": 1,
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"nodeName": NODE, "containers": [{"name": "app", "resources": resources(cpu)}]},
            "status": {"phase": "Pending"}}


# ---- the agent child -------------------------------------------------------------------------------
def write_config(work: Path, endpoint: str, api: str, enforce: bool, interval: float) -> Path:
    (work / "kubelet.yaml").write_text("kind: KubeletConfiguration\ncpuManagerPolicy: none\n")
    config = work / f"agent-{int(enforce)}.toml"
    config.write_text(f"""
node_name = "{NODE}"
state_dir = "{work}/state"
[listen]
socket = "{work}/agent.sock"
read_socket = ""
[health]
listen = ""
[discovery]
udev = false
[kubernetes]
enabled = true
pod_resources_socket = ""
node_name = "{NODE}"
api_server = "{api}"
kubelet_config = "{work}/kubelet.yaml"
enforce = {"true" if enforce else "false"}
runtime_endpoint = "{endpoint}"
enforce_interval_seconds = {interval}
""")
    return config


# ---- the bench -------------------------------------------------------------------------------------
def start_agent(work: Path, endpoint: str, api: str, enforce: bool, interval: float) -> subprocess.Popen[bytes]:
    config = write_config(work, endpoint, api, enforce, interval)
    env = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
    with open(work / f"agent-{int(enforce)}.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "memtopo.cli", "serve", "--config", str(config)], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (work / "agent.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"agent did not start: {(work / f'agent-{int(enforce)}.log').read_text()[-2000:]}")
        time.sleep(0.05)
    time.sleep(2.0)  # settle: the first discovery is published, the first passes ran
    return proc


def stop_agent(proc: subprocess.Popen[bytes], work: Path) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    (work / "agent.sock").unlink(missing_ok=True)


def wait_for(check: Any, limit_s: float = 60.0) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        if check():
            return time.perf_counter() - start
        time.sleep(0.002)
    return float("nan")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=50)
    ap.add_argument("--drifts", type=int, default=20)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--kubelet-status", action="store_true")
    args = ap.parse_args()
    why = unavailable_reason()
    if why:
        print(f"SKIP: {why}")
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("SKIP: needs 2 CPUs")
        return 0
    ctrd = Containerd.start()
    server = StandInApiServer()
    server.add_node(NODE)
    api = server.start_in_thread()
    work = Path(tempfile.mkdtemp(prefix="mt-enf-", dir="/tmp"))
    ok = True
    try:
        k = ctrd.kubelet()
        base = start_agent(work, ctrd.endpoint, api, False, args.interval)
        rss_off = memory_kib(base.pid).get("VmRSS", 0)
        stop_agent(base, work)
        agent = start_agent(work, ctrd.endpoint, api, True, args.interval)
        client = cri.CriClient(ctrd.endpoint)
        start_to_pinned: list[float] = []
        reported: list[bool] = []
        pid, cid = 0, ""
        for i in range(args.pods):
            name, uid = f"bench-{i}", str(uuid.uuid4())
            obj = bound_pod(name, uid, "1")
            server.call(partial(server.put_pod, obj))  # bound: the informer has it before the kubelet starts it
            pod = k.run_pod(name, [], uid=uid)
            cid = k.add_container(pod, "app")
            ready = time.perf_counter()  # StartContainer has returned
            if args.kubelet_status:
                status = {"phase": "Running", "containerStatuses": [{"name": "app", "started": True}]}
                server.call(partial(server.put_pod, {**obj, "status": status}))
            pid = client.container_status(cid).pid or 0
            wait_for(lambda pid=pid: len(parse_cpulist(cgroup_cpuset(pid)[0])) == 1)
            start_to_pinned.append(time.perf_counter() - ready)
            told = wait_for(partial(applied, server, name))
            reported.append(told == told)
            if i == args.pods - 1:
                break
            server.call(partial(server.delete_pod, "default", name))
            k.remove_pod(pod.uid)
        # Drift on the last pod, which stays pinned.
        pinned = cgroup_cpuset(pid)[0]
        drift: list[float] = []
        for _ in range(args.drifts):
            # At a random point of the agent's interval: a drift does not wait for the next pass.
            time.sleep(random.uniform(0, args.interval))
            client.update_cpuset(cid, cpus)
            drift.append(wait_for(lambda: cgroup_cpuset(pid)[0] == pinned))
        rss_on = memory_kib(agent.pid).get("VmRSS", 0)
        stop_agent(agent, work)
        client.close()
        pinned_all = all(t == t for t in start_to_pinned)
        drift_all = all(t == t for t in drift)
        ratio = rss_on / rss_off if rss_off else float("inf")
        print(f"container start -> pinned over {len(start_to_pinned)} containers, pods from the API server's watch "
              f"(interval {args.interval:g} s, {'with' if args.kubelet_status else 'without'} a pod status update): "
              f"p50 {pct(start_to_pinned, 0.5) * 1000:.0f} ms, p99 {pct(start_to_pinned, 0.99) * 1000:.0f} ms, "
              f"mean {statistics.fmean(start_to_pinned) * 1000:.0f} ms")
        print(f"drift -> restored over {len(drift)} drifts: p50 {pct(drift, 0.5) * 1000:.0f} ms, "
              f"p99 {pct(drift, 0.99) * 1000:.0f} ms")
        print(f"agent RSS: enforcement off {rss_off / 1024:.1f} MiB, on (after the rounds) {rss_on / 1024:.1f} MiB, "
              f"ratio {ratio:.3f}")
        for name, good in (("every container pinned", pinned_all), ("every pod told (its status annotation)",
                                                                    all(reported) and len(reported) == args.pods),
                           ("every drift restored", drift_all),
                           (f"RSS ratio <= {RSS_RATIO_TARGET}", ratio <= RSS_RATIO_TARGET)):
            print(f"{'PASS' if good else 'FAIL'}: {name}")
            ok = ok and good
    finally:
        ctrd.stop()
        server.close()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
