"""The scheduler extender over the API server's fleet (``--fleet nrt``): speed per scheduling cycle and
memory, against the bare JSON work of the same request and answer measured in the same run.

The stand-in API server (bench/k8s_standin.py: list/watch of NodeResourceTopologies and pods; not a
Kubernetes API server) runs in a process of its own with ``--nodes`` objects. The extender runs in this
process as ``memtopo controller serve --kube-api URL --fleet nrt`` puts it together (its own thread and
event loop, its HTTP listener on loopback); the client is kube-scheduler's shape: one keep-alive
connection, ``NodeNames``, a POST per verb.

One iteration is a scheduling cycle: one node's object changes (the stand-in writes it, the watch brings
it), then filter and prioritize of the same pod over every node. Per policy (a pod memtopo places with
hccs, xpu or place, and a plain Guaranteed CPU and memory pod judged by what the kubelet admits alone):

* **cycle**: filter + prioritize, p50/p99 of wall time (and the process's CPU time, p50); targets: p99
  ≤ 50 ms over 5,000 nodes, ≤ 10 ms over 500;
* **ratio**: the cycle's p99 against the p99 of decoding both requests and encoding both answers with
  ``json`` in this process (the floor any front end pays), same run;
* **update**: what one changed object costs the view — reading it (``read_nrt``), the informer's
  callback and judging that node again — p99; target ≤ 1 ms;
* **cold**: the first filter of a new pod shape, every node judged afresh (reported, no target).

The memory part lists ``--memory-nodes`` (10,000) objects of an 8-zone host into a fresh process and
reports its VmRSS after the view synced and after a filter over every node; target ≤ 150 MiB.

Fleets: ``plain`` and the memory part: the synthesized Ascend A2 host (8 NUMA zones); ``xpu``: the
Kunlunxin P800 host; ``place``: the GH200 host; ``hccs``: a 910 node of two zones, each one HCCS ring of
4 NPUs (built here: no synthesized host has that layout). Each node's free counts vary.

    .venv/bin/python bench/extender.py [--nodes 5000,500] [--iterations 100] [--policies plain,hccs,xpu,place]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.procstat import rss_mib  # noqa: E402
from bench.report import Report  # noqa: E402

TARGET_P99_MS = {5000: 50.0, 500: 10.0}
TARGET_UPDATE_MS = 1.0
TARGET_RSS_MIB = 150.0
KUBELET = {"topology_manager_policy": "single-numa-node", "topology_manager_scope": "pod",
           "cpu_manager_policy": "static", "memory_manager_policy": "Static"}
HOSTS = {"plain": "ascend-a2-8x910b", "xpu": "kunlunxin-p800-8xpu", "place": "gh200"}


def _guaranteed(**resources: str) -> dict[str, Any]:
    return {"metadata": {"name": "bench", "namespace": "default"},
            "spec": {"containers": [{"name": "c", "resources": {"requests": resources, "limits": resources}}]}}


PODS: dict[str, dict[str, Any]] = {
    "plain": _guaranteed(cpu="4", memory="8Gi"),
    "hccs": _guaranteed(cpu="4", memory="8Gi", **{"huawei.com/Ascend910": "2"}),
    "xpu": _guaranteed(cpu="4", memory="8Gi", **{"kunlunxin.com/xpu": "2"}),
    "place": _guaranteed(cpu="8", memory="16Gi", **{"nvidia.com/gpu": "1"}),
}


# ---- the objects ---------------------------------------------------------------------------------------
def template(policy: str) -> dict[str, Any]:
    from bench.roots import extracted
    from memtopo.discovery.discover import discover
    from memtopo.discovery.source import ProbeContext
    from memtopo.k8s.facts import KubeletFacts
    from memtopo.k8s.nrt import build_nrt

    kubelet = KubeletFacts(config_path="/var/lib/kubelet/config.yaml", **KUBELET)  # type: ignore[arg-type]
    if policy == "hccs":
        zones = []
        for i in range(2):
            ring = ",".join(f"NPU{4 * i + j}" for j in range(4))
            zones.append({"name": f"node-{i}", "type": "Node",
                          "costs": [{"name": "node-0", "value": 10 if i == 0 else 20},
                                    {"name": "node-1", "value": 20 if i == 0 else 10}],
                          "resources": [{"name": "cpu", "capacity": "96", "allocatable": "96", "available": "96"},
                                        {"name": "memory", "capacity": "512Gi", "allocatable": "512Gi",
                                         "available": "512Gi"},
                                        {"name": "huawei.com/Ascend910", "capacity": "4", "allocatable": "4",
                                         "available": "4"}],
                          "attributes": [{"name": "memtopo.io/memory-type", "value": "DRAM"},
                                         {"name": "memtopo.io/hccs-ring", "value": ring}]})
        return {"apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology",
                "metadata": {"name": "template"}, "zones": zones,
                "attributes": [{"name": "topologyManagerPolicy", "value": "single-numa-node"},
                               {"name": "topologyManagerScope", "value": "pod"}]}
    topo = discover(ProbeContext.at_root(extracted(REPO / "tests" / "fixtures" / HOSTS[policy] / "root.tar.gz")))
    built: dict[str, Any] = build_nrt(topo, "template", kubelet=kubelet)
    return built


def vary(obj: dict[str, Any], name: str, rng: random.Random) -> dict[str, Any]:
    """The template under ``name`` with each zone's available CPUs and devices drawn anew."""
    out: dict[str, Any] = json.loads(json.dumps(obj))
    out["metadata"] = {"name": name}
    for z in out["zones"]:
        for r in z["resources"]:
            if r["name"] == "memory" or r["name"].startswith("hugepages-"):
                continue
            total = int(r["allocatable"])
            r["available"] = str(rng.randint(0, total) if rng.random() < 0.5 else total)
    return out


