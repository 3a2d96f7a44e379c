"""What a discovery process says about its probes, so that when it dies of a signal (a C library —
hwloc, NVML — crashing on what it read) whoever started it can tell which probe it died in and run
the discovery again without it: a crash costs its sources, never the topology.

The process writes one short line per probe start and end, naming the thread (``mark``), and
faulthandler names the thread a fatal signal hit ("Current thread 0x…"); ``running_at_death`` reads
both back. Nothing here imports asyncio: the discovery helper uses it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

PROBE_MARK = "memtopo-probe"
# How faulthandler names the thread a fatal signal was delivered to.
_FAULTED = "Current thread "


def mark(fd: int, source: str, starting: bool) -> None:
    # One write(2) of a short line: whole in the pipe even with probes on several threads.
    os.write(fd, f"{PROBE_MARK} {'start' if starting else 'end'} {source} {threading.get_ident():#x}\n".encode())


def running_at_death(said: bytes) -> list[str]:
    """The probes the process died in, in starting order: the one on the thread that took the signal
    (faulthandler names it as the "Current thread"), else every one started and not ended."""
    running: dict[str, int] = {}
    faulted: int | None = None
    for line in said.decode("utf-8", "replace").splitlines():
        if line.startswith(_FAULTED):
            with contextlib.suppress(ValueError):
                faulted = int(line[len(_FAULTED):].split()[0], 16)
            continue
        word, _, rest = line.partition(" ")
        if word != PROBE_MARK:
            continue
        what, _, rest = rest.partition(" ")
        source, _, thread = rest.partition(" ")
        if what == "start":
            with contextlib.suppress(ValueError):
                running[source] = int(thread, 16)
        elif what == "end":
            running.pop(source, None)
    on_that_thread = [source for source, thread in running.items() if thread == faulted]
    return on_that_thread or list(running)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def left_out(signal_word: str, suspects: list[str], left: dict[str, str]) -> None:
    """Record in ``left`` why each suspect is left out of the next run."""
    for source in suspects:
        others = [s for s in suspects if s != source]
        beside = f" (beside {', '.join(others)})" if others else ""
        left[source] = (f"left out: the discovery process died of {signal_word} while this probe ran{beside}; "
                        "discovery ran again without it")
