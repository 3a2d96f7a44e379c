"""NVIDIA GPUs: NVML (nvidia-ml-py) plus the driver's ``/proc/driver/nvidia/gpus/<BDF>/numa_status``.

NVML gives, per device: name, UUID, PCI bus id, memory, the GPU memory's own NUMA node
(``nvmlDeviceGetNumaNodeId``, coherent platforms only), the nearest host memory node and CPUs, C2C
mode and links, addressing mode, MIG mode and NVLink peers. The driver's procfs names, for every GPU
whose NUMA support is not disabled, the node its memory is onlined to and that node's state. It is
read with or without NVML, so a captured root or a host without nvidia-ml-py still says which NUMA
node is GPU memory (devices known only from procfs get ``index_source = "pci_order"``).

**Superchips** (GH200, GB200, GB300, GB10): ``unified_memory`` is set when the model string names
one *and* NVML says C2C is enabled; node ids are never assumed. In the default NUMA mode the GPU
memory is a CPU-less node (``memory_numa_nodes``). In CDMM mode the driver keeps it: NumaNodeId is
NOT_SUPPORTED and no numa_status node is online, so ``attributes["cdmm"] == "true"``.

**MIG placeholder nodes**: firmware declares, after each GPU's memory node, a block of CPU-less nodes
for MIG instances (7 per GPU on GH200/GB200). NVML does not say which belong to which GPU, so they are
attributed from the kernel's view (:func:`attribute_mig_placeholders`): walking up from the GPU
memory node, the consecutive CPU-less nodes whose nearest CPU node by SLIT is the memory node's own,
up to a node with CPUs, another GPU's memory node or a node nearer other CPUs; the empty ones are the
placeholders. No block size is assumed, and without a SLIT that singles out one CPU node nothing is
attributed. Without a GPU memory node (CDMM, discrete GPUs) nothing is attributed either.

**Errors**: an :class:`NvmlApi` raises only :class:`NvmlCallError` (the NVML call, and the error name
as pynvml spells its classes, ``NVMLError_<Name>``). LibraryNotFound or DriverNotLoaded at init (or
no nvidia-ml-py) means no NVML: the source is UNAVAILABLE, or DEGRADED when procfs still listed GPUs
(those are reported). NotSupported is an *answer* where it means "this device has none" (NumaNodeId,
C2C mode and links, NVLink, MIG, addressing mode); anywhere else, and any other error, the fact stays
unknown and the source is DEGRADED with a reason naming the call.

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

import contextlib
import functools
import importlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from memtopo.cpulist import MAX_ID, CpuListError, format_cpulist, parse_cpulist
from memtopo.discovery import sysfs_numa
from memtopo.discovery.parts import AccelDevice, AcceleratorPart, AccelLink, Ids, SysNuma
from memtopo.discovery.source import RECORDED_NVML, ProbeContext, ProbeResult, StatusBuilder
from memtopo.hostfs import HostFS, HostReadError
from memtopo.pci import bdf_sort_key, normalize_bdf
from memtopo.text import excerpt

SOURCE = "nvidia"

PROC_GPUS = "proc/driver/nvidia/gpus"
NODE_POSSIBLE = "sys/devices/system/node/possible"
CPU_POSSIBLE = "sys/devices/system/cpu/possible"
# Affinity buffers when the root does not say how many ids are possible: above any shipped kernel.
_DEFAULT_NODES = 1024
_DEFAULT_CPUS = 8192
_MAX_REPLAY_BYTES = 16 << 20

# GH200, GB200, GB300, GB10: Grace-based superchips. The look-arounds keep "80GB" out.
_SUPERCHIP = re.compile(r"(?<![A-Za-z0-9])G[BH]\d{2,3}(?![0-9])")

# NotSupported from these means "the device has none of it", which is a fact, not a fault.
_UNSUPPORTED_IS_AN_ANSWER = frozenset({
    "numa_node_id", "c2c_enabled", "c2c_links", "nvlinks", "mig_mode", "addressing_mode",
})
# The library or the driver is absent: NVML has nothing to say on this host.
_ABSENT = frozenset({"LibraryNotFound", "DriverNotLoaded"})

# NvmlApi method → the NVML function it records (for reasons and the replay's error answers).
CALLS: Mapping[str, str] = {
    "init": "nvmlInit",
    "device_count": "nvmlDeviceGetCount",
    "open": "nvmlDeviceGetHandleByIndex",
    "name": "nvmlDeviceGetName",
    "uuid": "nvmlDeviceGetUUID",
    "pci_bus_id": "nvmlDeviceGetPciInfo",
    "memory_total": "nvmlDeviceGetMemoryInfo",
    "numa_node_id": "nvmlDeviceGetNumaNodeId",
    "memory_affinity": "nvmlDeviceGetMemoryAffinity",
    "cpu_affinity": "nvmlDeviceGetCpuAffinityWithinScope",
    "c2c_enabled": "nvmlDeviceGetC2cModeInfoV",
    "c2c_links": "nvmlDeviceGetFieldValues",
    "addressing_mode": "nvmlDeviceGetAddressingMode",
    "mig_mode": "nvmlDeviceGetMigMode",
    "nvlinks": "nvmlDeviceGetNvLinkState",
}
ADDRESSING_MODES: Mapping[int, str] = {0: "none", 1: "HMM", 2: "ATS"}
_NVLINK_REMOTE_TYPES: Mapping[int, str] = {0: "GPU", 1: "IBMNPU", 2: "SWITCH"}
_NVLINK_ACTIVE = 1
# pynvml's nvmlValue_t members by NVML_VALUE_TYPE_*.
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


class NvidiaParseError(ValueError):
    """A numa_status file or an NVML recording that does not parse."""


class NvmlCallError(Exception):
    """One NVML call failed. ``error`` is pynvml's class suffix: NotSupported, FunctionNotFound …"""

    def __init__(self, call: str, error: str, detail: str = "") -> None:
        super().__init__(f"{call}: {error}" + (f" ({detail})" if detail else ""))
        self.call = call
        self.error = error
        self.detail = detail


