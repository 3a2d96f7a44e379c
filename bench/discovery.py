"""Full discovery against hwloc's own load of the same root, measured in the same run.

For each root: the baseline is pyhwloc's public API loading the topology with the flags and I/O
filter our probe uses (and nothing else), with hwloc's default plugins; the subject is memtopo's
whole discovery (every probe, the assembly, the protobuf message and its fingerprint). Each root
runs in its own process so the peak RSS column is that root's. Target: ratio <= 2.0 for every root
(stretch 1.5).

Our probe loads an XML export or a captured root without hwloc's discovery plugins (none of them
can contribute there; discovery/hwloc.py). The last columns show that load on its own and our
discovery against it, so what the Python adds is visible apart from what the plugins cost.

    .venv/bin/python bench/discovery.py [--repeat N] [ROOT_NAME ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import Report  # noqa: E402
from bench.roots import HWLOC_XML, hwloc_root, synthesized_root  # noqa: E402
from memtopo.discovery.capture import context_for  # noqa: E402
from memtopo.discovery.source import ProbeContext  # noqa: E402

# name -> (kind, path); "this host" reads the live root.
ROOTS: dict[str, tuple[str, str]] = {
    "256ia64-64n2s2c": ("fsroot", "256ia64-64n2s2c"),
    "192em64t-24n8c2t.xml": ("xml", "192em64t-24n8c2t.xml"),
    "nvidiaDGX2.xml": ("xml", "nvidiaDGX2.xml"),
    "32em64t-2n8c+dax+nvme+mic+dimms": ("fsroot", "32em64t-2n8c+dax+nvme+mic+dimms"),
    # Synthesized hosts (tests/fixtures): their vendor tools and NVML replay from the capture.
    "ascend-a3-16npu (640 CPUs)": ("synth", "ascend-a3-16npu"),
    "gh200-quad (36 nodes)": ("synth", "gh200-quad"),
    "this host": ("live", "/"),
}


def _hwloc_load(ctx: ProbeContext, plugins: bool = True) -> Callable[[], None]:
    """hwloc alone, in the environment our probe gives this input (with hwloc's default plugins, or
    without them where our probe leaves them out)."""
    from pyhwloc import Topology
    from pyhwloc.topology import TopologyFlags, TypeFilter

    from memtopo.discovery.hwloc import environment, load_setup

    kind, path, env = load_setup(ctx, default_plugins=plugins)

    def load() -> None:
        with environment(env):
            topo = Topology.from_xml_file(path) if kind == "xml" else Topology.from_this_system()
            topo.set_flags(TopologyFlags.INCLUDE_DISALLOWED)
            with topo.set_io_types_filter(TypeFilter.KEEP_ALL):
                pass
    return load


def _discover(ctx: ProbeContext) -> Callable[[], None]:
    from memtopo.discovery.discover import discover

    def run() -> None:
        discover(ctx)
    return run


WARMUP = 3
TARGET_RATIO = 2.0


def _time_interleaved(fns: list[Callable[[], None]], repeat: int) -> list[list[float]]:
    """Alternate baselines and subject run by run, so a load spike on this (shared, 2-core) machine
    lands on all sides alike instead of on whichever block happened to be running."""
    for _ in range(WARMUP):  # page cache, imports, ctypes prototypes, thread pools
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, samples, strict=True):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return samples


def measure_one(name: str, repeat: int) -> dict[str, float]:
    kind, arg = ROOTS[name]
    if kind == "xml":
        path = str(HWLOC_XML / arg)
    elif kind == "fsroot":
        path = str(hwloc_root(arg))
    elif kind == "synth":
        path, kind = str(synthesized_root(arg)), "fsroot"
    else:
        path = "/"
    with context_for(None if kind == "xml" else path, hwloc_xml=path if kind == "xml" else None) as ctx:
        base_s, full_s, bare_s = _time_interleaved(
            [_hwloc_load(ctx), _discover(ctx), _hwloc_load(ctx, plugins=False)], repeat)
    base_min, base_med = min(base_s), statistics.median(base_s)
    full_min, full_med = min(full_s), statistics.median(full_s)
    bare_med = statistics.median(bare_s)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"hwloc_ms": base_med * 1e3, "full_ms": full_med * 1e3, "ratio": full_med / base_med,
            "ratio_min": full_min / base_min, "rss_mib": rss_mib, "bare_ms": bare_med * 1e3,
            "ratio_bare": full_med / bare_med}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("names", nargs="*", default=list(ROOTS))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.repeat)))
        return 0
    return Report.run("discovery", lambda report: compare(args, report))


def compare(args: argparse.Namespace, report: Report) -> None:
    rows = []
    for name in args.names:
        out = subprocess.run([sys.executable, __file__, "--repeat", str(args.repeat), "--one", name],
                             capture_output=True, text=True, check=False, cwd=REPO)
        if out.returncode != 0:
            report.unmeasured(f"{name}: full / hwloc", (out.stderr.strip().splitlines() or ["failed"])[-1][:200])
            continue
        rows.append((name, json.loads(out.stdout.strip().splitlines()[-1])))
    print(f"{'root':<34} {'hwloc load ms':>13} {'full discovery ms':>17} {'ratio':>6} {'ratio(min)':>10} "
          f"{'peak RSS MiB':>12} {'no-plugin load ms':>17} {'full/no-plugin':>14}")
    for name, r in rows:
        print(f"{name:<34} {r['hwloc_ms']:>13.2f} {r['full_ms']:>17.2f} {r['ratio']:>6.2f} "
              f"{r['ratio_min']:>10.2f} {r['rss_mib']:>12.1f} {r['bare_ms']:>17.2f} {r['ratio_bare']:>14.2f}")
    print("(median of --repeat alternating runs after warm-up; ratio = full / hwloc (default plugins);\n"
          " no-plugin = hwloc's load as our probe does it for an XML or a captured root; the live host loads its "
          "plugins both ways)")
    for name, r in rows:
        report.judge(f"{name}: full discovery / hwloc load", r["ratio"], "<=", TARGET_RATIO)


if __name__ == "__main__":
    sys.exit(main())
