"""``memtopo apply`` / ``rollback`` as a user sees them: exit codes, the human diff, JSON output."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@pytest.mark.parametrize(("action", "message"), [
    ({"thread_affinity": {"pid": 1, "cpus": 0}},
     "actions[0].thread_affinity.cpus: expected a list of uint32 integers, got a number 0"),
    ({"thread_affinity": {"pid": "one", "cpus": [0]}},
     "actions[0].thread_affinity.pid: expected an integer -2147483648..2147483647 (int32), got a string 'one'"),
    ({"cpuset": {"cgroup_path": "memtopo/a", "cpus": [0, -1]}},
     "actions[0].cpuset.cpus[1]: expected an integer 0..4294967295 (uint32), got a number -1"),
    ({"memory_policy": {"pid": 1, "mode": "BIND"}},
     "actions[0].memory_policy.mode: expected one of MODE_UNSPECIFIED, MODE_LOCAL, MODE_INTERLEAVE, MODE_PREFERRED, "
     "MODE_BIND, got a string 'BIND'"),
    ({"irq_affinity": {"irq": 24, "cpus": [1]}, "required": "yes"},
     "actions[0].required: expected true or false, got a string 'yes'"),
    ({"page_migration": ["pid", 1]},
     "actions[0].page_migration: expected an object (a PageMigration), got a list of 2"),
])
def test_a_wrong_typed_plan_field_is_named_with_the_type_it_takes(tmp_path: Path, action: dict[str, object],
                                                                  message: str) -> None:
    """Not protobuf's "Failed to parse cpus field: repeated field cpus must be in [] which is 0 at …":
    the field's path, the type it takes and a short excerpt of what it got."""
    plan_text = json.dumps({"plan_id": "p", "actions": [{"id": "a", **action}]})
    with pytest.raises(PlanFormatError) as err:
        load_plan(plan_text)
    assert str(err.value) == f"not a BindingPlan: {message}"
    res = _cli("apply", "--dry-run", "--state-dir", str(tmp_path / "s"), "-", stdin=plan_text)
    assert (res.returncode, res.stderr) == (2, f"memtopo: not a BindingPlan: {message}\n")


def test_a_long_wrong_value_is_quoted_short_and_escaped() -> None:
    hostile = "\u202e" + "x" * 5000
    with pytest.raises(PlanFormatError) as err:
        load_plan(json.dumps({"plan_id": "p", "actions": [{"id": "a", "thread_affinity": {"pid": hostile}}]}))
    message = str(err.value)
    assert len(message) < 200 and "\u202e" not in message and "\\u202e" in message and "(5001 chars)" in message


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.sampled_from(["plan_id", "actions", "id", "pid", "cpus", "mode",
                                                              "thread_affinity", "cpuset", "threads", "tids",
                                                              "created", "x"]), inner, max_size=4),
                           max_leaves=20)


@settings(max_examples=300)
@given(JSON_VALUES)
def test_any_json_is_a_plan_or_a_plan_format_error(value: object) -> None:
    try:
        load_plan(json.dumps(value))
    except PlanFormatError as exc:
        assert str(exc) and "\n" not in str(exc)