# ---- numa_status -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class NumaStatus:
    """``/proc/driver/nvidia/gpus/<BDF>/numa_status`` (nvidia ``nv-procfs.c``)."""

    node: int | None  # None when the driver prints -1 (no node)
    status: str  # disabled, offline, online_in_progress, online, online_failed, … as printed
    address: int | None = None  # absent until the GPU is initialised
    size_bytes: int | None = None

    @property
    def online_node(self) -> int | None:
        """The node holding the GPU memory now, if any."""
        return self.node if self.status == "online" else None


_STATUS_WORD = re.compile(r"[a-z][a-z_]*")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def parse_numa_status(text: str) -> NumaStatus:
    """``Node: <%d>``, ``Status: <word>`` and, once initialised, ``Address:``/``Size:`` in bare hex."""
    fields: dict[str, str] = {}
    for raw in text.replace("\0", "").splitlines():
        line = raw.strip()
        if not line:
            continue
        key, colon, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not colon or not key or not value:
            raise NvidiaParseError(f"not a 'Key: value' line: {excerpt(line, 60)}")
        if key in fields:
            raise NvidiaParseError(f"{key} given twice")
        fields[key] = value
    if "Node" not in fields or "Status" not in fields:
        raise NvidiaParseError("no Node: or Status: line")
    node_s = fields["Node"]
    digits = node_s.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()) or int(node_s) < -1 or int(node_s) >= MAX_ID:
        raise NvidiaParseError(f"Node is not a node id: {excerpt(node_s)}")
    status = fields["Status"]
    if not _STATUS_WORD.fullmatch(status):
        raise NvidiaParseError(f"Status is not a state word: {excerpt(status)}")
    node = int(node_s)
    return NumaStatus(None if node < 0 else node, status,
                      _hex_field(fields, "Address"), _hex_field(fields, "Size"))


def _hex_field(fields: Mapping[str, str], key: str) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    if len(value) > 16 or not _HEX_DIGITS.issuperset(value):
        raise NvidiaParseError(f"{key} is not a 64-bit hex number: {excerpt(value)}")
    return int(value, 16)


def is_superchip_model(model: str) -> bool:
    """GH200 / GB200 / GB300 / GB10 in an NVML device name."""
    return _SUPERCHIP.search(model) is not None


# ---- the NVML interface ------------------------------------------------------------------------------
@dataclass(frozen=True)
class C2cLink:
    active: bool
    max_bw_mbps: int  # NVML_FI_DEV_C2C_LINK_GET_MAX_BW: MB/s of an active link


@dataclass(frozen=True)
class NvLinkPeer:
    remote_bdf: str  # normalised, "" when NVML's bus id does not parse
    remote_type: str  # GPU, SWITCH, IBMNPU, or "" when NVML cannot say


