"""The daemon in this process against a captured root: what it does when one of its background
tasks ends before a stop was asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog

from memtopo.agent.daemon import EXIT_FAILURE, EXIT_OK, Agent
from tests.agents import inproc_agent, run_agent


def test_a_rescan_loop_that_dies_stops_the_agent_with_a_failure(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinging the watchdog on without the loop would serve a frozen topology as healthy; exit 1 lets
    systemd (Restart=on-failure) start a whole agent again."""
    agent = inproc_agent(tmp_path)
    real = Agent._discover_and_publish

    async def discover_once(self: Agent, ctx: Any, reason: str) -> None:
        if reason == "start":
            await real(self, ctx, reason)
            return
        raise RuntimeError("bug in a rescan")

    monkeypatch.setattr(Agent, "_discover_and_publish", discover_once)
    with structlog.testing.capture_logs() as logs:
        code = run_agent(agent, lambda: agent.request_rescan("test"))
    assert code == EXIT_FAILURE
    ended = [e for e in logs if e["event"] == "agent_task_ended"]
    assert ended and ended[0]["task"] == "rescan_loop" and "bug in a rescan" in ended[0]["error"]
    assert [e for e in logs if e["event"] == "agent_stopped"]  # the orderly shutdown still ran


def test_a_requested_stop_is_a_clean_exit(tmp_path: Path) -> None:
    agent = inproc_agent(tmp_path)
    with structlog.testing.capture_logs() as logs:
        code = run_agent(agent, agent.request_stop)
    assert code == EXIT_OK
    assert not [e for e in logs if e["event"] == "agent_task_ended"]
