"""NVML answers replayed from a recording.

**NVML replay** (``.memtopo/nvml.json`` in a captured root, ``ProbeContext.nvml_replay``), one JSON
object; keys are :class:`NvmlApi` methods, comments name the NVML call recorded::

    {
      "format": "memtopo.nvml/1",                 # optional, informative
      "nvmlInit": {"error": "DriverNotLoaded"},   # optional; absent or null: init succeeds
      "devices": [                                # nvmlDeviceGetCount = its length
        {
          "handle": {"error": "GpuIsLost"},       # optional: nvmlDeviceGetHandleByIndex fails
          "name": "NVIDIA GH200 480GB",           # nvmlDeviceGetName
          "uuid": "GPU-…",                        # nvmlDeviceGetUUID
          "pci_bus_id": "00000009:01:00.0",       # nvmlDeviceGetPciInfo().busId
          "memory_total": 102625181696,           # nvmlDeviceGetMemoryInfo().total, bytes
          "numa_node_id": 1,                      # nvmlDeviceGetNumaNodeId
          "memory_affinity": [0],                 # nvmlDeviceGetMemoryAffinity(scope NODE), node ids
          "cpu_affinity": "0-71",                 # nvmlDeviceGetCpuAffinityWithinScope(NODE), cpulist
          "c2c_enabled": true,                    # nvmlDeviceGetC2cModeInfoV().isC2cEnabled
          "c2c_links": [{"active": true, "max_bw_mbps": 45000}],
                                                  # nvmlDeviceGetFieldValues: C2C_LINK_COUNT, then
                                                  # C2C_LINK_GET_STATUS / _GET_MAX_BW per link (scope)
          "addressing_mode": 2,                   # nvmlDeviceGetAddressingMode: 0 none, 1 HMM, 2 ATS
          "mig_mode": [0, 0],                     # nvmlDeviceGetMigMode: [current, pending]
          "nvlinks": [null, {"remote": "00000019:01:00.0", "type": "GPU"}]
                                                  # per link: null = not active (nvmlDeviceGetNvLinkState),
                                                  # else nvmlDeviceGetNvLinkRemotePciInfo().busId and
                                                  # nvmlDeviceGetNvLinkRemoteDeviceType (GPU, SWITCH,
                                                  # IBMNPU; "" unknown)
        }
      ]
    }

Any answer (and ``devices`` itself, for nvmlDeviceGetCount) may be ``{"error": "<Name>"}``: that
call raises ``NVMLError_<Name>``. An absent key raises ``NotRecorded`` and a value of the wrong shape
``BadRecording``; both degrade the source like a failing call. A file that is not a JSON object with
a ``devices`` entry is :class:`NvidiaParseError`, which the probe reports as degraded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from memtopo.cpulist import CpuListError, parse_cpulist
from memtopo.discovery.nvml import CALLS, C2cLink, NvidiaParseError, NvLinkPeer, NvmlCallError
from memtopo.discovery.parts import Ids
from memtopo.discovery.source import RECORDED_NVML
from memtopo.hostfs import HostFS, HostReadError
from memtopo.pci import normalize_bdf

_MAX_REPLAY_BYTES = 16 << 20


def _unwrap(call: str, value: object) -> object:
    if isinstance(value, dict) and "error" in value:
        name = value["error"]
        if not (isinstance(name, str) and name.isidentifier() and len(name) <= 60):
            raise NvmlCallError(call, "BadRecording", f"error name {str(name)[:40]!r}")
        raise NvmlCallError(call, name)
    return value


def _bad(call: str, what: str, value: object) -> NvmlCallError:
    return NvmlCallError(call, "BadRecording", f"expected {what}, got {json.dumps(value)[:40]}")


def _as_int(call: str, value: object, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _bad(call, f"an integer >= {lo}", value)
    return value


def _as_str(call: str, value: object) -> str:
    if not isinstance(value, str):
        raise _bad(call, "a string", value)
    return value


@dataclass(frozen=True)
class ReplayNvml:
    """NVML answers recorded with a captured root (format in the module docstring)."""

    devices_answer: object
    init_answer: object = None

    def _device(self, index: int, key: str) -> object:
        call = CALLS.get(key, key)
        devices = _unwrap(CALLS["device_count"], self.devices_answer)
        if not isinstance(devices, list) or not 0 <= index < len(devices):
            raise NvmlCallError(call, "InvalidArgument", f"no device {index}")
        dev = devices[index]
        if not isinstance(dev, dict):
            raise _bad(call, "a device object", dev)
        if "handle" in dev:
            _unwrap(CALLS["open"], dev["handle"])
        if key == "open":
            return None
        if key not in dev:
            raise NvmlCallError(call, "NotRecorded")
        return _unwrap(call, dev[key])

    def init(self) -> None:
        if self.init_answer is not None:
            _unwrap(CALLS["init"], self.init_answer)
            raise _bad(CALLS["init"], "null or an error", self.init_answer)

    def shutdown(self) -> None:
        return None

    def device_count(self) -> int:
        devices = _unwrap(CALLS["device_count"], self.devices_answer)
        if not isinstance(devices, list):
            raise _bad(CALLS["device_count"], "a list", devices)
        return len(devices)

    def open(self, index: int) -> None:
        self._device(index, "open")

    def name(self, index: int) -> str:
        return _as_str(CALLS["name"], self._device(index, "name"))

    def uuid(self, index: int) -> str:
        return _as_str(CALLS["uuid"], self._device(index, "uuid"))

    def pci_bus_id(self, index: int) -> str:
        return _as_str(CALLS["pci_bus_id"], self._device(index, "pci_bus_id"))

    def memory_total(self, index: int) -> int:
        return _as_int(CALLS["memory_total"], self._device(index, "memory_total"))

    def numa_node_id(self, index: int) -> int:
        return _as_int(CALLS["numa_node_id"], self._device(index, "numa_node_id"), lo=-1)

    def memory_affinity(self, index: int, max_nodes: int) -> Ids:
        call = CALLS["memory_affinity"]
        value = self._device(index, "memory_affinity")
        if not isinstance(value, list):
            raise _bad(call, "a list of node ids", value)
        return tuple(sorted({_as_int(call, v) for v in value}))

    def cpu_affinity(self, index: int, max_cpus: int) -> Ids:
        call = CALLS["cpu_affinity"]
        text = _as_str(call, self._device(index, "cpu_affinity"))
        try:
            return parse_cpulist(text)
        except CpuListError as exc:
            raise NvmlCallError(call, "BadRecording", str(exc)[:80]) from exc

    def c2c_enabled(self, index: int) -> bool:
        value = self._device(index, "c2c_enabled")
        if not isinstance(value, bool):
            raise _bad(CALLS["c2c_enabled"], "true or false", value)
        return value

    def c2c_links(self, index: int) -> tuple[C2cLink, ...]:
        call = CALLS["c2c_links"]
        value = self._device(index, "c2c_links")
        if not isinstance(value, list):
            raise _bad(call, "a list of links", value)
        links = []
        for item in value:
            item = _unwrap(call, item)
            if not (isinstance(item, dict) and isinstance(item.get("active"), bool)):
                raise _bad(call, '{"active": bool, "max_bw_mbps": int}', item)
            links.append(C2cLink(item["active"], _as_int(call, item.get("max_bw_mbps", 0))))
        return tuple(links)

    def addressing_mode(self, index: int) -> int:
        return _as_int(CALLS["addressing_mode"], self._device(index, "addressing_mode"))

    def mig_mode(self, index: int) -> tuple[int, int]:
        call = CALLS["mig_mode"]
        value = self._device(index, "mig_mode")
        if not (isinstance(value, list) and len(value) == 2):
            raise _bad(call, "[current, pending]", value)
        return _as_int(call, value[0]), _as_int(call, value[1])

    def nvlinks(self, index: int) -> tuple[NvLinkPeer | None, ...]:
        call = CALLS["nvlinks"]
        value = self._device(index, "nvlinks")
        if not isinstance(value, list):
            raise _bad(call, "a list of links", value)
        out: list[NvLinkPeer | None] = []
        for item in value:
            item = _unwrap(call, item)
            if item is None:
                out.append(None)
                continue
            if not (isinstance(item, dict) and isinstance(item.get("remote"), str)
                    and isinstance(item.get("type", ""), str)):
                raise _bad(call, 'null or {"remote": busId, "type": kind}', item)
            out.append(NvLinkPeer(normalize_bdf(item["remote"]) or "", str(item.get("type", "")).upper()))
        return tuple(out)


def parse_nvml_replay(text: str) -> ReplayNvml:
    """A recording's top level; each answer is checked when it is asked for (see the docstring)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise NvidiaParseError(f"not JSON: {str(exc)[:80]}") from exc
    if not isinstance(doc, dict):
        raise NvidiaParseError(f"top level is {type(doc).__name__}, not an object")
    if "devices" not in doc:
        raise NvidiaParseError('no "devices" entry')
    devices = doc["devices"]
    if not (isinstance(devices, list) or (isinstance(devices, dict) and "error" in devices)):
        raise NvidiaParseError('"devices" is neither a list nor {"error": …}')
    init = doc.get("nvmlInit")
    if not (init is None or (isinstance(init, dict) and "error" in init)):
        raise NvidiaParseError('"nvmlInit" is neither null nor {"error": …}')
    return ReplayNvml(devices, init)


def load_nvml_replay(path: Path, fs: HostFS | None = None) -> ReplayNvml:
    """The replay at ``path``; the one a captured root holds is read through its ``fs``, inside it."""
    if fs is None or path != fs.path(RECORDED_NVML):
        fs, rel = HostFS.at(path.parent), path.name
    else:
        rel = RECORDED_NVML
    try:
        data = fs.read_bytes(rel, _MAX_REPLAY_BYTES)
    except HostReadError as exc:
        raise NvidiaParseError(f"cannot read: {exc.reason}") from exc
    return parse_nvml_replay(data.decode("utf-8", "replace"))
