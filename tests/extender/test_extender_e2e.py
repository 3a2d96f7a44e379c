"""End to end: a controller process with real agents (``memtopo serve`` on the synthesized Ascend A2,
Ascend 910 x8, Kunlunxin P800 and GH200 roots, each its own node name and socket), driven through
the scheduler-extender verbs over HTTP. For every policy the filter and prioritize answers agree
with ``memtopo controller place`` on the same fleet: filter keeps exactly the nodes the policy says
fit, and prioritize gives the policy's chosen node the top score."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memtopo.cli.main import main as memtopo_main
from tests.agents import Controller
from tests.extender.pods import npu_pod, pod
from tests.fixtures import SHARED, extracted

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parents[1] / "fixtures"
NPU_SMI_910A_X8 = SHARED / "fixtures" / "ascend910" / "npu-smi_info_910A_x8.txt"
GHOST = "ghost-node"


def ascend910_root(tmp: Path) -> Path:
    """The A2 tree with the real Ascend 910A x8 ``npu-smi info`` capture as its only recorded tool
    (as tests/fleet_nodes.py builds it): an 8-NPU node with the two HCCS rings."""
    root = tmp / "ascend910-root"
    shutil.copytree(extracted(FIXTURES / "ascend-a2-8x910b" / "root.tar.gz"), root, symlinks=True)
    tools = root / ".memtopo" / "tools"
    for f in tools.iterdir():
        f.unlink()
    shutil.copy(NPU_SMI_910A_X8, tools / "npu-smi-info.txt")
    (tools / "argv.json").write_text(json.dumps({"npu-smi-info.txt": ["npu-smi", "info"]}))
    return root


def spawn(*args: str, log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen([sys.executable, "-m", "memtopo.cli", *args], cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def post_json(url: str, doc: Any) -> Any:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())


def wait_for(predicate: Any, timeout: float = 90.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.controller = Controller(http=True)
        self.controller.start()
        self.grpc = f"127.0.0.1:{self.controller.port}"
        self.http = f"http://127.0.0.1:{self.controller.http_port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmp = tmp
        wait_for(lambda: get_json(self.http + "/healthz")["status"] == "ok", what="controller HTTP")
        roots = {"ascend-a2": extracted(FIXTURES / "ascend-a2-8x910b" / "root.tar.gz"),
                 "ascend-910": ascend910_root(tmp),
                 "kunlun-p800": extracted(FIXTURES / "kunlunxin-p800-8xpu" / "root.tar.gz"),
                 "grace-hopper": extracted(FIXTURES / "gh200" / "root.tar.gz")}
        self.names = list(roots)
        for name, root in roots.items():
            d = tmp / name
            d.mkdir()
            config = d / "agent.toml"
            config.write_text(
                f'node_name = "{name}"\nroot = "{root}"\nstate_dir = "{d / "state"}"\n'
                f'[listen]\nsocket = "{d / "agent.sock"}"\n'
                f'[controller]\naddress = "{self.grpc}"\ninsecure = true\nheartbeat_seconds = 1.0\n'
                'backoff_initial_seconds = 0.05\nbackoff_max_seconds = 0.5\n'
                '[discovery]\ndebounce_seconds = 0.0\nudev = false\n[health]\nlisten = ""\n')
            self.procs.append(spawn("serve", "--config", str(config), log=d / "agent.log"))
        wait_for(lambda: get_json(self.http + "/healthz")["topologies"] == len(roots), what="four topologies")

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.controller.kill()


# One fleet of agent processes for the module, on one xdist worker (not one per worker).
pytestmark = pytest.mark.xdist_group("extender-e2e")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("extender-e2e"))
    try:
        yield f
    finally:
        f.close()


_place_lock = threading.Lock()


def controller_place(fleet: Fleet, policy: str, request: dict[str, Any], tmp: Path,
                     capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``memtopo controller place POLICY --request FILE --addr …``: its JSON document."""
    path = tmp / "request.json"
    path.write_text(json.dumps(request))
    with _place_lock:
        capsys.readouterr()
        memtopo_main(["controller", "place", policy, "--request", str(path), "--addr", fleet.grpc])
        out = capsys.readouterr().out
    doc: dict[str, Any] = json.loads(out)
    return doc


