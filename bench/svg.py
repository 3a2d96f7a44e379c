"""The node drawing (``memtopo topo --format svg``) against the issue's target and the text view.

Rows: the 64-node capture (256ia64-64n2s2c: 64 domains, 2016 interconnect pairs), the 64-accelerator
MI300X CPX host and the 16-GPU DGX-2 export. Each topology is discovered once; then ``topology_svg``
and the text renderer (``agent.render.render``, the baseline) are timed on the same message in this
process over ``--repeat`` runs after warm-up: median wall time, minimum wall time, median CPU time of
this thread, the ratio svg / text (CPU), and the size of each output. Pass = CPU-time median under 1 s
and the SVG under 2 MB (the issue's figures); on this shared 2-core machine the wall clock also
measures whatever else runs (the load average is printed).

    .venv/bin/python bench/svg.py [--repeat N]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import Report  # noqa: E402
from bench.roots import HWLOC_LINUX, HWLOC_XML, extracted, synthesized_root  # noqa: E402
from bench.timing import timed  # noqa: E402
from memtopo.cli.render import render  # noqa: E402
from memtopo.discovery.discover import discover  # noqa: E402
from memtopo.discovery.source import ProbeContext  # noqa: E402
from memtopo.draw.svg import topology_svg  # noqa: E402

WARMUP = 2
TARGET_S = 1.0
TARGET_BYTES = 2 * 1024 * 1024
INPUTS: dict[str, Callable[[], ProbeContext]] = {
    "64 NUMA nodes (256ia64-64n2s2c)": lambda: ProbeContext.at_root(
        extracted(HWLOC_LINUX / "256ia64-64n2s2c.tar.bz2")),
    "64 accelerators (mi300x-8gpu-cpx-nps4)": lambda: ProbeContext.at_root(synthesized_root("mi300x-8gpu-cpx-nps4")),
    "16 GPUs, NVSwitch (nvidiaDGX2.xml)": lambda: ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml"),
}


def _time(fn: Callable[[], object], repeat: int) -> tuple[float, float, float]:
    """(median wall s, min wall s, median thread CPU s)."""
    return timed(fn, repeat, WARMUP)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)
    return Report.run("svg", lambda report: run(args.repeat, report))


def run(repeat: int, report: Report) -> None:
    print(f"repeat {repeat}")
    print(f"{'input':<42} {'svg median':>10} {'min':>8} {'cpu':>8} {'text cpu':>9} {'ratio':>6} "
          f"{'svg bytes':>10} {'text bytes':>10}")
    judged = []
    for name, context in INPUTS.items():
        topo = discover(context())
        svg_med, svg_min, svg_cpu = _time(partial(topology_svg, topo), repeat)
        _, _, txt_cpu = _time(partial(render, topo), repeat)
        size, text_size = len(topology_svg(topo).encode()), len(render(topo).encode())
        print(f"{name:<42} {svg_med * 1e3:8.1f}ms {svg_min * 1e3:6.1f}ms {svg_cpu * 1e3:6.1f}ms "
              f"{txt_cpu * 1e3:7.1f}ms {svg_cpu / txt_cpu:5.1f}x {size:>10,} {text_size:>10,}")
        judged.append((name, svg_cpu, size))
    for name, svg_cpu, size in judged:
        report.judge(f"{name}: drawing CPU (median)", svg_cpu, "<", TARGET_S, "s", 3)
        report.judge(f"{name}: SVG size", size / 1024 / 1024, "<", TARGET_BYTES / 1024 / 1024, "MB", 2)


if __name__ == "__main__":
    sys.exit(main())
