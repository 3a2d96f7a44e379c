"""The NVIDIA probe (NVML + numa_status) against synthesized GH200/GB200 hosts, hwloc's real
numa_status capture, and fakes of pynvml for every NVML failure (no GPU or driver here).

The synthesized hosts' layouts come from the sources their READMEs cite; the expected facts below are
written from those sources (node numbering, SLIT rule, GPU↔Grace placement), not from probe output.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.cpulist import parse_cpulist
from memtopo.discovery import nvidia, presence, probes
from memtopo.discovery.nvidia import (
    NumaStatus,
    attribute_mig_placeholders,
    is_superchip_model,
    nvlink_topology,
    parse_numa_status,
)
from memtopo.discovery.nvml import CALLS, NvidiaParseError, NvLinkPeer
from memtopo.discovery.nvml_live import PynvmlApi
from memtopo.discovery.nvml_replay import parse_nvml_replay
from memtopo.discovery.parts import AccelDevice, AcceleratorPart, AccelLink, SysNode, SysNuma
from memtopo.discovery.source import ProbeContext, ProbeResult, State
from memtopo.pci import normalize_bdf
from tests.fixtures import extracted, hwloc_root
from tests.strategies import json_like
from tests.synth import fixture_files, load_module, tree
from tests.sysfs_tree import Link, write_tree

FIXTURES = Path(__file__).parents[1] / "fixtures"
HOSTS = ("gh200", "gh200-quad", "gb200-tray")


# The layout module the three hosts are built from (also what their host.py load).
grace = load_module(FIXTURES / "gh200" / "grace.py", "memtopo_fixture_grace")


# Extracted once and cached across runs (tests.fixtures.extracted): tests that change files copy them.
@pytest.fixture(scope="module")
def roots() -> dict[str, Path]:
    return {name: extracted(FIXTURES / name / "root.tar.gz") for name in HOSTS}


def run(root: Path, **kw: Any) -> ProbeResult[AcceleratorPart]:
    api = kw.pop("api", None)
    result: ProbeResult[AcceleratorPart] = probes.run_alone(nvidia.SOURCE, ProbeContext.at_root(root, **kw), api=api)
    return result


def replay_doc(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / name / "nvml.json").read_text())
    return doc


def copy_root(root: Path, dest: Path) -> Path:
    shutil.copytree(root, dest, symlinks=True)
    return dest


# ---- the synthesized hosts -------------------------------------------------------------------------------
def test_fixture_files_are_what_the_layout_builds() -> None:
    for name in HOSTS:
        assert (FIXTURES / name / "nvml.json").read_text() == grace.nvml_text(name), f"regenerate {name}/nvml.json"


def test_gh200(roots: dict[str, Path]) -> None:
    res = run(roots["gh200"])
    assert res.status.state is State.OK, res.status.reasons
    (gpu,) = res.data.devices
    assert (gpu.kind, gpu.vendor, gpu.index, gpu.model) == ("GPU", "NVIDIA", 0, "NVIDIA GH200 480GB")
    assert gpu.bdf == "0009:01:00.0"  # NVML says 00000009:01:00.0
    assert gpu.uuid.startswith("GPU-")
    assert gpu.memory_bytes == 97871 << 20
    # Grace node 0 holds CPUs 0-71; node 1 holds the HBM; 2-8 are the firmware's MIG placeholders.
    assert gpu.numa_node == 0
    assert gpu.local_cpus == tuple(range(72))
    assert gpu.memory_numa_nodes == (1,)
    assert gpu.unified_memory
    assert gpu.attributes == {
        "c2c_mode": "enabled", "c2c_link_count": "10", "c2c_bandwidth_mbps": "450000",
        "addressing_mode": "ATS", "mig_mode": "disabled", "numa_status": "online", "cdmm": "false",
        "mig_placeholder_nodes": "2-8",
    }
    assert res.data.links == () and res.data.groups == ()


def test_gh200_quad(roots: dict[str, Path]) -> None:
    root = roots["gh200-quad"]
    # The tree carries the real 4×GH200 SLIT (numactl/numactl#224, row 0 as printed there).
    row0 = (root / "sys/devices/system/node/node0/distance").read_text().split()
    assert row0 == ["10", "40", "40", "40"] + ["80"] * 8 + ["120"] * 24
    row4 = (root / "sys/devices/system/node/node4/distance").read_text().split()
    assert row4[:6] == ["80", "120", "120", "120", "10", "255"]
    res = run(root)
    assert res.status.state is State.OK, res.status.reasons
    assert [d.index for d in res.data.devices] == [0, 1, 2, 3]
    for k, gpu in enumerate(res.data.devices):
        mem = 4 + 8 * k  # GPU nodes start at 4, 8 per GPU (mlperf-common#16)
        assert gpu.numa_node == k
        assert gpu.local_cpus == tuple(range(72 * k, 72 * k + 72))
        assert gpu.memory_numa_nodes == (mem,)
        assert gpu.attributes["mig_placeholder_nodes"] == f"{mem + 1}-{mem + 7}"
        assert gpu.unified_memory and gpu.attributes["cdmm"] == "false"
    assert res.data.links == tuple(AccelLink(a, b, "NV", 6) for a in range(4) for b in range(a + 1, 4))
    assert res.data.groups == ((0, 1, 2, 3),)


def test_gb200_tray(roots: dict[str, Path]) -> None:
    res = run(roots["gb200-tray"])
    assert res.status.state is State.OK, res.status.reasons
    devices = res.data.devices
    # srt-slurm#164: GPUs 0,1 on Grace node 0 (CPUs 0-71), 2,3 on node 1; vllm#39361: nodes 2, 10, 18, 26.
    assert [d.numa_node for d in devices] == [0, 0, 1, 1]
    assert [d.local_cpus for d in devices] == [tuple(range(72))] * 2 + [tuple(range(72, 144))] * 2
    assert [d.memory_numa_nodes for d in devices] == [(2,), (10,), (18,), (26,)]
    assert [d.attributes["mig_placeholder_nodes"] for d in devices] == ["3-9", "11-17", "19-25", "27-33"]
    assert all(d.unified_memory and d.model == "NVIDIA GB200" for d in devices)
    # All 18 links of each GPU go to NVSwitches: every pair NV18, one island.
    assert res.data.links == tuple(AccelLink(a, b, "NV", 18) for a in range(4) for b in range(a + 1, 4))
    assert res.data.groups == ((0, 1, 2, 3),)


@pytest.mark.parametrize("name", ["gh200", "gb200-tray"])
def test_cdmm_variant(name: str, tmp_path: Path) -> None:
    """CDMM: C2C on, the driver keeps the HBM — no GPU node online, no numa_status, NumaNodeId unsupported."""
    host = grace.host(name, cdmm=True)
    root = write_tree(tmp_path, {k: Link(v[3:]) if v.startswith("-> ") else v for k, v in tree(host).items()})
    (root / ".memtopo").mkdir()
    (root / ".memtopo/nvml.json").write_text(grace.nvml_text(name, cdmm=True))
    res = run(root)
    assert res.status.state is State.OK, res.status.reasons
    for gpu in res.data.devices:
        assert gpu.unified_memory, "still a coherent superchip"
        assert gpu.memory_numa_nodes == ()
        assert gpu.attributes["cdmm"] == "true"
        assert gpu.attributes["c2c_mode"] == "enabled"
        assert "mig_placeholder_nodes" not in gpu.attributes  # no memory node to attribute them to
        assert "numa_status" not in gpu.attributes


def test_hwloc_capture_without_nvml_uses_numa_status() -> None:
    """hwloc's real POWER9 capture: numa_status only (no NVML recording). INDEX.md's mapping."""
    res = run(hwloc_root("nvidiagpunumanodes"))
    assert res.status.state is State.DEGRADED
    assert any("captured root without an NVML recording" in r for r in res.status.reasons)
    want = {"0006:00:00.0": 253, "0004:06:00.0": 254, "0004:05:00.0": 255,
            "0035:05:00.0": 250, "0035:04:00.0": 251, "0007:00:00.0": 252}
    assert {d.bdf: d.memory_numa_nodes for d in res.data.devices} == {b: (n,) for b, n in want.items()}
    assert [d.index for d in res.data.devices] == list(range(6))
    assert [d.bdf for d in res.data.devices] == sorted(want)  # PCI order
    for d in res.data.devices:
        assert d.memory_bytes == 0x3F0000000  # numa_status Size
        assert d.attributes["index_source"] == "pci_order"
        assert not d.unified_memory and d.model == ""
        assert "mig_placeholder_nodes" not in d.attributes  # no empty nodes after 250-255


def test_live_host_without_nvidia() -> None:
    if Path("/proc/driver/nvidia/gpus").exists():
        pytest.skip("this host has NVIDIA GPUs")
    res = nvidia.probe(ProbeContext.live())
    assert res.status.state is State.UNAVAILABLE
    assert res.data == AcceleratorPart()
    assert "nvmlInit" in res.status.reasons[0] or "import pynvml" in res.status.reasons[0]


# ---- a fake pynvml (the real binding's shapes, no GPU) ------------------------------------------------
_CODES = {"InvalidArgument": 2, "NotSupported": 3, "DriverNotLoaded": 9, "LibraryNotFound": 12,
          "FunctionNotFound": 13, "GpuIsLost": 15, "Unknown": 999}


def fake_pynvml(doc: Mapping[str, Any], raise_on: Mapping[str, str | type[Exception]] | None = None,
                missing: tuple[str, ...] = (), field_return: int = 0,
                override: Mapping[str, Callable[..., Any]] | None = None) -> SimpleNamespace:
    """A pynvml look-alike answering from a replay document: ctypes-like structs, bytes bus ids,
    64-bit affinity words, and the NVMLError_<Name> class family built the way pynvml builds it."""

    class NVMLError(Exception):
        def __init__(self, value: int = 0) -> None:
            super().__init__(value)
            self.value = value

    classes = {code: type(f"NVMLError_{name}", (NVMLError,), {}) for name, code in _CODES.items()}
    raise_on = raise_on or {}
    devs = doc["devices"]

    def answer(h: int, key: str) -> Any:
        value = devs[h][key]
        if isinstance(value, dict) and "error" in value:
            raise classes[_CODES[value["error"]]](_CODES[value["error"]])
        return value

    def words(ids: tuple[int, ...] | list[int], size: int) -> list[int]:
        out = [0] * size
        for i in ids:
            if i // 64 < size:
                out[i // 64] |= 1 << (i % 64)
        return out

    def fields(h: int, ids: list[int | tuple[int, int]]) -> list[SimpleNamespace]:
        links = answer(h, "c2c_links")
        out = []
        for fid in ids:
            field_id, scope = fid if isinstance(fid, tuple) else (fid, 0)
            value = {170: len(links), 171: int(links[scope]["active"]) if scope < len(links) else 0,
                     172: links[scope]["max_bw_mbps"] if scope < len(links) else 0}[field_id]
            out.append(SimpleNamespace(nvmlReturn=field_return, valueType=1, value=SimpleNamespace(uiVal=value)))
        return out

    def link(h: int, n: int) -> Any:
        links = answer(h, "nvlinks")
        if n >= len(links):
            raise classes[2](2)
        return links[n]

    funcs: dict[str, Callable[..., Any]] = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: len(devs),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: answer(h, "name"),
        "nvmlDeviceGetUUID": lambda h: answer(h, "uuid"),
        "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=answer(h, "pci_bus_id").encode()),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=answer(h, "memory_total"), free=0, used=0),
        "nvmlDeviceGetNumaNodeId": lambda h: answer(h, "numa_node_id"),
        "nvmlDeviceGetMemoryAffinity": lambda h, size, scope: words(answer(h, "memory_affinity"), size),
        "nvmlDeviceGetCpuAffinityWithinScope":
            lambda h, size, scope: words(parse_cpulist(answer(h, "cpu_affinity")), size),
        "nvmlDeviceGetCpuAffinity": lambda h, size: words(parse_cpulist(answer(h, "cpu_affinity")), size),
        "nvmlDeviceGetC2cModeInfoV": lambda h: SimpleNamespace(isC2cEnabled=int(answer(h, "c2c_enabled"))),
        "nvmlDeviceGetFieldValues": fields,
        "nvmlDeviceGetAddressingMode": lambda h: answer(h, "addressing_mode"),
        "nvmlDeviceGetMigMode": lambda h: list(answer(h, "mig_mode")),
        "nvmlDeviceGetNvLinkState": lambda h, n: 0 if link(h, n) is None else 1,
        "nvmlDeviceGetNvLinkRemotePciInfo": lambda h, n: SimpleNamespace(busId=link(h, n)["remote"].encode()),
        "nvmlDeviceGetNvLinkRemoteDeviceType": lambda h, n: {"GPU": 0, "SWITCH": 2}[link(h, n)["type"]],
        "nvmlExceptionClass": lambda code: classes[code],
        **(override or {}),
    }

    def guarded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            err = raise_on.get(name)
            if isinstance(err, str):
                raise classes[_CODES[err]](_CODES[err])
            if err is not None:
                raise err("binding bug")
            return fn(*args)
        return call

    module = SimpleNamespace(**{k: guarded(k, f) for k, f in funcs.items() if k not in missing})
    module.NVMLError = NVMLError
    module.NVML_AFFINITY_SCOPE_NODE = 0
    module.NVML_FI_DEV_C2C_LINK_COUNT, module.NVML_FI_DEV_C2C_LINK_GET_STATUS = 170, 171
    module.NVML_FI_DEV_C2C_LINK_GET_MAX_BW = 172
    module.NVML_NVLINK_MAX_LINKS = 36
    return module


def pynvml_api(name: str, **kw: Any) -> PynvmlApi:
    module = fake_pynvml(replay_doc(name), **kw)
    return PynvmlApi(loader=lambda: module)


@pytest.mark.parametrize("name", HOSTS)
def test_pynvml_and_replay_agree(name: str, roots: dict[str, Path]) -> None:
    """The real-binding path (bytes bus ids, 64-bit affinity words over 288 CPUs, field values with
    scopes, per-link NVLink calls) gives exactly what the replay gives."""
    replayed = run(roots[name])
    live = run(roots[name], api=pynvml_api(name))
    assert live.status.state is State.OK, live.status.reasons
    assert live.data == replayed.data


def test_pynvml_without_remote_device_type_still_finds_gpu_peers(roots: dict[str, Path]) -> None:
    res = run(roots["gh200-quad"], api=pynvml_api("gh200-quad", raise_on={
        "nvmlDeviceGetNvLinkRemoteDeviceType": "FunctionNotFound"}))
    assert res.status.state is State.OK  # the bus id matches a GPU of this host
    assert len(res.data.links) == 6 and {link.count for link in res.data.links} == {6}


# ---- fault table -------------------------------------------------------------------------------------------
def _gh200_from_procfs_only(part: AcceleratorPart) -> None:
    (gpu,) = part.devices
    assert (gpu.bdf, gpu.memory_numa_nodes, gpu.model) == ("0009:01:00.0", (1,), "")
    assert gpu.memory_bytes == 95 << 30 and gpu.attributes["memory_source"] == "numa_status"
    assert gpu.attributes["mig_placeholder_nodes"] == "2-8"
    assert not gpu.unified_memory  # neither the model nor C2C is known without NVML


def _gh200_full_except(*missing_attrs: str, unified: bool = True) -> Callable[[AcceleratorPart], None]:
    def check(part: AcceleratorPart) -> None:
        (gpu,) = part.devices
        assert gpu.model == "NVIDIA GH200 480GB" and gpu.bdf == "0009:01:00.0"
        assert gpu.uuid.startswith("GPU-") and gpu.local_cpus == tuple(range(72)) and gpu.numa_node == 0
        assert gpu.memory_numa_nodes == (1,) and gpu.attributes["mig_placeholder_nodes"] == "2-8"
        assert gpu.unified_memory is unified
        for attr in missing_attrs:
            assert attr not in gpu.attributes
    return check


def _memory_from_numa_status(part: AcceleratorPart) -> None:
    _gh200_full_except()(part)
    (gpu,) = part.devices
    assert gpu.memory_bytes == 95 << 30 and gpu.attributes["memory_source"] == "numa_status"


def _mig_unsupported(part: AcceleratorPart) -> None:
    _gh200_full_except()(part)
    assert part.devices[0].attributes["mig_mode"] == "unsupported"


def _no_bus_id(part: AcceleratorPart) -> None:
    (gpu,) = part.devices  # numa_status cannot be matched, and is not added as a second GPU
    assert gpu.bdf == "" and gpu.model == "NVIDIA GH200 480GB" and gpu.memory_numa_nodes == (1,)


def _handle_lost(part: AcceleratorPart) -> None:
    (gpu,) = part.devices  # the procfs GPU is not added a second time
    assert gpu.index == 0 and gpu.bdf == "" and gpu.model == ""


FAULTS: list[tuple[str, dict[str, Any], State, str, Callable[[AcceleratorPart], None]]] = [
    ("library missing", {"raise_on": {"nvmlInit": "LibraryNotFound"}},
     State.DEGRADED, "nvmlInit: LibraryNotFound", _gh200_from_procfs_only),
    ("driver not loaded", {"raise_on": {"nvmlInit": "DriverNotLoaded"}},
     State.DEGRADED, "nvmlInit: DriverNotLoaded", _gh200_from_procfs_only),
    ("driver gone after init", {"raise_on": {"nvmlDeviceGetCount": "DriverNotLoaded"}},
     State.DEGRADED, "nvmlDeviceGetCount: DriverNotLoaded", _gh200_from_procfs_only),
    ("function not found", {"raise_on": {"nvmlDeviceGetC2cModeInfoV": "FunctionNotFound"}},
     State.DEGRADED, "GPU 0: nvmlDeviceGetC2cModeInfoV: FunctionNotFound",
     _gh200_full_except("c2c_mode", "c2c_link_count", "cdmm", unified=False)),
    ("function absent from the binding", {"missing": ("nvmlDeviceGetAddressingMode",)},
     State.DEGRADED, "GPU 0: nvmlDeviceGetAddressingMode: FunctionNotFound", _gh200_full_except("addressing_mode")),
    ("not supported (a fault)", {"raise_on": {"nvmlDeviceGetMemoryInfo": "NotSupported"}},
     State.DEGRADED, "GPU 0: nvmlDeviceGetMemoryInfo: NotSupported", _memory_from_numa_status),
    ("not supported (an answer)", {"raise_on": {"nvmlDeviceGetMigMode": "NotSupported"}},
     State.OK, "", _mig_unsupported),
    ("old driver without the scoped CPU affinity", {"missing": ("nvmlDeviceGetCpuAffinityWithinScope",)},
     State.OK, "", _gh200_full_except()),
    ("GPU lost", {"raise_on": {"nvmlDeviceGetHandleByIndex": "GpuIsLost"}},
     State.DEGRADED, "GPU 0: nvmlDeviceGetHandleByIndex: GpuIsLost", _handle_lost),
    ("field value error", {"field_return": 999},
     State.DEGRADED, "GPU 0: nvmlDeviceGetFieldValues: Unknown", _gh200_full_except("c2c_link_count")),
    ("struct without the field", {"override": {"nvmlDeviceGetPciInfo": lambda h: SimpleNamespace()}},
     State.DEGRADED, "GPU 0: nvmlDeviceGetPciInfo: AttributeError", _no_bus_id),
    ("short field value array", {"override": {"nvmlDeviceGetFieldValues": lambda h, ids: []}},
     State.DEGRADED, "GPU 0: nvmlDeviceGetFieldValues: ValueError", _gh200_full_except("c2c_link_count")),
    ("binding bug", {"raise_on": {"nvmlDeviceGetUUID": TypeError}},
     State.DEGRADED, "GPU 0: nvmlDeviceGetUUID: TypeError", lambda p: None),
]


@pytest.mark.parametrize(("case", "fault", "state", "reason", "check"), FAULTS, ids=[f[0] for f in FAULTS])
def test_nvml_fault_table(case: str, fault: dict[str, Any], state: State, reason: str,
                          check: Callable[[AcceleratorPart], None], roots: dict[str, Path]) -> None:
    res = run(roots["gh200"], api=pynvml_api("gh200", **fault))
    assert res.status.state is state, res.status.reasons
    if reason:
        assert any(reason in r for r in res.status.reasons), res.status.reasons
    check(res.data)


def test_nvidia_ml_py_not_installed(roots: dict[str, Path]) -> None:
    def loader() -> Any:
        raise ModuleNotFoundError("No module named 'pynvml'")
    res = run(roots["gh200"], api=PynvmlApi(loader=loader))
    assert res.status.state is State.DEGRADED
    assert any("LibraryNotFound (nvidia-ml-py is not installed)" in r for r in res.status.reasons)
    _gh200_from_procfs_only(res.data)


@pytest.mark.parametrize("error", ["LibraryNotFound", "DriverNotLoaded"])
def test_no_library_and_no_procfs_is_unavailable(error: str, tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"sys/devices/system/node/online": "0"})
    res = run(root, api=pynvml_api("gh200", raise_on={"nvmlInit": error}))
    assert res.status.state is State.UNAVAILABLE
    assert res.status.reasons == (f"no NVIDIA GPUs in {presence.PROC_GPUS} and NVML: nvmlInit: {error}",)
    assert res.data == AcceleratorPart()


def test_nvml_with_zero_devices_is_unavailable(tmp_path: Path) -> None:
    empty = PynvmlApi(loader=lambda: fake_pynvml({"devices": []}))
    res = run(write_tree(tmp_path, {"proc/version": "Linux"}), api=empty)
    assert res.status.state is State.UNAVAILABLE
    assert res.status.reasons == ("no NVIDIA GPUs (NVML reports 0 devices)",)


def test_gpu_in_procfs_but_not_in_nvml(roots: dict[str, Path]) -> None:
    res = run(roots["gh200"], api=PynvmlApi(loader=lambda: fake_pynvml({"devices": []})))
    assert res.status.state is State.DEGRADED
    assert res.status.reasons == (f"GPU 0009:01:00.0 is in {presence.PROC_GPUS} but not in NVML",)
    _gh200_from_procfs_only(res.data)


def test_nvml_and_numa_status_disagree(roots: dict[str, Path]) -> None:
    doc = replay_doc("gh200")
    doc["devices"][0]["numa_node_id"] = 3
    res = run(roots["gh200"], api=PynvmlApi(loader=lambda: fake_pynvml(doc)))
    assert res.status.state is State.DEGRADED
    assert res.status.reasons == ("GPU 0: NVML puts its memory on node 3, numa_status on node 1",)
    assert res.data.devices[0].memory_numa_nodes == (1, 3)


# ---- replay faults ------------------------------------------------------------------------------------------
def _with_replay(root: Path, tmp_path: Path, text: str) -> ProbeResult[AcceleratorPart]:
    path = tmp_path / "nvml.json"
    path.write_text(text)
    return run(root, nvml_replay=path)


REPLAY_FAULTS: list[tuple[str, Callable[[dict[str, Any]], Any], State, str]] = [
    ("init error", lambda d: d.update(nvmlInit={"error": "DriverNotLoaded"}),
     State.DEGRADED, "NVML: nvmlInit: DriverNotLoaded; GPUs from proc/driver/nvidia/gpus only"),
    ("count error", lambda d: d.update(devices={"error": "Unknown"}), State.DEGRADED, "nvmlDeviceGetCount: Unknown"),
    ("answer not recorded", lambda d: d["devices"][0].pop("uuid"),
     State.DEGRADED, "GPU 0: nvmlDeviceGetUUID: NotRecorded"),
    ("wrong type", lambda d: d["devices"][0].update(memory_total="96GB"),
     State.DEGRADED, 'GPU 0: nvmlDeviceGetMemoryInfo: BadRecording (expected an integer >= 0, got "96GB")'),
    ("bad error name", lambda d: d["devices"][0].update(name={"error": "no such; thing"}),
     State.DEGRADED, "GPU 0: nvmlDeviceGetName: BadRecording"),
    ("device not an object", lambda d: d.update(devices=[7]),
     State.DEGRADED, "GPU 0: nvmlDeviceGetHandleByIndex: BadRecording"),
]


@pytest.mark.parametrize(("case", "edit", "state", "reason"), REPLAY_FAULTS, ids=[f[0] for f in REPLAY_FAULTS])
def test_replay_fault_table(case: str, edit: Callable[[dict[str, Any]], Any], state: State, reason: str,
                            roots: dict[str, Path], tmp_path: Path) -> None:
    doc = replay_doc("gh200")
    edit(doc)
    res = _with_replay(roots["gh200"], tmp_path, json.dumps(doc))
    assert res.status.state is state
    assert any(reason in r for r in res.status.reasons), res.status.reasons
    assert res.data.devices and res.data.devices[0].index == 0  # the rest is still reported


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", '{"devices": 5}', '{"nvmlInit": 1, "devices": []}',
                                  "[" * 100_000, '{"format": "x"}'])
def test_garbage_replay_degrades(text: str, roots: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(NvidiaParseError):
        parse_nvml_replay(text)
    res = _with_replay(roots["gh200"], tmp_path, text)
    assert res.status.state is State.DEGRADED
    assert any(r.startswith("nvml.json: ") for r in res.status.reasons), res.status.reasons
    _gh200_from_procfs_only(res.data)


_JSON = json_like(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                  st.text(max_size=8), max_leaves=20)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_JSON | st.fixed_dictionaries({"devices": st.lists(_JSON, max_size=3)}), raw=st.text(max_size=40))
def test_replay_never_raises(doc: Any, raw: str, roots: dict[str, Path], tmp_path: Path) -> None:
    for text in (json.dumps(doc), raw):
        res = _with_replay(roots["gh200"], tmp_path, text)  # must not raise
        assert res.status.state is State.DEGRADED  # nothing garbage can match the procfs GPU fully
        assert res.data.devices


_STRING_KEYS = ("name", "uuid", "pci_bus_id", "cpu_affinity")
_INT_KEYS = ("memory_total", "numa_node_id", "addressing_mode")
_not_str = st.one_of(st.integers(), st.booleans(), st.none(), st.lists(st.integers(), max_size=2))
_not_int = st.one_of(st.text(max_size=5), st.booleans(), st.floats(allow_nan=False), st.integers(max_value=-2),
                     st.none())
_bad_item = st.one_of(st.integers(), st.text(max_size=2), st.booleans())
_WRONG: dict[str, st.SearchStrategy[Any]] = {
    **dict.fromkeys(_STRING_KEYS, _not_str),
    **dict.fromkeys(_INT_KEYS, _not_int),
    "c2c_enabled": st.one_of(st.integers(), st.text(max_size=3), st.none()),
    "memory_affinity": st.one_of(st.integers(), st.text(max_size=3),
                                 st.lists(st.one_of(st.text(max_size=2), st.integers(max_value=-1), st.booleans()),
                                          min_size=1, max_size=3)),
    "c2c_links": st.one_of(st.integers(), st.text(max_size=3),
                           st.lists(_bad_item | st.just({"active": "yes"}), min_size=1, max_size=3)),
    "mig_mode": st.one_of(st.integers(), st.lists(st.integers(min_value=0), min_size=3, max_size=4),
                          st.lists(st.text(max_size=2), min_size=2, max_size=2)),
    "nvlinks": st.one_of(st.integers(), st.text(max_size=3),
                         st.lists(_bad_item | st.just({"remote": 5}), min_size=1, max_size=3)),
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), key=st.sampled_from(sorted(_WRONG)))
def test_every_wrong_answer_degrades_naming_its_call(data: st.DataObject, key: str, roots: dict[str, Path],
                                                     tmp_path: Path) -> None:
    doc = replay_doc("gh200")
    doc["devices"][0][key] = data.draw(_WRONG[key])
    res = _with_replay(roots["gh200"], tmp_path, json.dumps(doc))
    assert res.status.state is State.DEGRADED
    assert any(f"GPU 0: {CALLS[key]}: BadRecording" in r for r in res.status.reasons), res.status.reasons
    assert res.data.devices[0].memory_numa_nodes == (1,)  # numa_status still counts


# ---- numa_status ---------------------------------------------------------------------------------------------
def test_numa_status_real_files() -> None:
    base = hwloc_root("nvidiagpunumanodes") / presence.PROC_GPUS
    got = parse_numa_status((base / "0035:05:00.0" / "numa_status").read_text())
    assert got == NumaStatus(250, "online", 0x40000000000, 0x3F0000000)
    assert got.online_node == 250


@pytest.mark.parametrize(("text", "want"), [
    ("Node:      -1\nStatus:    disabled\n", NumaStatus(None, "disabled")),
    ("Node:      4\nStatus:    offline\n", NumaStatus(4, "offline")),  # not initialised: no Address/Size
    ("Node: 2\nStatus: online_failed\nAddress: 0\nSize: 0\n", NumaStatus(2, "online_failed", 0, 0)),
    ("Node:      1\nStatus:    online\nAddress:   400000000000\nSize:      17c0000000\n\0",
     NumaStatus(1, "online", 0x400000000000, 95 << 30)),
])
def test_numa_status_states(text: str, want: NumaStatus) -> None:
    assert parse_numa_status(text) == want
    assert (want.online_node is not None) == (want.status == "online")


@pytest.mark.parametrize("text", [
    "", "Node: 1\n", "Status: online\n", "Node: x\nStatus: online", "Node: -2\nStatus: online",
    "Node: 1\nStatus: on line", "Node: 1\nNode: 2\nStatus: a", "Node: 1\nStatus: online\nSize: 0x10",
    "Node: 1\nStatus: online\nSize: 1ffffffffffffffff", "garbage", "Node: ١\nStatus: online",
])
def test_numa_status_garbage(text: str) -> None:
    with pytest.raises(NvidiaParseError):
        parse_numa_status(text)


@given(st.text(max_size=120))
def test_numa_status_parser_never_raises_anything_else(text: str) -> None:
    try:
        got = parse_numa_status(text)
    except NvidiaParseError:
        return
    assert got.status and (got.node is None or got.node >= 0)


_STATES = st.sampled_from(["disabled", "offline", "online_in_progress", "online", "online_failed",
                           "offline_in_progress", "offline_failed", "invalid"])


@given(node=st.integers(-1, 65535), status=_STATES, addr=st.none() | st.integers(0, (1 << 64) - 1),
       size=st.none() | st.integers(0, (1 << 64) - 1))
def test_numa_status_round_trip(node: int, status: str, addr: int | None, size: int | None) -> None:
    text = f"Node:      {node}\nStatus:    {status}\n"
    text += f"Address:   {addr:x}\n" if addr is not None else ""
    text += f"Size:      {size:x}\n" if size is not None else ""
    assert parse_numa_status(text) == NumaStatus(None if node < 0 else node, status, addr, size)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(max_size=80))
def test_garbage_numa_status_degrades(garbage: bytes, roots: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "root"
    if not root.exists():
        copy_root(roots["gh200"], root)
    rel = f"{presence.PROC_GPUS}/0009:01:00.0/numa_status"
    (root / rel).write_bytes(garbage)
    res = run(root)
    try:
        parse_numa_status(garbage.decode("utf-8"))
        parsed = True
    except (UnicodeDecodeError, NvidiaParseError):
        parsed = False
    if not parsed:
        assert res.status.state is State.DEGRADED
        assert any(rel in r for r in res.status.reasons), res.status.reasons
        (gpu,) = res.data.devices  # NVML's answers still stand
        assert gpu.memory_numa_nodes == (1,) and gpu.unified_memory


# ---- pieces -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "want"), [
    ("00000009:01:00.0", "0009:01:00.0"), ("0000:C1:00.0", "0000:c1:00.0"), ("10000:00:04.0", "10000:00:04.0"),
    ("00000000:C1:00.0\0", "0000:c1:00.0"), ("", None), ("C1:00.0", "0000:c1:00.0"), ("0000:c1:00.8", None),
])
def test_normalize_bdf(text: str, want: str | None) -> None:
    assert normalize_bdf(text) == want


@given(st.text(max_size=30))
def test_normalize_bdf_never_raises(text: str) -> None:
    got = normalize_bdf(text)
    assert got is None or normalize_bdf(got) == got


@pytest.mark.parametrize(("model", "want"), [
    ("NVIDIA GH200 480GB", True), ("NVIDIA GH200 144G HBM3e", True), ("NVIDIA GB200", True),
    ("NVIDIA GB300", True), ("NVIDIA GB10", True), ("NVIDIA H100 80GB HBM3", False),
    ("NVIDIA A100-SXM4-80GB", False), ("Tesla V100-SXM2-16GB", False), ("NVIDIA B200", False), ("", False),
])
def test_superchip_models(model: str, want: bool) -> None:
    assert is_superchip_model(model) is want


def _numa(rows: dict[int, tuple[tuple[int, ...], int, tuple[int, ...]]]) -> SysNuma:
    """node → (cpus, memory, SLIT row over all nodes in id order)."""
    nodes = tuple(SysNode(nid, cpus, mem, mem, row) for nid, (cpus, mem, row) in sorted(rows.items()))
    ids = tuple(sorted(rows))
    return SysNuma(ids, ids, None, None, None, None, nodes, ids, (), (), ())


def test_placeholders_stop_at_a_cpu_node_and_need_a_single_nearest_cpu_node() -> None:
    # node 0, 3: CPUs; 1: GPU memory near 0; 2: empty near 0; 4: empty near 3; 5: empty, equally near both.
    numa = _numa({
        0: ((0,), 1, (10, 80, 80, 40, 120, 90)),
        1: ((), 1, (80, 10, 255, 120, 255, 255)),
        2: ((), 0, (80, 255, 10, 120, 255, 255)),
        3: ((1,), 1, (40, 120, 120, 10, 80, 90)),
        4: ((), 0, (120, 255, 255, 80, 10, 255)),
        5: ((), 0, (90, 255, 255, 90, 255, 10)),
    })
    assert attribute_mig_placeholders(numa, {0: 1}) == {0: (2,)}  # stops at node 3 (CPUs)
    assert attribute_mig_placeholders(numa, {0: 5}) == {0: ()}  # tie between nodes 0 and 3: no guess
    flat = _numa({0: ((0,), 1, ()), 1: ((), 1, ()), 2: ((), 0, ())})  # no SLIT at all
    assert attribute_mig_placeholders(flat, {0: 1}) == {0: ()}


def test_placeholders_skip_nodes_with_memory_and_stop_at_the_next_gpu() -> None:
    numa = _numa({
        0: ((0,), 1, (10, 80, 80, 80, 80)),
        1: ((), 1, (80, 10, 255, 255, 255)),
        2: ((), 5, (80, 255, 10, 255, 255)),  # a MIG instance's memory onlined: not an empty placeholder
        3: ((), 0, (80, 255, 255, 10, 255)),
        4: ((), 1, (80, 255, 255, 255, 10)),  # the next GPU's memory
    })
    assert attribute_mig_placeholders(numa, {0: 1, 1: 4}) == {0: (3,), 1: ()}


def test_nvlink_topology_direct_and_switched() -> None:
    bdfs = {0: "0000:01:00.0", 1: "0000:02:00.0", 2: "0000:03:00.0", 3: "0000:04:00.0"}
    sw = NvLinkPeer("", "SWITCH")
    peers: dict[int, list[NvLinkPeer | None]] = {
        0: [NvLinkPeer("0000:02:00.0", "GPU")] * 2 + [None],
        1: [NvLinkPeer("0000:01:00.0", "")],  # one end sees fewer: the larger count wins
        2: [sw] * 4,
        3: [sw, sw, NvLinkPeer("0000:09:00.0", "GPU"), NvLinkPeer("", "IBMNPU")],  # unknown peer, CPU link
    }
    links, groups = nvlink_topology(bdfs, peers)
    assert links == (AccelLink(0, 1, "NV", 2), AccelLink(2, 3, "NV", 2))
    assert groups == ((0, 1), (2, 3))


def test_cdmm_tree_differs_only_where_the_notes_say() -> None:
    """The CDMM tree differs from the NUMA-mode one only where CDMM changes the host: the driver keeps
    GPU memory to itself, so there is no numa_status and no memory on the HBM node."""
    numa_mode = fixture_files(FIXTURES / "gh200")
    cdmm = tree(grace.host("gh200", cdmm=True))
    only_numa = set(numa_mode) - set(cdmm)
    assert {p for p in only_numa if not p.startswith(".memtopo/")} == {
        f"{presence.PROC_GPUS}/0009:01:00.0/numa_status"}
    assert cdmm["sys/devices/system/node/has_memory"] == "0"
    assert numa_mode["sys/devices/system/node/has_memory"] == "0-1"


def test_accel_device_shape_is_complete(roots: dict[str, Path]) -> None:
    """Every device field the parts docstring defines for NVIDIA is filled from NVML on a full host."""
    (gpu,) = run(roots["gh200"]).data.devices
    empty = AccelDevice(kind="GPU", vendor="NVIDIA", index=0)
    unfilled = [f for f in ("model", "uuid", "bdf", "memory_bytes", "numa_node", "local_cpus",
                            "memory_numa_nodes", "unified_memory", "attributes")
                if getattr(gpu, f) == getattr(empty, f)]
    assert unfilled == []
    assert gpu.health == ""  # NVML has no cheap health summary; left unknown
