"""Who this host is: node name, machine id and boot id (what a report is keyed on)."""

from __future__ import annotations

from memtopo.discovery.parts import Identity
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.hostfs import HostReadError

SOURCE = "host.identity"

# First readable non-empty file wins. The proc entries reflect the running kernel (and the UTS
# namespace); the /etc files are what a capture or a minimal container may have instead.
HOSTNAME_FILES = ("proc/sys/kernel/hostname", "etc/hostname")
MACHINE_ID_FILES = ("etc/machine-id", "var/lib/dbus/machine-id")
BOOT_ID_FILES = ("proc/sys/kernel/random/boot_id",)


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
    failures: list[str] = []
    for rel in candidates:
        try:
            text = ctx.fs.read_text(rel)
            # hostname(5): lines starting with "#" are comments; the name is the first other line.
            value = next((ln.strip() for ln in text.split("\n")
                          if ln.strip() and not ln.lstrip().startswith("#")), "")
        except HostReadError as exc:
            failures.append(str(exc))
            continue
        if value and value.isprintable():
            return value
        failures.append(f"{rel}: empty or not printable")
    sb.problem(f"no {what}: " + "; ".join(failures))
    return ""