# ---- the stand-in in a process of its own -------------------------------------------------------------
def serve(policy: str, nodes: int) -> None:
    """The stand-in with ``nodes`` objects; ``change I`` on stdin rewrites node I's object, then ``done``."""
    from bench.k8s_standin import StandInApiServer

    async def main() -> None:
        rng = random.Random(7)
        base = template(policy)
        server = StandInApiServer()
        url = await server.start()
        for i in range(nodes):
            server.put_nrt(vary(base, f"{policy}-{i:05d}", rng))
        print(url, len(json.dumps(base)), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            i = int(line.split()[1])
            server.put_nrt(vary(base, f"{policy}-{i:05d}", rng))
            print("done", flush=True)
        await server.stop()

    asyncio.run(main())


class StandIn:
    def __init__(self, policy: str, nodes: int) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", policy, str(nodes)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert self.proc.stdout is not None
        url, size = self.proc.stdout.readline().split()
        self.url, self.size = url, int(size)

    def change(self, i: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"change {i}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


# ---- the extender in this process ------------------------------------------------------------------------
class Extender:
    """``memtopo controller serve --kube-api URL --fleet nrt`` on its own loop in a thread."""

    def __init__(self, url: str) -> None:
        from memtopo.cli.extender import ExtenderOptions, add_routes, build
        from memtopo.controller.server import start_controller
        from memtopo.k8s.kubeapi import KubeApi

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.built: list[Any] = []
        kube = KubeApi(url, timeout_s=60)

        def install(routes: Any, state: Any) -> None:
            ext = build(ExtenderOptions(fleet="nrt", kube=kube), state)
            add_routes(routes, ext, state)
            self.built.append(ext)

        self.running = self.call(start_controller("127.0.0.1:0", http="127.0.0.1:0", kube=kube,
                                                  http_routes=install))
        self.fleet = self.built[0].fleet

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def synced(self, nodes: int, timeout: float = 600.0) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            ready, _ = self.fleet.readiness()
            if ready and len(self.fleet.states) >= nodes:
                return time.perf_counter() - start
            time.sleep(0.05)
        raise SystemExit("the extender's view did not sync")

    def stop(self) -> None:
        self.call(self.running.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _wall(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(policy: str, nodes: int, iterations: int) -> dict[str, Any]:
    stand_in = StandIn(policy, nodes)
    ext = Extender(stand_in.url)
    try:
        sync_s = ext.synced(nodes)
        names = [f"{policy}-{i:05d}" for i in range(nodes)]
        body = json.dumps({"Pod": PODS[policy], "NodeNames": names}).encode()
        assert ext.running.http is not None
        conn = http.client.HTTPConnection("127.0.0.1", ext.running.http.port, timeout=600)
        answers: dict[str, bytes] = {}

        def verb(name: str) -> None:
            conn.request("POST", f"/scheduler/{name}", body, {"Content-Type": "application/json"})
            answers[name] = conn.getresponse().read()

        def checked(name: str) -> None:
            # Outside the timed cycles: the client's decoding is kube-scheduler's work, not the extender's.
            doc = json.loads(answers[name])
            if isinstance(doc, dict) and doc.get("Error"):
                raise SystemExit(f"{policy} {name}: {doc['Error']}")

        def cycle() -> None:
            verb("filter")
            verb("prioritize")

        cold = _wall(lambda: verb("filter"))
        verb("prioritize")
        checked("filter")
        checked("prioritize")
        filter_doc, prio_doc = json.loads(answers["filter"]), json.loads(answers["prioritize"])
        fitting = len(filter_doc["NodeNames"])

        def bare() -> None:
            # What any front end pays: both requests decoded, both answers encoded.
            json.loads(body)
            json.dumps(filter_doc)
            json.loads(body)
            json.dumps(prio_doc)

        rng = random.Random(11)
        cycles: list[float] = []
        cpus: list[float] = []
        floors: list[float] = []
        updates: list[float] = []
        for _ in range(iterations):
            i = rng.randrange(nodes)
            name = names[i]
            before = ext.fleet.states[name].topology
            stand_in.change(i)
            deadline = time.monotonic() + 30
            while ext.fleet.states[name].topology is before and time.monotonic() < deadline:
                time.sleep(0.001)
            floors.append(_wall(bare))
            cpu = time.process_time()
            cycles.append(_wall(cycle))
            cpus.append(time.process_time() - cpu)
            updates.append(_update_cost(ext, policy, name))
        checked("filter")
        checked("prioritize")
        conn.close()
        return {"policy": policy, "nodes": nodes, "n": iterations, "bytes": stand_in.size, "sync_s": sync_s,
                "cpu_p50_ms": statistics.median(cpus) * 1e3,
                "fitting": fitting, "cold_ms": cold * 1e3,
                "p50_ms": statistics.median(cycles) * 1e3, "p99_ms": _percentile(cycles, 0.99) * 1e3,
                "floor_p99_ms": _percentile(floors, 0.99) * 1e3,
                "update_p50_ms": statistics.median(updates) * 1e3, "update_p99_ms": _percentile(updates, 0.99) * 1e3}
    finally:
        ext.stop()
        stand_in.close()


_OBJECTS: dict[str, dict[str, Any]] = {}


def _update_cost(ext: Extender, policy: str, name: str) -> float:
    """What one changed object costs, on the extender's loop: reading it (the informer's transform), the
    informer's callback, and the next call's judging of that node for the pod (and of no other node)."""
    from memtopo.extender.nrt import PodInfo, read_object

    obj = _OBJECTS.get(policy)
    if obj is None:
        obj = _OBJECTS[policy] = vary(template(policy), name, random.Random(3))
    obj = {**obj, "metadata": {"name": name}}
    pod = PODS[policy]
    PodInfo.of(pod)  # read once per pod shape, as a ReplicaSet's pods are
    fleet = ext.fleet

    async def on_loop() -> float:
        t = time.perf_counter()
        fleet.nrt_changed(name, read_object(obj))
        judged = await fleet.judge(pod, [name])
        seconds = time.perf_counter() - t
        assert judged.node(name) is not None
        return seconds

    seconds: float = ext.call(on_loop())
    return seconds


# ---- memory ----------------------------------------------------------------------------------------------
def memory_client(url: str, nodes: int) -> None:
    """A fresh process: the extender's view of ``nodes`` objects, its VmRSS synced and after a filter."""
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    baseline = rss_mib()
    ext = Extender(url)
    ext.synced(nodes)
    synced = rss_mib()
    names = [f"plain-{i:05d}" for i in range(nodes)]
    assert ext.running.http is not None
    conn = http.client.HTTPConnection("127.0.0.1", ext.running.http.port, timeout=600)
    conn.request("POST", "/scheduler/filter", json.dumps({"Pod": PODS["plain"], "NodeNames": names}).encode(),
                 {"Content-Type": "application/json"})
    conn.getresponse().read()
    after = rss_mib()
    ext.stop()
    print(json.dumps({"baseline": baseline, "synced": synced, "after_filter": after}), flush=True)


def memory(nodes: int) -> dict[str, Any]:
    stand_in = StandIn("plain", nodes)
    try:
        out = subprocess.run([sys.executable, __file__, "--memory-client", stand_in.url, str(nodes)],
                             capture_output=True, text=True, cwd=REPO, timeout=1800, check=True).stdout
        doc: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        doc["bytes"] = stand_in.size
        return doc
    finally:
        stand_in.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="5000,500")
    parser.add_argument("--iterations", type=int, default=100,
                        help="cycles per row (the p99 of fewer than 100 is their slowest)")
    parser.add_argument("--policies", default="plain,hccs,xpu,place")
    parser.add_argument("--memory-nodes", type=int, default=10_000, help="0 skips the memory part")
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--memory-client", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    if args.serve is not None:
        serve(args.serve[0], int(args.serve[1]))
        return 0
    if args.memory_client is not None:
        memory_client(args.memory_client[0], int(args.memory_client[1]))
        return 0
    return Report.run("extender", lambda report: measure(args, report))


def measure(args: argparse.Namespace, report: Report) -> None:
    print(f"{'policy':6} {'nodes':>6} {'fit':>5} {'n':>3} {'cycle p50':>9} {'cycle p99':>9} {'cpu p50':>8} "
          f"{'json p99':>8} {'ratio':>6} {'update p50/p99':>15} {'cold':>8}")
    rows: list[tuple[str, int, dict[str, Any]]] = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for policy in args.policies.split(","):
            r = run(policy, nodes, args.iterations)
            rows.append((policy, nodes, r))
            print(f"{policy:6} {nodes:>6} {r['fitting']:>5} {r['n']:>3} {r['p50_ms']:7.1f}ms {r['p99_ms']:7.1f}ms "
                  f"{r['cpu_p50_ms']:6.1f}ms {r['floor_p99_ms']:6.1f}ms {r['p99_ms'] / r['floor_p99_ms']:6.1f} "
                  f"{r['update_p50_ms']:5.2f}/{r['update_p99_ms']:5.2f}ms {r['cold_ms']:6.0f}ms", flush=True)
    print("ratio = cycle p99 / json p99 (both requests decoded and both answers encoded, same run); cpu = this "
          "process's CPU time per cycle (the extender and the client: what a busy machine does not inflate); "
          "cold = the first filter of a new pod shape")
    for policy, nodes, r in rows:
        what = f"{policy} filter+prioritize, {nodes:,} nodes"
        target = TARGET_P99_MS.get(nodes)
        if target is not None:
            report.judge(f"{what}: p99", r["p99_ms"], "<=", target, "ms", 1)
        report.judge(f"{policy}, {nodes:,} nodes: one changed object p99", r["update_p99_ms"], "<=",
                     TARGET_UPDATE_MS, "ms")
    if args.memory_nodes:
        m = memory(args.memory_nodes)
        print(f"memory: {args.memory_nodes} NodeResourceTopologies ({m['bytes']:,} bytes of JSON each, 8 zones): "
              f"process {m['baseline']:.1f} MiB before, {m['synced']:.1f} MiB synced, {m['after_filter']:.1f} MiB "
              "after a filter over all")
        report.judge(f"memory: {args.memory_nodes:,} objects synced and filtered, VmRSS",
                     max(m["synced"], m["after_filter"]), "<=", TARGET_RSS_MIB, "MiB", 1)


if __name__ == "__main__":
    sys.exit(main())
