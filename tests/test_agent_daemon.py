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
from memtopo.discovery.changes import Change
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

    async def discover_once(self: Agent, ctx: Any, change: Change) -> None:
        if change.reasons == ("start",):
            await real(self, ctx, change)
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
