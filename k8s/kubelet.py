"""The kubelet's configuration facts, read through a root (the live host's ``/`` or a capture).

``KubeletConfiguration`` (``kubelet.config.k8s.io/v1beta1``, YAML, usually ``/var/lib/kubelet/config.yaml``):
topology-manager policy and scope, CPU and memory manager policies, ``reservedSystemCPUs`` and
``reservedMemory``. Plus the node's huge page pools per NUMA node from sysfs, which the kubelet reports
as ``hugepages-<size>`` resources. Nothing here raises: an unreadable or malformed file becomes
``KubeletFacts.problem`` (quoted briefly), and the object then says the kubelet config was unreadable.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from memtopo.cpulist import CpuListError, parse_cpulist
from memtopo.hostfs import HostFS, HostReadError
from memtopo.k8s.defaults import DEFAULT_CONFIG_PATHS
from memtopo.k8s.facts import KubeletFacts
from memtopo.k8s.quantity import QuantityError, parse_bytes
from memtopo.k8s.resources import hugepage_resource
from memtopo.text import EXCERPT_CHARS, shorten

MAX_CONFIG_BYTES = 1 << 20
class KubeletConfigError(ValueError):
    """A value in the kubelet configuration memtopo cannot use."""


def _shown(value: object) -> str:
    # Quoted as a repr (a string's quotes show where it ends), escaped and cut by the one shortener.
    return shorten(repr(value), EXCERPT_CHARS)


def parse_quantity(value: object) -> int:
    """A Kubernetes quantity of bytes (``1Gi``, ``512M``, ``1e9``, ``1048576``) as an integer ≥ 0."""
    try:
        return parse_bytes(value)
    except QuantityError as exc:
        raise KubeletConfigError(str(exc)) from None


def _string(doc: Mapping[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 64:
        raise KubeletConfigError(f"{key}: not a short string: {_shown(value)}")
    return value


def _reserved_memory(value: object) -> dict[int, dict[str, int]]:
    if value is None:
        return {}
    if not isinstance(value, list):
        raise KubeletConfigError(f"reservedMemory: not a list: {_shown(value)}")
    out: dict[int, dict[str, int]] = {}
    for item in value[:1024]:
        if not isinstance(item, Mapping):
            raise KubeletConfigError(f"reservedMemory: entry is not a mapping: {_shown(item)}")
        node, limits = item.get("numaNode"), item.get("limits") or {}
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < 1 << 16:
            raise KubeletConfigError(f"reservedMemory: numaNode {_shown(node)} is not a NUMA node id")
        if not isinstance(limits, Mapping):
            raise KubeletConfigError(f"reservedMemory: limits of node {node} is not a mapping")
        for res, qty in limits.items():
            if not isinstance(res, str):
                raise KubeletConfigError(f"reservedMemory: resource name {_shown(res)}")
            out.setdefault(node, {})[res] = out.get(node, {}).get(res, 0) + parse_quantity(qty)
    return out


def facts_from_config(doc: object, path: str) -> KubeletFacts:
    """The facts in a parsed KubeletConfiguration document (``problem`` set when it is unusable)."""
    try:
        if not isinstance(doc, Mapping):
            raise KubeletConfigError("not a KubeletConfiguration mapping")
        kind = doc.get("kind")
        if kind is not None and kind != "KubeletConfiguration":
            raise KubeletConfigError(f"kind is {_shown(kind)}, not KubeletConfiguration")
        cpus_text = doc.get("reservedSystemCPUs") or ""
        if not isinstance(cpus_text, str):
            raise KubeletConfigError(f"reservedSystemCPUs: not a CPU list: {_shown(cpus_text)}")
        try:
            reserved_cpus = parse_cpulist(cpus_text)
        except CpuListError as exc:
            raise KubeletConfigError(f"reservedSystemCPUs: {exc}") from None
        return KubeletFacts(
            config_path=path,
            topology_manager_policy=_string(doc, "topologyManagerPolicy"),
            topology_manager_scope=_string(doc, "topologyManagerScope"),
            cpu_manager_policy=_string(doc, "cpuManagerPolicy"),
            memory_manager_policy=_string(doc, "memoryManagerPolicy"),
            reserved_cpus=reserved_cpus,
            reserved_memory=_reserved_memory(doc.get("reservedMemory")))
    except KubeletConfigError as exc:
        return KubeletFacts(config_path=path, problem=str(exc))


def hugepage_pools(fs: HostFS) -> dict[int, dict[str, int]]:
    """NUMA node → ``hugepages-<size>`` → bytes in its pool; unreadable entries count as empty."""
    base = "sys/devices/system/node"
    out: dict[int, dict[str, int]] = {}
    try:
        nodes = [e for e in fs.listdir(base) if e.startswith("node") and e[4:].isdigit()]
    except HostReadError:
        return out
    for entry in nodes:
        rel = f"{base}/{entry}/hugepages"
        try:
            sizes = fs.listdir(rel)
        except HostReadError:
            continue
        for e in sizes:
            size_kb = e[10:-2]
            if not (e.startswith("hugepages-") and e.endswith("kB") and size_kb.isdigit()):
                continue
            try:
                pages = fs.read_int(f"{rel}/{e}/nr_hugepages")
            except HostReadError:
                continue
            if pages > 0:
                out.setdefault(int(entry[4:]), {})[hugepage_resource(int(size_kb) * 1024)] = pages * int(size_kb) * 1024
    return out


def read_kubelet_facts(fs: HostFS, config_paths: Sequence[str] = DEFAULT_CONFIG_PATHS) -> KubeletFacts:
    """The kubelet's facts under ``fs``: the first config file of ``config_paths`` that exists (paths are
    absolute on the node, read under the root), and the huge page pools. Never raises."""
    import yaml

    huge = hugepage_pools(fs)
    for path in config_paths:
        rel = path.lstrip("/")
        if not fs.exists(rel) and not os.path.islink(fs.join(rel)):
            continue
        try:
            # Confined to the root, regular files only (a FIFO cannot block), bounded.
            text = fs.read_text(rel, MAX_CONFIG_BYTES)
        except HostReadError as exc:
            return KubeletFacts(config_path=path, problem=exc.reason, hugepages=huge)
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            return KubeletFacts(config_path=path, problem=f"not valid YAML{where}", hugepages=huge)
        except RecursionError:
            return KubeletFacts(config_path=path, problem="YAML nested too deeply", hugepages=huge)
        facts = facts_from_config(doc, path)
        return dataclasses.replace(facts, hugepages=huge)
    return KubeletFacts(problem=f"no kubelet config at {', '.join(config_paths)}", hugepages=huge)
