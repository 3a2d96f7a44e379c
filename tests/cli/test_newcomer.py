"""What a newcomer meets first, through the real ``memtopo`` entry point (.venv/bin/memtopo, or
``main([...])`` where the in-process call is the same code): clear errors, honest output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agents import Agent, copy_root, wait_for
from tests.controllers import Background
from tests.fixtures import REPO

MEMTOPO = REPO / ".venv" / "bin" / "memtopo"


def memtopo(*args: str, stdin: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MEMTOPO), *args], cwd=cwd, input=stdin, capture_output=True, text=True,
                          timeout=300, check=False)


def no_traceback(res: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in res.stderr + res.stdout, res.stderr


# ---- gather ------------------------------------------------------------------------------------------
def test_gather_into_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    res = memtopo("gather", str(tmp_path / "nonexistent/dir/out.tar.gz"))
    no_traceback(res)
    assert res.returncode == 2
    assert "does not exist" in res.stderr and "nonexistent/dir" in res.stderr


@pytest.mark.parametrize("name", ["out.zip", "out.tar.bz2", "out"])
def test_gather_refuses_a_suffix_it_does_not_write(tmp_path: Path, name: str) -> None:
    res = memtopo("gather", name, cwd=tmp_path)
    no_traceback(res)
    assert res.returncode == 2 and ".tar.gz" in res.stderr and ".tar.xz" in res.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written under a misleading name


# ---- plan → apply --------------------------------------------------------------------------------------
def _dead_pid() -> int:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(p for p in range(pid_max - 1, 1, -1) if not Path(f"/proc/{p}").exists())


def test_plan_place_for_a_process_that_does_not_exist_fails(tmp_path: Path) -> None:
    pid = _dead_pid()
    res = memtopo("plan", "place", "--request", "-", "--pid", str(pid), stdin='{"cpus": 1}')
    no_traceback(res)
    assert res.returncode == 2
    assert json.loads(res.stdout)["error"] == {"code": "usage", "message": f"--pid {pid}: no such process on this host"}
    ok = memtopo("plan", "place", "--request", "-", "--pid", str(os.getpid()), "--emit", "plan", stdin='{"cpus": 1}')
    assert ok.returncode == 0 and json.loads(ok.stdout)["plan_id"]  # a live process still gets its plan


def test_apply_of_emit_both_output_says_to_use_emit_plan(tmp_path: Path) -> None:
    both = memtopo("plan", "place", "--request", "-", "--pid", str(os.getpid()), "--emit", "both",
                   stdin='{"cpus": 1}')
    assert both.returncode == 0 and set(json.loads(both.stdout)) == {"decision", "plan"}
    res = memtopo("apply", "--dry-run", "--state-dir", str(tmp_path / "state"), "-", stdin=both.stdout)
    no_traceback(res)
    assert res.returncode == 2 and "--emit plan" in res.stderr


def test_an_unknown_plan_field_is_named_as_the_project_writes_fields(tmp_path: Path) -> None:
    plan = {"plan_id": "p", "actions": [{"id": "a1", "thread_afinity": {}}]}
    res = memtopo("apply", "--dry-run", "--state-dir", str(tmp_path / "state"), "-", stdin=json.dumps(plan))
    no_traceback(res)
    assert res.returncode == 2
    assert "'thread_afinity'" in res.stderr and "thread_affinity" in res.stderr and "page_migration" in res.stderr
    assert "threadAffinity" not in res.stderr and "Available Fields" not in res.stderr


# ---- controller nodes ----------------------------------------------------------------------------------
@pytest.fixture
def empty_controller() -> Iterator[str]:
    bg = Background()
    try:
        yield bg.addr
    finally:
        bg.close()


def test_controller_nodes_speaks_text_and_json_like_every_command(empty_controller: str) -> None:
    text = memtopo("controller", "nodes", "--addr", empty_controller, "--format", "text")
    assert text.returncode == 0 and text.stdout == "no nodes\n"
    table = memtopo("controller", "nodes", "--addr", empty_controller, "--format", "table")  # the old name
    assert (table.returncode, table.stdout) == (0, text.stdout)
    js = memtopo("controller", "nodes", "--addr", empty_controller, "--format", "json")
    assert js.returncode == 0 and json.loads(js.stdout) == {"nodes": []}
    helped = memtopo("controller", "nodes", "--help")
    assert "{text,json}" in helped.stdout and "table" not in helped.stdout


# ---- a running agent: plans, watch, logs ---------------------------------------------------------------
def test_query_plans_watch_and_the_published_log_against_a_running_agent(tmp_path: Path) -> None:
    agent = Agent(tmp_path, copy_root(tmp_path), None)
    agent.start()
    try:
        addr = f"unix://{agent.sock}"
        none = memtopo("query", "plans", "--addr", addr)
        assert none.returncode == 0 and none.stdout == "no plans: this agent has applied, dry-run or recorded none\n"
        js = memtopo("query", "plans", "--addr", addr, "--format", "json")
        assert js.returncode == 0 and json.loads(js.stdout) == {"plans": []}

        # A SIGHUP rescan that finds the same topology still shows in the watch.
        watch = subprocess.Popen([str(MEMTOPO), "query", "watch", "--addr", addr, "--count", "2"], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        assert watch.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(watch.stdout or []), daemon=True)
        reader.start()
        wait_for(lambda: lines, what="the watch's snapshot")
        assert lines[0].startswith("snapshot generation=1 ")
        assert agent.proc is not None
        os.kill(agent.proc.pid, signal.SIGHUP)
        assert watch.wait(60) == 0
        reader.join(30)
        assert lines[1].startswith("unchanged generation=1 ") and "rescanned" in lines[1], lines

        # The log's degraded_sources names degraded sources only, not the absent ones.
        topo = json.loads(memtopo("query", "topology", "--addr", addr, "--format", "json").stdout)
        states = {s["source"]: s["state"] for s in topo["sources"]}
        assert "SOURCE_STATE_UNAVAILABLE" in states.values()  # the capture lacks some vendors
        (published,) = agent.events("generation_published")
        assert sorted(published["degraded_sources"]) == sorted(
            name for name, state in states.items() if state == "SOURCE_STATE_DEGRADED")
    finally:
        agent.stop()




# ---- rollback and a rolled-back plan -------------------------------------------------------------------
def test_rollback_shows_what_the_rollback_changed(tmp_path: Path) -> None:
    """A stand-in machine (tests.apply_fakes): the apply moves the threads 0-7 → 1; the rollback's
    diff reads the other way, 1 → 0-7."""
    from memtopo.cli import apply as apply_cli
    from tests.apply_fakes import machine, plan, threads

    m = machine(tmp_path)
    p = plan("p", threads("t", 100, [1], all=True))
    engine = m.engine()
    applied = apply_cli.render(engine.apply(p), p)
    assert "      - pid 100 (worker) 11 threads [tid 100-110]: cpus 0-7" in applied
    undone = apply_cli.render(engine.rollback("p")).splitlines()
    minus = undone.index("      - pid 100 (worker) 11 threads [tid 100-110]: cpus 1")
    assert undone[minus + 1] == "      + pid 100 (worker) 11 threads [tid 100-110]: cpus 0-7"


def test_applying_a_rolled_back_plan_again_says_it_is_spent_and_fails(tmp_path: Path) -> None:
    child = subprocess.Popen(["sleep", "600"])
    try:
        if len(os.sched_getaffinity(child.pid)) < 2:
            pytest.skip("one CPU: a placement changes nothing to roll back")
        state = str(tmp_path / "state")
        made = memtopo("plan", "place", "--request", "-", "--pid", str(child.pid), "--emit", "plan",
                       stdin='{"cpus": 1}')
        plan_id = json.loads(made.stdout)["plan_id"]
        assert memtopo("apply", "--state-dir", state, "-", stdin=made.stdout).returncode == 0
        assert len(os.sched_getaffinity(child.pid)) == 1
        assert memtopo("rollback", "--state-dir", state, plan_id).returncode == 0
        restored = os.sched_getaffinity(child.pid)
        again = memtopo("apply", "--state-dir", state, "-", stdin=made.stdout)
        no_traceback(again)
        assert again.returncode == 1
        assert "rolled back earlier" in again.stderr and "new plan_id" in again.stderr
        assert os.sched_getaffinity(child.pid) == restored  # nothing was applied
        renamed = json.loads(made.stdout) | {"plan_id": plan_id + "-again"}
        assert memtopo("apply", "--state-dir", state, "-", stdin=json.dumps(renamed)).returncode == 0
        assert len(os.sched_getaffinity(child.pid)) == 1
    finally:
        child.kill()
        child.wait()


def test_applying_a_rolled_back_plan_again_through_the_agent_says_it_is_spent(tmp_path: Path) -> None:
    """The same hint as the local apply when the plan goes through a running agent: the agent's
    resend of a spent plan id answers with the stored rollback, which alone reads like a failure."""
    child = subprocess.Popen(["sleep", "600"])
    agent = None
    try:
        if len(os.sched_getaffinity(child.pid)) < 2:
            pytest.skip("one CPU: a placement changes nothing to roll back")
        state = tmp_path / "state" / "apply"  # the agent's apply state under its state_dir
        made = memtopo("plan", "place", "--request", "-", "--pid", str(child.pid), "--emit", "plan",
                       stdin='{"cpus": 1}')
        plan_id = json.loads(made.stdout)["plan_id"]
        plan_file = tmp_path / "plan.json"
        plan_file.write_text(made.stdout)
        assert memtopo("apply", "--state-dir", str(state), str(plan_file)).returncode == 0
        assert memtopo("rollback", "--state-dir", str(state), plan_id).returncode == 0
        restored = os.sched_getaffinity(child.pid)
        agent = Agent(tmp_path, copy_root(tmp_path), None)
        agent.start()
        addr = f"unix://{agent.sock}"
        again = memtopo("query", "apply", str(plan_file), "--addr", addr)
        no_traceback(again)
        assert again.returncode == 1
        assert "rolled back earlier" in again.stderr and "new plan_id" in again.stderr
        assert os.sched_getaffinity(child.pid) == restored
        fresh = memtopo("query", "apply", str(tmp_path / "missing.json"), "--addr", addr)
        assert fresh.returncode == 2 and "rolled back earlier" not in fresh.stderr
    finally:
        if agent is not None:
            agent.stop()
        child.kill()
        child.wait()
