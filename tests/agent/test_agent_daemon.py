"""The daemon in this process against a captured root: what it does when one of its background
tasks fails or ends before a stop was asked for (it is started again; the agent goes on serving)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import structlog

from memtopo.agent.daemon import EXIT_OK, Agent
from memtopo.agent.enforce import EngineMigrator
from memtopo.agent.tasks import Supervisor
from memtopo.backoff import Backoff
from memtopo.discovery.changes import Change
from tests.agents import inproc_agent, run_agent


def test_a_failing_rescan_loop_is_restarted_and_shown_while_the_agent_keeps_serving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A background task's failure never stops the daemon: the loop is started again after a backoff,
    /readyz names it and its cause, the restarts are counted, and the cause is logged once."""
    agent = inproc_agent(tmp_path)
    seen: dict[str, Any] = {}

    def restarted(name: str) -> None:
        agent.metrics.task_restarts.labels(name).inc()
        seen.setdefault("down", agent.ready())  # as /readyz answers while the task waits to restart

    agent.tasks = Supervisor(agent._stop.is_set, restarted, backoff=Backoff(0.01, 0.02))
    real = Agent._discover_and_publish
    failures: list[str] = []
    worked: list[str] = []

    async def discover(self: Agent, ctx: Any, change: Change) -> None:
        reason = ",".join(change.reasons)
        if change.reasons != ("start",) and len(failures) < 3:
            failures.append(reason)
            raise RuntimeError("bug in a rescan: " + "\x1b[2J" * 500)  # a cause that would flood a log
        await real(self, ctx, change)
        worked.append(reason)

    monkeypatch.setattr(Agent, "_discover_and_publish", discover)

    async def exercise() -> None:
        for i in range(3):
            agent.request_rescan("test")
            await _until(lambda n=i + 1: len(failures) == n)
        await _until(lambda: agent.tasks.states["rescan_loop"].down_until is None and agent.tasks.states[
            "rescan_loop"].restarts == 3)
        agent.request_rescan("test")  # the fourth rescan works again
        await _until(lambda: len(worked) == 2)
        seen["after"] = agent.ready()
        seen["metrics"] = agent.metrics.render()[0].decode()
        agent.request_stop()

    with structlog.testing.capture_logs() as logs:
        code = _run_async(agent, exercise)
    assert code == EXIT_OK
    ready, checks = seen["down"]
    text = checks["task_rescan_loop"]
    assert not ready and text.startswith("down after RuntimeError: bug in a rescan: \\x1b[2J")
    assert "(at test_agent_daemon.py:" in text and len(text) < 300
    ready, checks = seen["after"]
    assert not ready and checks["task_rescan_loop"].startswith("running; restarted 3 times")
    assert 'memtopo_agent_task_restarts_total{task="rescan_loop"} 3.0' in seen["metrics"]
    failed = [e for e in logs if e["event"] == "agent_task_failed"]
    assert len(failed) == 1 and failed[0]["task"] == "rescan_loop" and len(failed[0]["cause"]) < 250
    assert [e for e in logs if e["event"] == "agent_stopped"]


def test_a_task_that_ends_early_is_restarted_too() -> None:
    async def main() -> None:
        stop = asyncio.Event()
        runs: list[int] = []

        async def job() -> None:
            runs.append(1)
            if len(runs) == 3:
                await stop.wait()

        supervisor = Supervisor(stop.is_set, backoff=Backoff(0.01, 0.01))
        supervisor.start("short", job)
        await asyncio.wait_for(_until_async(lambda: len(runs) == 3), 30)
        assert supervisor.states["short"].restarts == 2
        assert "it ended before the agent stopped" in supervisor.checks()["task_short"][1]
        stop.set()
        await supervisor.stop()
    asyncio.run(main())


async def _until_async(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def _until(cond: Any) -> None:
    await asyncio.wait_for(_until_async(cond), 30)


def _run_async(agent: Agent, after_ready: Any) -> int:
    async def main() -> int:
        run = asyncio.create_task(agent.run())
        while agent.server is None or agent.state.current is None:
            assert not run.done(), run.result()
            await asyncio.sleep(0.01)
        await after_ready()
        return await asyncio.wait_for(run, 30)
    return asyncio.run(main())


def test_a_requested_stop_is_a_clean_exit(tmp_path: Path) -> None:
    agent = inproc_agent(tmp_path)
    with structlog.testing.capture_logs() as logs:
        code = run_agent(agent, agent.request_stop)
    assert code == EXIT_OK
    assert not [e for e in logs if e["event"] == "agent_task_failed"]


def _enforcing_agent(tmp_path: Path, with_seams: bool) -> Agent:
    from bench.enforce_standins import StandinPods, StandinReporter

    seams: dict[str, Any] = {"pod_source": StandinPods(), "pod_reporter": StandinReporter()} if with_seams else {}
    return inproc_agent(tmp_path, f'[kubernetes]\nenforce = true\nruntime_endpoint = "unix://{tmp_path}/none.sock"\n'
                                  'enforce_interval_seconds = 0.1\n', **seams)


def test_enforce_without_an_api_server_says_so_and_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a cluster, with no kubernetes.api_server, the pods bound to the node cannot be read."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    agent = _enforcing_agent(tmp_path, with_seams=False)
    seen: dict[str, Any] = {}

    def check() -> None:
        seen["ready"] = agent.ready()
        agent.request_stop()

    with structlog.testing.capture_logs() as logs:
        assert run_agent(agent, check) == EXIT_OK
    ready, checks = seen["ready"]
    assert ready and checks["enforce"] == ("no pod source: find the API server: not in a cluster: "
                                           "KUBERNETES_SERVICE_HOST/PORT are not set; nothing is enforced")
    assert "enforce_pods" not in checks
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

    assert run_agent(agent, check) == EXIT_OK
    ready, checks = seen["ready"]
    assert ready and checks["enforce"].startswith("config_unreadable: kubelet configuration: no kubelet config")
    # A pinned container's memory is moved through the agent's own apply engine.
    assert agent.enforcer is not None and isinstance(agent.enforcer.migrate, EngineMigrator)
    assert agent.enforcer.migrate.engine is agent.engine
