"""Who this host is: node name, machine id and boot id (what a report is keyed on)."""

from __future__ import annotations

from memtopo.discovery.parts import Identity
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.hostinfo import BOOT_ID_FILES, HOSTNAME_FILES, MACHINE_ID_FILES, first_value

SOURCE = "host.identity"


def probe(ctx: ProbeContext) -> ProbeResult[Identity]:
    sb = StatusBuilder(SOURCE)
    if not ctx.sysfs_available:
        sb.unavailable("input is an hwloc XML export")
        return ProbeResult(Identity("", "", ""), sb.finish())
    data = Identity(
        node_name=_first(ctx, sb, "host name", HOSTNAME_FILES),
        machine_id=_first(ctx, sb, "machine id", MACHINE_ID_FILES),
        boot_id=_first(ctx, sb, "boot id", BOOT_ID_FILES),
    )
    return ProbeResult(data, sb.finish())


def _first(ctx: ProbeContext, sb: StatusBuilder, what: str, candidates: tuple[str, ...]) -> str:
    value, failures = first_value(ctx.fs, candidates)
    if failures:
        sb.problem(f"no {what}: " + "; ".join(failures))
    return value
