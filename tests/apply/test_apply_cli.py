"""``memtopo apply`` / ``rollback`` as a user sees them: exit codes, the human diff, JSON output."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memtopo.apply.errors import PlanFormatError
from memtopo.apply.planio import load_plan
from memtopo.cli import apply as apply_cli
from memtopo.protojson import to_json
from memtopo.v1 import plan_pb2 as planpb
from tests.apply_fakes import FakeMachine, irq, machine, plan, threads

REPO = Path(__file__).resolve().parents[2]
P = planpb.PlanResult


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memtopo.cli", *args], cwd=REPO, capture_output=True, text=True,
                          input=stdin, timeout=60, check=False)


def test_commands_register_on_a_memtopo_parser() -> None:
    parser = argparse.ArgumentParser(prog="memtopo")
    sub = parser.add_subparsers(dest="command", required=True)
    apply_cli.add_commands(sub)
    args = parser.parse_args(["apply", "p.json", "--dry-run", "--state-dir", "/x", "--irqbalance", "stop"])
    assert (args.func, args.plan, args.dry_run, args.state_dir, args.irqbalance) == (
        apply_cli.cmd_apply, "p.json", True, "/x", "stop")
    args = parser.parse_args(["rollback", "p1"])
    assert args.func is apply_cli.cmd_rollback and args.plan_id == "p1"
    args = parser.parse_args(["exec", "--cpus", "2-37", "--membind", "0", "--", "numactl", "-s"])
    assert args.func is apply_cli.cmd_exec and args.cmd == ["--", "numactl", "-s"] and args.command == "exec"


def test_render_shows_the_diff_reason_and_details(tmp_path: Path) -> None:
    m: FakeMachine = machine(tmp_path)
    p = plan("p", threads("t", 100, [1], all=True), irq("m", [1], number=36, required=False))
    text = apply_cli.render(m.engine().apply(p, dry_run=True), p)
    assert text.splitlines()[0].startswith("plan p: DRY_RUN — dry run: 2 would change")
    assert "  [WOULD_CHANGE] t thread_affinity (required)" in text
    assert "      - pid 100 (worker) 11 threads [tid 100-110]: cpus 0-7" in text
    assert "      + pid 100 (worker) 11 threads [tid 100-110]: cpus 1" in text
    done = apply_cli.render(m.engine().apply(p), p)
    assert "  [SKIPPED] m irq_affinity (optional)" in done
    assert "managed by the kernel (EPERM)" in done


def test_rejection_rendered_and_exit_1(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(to_json(plan("bad", threads("t", 1, [0], all=True))))
    res = _cli("apply", str(f), "--state-dir", str(tmp_path / "s"))
    assert res.returncode == 1
    assert "plan bad: REJECTED" in res.stdout and "t: pid: pid 1 (init) is refused" in res.stdout


def test_plan_from_stdin_and_json_output(tmp_path: Path) -> None:
    res = _cli("apply", "-", "--state-dir", str(tmp_path / "s"), "--format", "json",
               stdin=to_json(plan("bad", threads("t", 1, [0], all=True))))
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["state"] == "STATE_REJECTED" and out["rejections"][0].startswith("t: ")


@pytest.mark.parametrize(("content", "why"), [("{", "not JSON"),
                                             ('{"plan_id": 5, "actions": "x"}', "not a BindingPlan")])
def test_unusable_plan_file_exit_2(tmp_path: Path, content: str, why: str) -> None:
    f = tmp_path / "p.json"
    f.write_text(content)
    res = _cli("apply", str(f), "--state-dir", str(tmp_path / "s"))
    assert res.returncode == 2 and why in res.stderr
    res = _cli("apply", str(tmp_path / "missing.json"), "--state-dir", str(tmp_path / "s"))
    assert res.returncode == 2 and "No such file" in res.stderr


def test_rollback_of_an_unknown_plan_exit_2(tmp_path: Path) -> None:
    res = _cli("rollback", "nope", "--state-dir", str(tmp_path / "s"))
    assert res.returncode == 2 and "no plan 'nope'" in res.stderr


def test_load_plan_rejects_oversized_and_accepts_proto3_json() -> None:
    with pytest.raises(PlanFormatError, match="larger than"):
        load_plan(" " * (17 << 20))
    p = load_plan(json.dumps({"planId": "x", "actions": [{"id": "a", "required": True,
                                                          "irqAffinity": {"irq": 24, "cpus": [1]}}]}))
    assert p.plan_id == "x" and p.actions[0].irq_affinity.irq == 24
