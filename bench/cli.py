"""Whole-process timings of the command line against the interpreter's own start, in the same run.

Each row runs one command as a user does (a fresh process) and ``python -c pass`` with the same
interpreter, alternating the two, and reports the medians and their ratio. Targets (ratios): --help
<= 2.5, topo --format json <= 7 (this host), plan mtf <= 3, apply of a 1,000-thread plan <= 8 (with
``taskset -a -p`` on the same threads beside it, for what a user compares it with).

    .venv/bin/python bench/cli.py [--repeat N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.apply import threads_child  # noqa: E402
from bench.report import Report  # noqa: E402

MEMTOPO = [sys.executable, "-m", "memtopo.cli"]
BASELINE = [sys.executable, "-c", "pass"]
TARGETS = {"--help": 2.5, "topo --format json": 7.0, "plan mtf 00000011": 3.0, "apply (1,000 threads)": 8.0}


def user_env(**extra: str) -> dict[str, str]:
    """A user's environment: Python writes and reuses compiled bytecode (a shell that sets
    PYTHONDONTWRITEBYTECODE would time the compiler on every run, which no installed memtopo pays)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, **extra}


def _once(argv: Sequence[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False)
    return time.perf_counter() - t0


def paired(subject: Sequence[str], repeat: int, env: dict[str, str] | None = None,
           reset: Sequence[str] | None = None) -> tuple[float, float]:
    """Median seconds of ``subject`` and of ``python -c pass``, runs alternating (``reset`` untimed before
    each subject run), after one untimed run of each that leaves their bytecode compiled."""
    env = env or user_env()
    _once(subject, env)
    _once(BASELINE, env)
    ours: list[float] = []
    base: list[float] = []
    for _ in range(repeat):
        if reset:
            subprocess.run(reset, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        ours.append(_once(subject, env))
        base.append(_once(BASELINE, env))
    return statistics.median(ours), statistics.median(base)


def _apply_row(repeat: int, nthreads: int) -> tuple[float, float, float | None]:
    with threads_child(nthreads) as (pid, _tids), tempfile.TemporaryDirectory() as state:
        cpus = sorted(os.sched_getaffinity(pid))
        target = cpus[:1]
        plan_path = Path(state) / "plan.json"
        env = user_env(MEMTOPO_STATE_DIR=str(Path(state) / "apply"))
        ours: list[float] = []
        base: list[float] = []
        taskset: list[float] = []
        restore = ["taskset", "-a", "-p", "-c", ",".join(map(str, cpus)), str(pid)]
        for i in range(-1, repeat):  # run -1 is untimed: it compiles the bytecode
            # A new plan id each run: the same id again is answered from the stored result.
            plan = {"plan_id": f"bench-cli-{i}", "policy": "manual", "actions": [
                {"id": "pin", "thread_affinity": {"pid": pid, "threads": {"all": True}, "cpus": target}}]}
            plan_path.write_text(json.dumps(plan))
            subprocess.run(restore, stdout=subprocess.DEVNULL, check=False)
            took, baseline = _once([*MEMTOPO, "apply", str(plan_path)], env), _once(BASELINE, env)
            if i < 0:
                continue
            ours.append(took)
            base.append(baseline)
            if shutil.which("taskset"):
                subprocess.run(restore, stdout=subprocess.DEVNULL, check=False)
                taskset.append(_once(["taskset", "-a", "-p", "-c", str(target[0]), str(pid)], env))
        return (statistics.median(ours), statistics.median(base),
                statistics.median(taskset) if taskset else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1000)
    args = ap.parse_args()
    return Report.run("cli", lambda report: run(args, report))


def run(args: argparse.Namespace, report: Report) -> None:
    rows: list[tuple[str, float, float, str]] = []
    for name in ("--help", "topo --format json", "plan mtf 00000011"):
        ours, base = paired([*MEMTOPO, *name.split()], args.repeat)
        rows.append((name, ours, base, ""))
    if os.geteuid() == 0:
        ours, base, taskset = _apply_row(args.repeat, args.threads)
        rows.append(("apply (1,000 threads)", ours, base,
                     f"taskset -a -p: {taskset * 1e3:.1f} ms" if taskset is not None else "no taskset here"))
    else:
        report.unmeasured("apply (1,000 threads) / python -c pass", "needs root (it pins another process's threads)")
    print(f"{'command':<24} {'memtopo ms':>10} {'python -c pass ms':>18} {'ratio':>6}  beside")
    for name, ours, base, extra in rows:
        print(f"{name:<24} {ours * 1e3:>10.1f} {base * 1e3:>18.1f} {ours / base:>6.2f}  {extra}")
    for name, ours, base, _ in rows:
        report.judge(f"{name} / python -c pass", ours / base, "<=", TARGETS[name])


if __name__ == "__main__":
    sys.exit(main())
