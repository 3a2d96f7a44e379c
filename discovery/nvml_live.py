"""The live NVML, through nvidia-ml-py (imported lazily: only a live host's discovery asks it)."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memtopo.discovery.nvml import CALLS, C2cLink, NvLinkPeer, NvmlCallError
from memtopo.discovery.parts import Ids
from memtopo.pci import normalize_bdf

_NVLINK_REMOTE_TYPES: Mapping[int, str] = {0: "GPU", 1: "IBMNPU", 2: "SWITCH"}
_NVLINK_ACTIVE = 1
# pynvml's nvmlValue_t members by NVML_VALUE_TYPE_*.
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


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
