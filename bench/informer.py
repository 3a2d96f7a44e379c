"""An informer holding a fleet's NodeResourceTopologies: the process's RSS with 10,000 objects.

The stand-in API server (bench/k8s_standin.py: list/watch of NodeResourceTopologies; not a Kubernetes
API server) runs in a process of its own with ``--nodes`` objects, each the NRT memtopo builds for the
synthesized Ascend A2 host (8 NUMA zones with CPUs, memory, NPUs, SLIT costs and memtopo's
attributes). The informer runs in another process and lists them (500 a page), then watches while
``--churn`` objects change; figures are that process's VmRSS:

* **baseline**: after importing the client and the informer and making the client (the same run);
* **synced**: the store complete; **after churn**: every change seen through the watch.

Two stores are measured, each in a fresh process: ``compact`` keeps what a scheduler extender needs
of each object (free devices per zone, ``k8s.nrt.available_from_nrt``), ``raw`` keeps the decoded
object itself (what an informer without a transform would hold). Target (the extender's budget): the
compact store's process stays within 150 MiB with 10,000 objects.

    .venv/bin/python bench/informer.py [--nodes 10000] [--churn 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.procstat import rss_mib  # noqa: E402

TARGET_RSS_MIB = 150.0
HOST = "ascend-a2-8x910b"


def _template() -> dict[str, Any]:
    from bench.roots import extracted
    from memtopo.discovery.discover import discover
    from memtopo.discovery.source import ProbeContext
    from memtopo.k8s.nrt import build_nrt

    topo = discover(ProbeContext.at_root(extracted(REPO / "tests" / "fixtures" / HOST / "root.tar.gz")))
    return build_nrt(topo, "template")


def serve(nodes: int) -> None:
    """The stand-in with ``nodes`` objects; on stdin ``churn N`` changes N of them, then prints ``done``."""
    from bench.k8s_standin import StandInApiServer

    async def main() -> None:
        template = _template()
        server = StandInApiServer()
        url = await server.start()
        for i in range(nodes):
            obj = json.loads(json.dumps(template))
            obj["metadata"]["name"] = f"node-{i:05d}"
            server.put_nrt(obj)
        size = len(json.dumps(template))
        print(url, size, flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            count = int(line.split()[1])
            for i in range(count):
                obj = json.loads(json.dumps(server.objects[f"node-{i:05d}"]))
                obj["zones"][0]["resources"][-1]["available"] = "0"
                server.put_nrt(obj)
            print("done", flush=True)
        await server.stop()

    asyncio.run(main())


def client(url: str, store: str, nodes: int) -> None:
    """Lists and watches; prints one JSON line per stage for the parent (which drives the churn)."""
    import structlog

    from memtopo.k8s import kubeapi
    from memtopo.k8s.informer import Informer
    from memtopo.k8s.nrt import available_from_nrt

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout is for the figures

    async def main() -> None:
        api = kubeapi.KubeApi(url, timeout_s=60)
        changed = 0

        def upsert(key: str, value: object) -> None:
            nonlocal changed
            changed += 1

        transform = available_from_nrt if store == "compact" else (lambda obj: obj)
        informer: Informer[Any] = Informer(api, kubeapi.nrt_path(), transform, on_upsert=upsert)
        print(json.dumps({"stage": "baseline", "rss": rss_mib()}), flush=True)
        task = asyncio.create_task(informer.run())
        await informer.wait_synced(600)
        print(json.dumps({"stage": "synced", "rss": rss_mib(), "objects": len(informer)}), flush=True)
        target = changed + int(sys.stdin.readline())
        while changed < target:
            await asyncio.sleep(0.05)
        print(json.dumps({"stage": "after churn", "rss": rss_mib(), "objects": len(informer),
                          "relists": informer.status().relists}), flush=True)
        informer.stop()
        await task
        await api.close()

    asyncio.run(main())


def measure(store: str, nodes: int, churn: int) -> tuple[dict[str, dict[str, Any]], int]:
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(nodes)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert server.stdin is not None and server.stdout is not None
    try:
        url, size = server.stdout.readline().split()
        proc = subprocess.Popen([sys.executable, __file__, "--client", url, store, str(nodes)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert proc.stdin is not None and proc.stdout is not None
        stages = {}
        for _ in range(2):
            doc = json.loads(proc.stdout.readline())
            stages[doc["stage"]] = doc
        server.stdin.write(f"churn {churn}\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "done"
        proc.stdin.write(f"{churn}\n")
        proc.stdin.flush()
        doc = json.loads(proc.stdout.readline())
        stages[doc["stage"]] = doc
        proc.wait(60)
        return stages, int(size)
    finally:
        server.stdin.close()
        server.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--churn", type=int, default=1_000)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return 0
    if args.client is not None:
        url, store, nodes = args.client
        client(url, store, int(nodes))
        return 0
    results = {}
    for store in ("compact", "raw"):
        results[store], size = measure(store, args.nodes, args.churn)
    print(f"{args.nodes} NodeResourceTopologies of {size:,} bytes of JSON each ({HOST}, 8 zones); "
          f"{args.churn} changed through the watch")
    print(f"{'store':8} {'baseline MiB':>13} {'synced MiB':>11} {'after churn MiB':>16} {'per object':>11}")
    for store, st in results.items():
        per = (st["after churn"]["rss"] - st["baseline"]["rss"]) * (1 << 20) / args.nodes
        print(f"{store:8} {st['baseline']['rss']:13.1f} {st['synced']['rss']:11.1f} "
              f"{st['after churn']['rss']:16.1f} {per:9,.0f} B")
    peak = max(results["compact"]["synced"]["rss"], results["compact"]["after churn"]["rss"])
    ok = peak <= TARGET_RSS_MIB
    ratio = (results["raw"]["after churn"]["rss"] - results["raw"]["baseline"]["rss"]) / max(
        results["compact"]["after churn"]["rss"] - results["compact"]["baseline"]["rss"], 0.1)
    print(f"compact store: {peak:.1f} MiB (target <= {TARGET_RSS_MIB:.0f} MiB): {'PASS' if ok else 'FAIL'}; "
          f"the raw store grows {ratio:.1f}x as much")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
