"""A stand-in for the discovery helper whose discoveries misbehave on cue: the real helper
(``memtopo.discovery.helper``) with ``Rescanner.discover`` replaced in it before its first fork, so
every child it forks runs the replacement. Tests point ``isolated.helper_argv`` here.

    python -m tests.helper_standin MODE [PIDFILE]

MODE: ``hang-from-N`` (the Nth discovery and every later one never return), ``raise-first`` (the
first raises), ``crash-first`` (the first child is killed by SIGKILL, as by a crash in a C library),
``ok`` (none misbehaves). PIDFILE: each child appends its pid (one line) before it discovers.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from memtopo.discovery import discover, helper

RUNS = [0]  # discoveries asked of this helper: each child inherits the count before its own


def misbehave(mode: str, pidfile: str | None) -> None:
    real = discover.Rescanner.discover

    def replacement(self: discover.Rescanner, *args: Any, **kwargs: Any) -> Any:
        if pidfile:
            with open(pidfile, "a") as f:
                f.write(f"{os.getpid()}\n")
        run = RUNS[0]
        if mode.startswith("hang-from-") and run + 1 >= int(mode.removeprefix("hang-from-")):
            threading.Event().wait()
        if mode == "raise-first" and run == 0:
            raise RuntimeError("probe bug \x1b[2J on cue")
        if mode == "crash-first" and run == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    discover.Rescanner.discover = replacement  # type: ignore[method-assign]
    answer = helper.Helper.answer

    def counted(self: helper.Helper, asked: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        try:
            return answer(self, asked)
        finally:
            RUNS[0] += 1

    helper.Helper.answer = counted  # type: ignore[method-assign]


def main() -> int:
    misbehave(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    return helper.main([])


if __name__ == "__main__":
    sys.exit(main())
