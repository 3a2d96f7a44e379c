"""The informer (``memtopo.k8s.informer``: list, then watch from the list's version, resume, relist on
410) against the STAND-IN API server (bench/k8s_standin.py; not a Kubernetes API server, none can run
here), which breaks its watches, compacts its history, answers 500s and garbage, and hangs on demand."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import pytest
import structlog

from bench.k8s_standin import StandInApiServer
from memtopo.backoff import Backoff
from memtopo.k8s import kubeapi
from memtopo.k8s.informer import Informer, object_key
from memtopo.k8s.kubeapi import KubeApi

WAIT = 60.0  # generous: ends a hang, never a speed assertion
FAST = Backoff(0.01, 0.05)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 180))


def pod(name: str, cpus: str = "1", node: str = "n1", app: str = "x") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {"app": app}, "annotations": {}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"requests": {"cpu": cpus}}}]},
            "status": {"phase": "Running"}}


@dataclass(frozen=True)
class Cpus:
    """What a consumer keeps of a pod: its node and CPU request, not the pod."""

    node: str
    cpus: int


def cpus_of(obj: dict[str, Any]) -> Cpus | Exception:
    text = obj["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    if not text.isdigit():
        return ValueError(f"cpu {text!r} is not a whole number")
    return Cpus(obj["spec"]["nodeName"], int(text))


class Recorder:
    def __init__(self) -> None:
        self.upserts: list[tuple[str, Any]] = []
        self.deletes: list[tuple[str, Any]] = []

    def upsert(self, key: str, value: Any) -> None:
        self.upserts.append((key, value))

    def delete(self, key: str, value: Any) -> None:
        self.deletes.append((key, value))


async def eventually(cond: Callable[[], bool]) -> None:
    async def loop() -> None:
        while not cond():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(loop(), WAIT)


class Setup:
    def __init__(self, server: StandInApiServer, api: KubeApi, informer: Informer[Cpus], rec: Recorder) -> None:
        self.server, self.api, self.informer, self.rec = server, api, informer, rec
        self.task = asyncio.create_task(informer.run())

    async def close(self) -> None:
        self.informer.stop()
        await asyncio.wait_for(self.task, WAIT)
        await self.api.close()
        await self.server.stop()


async def setup(*pods: dict[str, Any], timeout_s: float = 10.0, **kwargs: Any) -> Setup:
    server = StandInApiServer()
    url = await server.start()
    for p in pods:
        server.put_pod(p)
    api = KubeApi(url, timeout_s=timeout_s)
    rec = Recorder()
    kwargs.setdefault("backoff", FAST)
    informer: Informer[Cpus] = Informer(api, kubeapi.core("pods"), cpus_of, on_upsert=rec.upsert,
                                        on_delete=rec.delete, rng=random.Random(7), **kwargs)
    return Setup(server, api, informer, rec)


def test_lists_then_watches_from_the_lists_version_and_keeps_only_the_derived_values() -> None:
    async def main() -> None:
        s = await setup(pod("a", "2"), pod("b", "4"), pod("c", "1", app="y"), label_selector="app=x", page_size=1)
        assert await s.informer.wait_synced(WAIT)
        assert dict(s.informer.items()) == {"default/a": Cpus("n1", 2), "default/b": Cpus("n1", 4)}
        st = s.informer.status()
        assert st.synced and st.stale_since is None and st.relists == 0 and st.objects == 2
        lists = [r for r in s.server.requests if r.query.get("watch") != "true"]
        assert [r.query.get("limit") for r in lists] == ["1", "1"]  # paged
        await eventually(lambda: bool(s.server.watches()))
        assert s.server.watches()[0].query["resourceVersion"] == st.resource_version == "3"
        assert s.server.watches()[0].query["labelSelector"] == "app=x"
        s.server.put_pod(pod("a", "8"))
        s.server.put_pod(pod("d", "1"))
        s.server.put_pod(pod("e", "1", app="y"))  # not selected
        s.server.delete_pod("default", "b")
        await eventually(lambda: len(s.rec.deletes) == 1)
        assert dict(s.informer.items()) == {"default/a": Cpus("n1", 8), "default/d": Cpus("n1", 1)}
        assert s.rec.upserts == [("default/a", Cpus("n1", 2)), ("default/b", Cpus("n1", 4)),
                                 ("default/a", Cpus("n1", 8)), ("default/d", Cpus("n1", 1))]
        assert s.rec.deletes == [("default/b", Cpus("n1", 4))]
        assert s.informer.status().resource_version == str(s.server.resource_version)
        await s.close()
    run(main)


def test_an_update_while_the_watch_is_down_is_seen_after_it_resumes_without_a_relist() -> None:
    async def main() -> None:
        s = await setup(pod("a", "2"))
        await s.informer.wait_synced(WAIT)
        await eventually(lambda: len(s.server.watches()) == 1)
        s.server.put_pod(pod("a", "3"))
        await eventually(lambda: s.informer.get("default/a") == Cpus("n1", 3))
        seen = s.informer.status().resource_version
        # The watch breaks mid-stream and the next two tries fail; meanwhile "a" changes again.
        s.server.inject("status", status=500, path="/api/v1/pods", times=2)
        s.server.drop_watches()
        await eventually(lambda: s.informer.status().stale_since is not None)
        s.server.put_pod(pod("a", "6"))
        await eventually(lambda: s.informer.get("default/a") == Cpus("n1", 6))
        st = s.informer.status()
        assert st.relists == 0 and st.restarts >= 1 and st.stale_since is None
        resumed = [r for r in s.server.watches() if r.status == 200][-1]
        assert resumed.query["resourceVersion"] == seen  # from the last version seen, not a new list
        assert "HTTP 500" in st.last_error or "broke off" in st.last_error
        await s.close()
    run(main)


def test_bookmarks_advance_the_version_a_watch_resumes_from() -> None:
    async def main() -> None:
        s = await setup(pod("a"))
        await s.informer.wait_synced(WAIT)
        await eventually(lambda: len(s.server.watches()) == 1)
        s.server.put_pod(pod("other", app="y"))  # changes the version, but not a selected object...
        s.server.put_pod(pod("a", "5"))
        await eventually(lambda: s.informer.get("default/a") == Cpus("n1", 5))
        s.server.bookmark()
        await eventually(lambda: s.informer.status().resource_version == str(s.server.resource_version))
        version = s.server.resource_version
        s.server.drop_watches()
        await eventually(lambda: len([r for r in s.server.watches() if r.status == 200]) == 2)
        assert s.server.watches()[-1].query["resourceVersion"] == str(version)
        await s.close()
    run(main)


@pytest.mark.parametrize("as_event", [False, True])
def test_a_410_relists_and_what_vanished_meanwhile_is_deleted(as_event: bool) -> None:
    async def main() -> None:
        s = await setup(pod("a"), pod("b"))
        s.server.gone_as_event = as_event
        await s.informer.wait_synced(WAIT)
        await eventually(lambda: len(s.server.watches()) == 1)
        # While the watch is down, the server forgets its history: the old version is gone.
        s.server.inject("status", status=503, path="/api/v1/pods")
        s.server.drop_watches()
        await eventually(lambda: s.informer.status().stale_since is not None)
        s.server.delete_pod("default", "b")
        s.server.put_pod(pod("c", "7"))
        s.server.compact()
        await eventually(lambda: s.informer.status().relists == 1 and s.informer.status().stale_since is None)
        assert dict(s.informer.items()) == {"default/a": Cpus("n1", 1), "default/c": Cpus("n1", 7)}
        assert s.rec.deletes == [("default/b", Cpus("n1", 1))]
        assert s.rec.upserts[-1] == ("default/c", Cpus("n1", 7))
        assert [k for k, _ in s.rec.upserts].count("default/a") == 1  # unchanged by the relist: no callback
        await s.close()
    run(main)


def test_server_errors_back_off_capped_and_attempts_start_over_after_a_good_watch() -> None:
    class Recording(Backoff):
        def __init__(self) -> None:
            super().__init__(0.01, 0.04)
            object.__setattr__(self, "attempts", [])

        def delay(self, attempt: int, rng: random.Random) -> float:
            self.attempts.append(attempt)  # type: ignore[attr-defined]
            return super().delay(attempt, rng)

    async def main() -> None:
        backoff = Recording()
        s = await setup(pod("a"), backoff=backoff)
        s.server.inject("status", status=500, path="/api/v1/pods", times=4)
        with structlog.testing.capture_logs() as logs:
            assert await s.informer.wait_synced(WAIT)
            assert backoff.attempts == [0, 1, 2, 3]  # type: ignore[attr-defined]
            await eventually(lambda: len(s.server.watches()) == 1)
            s.server.put_pod(pod("a", "2"))
            await eventually(lambda: s.informer.get("default/a") == Cpus("n1", 2))
            s.server.inject("status", status=503, path="/api/v1/pods")
            s.server.drop_watches()
            # The broken watch had worked: its retry is a first try again, then the 503 the second.
            await eventually(lambda: s.informer.status().stale_since is None and len(backoff.attempts) == 6)  # type: ignore[attr-defined]
        assert backoff.attempts[4:] == [0, 1]  # type: ignore[attr-defined]
        for attempt in range(8):
            assert 0.005 <= Backoff(0.01, 0.04).delay(attempt, random.Random(attempt)) <= 0.04
        # One warning per distinct cause, not one per try.
        failed = [e for e in logs if e["event"] == "informer_failed"]
        assert len([e for e in failed if "HTTP 500" in e["error"]]) == 1
        await s.close()
    run(main)


def test_garbage_a_hang_and_a_broken_watch_are_survived() -> None:
    async def main() -> None:
        s = await setup(pod("a"), timeout_s=1.0)
        s.server.inject("garbage", body=b"\xff\xfe\x00 not json", path="/api/v1/pods")
        s.server.inject("hang", path="/api/v1/pods")
        assert await s.informer.wait_synced(WAIT)
        assert s.informer.status().restarts == 0
        await eventually(lambda: len(s.server.watches()) == 1)
        s.server.inject("watch_line", body=b'{"type": "MODIFIED", "object": "not an object"}')
        s.server.put_pod(pod("a", "2"))
        await eventually(lambda: s.informer.get("default/a") == Cpus("n1", 2))
        assert s.informer.status().relists == 0  # resumed from its version, not listed again
        s.server.inject("drop", body=b'{"items": [', path="/api/v1/pods", method="GET")
        s.server.drop_watches()
        s.server.put_pod(pod("a", "3"))
        await eventually(lambda: s.informer.get("default/a") == Cpus("n1", 3))
        await s.close()
    run(main)


def test_a_bad_object_is_kept_as_its_error_and_the_stream_goes_on() -> None:
    async def main() -> None:
        s = await setup(pod("a", "half"), pod("b", "2"))

        def explode(key: str, value: Any) -> None:
            raise RuntimeError("consumer bug")

        s.informer._on_delete = explode  # a callback that raises is logged, not fatal
        assert await s.informer.wait_synced(WAIT)
        bad = s.informer.get("default/a")
        assert isinstance(bad, ValueError) and "half" in str(bad)
        assert s.informer.status().errors == 1
        s.server.put_pod(pod("a", "3"))
        s.server.delete_pod("default", "b")
        s.server.put_pod(pod("c", "1"))
        await eventually(lambda: s.informer.get("default/c") == Cpus("n1", 1))
        assert s.informer.get("default/a") == Cpus("n1", 3) and s.informer.get("default/b") is None
        assert s.informer.status().errors == 0
        await s.close()
    run(main)


def test_keys_are_client_gos() -> None:
    assert object_key({"metadata": {"name": "a", "namespace": "ns"}}) == "ns/a"
    assert object_key({"metadata": {"name": "node-1"}}) == "node-1"
    assert object_key({"metadata": {}}) is None and object_key({"metadata": "x"}) is None
