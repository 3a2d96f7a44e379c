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
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.timing import timed  # noqa: E402
from memtopo.cli.render import render  # noqa: E402
from memtopo.discovery.capture import context_for  # noqa: E402
from memtopo.discovery.discover import discover  # noqa: E402
from memtopo.draw.svg import topology_svg  # noqa: E402
from memtopo.v1 import topology_pb2 as pb  # noqa: E402

SHARED = Path(os.environ.get("MEMTOPO_SHARED", REPO.parent / "shared"))
WARMUP = 2
TARGET_S = 1.0
TARGET_BYTES = 2 * 1024 * 1024
INPUTS = {
    "64 NUMA nodes (256ia64-64n2s2c)": SHARED / "fixtures/hwloc/linux/256ia64-64n2s2c.tar.bz2",
    "64 accelerators (mi300x-8gpu-cpx-nps4)": REPO / "tests/fixtures/mi300x-8gpu-cpx-nps4/root.tar.gz",
    "16 GPUs, NVSwitch (nvidiaDGX2.xml)": SHARED / "fixtures/hwloc/xml/nvidiaDGX2.xml",
}


def _topology(path: Path) -> pb.MemoryTopology:
    xml = path.suffix == ".xml"
    with context_for(None if xml else path, hwloc_xml=path if xml else None) as ctx:
        return discover(ctx)


def _time(fn: Callable[[], object], repeat: int) -> tuple[float, float, float]:
    """(median wall s, min wall s, median thread CPU s)."""
    return timed(fn, repeat, WARMUP)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}; repeat {args.repeat}; target CPU < {TARGET_S:g} s and "
          f"< {TARGET_BYTES // 1024 // 1024} MB")
    print(f"{'input':<42} {'svg median':>10} {'min':>8} {'cpu':>8} {'text cpu':>9} {'ratio':>6} "
          f"{'svg bytes':>10} {'text bytes':>10}  verdict")
    failed = False
    for name, path in INPUTS.items():
        topo = _topology(path)
        svg_med, svg_min, svg_cpu = _time(partial(topology_svg, topo), args.repeat)
        _, _, txt_cpu = _time(partial(render, topo), args.repeat)
        size, text_size = len(topology_svg(topo).encode()), len(render(topo).encode())
        ok = svg_cpu < TARGET_S and size < TARGET_BYTES
        failed |= not ok
        print(f"{name:<42} {svg_med * 1e3:8.1f}ms {svg_min * 1e3:6.1f}ms {svg_cpu * 1e3:6.1f}ms "
              f"{txt_cpu * 1e3:7.1f}ms {svg_cpu / txt_cpu:5.1f}x {size:>10,} {text_size:>10,}  "
              f"{'pass' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
