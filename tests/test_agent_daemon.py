"""The daemon in this process against a captured root: what it does when one of its background
tasks ends before a stop was asked for."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import structlog

from memtopo.agent.config import load_config
from memtopo.agent.daemon import EXIT_FAILURE, EXIT_OK, Agent
from memtopo.agent.sdnotify import Notifier
from tests.fixtures import lab_root


def _agent(tmp_path: Path) -> Agent:
    config = tmp_path / "agent.toml"
    config.write_text(
        f'node_name = "inproc"\nroot = "{lab_root("dual-socket-cxl")}"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[listen]\nsocket = "{tmp_path / "agent.sock"}"\n'
        '[discovery]\ndebounce_seconds = 0.0\nudev = false\n[health]\nlisten = ""\n')
    return Agent(load_config(config), notifier=Notifier(None))


def _run(agent: Agent, after_ready: Any) -> int:
    async def main() -> int:
        run = asyncio.create_task(agent.run())
        while agent.server is None or agent.state.current is None:
            assert not run.done(), run.result()
            await asyncio.sleep(0.01)
        after_ready()
        return await asyncio.wait_for(run, 30)
    return asyncio.run(main())


def test_a_rescan_loop_that_dies_stops_the_agent_with_a_failure(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinging the watchdog on without the loop would serve a frozen topology as healthy; exit 1 lets
    systemd (Restart=on-failure) start a whole agent again."""
    agent = _agent(tmp_path)
    real = Agent._discover_and_publish

    async def discover_once(self: Agent, ctx: Any, reason: str) -> None:
        if reason == "start":
            await real(self, ctx, reason)
            return
        raise RuntimeError("bug in a rescan")

    monkeypatch.setattr(Agent, "_discover_and_publish", discover_once)
    with structlog.testing.capture_logs() as logs:
        code = _run(agent, lambda: agent.request_rescan("test"))
    assert code == EXIT_FAILURE
    ended = [e for e in logs if e["event"] == "agent_task_ended"]
    assert ended and ended[0]["task"] == "rescan_loop" and "bug in a rescan" in ended[0]["error"]
    assert [e for e in logs if e["event"] == "agent_stopped"]  # the orderly shutdown still ran


def test_a_requested_stop_is_a_clean_exit(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    with structlog.testing.capture_logs() as logs:
        code = _run(agent, agent.request_stop)
    assert code == EXIT_OK
    assert not [e for e in logs if e["event"] == "agent_task_ended"]


def _enforcing_agent(tmp_path: Path, with_seams: bool) -> Agent:
    from tests.enforce_standins import StandinPods, StandinReporter

    config = tmp_path / "agent.toml"
    config.write_text(
        f'node_name = "inproc"\nroot = "{lab_root("dual-socket-cxl")}"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[listen]\nsocket = "{tmp_path / "agent.sock"}"\n'
        '[discovery]\ndebounce_seconds = 0.0\nudev = false\n[health]\nlisten = ""\n'
        f'[kubernetes]\nenforce = true\nruntime_endpoint = "unix://{tmp_path}/none.sock"\n'
        'enforce_interval_seconds = 0.1\n')
    seams: dict[str, Any] = {"pod_source": StandinPods(), "pod_reporter": StandinReporter()} if with_seams else {}
    return Agent(load_config(config), notifier=Notifier(None), **seams)


def test_enforce_without_a_pod_source_says_so_and_serves(tmp_path: Path) -> None:
    agent = _enforcing_agent(tmp_path, with_seams=False)
    seen: dict[str, Any] = {}

    def check() -> None:
        seen["ready"] = agent.ready()
        agent.request_stop()

    with structlog.testing.capture_logs() as logs:
        assert _run(agent, check) == EXIT_OK
    ready, checks = seen["ready"]
    assert ready and checks["enforce"] == "no pod source: nothing is enforced"
    assert [e for e in logs if e["event"] == "enforce_without_pod_source"]


def test_enforce_runs_beside_the_agent_and_reports_in_readyz(tmp_path: Path) -> None:
    """The captured root has no kubelet configuration: the enforcement changes nothing and says why,
    and the agent stays ready and stops cleanly with the enforcement task running."""
    agent = _enforcing_agent(tmp_path, with_seams=True)
    seen: dict[str, Any] = {}

    async def settle() -> None:
        while agent.enforcer is None or agent.enforcer.last.state == "waiting":
            await asyncio.sleep(0.02)

    def done(_task: asyncio.Task[None]) -> None:
        seen["ready"] = agent.ready()
        agent.request_stop()

    def check() -> None:
        asyncio.get_running_loop().create_task(settle()).add_done_callback(done)

    assert _run(agent, check) == EXIT_OK
    ready, checks = seen["ready"]
    assert ready and checks["enforce"].startswith("config_unreadable: kubelet configuration: no kubelet config")
