"""What a newcomer meets first, through the real ``memtopo`` entry point (.venv/bin/memtopo, or
``main([...])`` where the in-process call is the same code): clear errors, honest output."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agents import Agent, copy_root, free_port, wait_for
from tests.controllers import Background, answering_agent, topo
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
BACKGROUNDS: dict[str, Background] = {}


@pytest.fixture
def empty_controller() -> Iterator[str]:
    bg = Background()
    BACKGROUNDS[bg.addr] = bg
    try:
        yield bg.addr
    finally:
        del BACKGROUNDS[bg.addr]
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


def test_controller_nodes_escapes_what_a_terminal_would_act_on_in_node_names(empty_controller: str) -> None:
    """Node names come from the network: U+202E (right-to-left override) and U+0085 (next line) are
    printed as escapes, and the columns stay aligned."""
    bg = BACKGROUNDS[empty_controller]
    hostile = "evil\u202egnp.exe\x85forged"
    bg.run(answering_agent(bg, hostile, topo(1, "a" * 64, numa=2, accel=0)))
    bg.run(answering_agent(bg, "plain", topo(1, "b" * 64, numa=4, accel=1)))
    res = memtopo("controller", "nodes", "--addr", empty_controller)
    assert res.returncode == 0, res.stderr
    assert "\u202e" not in res.stdout and "\x85" not in res.stdout
    header, *rows = res.stdout.splitlines()
    assert sorted(r.split()[0] for r in rows) == ["evil\\u202egnp.exe\\x85forged", "plain"]
    link = header.index("LINK")
    assert all(r[link:].startswith("connected") for r in rows)  # aligned under their header
    js = memtopo("controller", "nodes", "--addr", empty_controller, "--format", "json")
    assert hostile in [n["node_name"] for n in json.loads(js.stdout)["nodes"]]  # JSON escapes, and round-trips
    assert "\u202e" not in js.stdout


# ---- a server that is not there --------------------------------------------------------------------------
def test_a_missing_agent_is_named_with_its_socket_and_how_to_start_one(tmp_path: Path) -> None:
    sock = tmp_path / "agent.sock"
    res = memtopo("query", "topology", "--addr", f"unix://{sock}")
    no_traceback(res)
    assert res.returncode == 1
    assert f"cannot reach the agent at unix://{sock}" in res.stderr and f"no socket {sock}" in res.stderr
    assert "memtopo serve" in res.stderr and "--addr" in res.stderr
    assert "failed to connect to all addresses" not in res.stderr and "FAILED_PRECONDITION" not in res.stderr
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))  # a socket file nobody listens on: what a killed agent leaves
    try:
        res = memtopo("query", "health", "--addr", f"unix://{sock}")
        assert res.returncode == 1 and f"nothing listens on {sock}" in res.stderr
    finally:
        stale.close()


def test_a_missing_controller_is_named_with_its_address_and_how_to_start_one() -> None:
    port = free_port()
    res = memtopo("controller", "nodes", "--addr", f"127.0.0.1:{port}")
    no_traceback(res)
    assert res.returncode == 3
    assert res.stderr == (f"memtopo: cannot reach the controller at 127.0.0.1:{port} (UNAVAILABLE): nothing listens "
                          "there (connection refused); start it with `memtopo controller serve` (or `bash "
                          "tools/run.sh`, which embeds one), or give --addr\n")


def test_the_standalone_controller_logs_json_like_the_agent() -> None:
    proc = subprocess.Popen([str(MEMTOPO), "controller", "serve", "--listen", f"127.0.0.1:{free_port()}",
                             "--http", ""], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["event"] == "controller_listening" and first["level"] == "info" and "timestamp" in first
        assert list(first)[:3] == ["timestamp", "level", "event"]  # the agent's order
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert [json.loads(line)["event"] for line in out.splitlines()] == ["controller_stopped"]


# ---- the main job: serve --with-controller (tools/run.sh) ---------------------------------------------
def serve_config(tmp_path: Path, health_port: int, extra: str = "") -> Path:
    """An agent on a copied capture, its sockets and state under ``tmp_path``."""
    config = tmp_path / "agent.toml"
    config.write_text(f'node_name = "main-job"\nroot = "{copy_root(tmp_path)}"\nstate_dir = "{tmp_path / "state"}"\n'
                      f'[listen]\nsocket = "{tmp_path / "agent.sock"}"\n'
                      f'read_socket = "{tmp_path / "agent-read.sock"}"\n{extra}\n'
                      f'[discovery]\nudev = false\n[health]\nlisten = "127.0.0.1:{health_port}"\n')
    return config


def left_behind(tmp_path: Path) -> list[str]:
    """Socket files and the front's private directories: what a stopped agent must not leave."""
    return sorted(p.name for p in tmp_path.iterdir() if p.is_socket() or p.name.startswith(".memtopo-grpc"))


