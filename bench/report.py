"""How every benchmark reports its verdict: each target on a line of its own, its figure beside it
and PASS or FAIL, then the overall line; the exit status is 1 when any target failed or could not
be measured (a benchmark that stops with an error has measured nothing, and says FAIL too).

    report = Report("watch")
    report.judge("SIGHUP -> watcher has it, p99", p99_ms, "<=", 50, "ms")
    return report.finish()

or, so that an error on the way is a FAIL in the same form, ``sys.exit(Report.run("watch", body))``
with ``body(report) -> None``.

The target lines read ``PASS  <target>: <figure> (target <op> <limit>)``. With MEMTOPO_BENCH_SUMMARY
naming a file, each verdict is also appended to it as one tab-separated line — bench, target,
figure, limit, verdict — from which tools/bench.sh prints its table.
"""

from __future__ import annotations

import operator
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

SUMMARY_ENV = "MEMTOPO_BENCH_SUMMARY"
_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, "<": operator.lt, ">=": operator.ge,
                                                   ">": operator.gt, "==": operator.eq}


@dataclass(frozen=True)
class Verdict:
    target: str
    figure: str  # the measured value as printed ("" when it could not be measured)
    limit: str  # "<= 50 ms"
    passed: bool


class Report:
    def __init__(self, bench: str) -> None:
        self.bench = bench
        self.verdicts: list[Verdict] = []

    def judge(self, target: str, value: float, op: str, limit: float, unit: str = "", digits: int = 2) -> bool:
        """``value op limit`` (op one of <=, <, >=, >, ==), printed and kept; True when it holds."""
        passed = _OPS[op](value, limit)
        suffix = f" {unit}" if unit else ""
        self._add(Verdict(target, f"{value:.{digits}f}{suffix}", f"{op} {limit:g}{suffix}", passed))
        return passed

    def check(self, target: str, holds: bool, figure: str, expected: str) -> bool:
        """A target that is a fact rather than a number (``expected``: what passing reads like)."""
        self._add(Verdict(target, figure, expected, holds))
        return holds

    def unmeasured(self, target: str, why: str) -> bool:
        """A target the benchmark could not measure: a FAIL, with why."""
        self._add(Verdict(target, "", f"not measured: {why}", False))
        return False

    @property
    def passed(self) -> bool:
        return bool(self.verdicts) and all(v.passed for v in self.verdicts)

    def finish(self) -> int:
        """The overall line; the exit status (0: every target passed, 1: otherwise or none judged)."""
        failed = sum(not v.passed for v in self.verdicts)
        if not self.verdicts:
            self.unmeasured("any target", "nothing was judged")
            failed = 1
        total = len(self.verdicts)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"{self.bench}: {'PASS' if not failed else 'FAIL'} ({total - failed} of {total} targets met; "
              f"load average now {load} on {os.cpu_count()} CPUs)")
        return 0 if not failed else 1

    def _add(self, v: Verdict) -> None:
        self.verdicts.append(v)
        if v.figure:
            print(f"{'PASS' if v.passed else 'FAIL'}  {v.target}: {v.figure} (target {v.limit})")
        else:
            print(f"FAIL  {v.target}: {v.limit}")
        path = os.environ.get(SUMMARY_ENV)
        if path:
            fields = (self.bench, v.target, v.figure or "-", v.limit, "PASS" if v.passed else "FAIL")
            with open(path, "a", encoding="utf-8") as f:
                f.write("\t".join(x.replace("\t", " ").replace("\n", " ") for x in fields) + "\n")

    @classmethod
    def run(cls, bench: str, body: Callable[[Report], None]) -> int:
        """``body(report)``, then the verdict; an error on the way (SystemExit with a message, any
        exception) is printed and judged as a target that could not be measured."""
        report = cls(bench)
        try:
            body(report)
        except SystemExit as exc:
            if exc.code in (None, 0):
                return report.finish()
            why = exc.code if isinstance(exc.code, str) else f"exit status {exc.code}"
            print(f"{bench}: {why}", file=sys.stderr)
            report.unmeasured("the run", str(why).splitlines()[0][:200])
        except Exception as exc:  # a benchmark that breaks has measured nothing
            traceback.print_exc()
            report.unmeasured("the run", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        return report.finish()
