"""What a host's own files say about it and about the process reading them: its name, machine id
and boot id, and the CPUs and memory nodes this process may use. Discovery reports these and the
command-line apply validates against them; both read them here so the two never disagree.
"""

from __future__ import annotations

from memtopo.hostfs import HostFS, HostReadError
from memtopo.text import excerpt

# First readable non-empty file wins. The proc entries reflect the running kernel (and the UTS
# namespace); the /etc files are what a capture or a minimal container may have instead.
HOSTNAME_FILES = ("proc/sys/kernel/hostname", "etc/hostname")
MACHINE_ID_FILES = ("etc/machine-id", "var/lib/dbus/machine-id")
BOOT_ID_FILES = ("proc/sys/kernel/random/boot_id",)

STATUS = "proc/self/status"
ALLOWED_KEYS = ("Cpus_allowed_list", "Mems_allowed_list")


def first_value(fs: HostFS, candidates: tuple[str, ...]) -> tuple[str, list[str]]:
    """The first printable value among ``candidates`` and, when none has one, why each did not."""
    failures: list[str] = []
    for rel in candidates:
        try:
            text = fs.read_text(rel)
        except HostReadError as exc:
            failures.append(str(exc))
            continue
        # hostname(5): lines starting with "#" are comments; the name is the first other line.
        value = next((ln.strip() for ln in text.split("\n") if ln.strip() and not ln.lstrip().startswith("#")), "")
        if value and value.isprintable():
            return value, []
        failures.append(f"{rel}: not printable: {excerpt(value)}" if value else f"{rel}: empty")
    return "", failures


def allowed_lists(status_text: str) -> dict[str, str]:
    """The unparsed cpulists of /proc/self/status's ALLOWED_KEYS lines that are present."""
    found: dict[str, str] = {}
    for line in status_text.split("\n"):
        key, sep, value = line.partition(":")
        if sep and key in ALLOWED_KEYS:
            found[key] = value
    return found
