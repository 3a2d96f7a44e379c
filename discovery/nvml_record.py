"""NVML's answers written down in the replay format (discovery/nvml_replay.py), for ``memtopo gather``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from memtopo.cpulist import format_cpulist
from memtopo.discovery.nvml import NvmlApi, NvmlCallError, id_spans
from memtopo.discovery.nvml_live import PynvmlApi
from memtopo.discovery.source import ProbeContext

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


def record_live(ctx: ProbeContext) -> dict[str, object]:
    """This host's NVML answers in the replay format (``memtopo gather``)."""
    return record(PynvmlApi(), *id_spans(ctx))
