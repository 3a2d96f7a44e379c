"""``memtopo apply`` as it is, except that it pauses after one action, for a test to kill it there:
the CLI's engine is given a hook (Engine's own ``hook``) before the command runs.

    python -m tests.apply_pausing ACTION_ID SECONDS MARKER apply PLAN.json [OPTIONS]

After ACTION_ID it prints ``paused after ACTION_ID`` on stderr, writes its pid to the MARKER file and
sleeps SECONDS. Everything after MARKER is the memtopo command line.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from memtopo.apply import engine
from memtopo.v1 import plan_pb2 as planpb


def main(argv: list[str]) -> int:
    aid, seconds, marker, *command = argv

    def pause(event: str, action: planpb.PlanAction) -> None:
        if event == "after_action" and action.id == aid:
            print(f"paused after {aid}", file=sys.stderr, flush=True)
            Path(marker).write_text(f"{os.getpid()}\n")
            time.sleep(float(seconds))

    made = engine.Engine.__init__

    def with_pause(self: engine.Engine, *args: object, **kwargs: object) -> None:
        made(self, *args, **kwargs)  # type: ignore[arg-type]
        self.hook = pause

    engine.Engine.__init__ = with_pause  # type: ignore[method-assign]
    from memtopo.cli.main import main as memtopo

    return memtopo(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