class NvmlApi(Protocol):
    """The NVML calls this probe makes, by device index. Every method raises only NvmlCallError."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def open(self, index: int) -> None: ...
    def name(self, index: int) -> str: ...
    def uuid(self, index: int) -> str: ...
    def pci_bus_id(self, index: int) -> str: ...
    def memory_total(self, index: int) -> int: ...
    def numa_node_id(self, index: int) -> int: ...
    def memory_affinity(self, index: int, max_nodes: int) -> Ids: ...
    def cpu_affinity(self, index: int, max_cpus: int) -> Ids: ...
    def c2c_enabled(self, index: int) -> bool: ...
    def c2c_links(self, index: int) -> tuple[C2cLink, ...]: ...
    def addressing_mode(self, index: int) -> int: ...
    def mig_mode(self, index: int) -> tuple[int, int]: ...
    def nvlinks(self, index: int) -> tuple[NvLinkPeer | None, ...]: ...


# Per-device NvmlApi methods, in the order the probe asks them.
_RECORDED_METHODS = ("name", "uuid", "pci_bus_id", "memory_total", "numa_node_id", "memory_affinity",
                     "cpu_affinity", "c2c_enabled", "c2c_links", "addressing_mode", "mig_mode", "nvlinks")


def record(api: NvmlApi, max_nodes: int, max_cpus: int) -> dict[str, object]:
    """Ask ``api`` everything the probe asks and write it down in the replay format above, errors
    included, so ``memtopo gather`` captures answer like the host they came from."""
    def answer(key: str, fn: Callable[[], object]) -> object:
        try:
            value = fn()
        except NvmlCallError as exc:
            return {"error": exc.error}
        if not isinstance(value, tuple):
            return value
        if key == "c2c_links":
            return [{"active": c.active, "max_bw_mbps": c.max_bw_mbps} for c in value]
        if key == "nvlinks":
            return [None if p is None else {"remote": p.remote_bdf, "type": p.remote_type} for p in value]
        if key == "cpu_affinity":
            return format_cpulist(value)
        return list(value)

    out: dict[str, object] = {"format": "memtopo.nvml/1"}
    try:
        api.init()
    except NvmlCallError as exc:
        out["nvmlInit"] = {"error": exc.error}
        out["devices"] = []
        return out
    try:
        try:
            count = api.device_count()
        except NvmlCallError as exc:
            out["devices"] = {"error": exc.error}
            return out
        devices: list[dict[str, object]] = []
        for i in range(count):
            dev: dict[str, object] = {}
            try:
                api.open(i)
            except NvmlCallError as exc:
                devices.append({"handle": {"error": exc.error}})
                continue
            extra = {"memory_affinity": (max_nodes,), "cpu_affinity": (max_cpus,)}
            for key in _RECORDED_METHODS:
                dev[key] = answer(key, functools.partial(getattr(api, key), i, *extra.get(key, ())))
            devices.append(dev)
        out["devices"] = devices
        return out
    finally:
        with contextlib.suppress(NvmlCallError):
            api.shutdown()


def _import_pynvml() -> Any:
    return importlib.import_module("pynvml")


def _text(value: object) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return str(value).strip("\0").strip()


def _bits(words: Sequence[int]) -> Ids:
    """NVML affinity arrays: 64-bit words, bit n of word w is id 64*w + n."""
    return tuple(64 * w + b for w, word in enumerate(words) for b in range(64) if (int(word) >> b) & 1)


def _exception_name(exc: BaseException) -> str:
    cls = type(exc).__name__
    if cls.startswith("NVMLError_"):
        return cls.removeprefix("NVMLError_")
    return cls


def _converts[**P, R](method: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Whatever the binding hands back that does not fit (a short array, a struct without the field)
    becomes an NvmlCallError of that method's call too: nothing but NvmlCallError leaves the API."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except NvmlCallError:
                raise
            except Exception as exc:
                raise NvmlCallError(CALLS[method], type(exc).__name__, str(exc)[:120]) from exc
        return guarded
    return wrap


class PynvmlApi:
    """The real NVML through nvidia-ml-py, imported lazily (``loader`` is replaceable for tests).

    Every pynvml exception, and anything else the binding raises, becomes an NvmlCallError naming
    the call: a binding too old to have a function reports FunctionNotFound, like a driver without
    the symbol would.
    """

    def __init__(self, loader: Callable[[], Any] = _import_pynvml) -> None:
        self._loader = loader
        self._nv: Any = None
        self._handles: dict[int, Any] = {}

    def init(self) -> None:
        try:
            self._nv = self._loader()
        except ImportError as exc:
            raise NvmlCallError("import pynvml", "LibraryNotFound", "nvidia-ml-py is not installed") from exc
        except Exception as exc:
            raise NvmlCallError("import pynvml", "LibraryNotFound", f"{type(exc).__name__}: {exc}") from exc
        self._call("nvmlInit")

    def shutdown(self) -> None:
        if self._nv is None:
            return
        # A failed shutdown leaves nothing this process could still release.
        with contextlib.suppress(NvmlCallError):
            self._call("nvmlShutdown")

    def _call(self, fn_name: str, *args: Any) -> Any:
        fn = getattr(self._nv, fn_name, None)
        if fn is None:
            raise NvmlCallError(fn_name, "FunctionNotFound", "not in this nvidia-ml-py")
        try:
            return fn(*args)
        except Exception as exc:
            # Broad on purpose: ctypes and binding bugs must not escape the probe either.
            name = _exception_name(exc)
            detail = "" if name != type(exc).__name__ or name == "NVMLError" else str(exc)[:120]
            raise NvmlCallError(fn_name, name, detail) from exc

    def _const(self, name: str, default: int) -> int:
        value = getattr(self._nv, name, default)
        return value if isinstance(value, int) else default

    def _h(self, index: int) -> Any:
        if index not in self._handles:
            self.open(index)
        return self._handles[index]

    @_converts("device_count")
    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    @_converts("open")
    def open(self, index: int) -> None:
        self._handles[index] = self._call("nvmlDeviceGetHandleByIndex", index)

    @_converts("name")
    def name(self, index: int) -> str:
        return _text(self._call("nvmlDeviceGetName", self._h(index)))

    @_converts("uuid")
    def uuid(self, index: int) -> str:
        return _text(self._call("nvmlDeviceGetUUID", self._h(index)))

    @_converts("pci_bus_id")
    def pci_bus_id(self, index: int) -> str:
        return _text(self._call("nvmlDeviceGetPciInfo", self._h(index)).busId)

    @_converts("memory_total")
    def memory_total(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetMemoryInfo", self._h(index)).total)

    @_converts("numa_node_id")
    def numa_node_id(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetNumaNodeId", self._h(index)))

    @_converts("memory_affinity")
    def memory_affinity(self, index: int, max_nodes: int) -> Ids:
        scope = self._const("NVML_AFFINITY_SCOPE_NODE", 0)
        words = self._call("nvmlDeviceGetMemoryAffinity", self._h(index), _words(max_nodes), scope)
        return _bits(list(words))

    @_converts("cpu_affinity")
    def cpu_affinity(self, index: int, max_cpus: int) -> Ids:
        h, n = self._h(index), _words(max_cpus)
        try:
            words = self._call("nvmlDeviceGetCpuAffinityWithinScope", h, n,
                               self._const("NVML_AFFINITY_SCOPE_NODE", 0))
        except NvmlCallError as exc:
            if exc.error != "FunctionNotFound":
                raise
            # Drivers before the scoped call: the unscoped one is the same node-level answer.
            words = self._call("nvmlDeviceGetCpuAffinity", h, n)
        return _bits(list(words))

    @_converts("c2c_enabled")
    def c2c_enabled(self, index: int) -> bool:
        return bool(self._call("nvmlDeviceGetC2cModeInfoV", self._h(index)).isC2cEnabled)

    def _fields(self, index: int, ids: Sequence[int | tuple[int, int]]) -> list[int]:
        values = self._call("nvmlDeviceGetFieldValues", self._h(index), list(ids))
        out: list[int] = []
        for fid, fv in zip(ids, values, strict=True):
            ret = int(fv.nvmlReturn)
            if ret != 0:
                raise NvmlCallError("nvmlDeviceGetFieldValues", self._code_name(ret), f"field {fid}")
            member = _VALUE_MEMBERS[int(fv.valueType)] if 0 <= int(fv.valueType) < len(_VALUE_MEMBERS) else "uiVal"
            out.append(int(getattr(fv.value, member)))
        return out

    def _code_name(self, code: int) -> str:
        try:
            return _exception_name(self._nv.nvmlExceptionClass(code)(code))
        except Exception:
            return f"NVML error {code}"

    @_converts("c2c_links")
    def c2c_links(self, index: int) -> tuple[C2cLink, ...]:
        (count,) = self._fields(index, [self._const("NVML_FI_DEV_C2C_LINK_COUNT", 170)])
        status_id = self._const("NVML_FI_DEV_C2C_LINK_GET_STATUS", 171)
        bw_id = self._const("NVML_FI_DEV_C2C_LINK_GET_MAX_BW", 172)
        links = []
        for link in range(max(0, min(count, 64))):
            status, bw = self._fields(index, [(status_id, link), (bw_id, link)])
            links.append(C2cLink(status == 1, bw if status == 1 else 0))
        return tuple(links)

    @_converts("addressing_mode")
    def addressing_mode(self, index: int) -> int:
        return int(self._call("nvmlDeviceGetAddressingMode", self._h(index)))

    @_converts("mig_mode")
    def mig_mode(self, index: int) -> tuple[int, int]:
        current, pending = self._call("nvmlDeviceGetMigMode", self._h(index))
        return int(current), int(pending)

    @_converts("nvlinks")
    def nvlinks(self, index: int) -> tuple[NvLinkPeer | None, ...]:
        h = self._h(index)
        out: list[NvLinkPeer | None] = []
        for link in range(self._const("NVML_NVLINK_MAX_LINKS", 18)):
            try:
                state = int(self._call("nvmlDeviceGetNvLinkState", h, link))
            except NvmlCallError as exc:
                # Past the device's last link NVML answers InvalidArgument (or NotSupported).
                if link > 0 and exc.error in ("InvalidArgument", "NotSupported"):
                    break
                raise
            if state != _NVLINK_ACTIVE:
                out.append(None)
                continue
            bus = _text(self._call("nvmlDeviceGetNvLinkRemotePciInfo", h, link).busId)
            try:
                kind = _NVLINK_REMOTE_TYPES.get(int(self._call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)), "")
            except NvmlCallError:
                kind = ""  # older drivers: the probe matches the bus id against its own GPUs
            out.append(NvLinkPeer(normalize_bdf(bus) or "", kind))
        return tuple(out)


def _words(n_ids: int) -> int:
    return max(1, (n_ids + 63) // 64)


# ---- the replay ------------------------------------------------------------------------------------
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


# ---- MIG placeholder attribution ---------------------------------------------------------------------
def attribute_mig_placeholders(numa: SysNuma, memory_nodes: Mapping[int, int]) -> dict[int, Ids]:
    """GPU index → its empty MIG placeholder nodes, given each GPU's memory node (see the docstring)."""
    nodes = {n.id: n for n in numa.nodes}
    cols = numa.distance_nodes
    cpu_nodes = [n.id for n in numa.nodes if n.cpus]

    def nearest_cpu_node(nid: int) -> int | None:
        node = nodes.get(nid)
        if node is None or len(node.distances) != len(cols):
            return None
        row = dict(zip(cols, node.distances, strict=True))
        cands = [(row[c], c) for c in cpu_nodes if c in row]
        if not cands:
            return None
        best = min(d for d, _ in cands)
        winners = [c for d, c in cands if d == best]
        return winners[0] if len(winners) == 1 else None

    order = sorted(nodes)
    gpu_memory = set(memory_nodes.values())
    out: dict[int, Ids] = {}
    for gpu, mem in memory_nodes.items():
        home = nearest_cpu_node(mem)
        found: list[int] = []
        if home is not None:
            for nid in order[order.index(mem) + 1:]:
                node = nodes[nid]
                if node.cpus or nid in gpu_memory or nearest_cpu_node(nid) != home:
                    break
                if node.mem_total_bytes == 0:
                    found.append(nid)
        out[gpu] = tuple(found)
    return out


