"""PodResources answers near the kubelet's 16 MiB limit: what they cost the client and the agent.

A test kubelet (memtopo's schema of the PodResources API, tests/test_k8s_kubelet.py's server, in a
process of its own) answers ``List`` with 14 MB: 33,000 pods of 8 containers, each with a device, a
CPU and a memory grant (264,000 containers).

* **client**: one ``read_pod_resources`` in a fresh process; its peak RSS growth against the answer's
  size. Target: at most 5 times the answer (parsed whole, into a grant per container, it was 22x).
* **agent**: ``memtopo serve`` on a lab capture with ``[kubernetes]`` on, publishing to the stand-in
  API server (bench/k8s_standin.py, not a Kubernetes API server) and polling that kubelet every 2 s,
  for ``--seconds``; its VmRSS at the end and VmHWM. Target: VmHWM within half the DaemonSet's
  512 MiB memory limit.

    .venv/bin/python bench/podresources.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.kubelet_standin import HUGE_LIST  # noqa: E402
from bench.roots import LAB_CAPTURES  # noqa: E402

CLIENT_TARGET = 5.0
AGENT_TARGET_MIB = 256
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
KUBELET = HUGE_LIST.split('server = subprocess.Popen([sys.executable, "-c", """')[1].split('""", path]')[0]
API_SERVER = """
import asyncio
from bench.k8s_standin import StandInApiServer

async def main():
    server = StandInApiServer()
    server.add_node("bench-node")
    print(await server.start(), flush=True)
    await asyncio.sleep(86400)

asyncio.run(main())
"""


def client(tmp: Path) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", HUGE_LIST, str(tmp)], capture_output=True, text=True, cwd=REPO,
                         timeout=600, check=True, env=ENV)
    size, _, _, grown = map(int, out.stdout.split())
    return size, grown


def memory(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) // 1024
    return out


def agent(tmp: Path, seconds: float) -> tuple[dict[str, int], int]:
    sock = str(tmp / "kubelet.sock")
    procs = []
    try:
        kubelet = subprocess.Popen([sys.executable, "-c", KUBELET, sock], stdout=subprocess.PIPE, text=True, env=ENV)
        procs.append(kubelet)
        assert kubelet.stdout is not None
        kubelet.stdout.readline()
        kubelet.stdout.readline()
        api = subprocess.Popen([sys.executable, "-c", API_SERVER], stdout=subprocess.PIPE, text=True, env=ENV,
                               cwd=REPO)
        procs.append(api)
        assert api.stdout is not None
        url = api.stdout.readline().strip()
        config = tmp / "agent.toml"
        config.write_text(
            f'node_name = "bench-node"\nroot = "{LAB_CAPTURES / "dual-socket-cxl.tar.gz"}"\nstate_dir = "{tmp}/state"\n'
            f'[listen]\nsocket = "{tmp}/agent.sock"\n[discovery]\nudev = false\n[health]\nlisten = ""\n'
            f'[kubernetes]\nenabled = true\napi_server = "{url}"\npod_resources_socket = "{sock}"\n'
            "pod_resources_seconds = 2.0\n")
        serve = subprocess.Popen([sys.executable, "-m", "memtopo.cli", "serve", "--config", str(config)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=REPO)
        procs.append(serve)
        time.sleep(seconds)
        if serve.poll() is not None:
            raise SystemExit(f"the agent exited {serve.returncode}")
        figures = memory(serve.pid)
        serve.terminate()
        assert serve.stdout is not None
        applied = sum('"nrt_applied"' in line for line in serve.stdout.read().splitlines())
        return figures, applied
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the agent runs (default 60)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mtbp") as d:
        size, grown = client(Path(d))
    ratio = grown / size
    client_ok = ratio <= CLIENT_TARGET
    print(f"client: a {size / 1e6:.1f} MB List grows the process by {grown / (1 << 20):.1f} MiB at its peak "
          f"({ratio:.1f}x the answer; target <= {CLIENT_TARGET:g}x): {'PASS' if client_ok else 'FAIL'}")
    with tempfile.TemporaryDirectory(prefix="mtbp") as d:
        figures, applied = agent(Path(d), args.seconds)
    agent_ok = figures["VmHWM"] <= AGENT_TARGET_MIB and applied >= 1
    print(f"agent: polling it every 2 s for {args.seconds:g} s: VmRSS {figures['VmRSS']} MiB, VmHWM "
          f"{figures['VmHWM']} MiB, NRT applied {applied}x (target VmHWM <= {AGENT_TARGET_MIB} MiB): "
          f"{'PASS' if agent_ok else 'FAIL'}")
    return 0 if client_ok and agent_ok else 1


if __name__ == "__main__":
    sys.exit(main())
