"""Kernel memory tiers (/sys/devices/virtual/memory_tiering, 6.1+) and the demotion switch."""

from __future__ import annotations

from memtopo.cpulist import CpuListError, parse_cpulist
from memtopo.discovery.parts import KernelTier, SysTiers
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.discovery.sysfs_read import dir_ids
from memtopo.hostfs import HostReadError
from memtopo.text import excerpt

SOURCE = "sysfs.memory_tiers"

TIER_DIR = "sys/devices/virtual/memory_tiering"
DEMOTION = "sys/kernel/mm/numa/demotion_enabled"
_PREFIX = "memory_tier"


def probe(ctx: ProbeContext) -> ProbeResult[SysTiers]:
    sb = StatusBuilder(SOURCE)
    if not ctx.sysfs_available:
        sb.unavailable("input is an hwloc XML export")
        return ProbeResult(SysTiers((), None), sb.finish())
    demotion = _demotion(ctx, sb)
    if not ctx.fs.is_dir(TIER_DIR):
        # Kernels before 6.1 have no tiering bus, and hwloc-gather dumps do not collect it.
        sb.unavailable(f"no {TIER_DIR} (kernel before 6.1, or not in this capture)")
        return ProbeResult(SysTiers((), demotion), sb.finish())
    try:
        entries = ctx.fs.listdir(TIER_DIR)
    except HostReadError as exc:
        sb.problem(exc)
        entries = []
    tiers: list[KernelTier] = []
    for tier_id in dir_ids(sb, TIER_DIR, entries, _PREFIX):
        # The ABI doc says `nodes`, but mm/memory-tiers.c registers `nodelist`.
        rel = f"{TIER_DIR}/{_PREFIX}{tier_id}/nodelist"
        try:
            text = ctx.fs.read_text(rel)
            tiers.append(KernelTier(tier_id, parse_cpulist(text)))
        except HostReadError as exc:
            sb.problem(exc)
        except CpuListError as exc:
            sb.problem(HostReadError(rel, str(exc)))
    return ProbeResult(SysTiers(tuple(tiers), demotion), sb.finish())


def _demotion(ctx: ProbeContext, sb: StatusBuilder) -> bool | None:
    try:
        text = ctx.fs.read_attr(DEMOTION)
    except HostReadError as exc:
        if exc.reason != "missing":
            sb.problem(exc)
        return None
    # The kernel prints true/false; the rest is what kstrtobool accepts on write, in case a
    # capture recorded the written value.
    value = text.lower()
    if value in ("true", "1", "y", "yes", "on"):
        return True
    if value in ("false", "0", "n", "no", "off"):
        return False
    sb.problem(HostReadError(DEMOTION, f"not a boolean: {excerpt(text)}"))
    return None