# ---- the probe -------------------------------------------------------------------------------------
@dataclass
class _Gpu:
    """One device while it is being assembled."""

    index: int
    model: str = ""
    uuid: str = ""
    bdf: str = ""
    memory_bytes: int = 0
    numa_node_id: int | None = None
    numa_id_unsupported: bool = False
    memory_affinity: Ids | None = None
    local_cpus: Ids = ()
    c2c: bool | None = None
    nvlinks: tuple[NvLinkPeer | None, ...] = ()
    attributes: dict[str, str] = field(default_factory=dict)
    memory_nodes: set[int] = field(default_factory=set)


class _Asker:
    """Asks one device's questions; a failed call becomes a reason naming it, never an exception."""

    def __init__(self, sb: StatusBuilder, index: int) -> None:
        self.sb = sb
        self.index = index
        self.unsupported: set[str] = set()

    def __call__[T](self, what: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except NvmlCallError as exc:
            if exc.error == "NotSupported" and what in _UNSUPPORTED_IS_AN_ANSWER:
                self.unsupported.add(what)
            else:
                self.sb.problem(f"GPU {self.index}: {exc}")
            return None


def probe(ctx: ProbeContext, *, api: NvmlApi | None = None) -> ProbeResult[AcceleratorPart]:
    """NVIDIA GPUs of the root. ``api`` replaces the NVML choice (tests inject fakes through it)."""
    sb = StatusBuilder(SOURCE)
    procfs = _read_procfs(ctx, sb) if ctx.sysfs_available else {}
    gpus: list[_Gpu] = []
    absent: str | None = None
    if api is None:
        api, absent = _choose_api(ctx, sb)
    if api is not None:
        gpus, absent = _query_nvml(api, ctx, sb)
    gpus = _merge_procfs(gpus, procfs, nvml_answered=absent is None, sb=sb)
    if absent is not None:
        if gpus:
            sb.problem(f"NVML: {absent}; GPUs from {PROC_GPUS} only")
        else:
            sb.unavailable(f"no NVIDIA GPUs in {PROC_GPUS} and NVML: {absent}")
    elif not gpus:
        sb.unavailable("no NVIDIA GPUs (NVML reports 0 devices)")
    _attribute_placeholders(ctx, gpus)
    devices = tuple(_freeze(g) for g in gpus)
    links, groups = nvlink_topology({g.index: g.bdf for g in gpus}, {g.index: g.nvlinks for g in gpus})
    return ProbeResult(AcceleratorPart(devices, links, groups), sb.finish())


def _choose_api(ctx: ProbeContext, sb: StatusBuilder) -> tuple[NvmlApi | None, str | None]:
    if ctx.nvml_replay is not None:
        try:
            return load_nvml_replay(ctx.nvml_replay, ctx.fs), None
        except NvidiaParseError as exc:
            sb.problem(f"{ctx.nvml_replay.name}: {exc}")
            return None, "recording unusable"
    if ctx.libraries_live:
        return PynvmlApi(), None
    if not ctx.sysfs_available:
        return None, "input is an hwloc XML export"
    return None, "captured root without an NVML recording"


def _query_nvml(api: NvmlApi, ctx: ProbeContext, sb: StatusBuilder) -> tuple[list[_Gpu], str | None]:
    """Every device's answers, or the reason NVML is absent (library or driver missing)."""
    try:
        api.init()
    except NvmlCallError as exc:
        if exc.error in _ABSENT:
            return [], str(exc)
        sb.problem(str(exc))
        return [], None
    try:
        try:
            count = api.device_count()
        except NvmlCallError as exc:
            if exc.error in _ABSENT:
                return [], str(exc)
            sb.problem(str(exc))
            return [], None
        max_nodes = _span(ctx, NODE_POSSIBLE, _DEFAULT_NODES)
        max_cpus = _span(ctx, CPU_POSSIBLE, _DEFAULT_CPUS)
        return [_query_device(api, i, sb, max_nodes, max_cpus) for i in range(count)], None
    finally:
        api.shutdown()


def _span(ctx: ProbeContext, rel: str, default: int) -> int:
    if not ctx.sysfs_available:
        return default
    try:
        ids = ctx.fs.read_cpulist(rel)
    except HostReadError:
        return default
    return max(ids) + 1 if ids else default


def _query_device(api: NvmlApi, i: int, sb: StatusBuilder, max_nodes: int, max_cpus: int) -> _Gpu:
    gpu = _Gpu(i)
    try:
        api.open(i)
    except NvmlCallError as exc:
        sb.problem(f"GPU {i}: {exc}")
        return gpu
    ask = _Asker(sb, i)
    gpu.model = ask("name", lambda: api.name(i)) or ""
    gpu.uuid = ask("uuid", lambda: api.uuid(i)) or ""
    bus = ask("pci_bus_id", lambda: api.pci_bus_id(i))
    if bus is not None:
        gpu.bdf = normalize_bdf(bus) or ""
        if not gpu.bdf:
            sb.problem(f"GPU {i}: {CALLS['pci_bus_id']}: not a PCI address: {excerpt(bus)}")
    gpu.memory_bytes = ask("memory_total", lambda: api.memory_total(i)) or 0
    numa_id = ask("numa_node_id", lambda: api.numa_node_id(i))
    gpu.numa_node_id = numa_id if numa_id is not None and numa_id >= 0 else None
    gpu.numa_id_unsupported = "numa_node_id" in ask.unsupported or numa_id == -1
    gpu.memory_affinity = ask("memory_affinity", lambda: api.memory_affinity(i, max_nodes))
    gpu.local_cpus = ask("cpu_affinity", lambda: api.cpu_affinity(i, max_cpus)) or ()
    attrs = gpu.attributes
    gpu.c2c = ask("c2c_enabled", lambda: api.c2c_enabled(i))
    if gpu.c2c is not None:
        attrs["c2c_mode"] = "enabled" if gpu.c2c else "disabled"
    elif "c2c_enabled" in ask.unsupported:
        attrs["c2c_mode"] = "unsupported"
    if gpu.c2c:
        links = ask("c2c_links", lambda: api.c2c_links(i))
        if links is not None:
            active = [link for link in links if link.active]
            attrs["c2c_link_count"] = str(len(active))
            attrs["c2c_bandwidth_mbps"] = str(sum(link.max_bw_mbps for link in active))
    mode = ask("addressing_mode", lambda: api.addressing_mode(i))
    if mode is not None:
        attrs["addressing_mode"] = ADDRESSING_MODES.get(mode, f"unknown ({mode})")
    mig = ask("mig_mode", lambda: api.mig_mode(i))
    if mig is not None:
        attrs["mig_mode"] = "enabled" if mig[0] else "disabled"
        if bool(mig[1]) != bool(mig[0]):
            attrs["mig_mode_pending"] = "enabled" if mig[1] else "disabled"
    elif "mig_mode" in ask.unsupported:
        attrs["mig_mode"] = "unsupported"
    gpu.nvlinks = ask("nvlinks", lambda: api.nvlinks(i)) or ()
    return gpu


def _read_procfs(ctx: ProbeContext, sb: StatusBuilder) -> dict[str, NumaStatus | None]:
    """BDF → its numa_status (None when the file is absent: NUMA support disabled, discrete GPU)."""
    out: dict[str, NumaStatus | None] = {}
    try:
        entries = ctx.fs.listdir(PROC_GPUS)
    except HostReadError as exc:
        sb.problem(exc)
        return out
    for entry in entries:
        bdf = normalize_bdf(entry)
        if bdf is None:
            continue
        rel = f"{PROC_GPUS}/{entry}/numa_status"
        out[bdf] = None
        try:
            out[bdf] = parse_numa_status(ctx.fs.read_text(rel))
        except HostReadError as exc:
            if exc.reason != "missing":
                sb.problem(exc)
        except NvidiaParseError as exc:
            sb.problem(HostReadError(rel, str(exc)))
    return out


def _merge_procfs(gpus: list[_Gpu], procfs: Mapping[str, NumaStatus | None], *, nvml_answered: bool,
                  sb: StatusBuilder) -> list[_Gpu]:
    """numa_status into the NVML devices (by BDF), and GPUs only procfs knows as devices of their own."""
    remaining = dict(procfs)
    for gpu in gpus:
        status = remaining.pop(gpu.bdf, None) if gpu.bdf else None
        _apply_numa_status(gpu, status, sb)
    if not remaining:
        return gpus
    if any(not g.bdf for g in gpus):
        # An NVML device without a bus id may be one of them: adding them could count a GPU twice.
        sb.problem(f"{PROC_GPUS} lists {', '.join(sorted(remaining))}, not matched to NVML devices")
        return gpus
    out = list(gpus)
    for bdf in sorted(remaining, key=bdf_sort_key):
        if nvml_answered:
            sb.problem(f"GPU {bdf} is in {PROC_GPUS} but not in NVML")
        # NVML and nvidia-smi enumerate in PCI bus order, the best guess at the index NVML would give.
        gpu = _Gpu(len(out), bdf=bdf, attributes={"index_source": "pci_order"})
        _apply_numa_status(gpu, remaining[bdf], sb)
        out.append(gpu)
    return out


def _apply_numa_status(gpu: _Gpu, status: NumaStatus | None, sb: StatusBuilder) -> None:
    nodes = {gpu.numa_node_id} if gpu.numa_node_id is not None else set()
    if status is not None:
        gpu.attributes["numa_status"] = status.status
        online = status.online_node
        if online is not None:
            if gpu.numa_node_id is not None and online != gpu.numa_node_id:
                sb.problem(f"GPU {gpu.index}: NVML puts its memory on node {gpu.numa_node_id}, "
                           f"numa_status on node {online}")
            nodes.add(online)
            if not gpu.memory_bytes and status.size_bytes:
                gpu.memory_bytes = status.size_bytes
                gpu.attributes["memory_source"] = "numa_status"
    gpu.memory_nodes = nodes
    if gpu.c2c:
        if nodes:
            gpu.attributes["cdmm"] = "false"
        elif gpu.numa_id_unsupported:
            gpu.attributes["cdmm"] = "true"


def _attribute_placeholders(ctx: ProbeContext, gpus: list[_Gpu]) -> None:
    memory_nodes = {g.index: min(g.memory_nodes) for g in gpus if g.memory_nodes}
    if not memory_nodes or not ctx.sysfs_available:
        return
    # The kernel's own node view (the sysfs.numa probe reports its problems itself).
    numa = sysfs_numa.probe(ctx).data
    for index, nodes in attribute_mig_placeholders(numa, memory_nodes).items():
        if nodes:
            gpus[index].attributes["mig_placeholder_nodes"] = format_cpulist(nodes)


def _freeze(gpu: _Gpu) -> AccelDevice:
    attrs = dict(gpu.attributes)
    memory_nodes = tuple(sorted(gpu.memory_nodes))
    numa_node: int | None = None
    if gpu.memory_affinity:
        # The GPU's own memory node can be listed too; the host node is the one that is not.
        host = [n for n in gpu.memory_affinity if n not in memory_nodes] or list(gpu.memory_affinity)
        if len(host) == 1:
            numa_node = host[0]
        else:
            attrs["memory_affinity_nodes"] = format_cpulist(host)
    return AccelDevice(
        kind="GPU", vendor="NVIDIA", index=gpu.index, model=gpu.model, uuid=gpu.uuid, bdf=gpu.bdf,
        memory_bytes=gpu.memory_bytes, numa_node=numa_node, local_cpus=gpu.local_cpus,
        memory_numa_nodes=memory_nodes,
        unified_memory=bool(gpu.c2c) and is_superchip_model(gpu.model),
        attributes=attrs,
    )


def nvlink_topology(bdfs: Mapping[int, str], peers: Mapping[int, Sequence[NvLinkPeer | None]],
                    ) -> tuple[tuple[AccelLink, ...], tuple[Ids, ...]]:
    """NV links between GPUs (index → BDF, index → its links' far ends) and the islands they form.

    A direct GPU↔GPU link counts from either end (the larger count wins, in case one end's answer is
    missing). GPUs whose links go to NVSwitches all share the host's switch fabric (HGX boards,
    NVL72 trays): each such pair is NV<fewest switch links of the two>, as nvidia-smi prints it.
    """
    by_bdf = {bdf: index for index, bdf in bdfs.items() if bdf}
    direct: dict[tuple[int, int], int] = {}
    switch: dict[int, int] = {}
    for index, ends in peers.items():
        for peer in ends:
            if peer is None:
                continue
            if peer.remote_type == "SWITCH":
                switch[index] = switch.get(index, 0) + 1
                continue
            target = by_bdf.get(peer.remote_bdf)
            if target is not None and target != index and peer.remote_type in ("GPU", ""):
                direct[(index, target)] = direct.get((index, target), 0) + 1
    pairs: dict[tuple[int, int], int] = {}
    for (a, b), n in direct.items():
        key = (min(a, b), max(a, b))
        pairs[key] = max(pairs.get(key, 0), n)
    switched = sorted(switch)
    for x, a in enumerate(switched):
        for b in switched[x + 1:]:
            pairs.setdefault((a, b), min(switch[a], switch[b]))
    links = tuple(AccelLink(a, b, "NV", n) for (a, b), n in sorted(pairs.items()))
    return links, _islands(links)


def _islands(links: Sequence[AccelLink]) -> tuple[Ids, ...]:
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for link in links:
        parent[root(link.a)] = root(link.b)
    members: dict[int, list[int]] = {}
    for x in list(parent):
        members.setdefault(root(x), []).append(x)
    return tuple(sorted(tuple(sorted(m)) for m in members.values() if len(m) > 1))



def record_live(ctx: ProbeContext) -> dict[str, object]:
    """This host's NVML answers in the replay format (``memtopo gather``)."""
    return record(PynvmlApi(), _span(ctx, NODE_POSSIBLE, _DEFAULT_NODES), _span(ctx, CPU_POSSIBLE, _DEFAULT_CPUS))