@pytest.mark.parametrize("taken", ["--with-controller", "--controller-http", "health.listen"])
def test_serve_with_controller_on_a_taken_port_starts_nothing_and_exits_78(tmp_path: Path, taken: str) -> None:
    """Every address is checked before anything starts: the one another process holds is named with
    its option or key, nothing was discovered or listened on, and no socket file is left."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    busy = holder.getsockname()[1]
    try:
        ports = {key: busy if key == taken else free_port()
                 for key in ("--with-controller", "--controller-http", "health.listen")}
        config = serve_config(tmp_path, ports["health.listen"])
        res = memtopo("serve", "--config", str(config), "--with-controller", f"127.0.0.1:{ports['--with-controller']}",
                      "--controller-http", f"127.0.0.1:{ports['--controller-http']}")
    finally:
        holder.close()
    no_traceback(res)
    source = str(config) if taken == "health.listen" else "command line"
    assert (res.returncode, res.stderr) == (78, f"memtopo: {source}: {taken}: 127.0.0.1:{busy}: address already in "
                                                f"use\n")
    assert res.stdout == ""  # no log event: nothing had started
    assert left_behind(tmp_path) == []


def test_serve_refuses_one_address_for_two_listeners(tmp_path: Path) -> None:
    port = free_port()
    res = memtopo("serve", "--config", str(serve_config(tmp_path, port)),
                  "--with-controller", f"127.0.0.1:{free_port()}", "--controller-http", f"127.0.0.1:{port}")
    assert res.returncode == 78 and "--controller-http" in res.stderr and "also given as health.listen" in res.stderr
    assert left_behind(tmp_path) == []


def test_check_free_names_the_key_of_each_address_it_cannot_have() -> None:
    from memtopo.ports import AddressInUseError, check_free

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    busy = f"127.0.0.1:{holder.getsockname()[1]}"
    try:
        cases = {"taken": ({"a": f"127.0.0.1:{free_port()}", "b": busy}, "b", "address already in use"),
                 "twice": ({"a": "127.0.0.1:1", "b": "unix:/x", "c": "127.0.0.1:1"}, "c", "also given as a"),
                 "not here": ({"a": "192.0.2.1:80"}, "a", "cannot assign requested address"),
                 "no such name": ({"a": "no-such-host.invalid:80"}, "a", "cannot resolve no-such-host.invalid")}
        for what, (addresses, key, reason) in cases.items():
            with pytest.raises(AddressInUseError) as err:
                check_free(addresses)
            assert err.value.key == key and reason in str(err.value), what
        check_free({"a": "127.0.0.1:0", "b": "", "c": "unix:/run/x.sock", "d": f"localhost:{free_port()}"})
    finally:
        holder.close()
    check_free({"b": busy})  # let go: free again


def test_a_listener_failing_after_the_controller_started_unwinds_it(tmp_path: Path) -> None:
    """A read socket that cannot be created fails after the embedded controller is up and the agent's
    own socket exists: both are taken down again, exit 78 naming the key."""
    (tmp_path / "file").write_text("not a directory\n")
    config = serve_config(tmp_path, free_port())
    config.write_text(config.read_text().replace(str(tmp_path / "agent-read.sock"), str(tmp_path / "file/r.sock")))
    res = memtopo("serve", "--config", str(config), "--with-controller", f"127.0.0.1:{free_port()}",
                  "--controller-http", "")
    no_traceback(res)
    assert res.returncode == 78 and "listen.read_socket" in res.stderr, res.stderr
    events = [json.loads(line)["event"] for line in res.stdout.splitlines()]
    assert "controller_listening" in events and "controller_stopped" in events
    assert left_behind(tmp_path) == []


def test_run_sh_takes_serve_options_and_its_banner_names_what_the_agent_bound(tmp_path: Path) -> None:
    """The main job with other ports: the banner comes from the running agent, after it bound, and
    every command it shows works as printed."""
    grpc_port, http_port, health_port = free_port(), free_port(), free_port()
    config = serve_config(tmp_path, health_port)
    proc = subprocess.Popen(["bash", "tools/run.sh", "--config", str(config), "--with-controller",
                             f"127.0.0.1:{grpc_port}", "--controller-http", f"127.0.0.1:{http_port}"],
                            cwd=REPO, env={**os.environ, "MEMTOPO_LINK": "0"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    banner: list[str] = []
    lines: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
    reader.start()
    try:
        # What setup says first (a reinstall's pip notes) comes before the banner.
        wait_for(lambda: any(line.startswith("Ctrl-C") for line in lines), timeout=300, what="the banner")
        start = next(i for i, line in enumerate(lines) if line.startswith("memtopo: the agent serves"))
        banner = [line.rstrip("\n") for line in lines[start:]]
        text = "\n".join(banner)
        assert banner and banner[0].startswith("memtopo: the agent serves generation 1"), text
        assert f"--addr unix://{tmp_path / 'agent.sock'}" in text
        assert f"--addr unix://{tmp_path / 'agent-read.sock'}" in text
        assert f"controller nodes --addr 127.0.0.1:{grpc_port}" in text
        assert f"curl -s http://127.0.0.1:{health_port}/readyz" in text
        assert f"open http://127.0.0.1:{http_port}/ in a browser" in text
        assert not any(default in text for default in ("9470", "9471", "9464", "/run/memtopo"))
        commands = [line.split("#")[0].split() for line in banner if "query" in line or "controller nodes" in line]
        assert len(commands) == 5
        for argv in commands:
            if argv[1:3] == ["query", "watch"]:
                argv += ["--count", "1"]
            ran = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
            assert ran.returncode == 0, (argv, ran.stderr)
        assert "main-job" in subprocess.run(commands[-1], capture_output=True, text=True, timeout=120,
                                            check=False).stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0
    assert left_behind(tmp_path) == []


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
