"""The CPU enforcement on a real containerd: how soon a started container is pinned, how soon drift is
put back, and what enforcement costs the agent in memory.

A private containerd (tests/containerd.py, as the tests start it) runs the pods; the real agent runs
as its own process (``memtopo.agent.daemon.Agent`` on this host's root, ``kubernetes.enforce = true``)
with a pod source that reads the pods from a JSON file the bench rewrites (a stand-in for the API
server's watch: it notices a change within 20 ms) and a reporter that writes each status annotation
to a second file. Each round: the pod is written to the file (as a bind reaches the informer before
the kubelet starts anything), its container is started through CRI, and the clock runs from
StartContainer's return until the container's cgroup has its exclusive CPU; then the pod is removed.
Nothing tells the agent that the container started but its own pass (``enforce_interval_seconds``,
1 s by default; containerd 1.6 has no container events), unless the pod's status update arrives first:
``--kubelet-status`` rewrites the pod file when the container has started, as the kubelet's status
update would reach an informer.

Drift: at a random point of the interval the pinned container is moved onto every CPU through CRI
by someone else, and the clock runs until its cgroup is back. RSS: the agent process's VmRSS with
enforcement off and with it on after the rounds, same host, same run.

    .venv/bin/python bench/enforce.py [--pods 50] [--drifts 20] [--interval 1.0] [--kubelet-status]

Prints the figures and PASS/FAIL against: every container pinned; every drift restored; enforcement
adds at most 15 % to the agent's RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memtopo.cpulist import parse_cpulist  # noqa: E402
from memtopo.k8s import cri  # noqa: E402
from tests.containerd import Containerd, cgroup_cpuset, unavailable_reason  # noqa: E402
from tests.enforce_standins import NODE, pod_object, resources  # noqa: E402

RSS_RATIO_TARGET = 1.15


# ---- the agent child -------------------------------------------------------------------------------
class FilePods:
    """The pod source of the agent child: the pods in a JSON file, re-read when its mtime changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime = 0
        self._pods: list[Mapping[str, Any]] = []
        self._reload()

    def _reload(self) -> bool:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return False
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        self._pods = json.loads(self.path.read_text() or "[]")
        return True

    def synced(self) -> bool:
        return True

    def bound_pods(self) -> Sequence[Mapping[str, Any]]:
        self._reload()
        return self._pods

    async def wait_changed(self) -> None:
        while not self._reload():
            await asyncio.sleep(0.02)


class FileReporter:
    def __init__(self, path: Path) -> None:
        self.path = path

    async def annotate(self, namespace: str, name: str, uid: str, key: str, value: str) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps({"uid": uid, "value": json.loads(value)}) + "\n")

    async def event(self, namespace: str, name: str, uid: str, type_: str, reason: str, message: str) -> None:
        return None


def agent_child(work: Path, endpoint: str, enforce: bool, interval: float) -> int:
    from memtopo.agent.config import parse_config
    from memtopo.agent.daemon import Agent

    (work / "kubelet.yaml").write_text("kind: KubeletConfiguration\ncpuManagerPolicy: none\n")
    config = parse_config(f"""
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
node_name = "{NODE}"
kubelet_config = "{work}/kubelet.yaml"
enforce = {"true" if enforce else "false"}
runtime_endpoint = "{endpoint}"
enforce_interval_seconds = {interval}
""", "bench")
    agent = Agent(config, pod_source=FilePods(work / "pods.json"), pod_reporter=FileReporter(work / "reports.jsonl"))
    return asyncio.run(agent.run())


# ---- the bench -------------------------------------------------------------------------------------
def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def start_agent(work: Path, endpoint: str, enforce: bool, interval: float) -> subprocess.Popen[bytes]:
    with open(work / f"agent-{int(enforce)}.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--agent-child", str(work), endpoint,
                                 "1" if enforce else "0", str(interval)], stdout=out, stderr=subprocess.STDOUT)
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


def write_pods(path: Path, pods: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(pods))
    os.replace(tmp, path)


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
    ap.add_argument("--agent-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.agent_child:
        work, endpoint, enforce, interval = args.agent_child
        return agent_child(Path(work), endpoint, enforce == "1", float(interval))
    why = unavailable_reason()
    if why:
        print(f"SKIP: {why}")
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("SKIP: needs 2 CPUs")
        return 0
    ctrd = Containerd.start()
    work = Path(tempfile.mkdtemp(prefix="mt-enf-", dir="/tmp"))
    pods_file = work / "pods.json"
    write_pods(pods_file, [])
    ok = True
    try:
        k = ctrd.kubelet()
        base = start_agent(work, ctrd.endpoint, False, args.interval)
        rss_off = rss_kib(base.pid)
        stop_agent(base, work)
        agent = start_agent(work, ctrd.endpoint, True, args.interval)
        client = cri.CriClient(ctrd.endpoint)
        start_to_pinned: list[float] = []
        pid, cid = 0, ""
        for i in range(args.pods):
            pod = k.run_pod(f"bench-{i}", [])
            obj = pod_object(pod, {"app": resources("1")})
            write_pods(pods_file, [obj])
            cid = k.add_container(pod, "app")
            ready = time.perf_counter()  # StartContainer has returned
            if args.kubelet_status:
                obj["status"]["containerStatuses"] = [{"name": "app", "started": True}]
                write_pods(pods_file, [obj])
            pid = client.container_status(cid).pid or 0
            wait_for(lambda pid=pid: len(parse_cpulist(cgroup_cpuset(pid)[0])) == 1)
            start_to_pinned.append(time.perf_counter() - ready)
            if i == args.pods - 1:
                break
            write_pods(pods_file, [])
            k.remove_pod(pod.uid)
        # Drift on the last pod, which stays pinned.
        pinned = cgroup_cpuset(pid)[0]
        drift: list[float] = []
        for _ in range(args.drifts):
            # At a random point of the agent's interval: a drift does not wait for the next pass.
            time.sleep(random.uniform(0, args.interval))
            client.update_cpuset(cid, cpus)
            drift.append(wait_for(lambda: cgroup_cpuset(pid)[0] == pinned))
        rss_on = rss_kib(agent.pid)
        stop_agent(agent, work)
        client.close()
        pinned_all = all(t == t for t in start_to_pinned)
        drift_all = all(t == t for t in drift)
        ratio = rss_on / rss_off if rss_off else float("inf")
        print(f"container start -> pinned over {len(start_to_pinned)} containers (interval {args.interval:g} s, "
              f"{'with' if args.kubelet_status else 'without'} a pod status update): "
              f"p50 {pct(start_to_pinned, 0.5) * 1000:.0f} ms, p99 {pct(start_to_pinned, 0.99) * 1000:.0f} ms, "
              f"mean {statistics.fmean(start_to_pinned) * 1000:.0f} ms")
        print(f"drift -> restored over {len(drift)} drifts: p50 {pct(drift, 0.5) * 1000:.0f} ms, "
              f"p99 {pct(drift, 0.99) * 1000:.0f} ms")
        print(f"agent RSS: enforcement off {rss_off / 1024:.1f} MiB, on (after the rounds) {rss_on / 1024:.1f} MiB, "
              f"ratio {ratio:.3f}")
        for name, good in (("every container pinned", pinned_all), ("every drift restored", drift_all),
                           (f"RSS ratio <= {RSS_RATIO_TARGET}", ratio <= RSS_RATIO_TARGET)):
            print(f"{'PASS' if good else 'FAIL'}: {name}")
            ok = ok and good
    finally:
        ctrd.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
