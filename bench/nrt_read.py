"""Memory of the NodeResourceTopology read model (``k8s/nrt_read.py``) and the time to judge a pod with it.

memtopo's own objects for synthesized hosts of 2 to 8 NUMA zones (``k8s/nrt.py`` on the host's topology),
copied ``--objects`` times under distinct names, in two fleets: *alike* (every node idle, as a fleet of
one hardware model starts) and *busy* (every resource's ``available`` drawn at random per node, so little
is shared). Measured with tracemalloc in this process: the bytes the read models hold per object, against
the bytes of the parsed JSON dicts they are read from (the baseline: what holding the raw objects
costs). Pass = the read model under half the JSON's bytes, and 10,000 busy objects of the widest host
under 100 MiB.

Then the time per node of ``admit`` (k8s/admission.py) for a Guaranteed pod of integral CPUs, memory and
one accelerator, and of ``read_nrt`` on the same objects: thread CPU, medians over ``--repeat`` passes
(shown, no target).

    .venv/bin/python bench/nrt_read.py [--objects N] [--repeat N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import tracemalloc
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.timing import timed  # noqa: E402
from memtopo.discovery.capture import extract, find_root  # noqa: E402
from memtopo.discovery.discover import discover  # noqa: E402
from memtopo.discovery.source import ProbeContext  # noqa: E402
from memtopo.hostfs import HostFS  # noqa: E402
from memtopo.k8s.admission import PodRequest, Verdict, admit, parse_pod  # noqa: E402
from memtopo.k8s.facts import KubeletFacts  # noqa: E402
from memtopo.k8s.kubelet import read_kubelet_facts  # noqa: E402
from memtopo.k8s.nrt import build_nrt  # noqa: E402
from memtopo.k8s.nrt_read import NodeTopology, read_nrt  # noqa: E402
from memtopo.k8s.quantity import parse  # noqa: E402

HOSTS = ("kunlunxin-p800-8xpu", "gh200", "gb200-tray", "gh200-quad", "mi300x-8gpu-cpx-nps4")
RATIO_TARGET = 0.5
FLEET = 10_000
FLEET_TARGET = 100 << 20
ACCELERATORS = ("nvidia.com/gpu", "amd.com/gpu", "kunlunxin.com/xpu")


def _object(host: str, tmp: Path) -> dict[str, Any]:
    dest = tmp / host
    dest.mkdir(parents=True)
    extract(REPO / "tests" / "fixtures" / host / "root.tar.gz", dest)
    root = find_root(dest)
    facts = read_kubelet_facts(HostFS.at(root))
    kubelet = KubeletFacts(config_path="/var/lib/kubelet/config.yaml", topology_manager_policy="single-numa-node",
                           topology_manager_scope="pod", cpu_manager_policy="static", memory_manager_policy="Static",
                           hugepages=facts.hugepages)
    return build_nrt(discover(ProbeContext.at_root(root)), f"{host}-0", kubelet=kubelet)


def _fleet(obj: dict[str, Any], count: int, busy: bool, rng: random.Random) -> list[dict[str, Any]]:
    text = json.dumps(obj)
    name = obj["metadata"]["name"]
    out = []
    for i in range(count):
        doc = json.loads(text.replace(f'"{name}"', f'"{name}-{i:05d}"'))
        if busy:
            for zone in doc["zones"]:
                for res in zone["resources"]:
                    res["available"] = str(rng.randint(0, int(parse(res["allocatable"]))))
        out.append(doc)
    return out


def _bytes(build: partial[Any]) -> tuple[int, Any]:
    gc.collect()
    tracemalloc.start()
    held = build()
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return size, held


def _pod(obj: dict[str, Any]) -> dict[str, Any]:
    names = {r["name"] for z in obj["zones"] for r in z["resources"]}
    device = next((a for a in ACCELERATORS if a in names), None)
    ask = {"cpu": "4", "memory": "8Gi", **({device: "1"} if device else {})}
    return {"spec": {"containers": [{"name": "c", "resources": {"requests": ask, "limits": ask}}]}}


def _read_all(docs: list[dict[str, Any]]) -> list[NodeTopology]:
    return [read_nrt(d) for d in docs]


def _admit_all(nodes: list[NodeTopology], pod: PodRequest) -> list[Verdict]:
    return [admit(n, pod) for n in nodes]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.objects} objects a fleet; pass = read model < "
          f"{RATIO_TARGET:g} x JSON and {FLEET:,} busy objects < {FLEET_TARGET >> 20} MiB")
    print(f"{'host':<22} {'zones':>5} {'fleet':>6} {'json B/obj':>11} {'model B/obj':>12} {'ratio':>6} "
          f"{'x10,000':>9} {'admit us':>9} {'read us':>8}  verdict")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for host in HOSTS:
            obj = _object(host, Path(tmp))
            pod = parse_pod(_pod(obj))
            for busy in (False, True):
                json_bytes, docs = _bytes(partial(_fleet, obj, args.objects, busy, rng))
                model_bytes, models = _bytes(partial(_read_all, docs))
                per_json, per_model = json_bytes / len(docs), model_bytes / len(docs)
                fleet = per_model * FLEET
                ok = per_model < RATIO_TARGET * per_json and (not busy or fleet < FLEET_TARGET)
                failed |= not ok
                nodes: list[NodeTopology] = models
                sample = nodes[:500]
                _, _, admit_cpu = timed(partial(_admit_all, sample, pod), args.repeat, 1)
                _, _, read_cpu = timed(partial(_read_all, docs[:500]), args.repeat, 1)
                print(f"{host:<22} {len(nodes[0].zones):>5} {'busy' if busy else 'alike':>6} {per_json:>11,.0f} "
                      f"{per_model:>12,.0f} {per_model / per_json:>6.2f} {fleet / (1 << 20):>7.1f}Mi "
                      f"{admit_cpu / len(sample) * 1e6:>9.1f} {read_cpu / len(sample) * 1e6:>8.1f}  "
                      f"{'pass' if ok else 'FAIL'}")
                del docs, models, nodes, sample
    print("PASS" if not failed else "FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
