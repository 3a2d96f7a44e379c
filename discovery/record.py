"""What ``memtopo gather`` records beside the files: vendor tools' outputs and NVML's answers.

A capture replays them (``ProbeContext.at_root``), so ``topo --root`` on it reports the accelerators
the host had, and gives the same fingerprint as ``topo`` on the host itself. A tool that is missing
or times out is left out and replays as missing.
"""

from __future__ import annotations

import json

from memtopo.discovery import ascend, kunlunxin, nvml_record
from memtopo.discovery.source import RECORDED_NVML, ProbeContext
from memtopo.runner import RECORDED_TOOLS_DIR, run_all

RECORDED_COMMANDS: tuple[tuple[str, ...], ...] = (*ascend.RECORDED_COMMANDS, *kunlunxin.RECORDED_COMMANDS)


def recordings(ctx: ProbeContext) -> dict[str, str]:
    """Root-relative path → content for the capture."""
    files: dict[str, str] = {}
    index: dict[str, list[str]] = {}
    for n, (argv, res) in enumerate(zip(RECORDED_COMMANDS, run_all(ctx.runner, RECORDED_COMMANDS), strict=True)):
        if res.returncode is None:
            continue
        exit_part = "" if res.returncode == 0 else f".exit{res.returncode}"
        name = f"{n:02d}-{argv[0]}{exit_part}.txt"
        files[f"{RECORDED_TOOLS_DIR}/{name}"] = res.stdout
        index[name] = list(argv)
    files[f"{RECORDED_TOOLS_DIR}/argv.json"] = json.dumps(index, indent=1, sort_keys=True)
    files[RECORDED_NVML] = json.dumps(nvml_record.record_live(ctx), indent=1, sort_keys=True)
    return files
