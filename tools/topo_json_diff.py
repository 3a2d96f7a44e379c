"""Whether `memtopo topo --format json` says the same on every captured root before and after a change.

    .venv/bin/python tools/topo_json_diff.py dump DIR      # one JSON per root: lab captures, hwloc's
                                                           # Linux captures and XML exports, the
                                                           # synthesized hosts
    .venv/bin/python tools/topo_json_diff.py compare A B   # exit 1 and name each root that differs

Run `dump` on the old code (a checkout of the base commit) and on the new, then `compare`. What
changes from run to run is left out of the comparison: the discovery time and each source's duration.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures import HWLOC_LINUX, HWLOC_XML, LAB_CAPTURES  # noqa: E402

# The run's own clock, not the host's topology.
VOLATILE = ("discovery_time",)
VOLATILE_SOURCE = ("duration_seconds",)


def roots() -> dict[str, list[str]]:
    """Name → the `topo` arguments reading it."""
    out: dict[str, list[str]] = {}
    for p in sorted(LAB_CAPTURES.glob("*.tar.gz")):
        out[f"lab-{p.name.removesuffix('.tar.gz')}"] = ["--root", str(p)]
    for p in sorted(HWLOC_LINUX.glob("*.tar.bz2")):
        out[f"linux-{p.name.removesuffix('.tar.bz2')}"] = ["--root", str(p)]
    for p in sorted(HWLOC_XML.glob("*.xml")):
        out[f"xml-{p.name.removesuffix('.xml')}"] = ["--hwloc-xml", str(p)]
    for p in sorted((REPO / "tests" / "fixtures").glob("*/root.tar.gz")):
        out[f"synth-{p.parent.name}"] = ["--root", str(p)]
    return out


def dump(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for name, args in roots().items():
        res = subprocess.run([sys.executable, "-m", "memtopo.cli", "topo", *args, "--format", "json"],
                             cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
        # A synthesized host's tarball lies in the checkout: the old code's checkout is another path.
        text = res.stdout.replace(f'"{REPO}/', '"<checkout>/')
        (out / f"{name}.json").write_text(text if res.returncode == 0 else f"exit {res.returncode}\n")
        print(f"{name}: exit {res.returncode}, {len(res.stdout)} bytes", flush=True)
    return 0


def comparable(text: str) -> Any:
    try:
        doc = json.loads(text)
    except ValueError:
        return text
    for key in VOLATILE:
        doc.pop(key, None)
    for source in doc.get("sources", []):
        for key in VOLATILE_SOURCE:
            source.pop(key, None)
    return doc


def compare(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.glob("*.json")} | {p.name for p in b.glob("*.json")})
    differ = []
    for name in names:
        left, right = a / name, b / name
        if not left.exists() or not right.exists():
            differ.append(f"{name}: only in {a if left.exists() else b}")
        elif comparable(left.read_text()) != comparable(right.read_text()):
            differ.append(f"{name}: differs")
    for line in differ:
        print(line)
    print(f"{len(names) - len(differ)} of {len(names)} roots identical (discovery time and durations aside)")
    return 1 if differ else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "dump":
        return dump(Path(argv[1]))
    if len(argv) == 3 and argv[0] == "compare":
        return compare(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