CASES = [
    ("hccs", npu_pod(1), {"request": 1}),
    ("hccs", npu_pod(2), {"request": 2}),
    ("hccs", npu_pod(4), {"request": 4}),
    ("hccs", npu_pod(8), {"request": 8}),
    ("xpu", pod(limits={"kunlunxin.com/xpu": "1"}), {"request": 1}),
    ("xpu", pod(limits={"kunlunxin.com/xpu": "4"}), {"request": 4}),
    ("xpu", pod(limits={"kunlunxin.com/xpu": "8"}), {"request": 8}),
    ("place", pod(requests={"cpu": "4", "memory": "8Gi"}, limits={"nvidia.com/gpu": "1"}),
     {"cpus": 4, "gpus": 1, "memory_gb": 8}),
    ("place", pod(requests={"cpu": "2", "memory": "1Gi"}, annotations={"memtopo.io/workload": "cpu-heavy"}),
     {"cpus": 2, "memory_gb": 1, "workload": "cpu-heavy"}),
    ("place", pod(requests={"cpu": "1", "memory": "100Gi"},
                  annotations={"memtopo.io/policy": "place", "memtopo.io/memory-policy": "interleave"}),
     {"cpus": 1, "memory_gb": 100, "constraints": {"memory_policy": "interleave"}}),
    ("place", pod(requests={"cpu": "100000"}, annotations={"memtopo.io/policy": "place"}), {"cpus": 100000}),
]


@pytest.mark.parametrize(("policy", "the_pod", "request_obj"), CASES)
def test_filter_and_prioritize_agree_with_controller_place(fleet: Fleet, policy: str, the_pod: dict[str, Any],
                                                           request_obj: dict[str, Any], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    names = [*fleet.names, GHOST]
    doc = controller_place(fleet, policy, request_obj, tmp_path, capsys)
    for cache_capable in (True, False):
        args = ({"Pod": the_pod, "NodeNames": names} if cache_capable else
                {"Pod": the_pod, "Nodes": {"items": [{"metadata": {"name": n}} for n in names]}})
        answer = post_json(fleet.http + "/scheduler/filter", args)
        assert answer["Error"] == ""
        passing = (answer["NodeNames"] if cache_capable else
                   [i["metadata"]["name"] for i in answer["Nodes"]["items"]])
        failed = {**answer["FailedNodes"], **answer["FailedAndUnresolvableNodes"]}
        assert sorted([*passing, *failed]) == sorted(names) and GHOST in answer["FailedAndUnresolvableNodes"]
        scores = {h["Host"]: h["Score"] for h in post_json(fleet.http + "/scheduler/prioritize", args)}
        assert set(scores) == set(names)
        if "error" in doc:
            # controller place: no node can take it; filter keeps none, prioritize scores none.
            assert doc["error"]["code"] == "unsatisfiable", doc
            assert passing == [] and set(scores.values()) == {0}
            continue
        key = "node" if policy == "place" else "name"
        fits = [n[key] for n in doc["nodes"] if n["fits"]]
        assert sorted(passing) == sorted(fits)
        chosen = doc["chosen"][0] if policy == "hccs" else doc["chosen"]
        assert scores[chosen] == 10
        assert all(scores[n] == 0 for n in names if n not in fits)
        assert all(scores[n] >= 1 for n in fits)
        # Skipped nodes (not that policy's hardware) fail as unresolvable, with the policy's reason.
        for s in doc["skipped"]:
            assert s["reason"] in answer["FailedAndUnresolvableNodes"][s["name"]]


def test_the_fleet_holds_each_kind_of_node(fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cases above are not vacuous: each policy finds its own node in this fleet."""
    assert controller_place(fleet, "hccs", {"request": 8}, tmp_path, capsys)["chosen"] == ["ascend-910"]
    assert controller_place(fleet, "xpu", {"request": 8}, tmp_path, capsys)["chosen"] == "kunlun-p800"
    doc = controller_place(fleet, "place", {"cpus": 4, "gpus": 1, "memory_gb": 8}, tmp_path, capsys)
    assert doc["chosen"] == "grace-hopper"
