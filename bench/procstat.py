"""What /proc says of a process's memory, for the benchmarks that measure it. Standard library only:
a benchmark that measures its own process imports this before anything it measures."""

from __future__ import annotations

import os
from pathlib import Path


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS), RssAnon and RssFile of /proc/PID/status, in KiB (those it shows: a
    process that has exited shows none)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def rss_mib() -> float:
    """This process's VmRSS, in MiB."""
    return memory_kib(os.getpid())["VmRSS"] / 1024
