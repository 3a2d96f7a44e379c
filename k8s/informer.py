"""List and watch one Kubernetes resource, the way client-go's reflector does, keeping a compact store.

An :class:`Informer` lists the resource (paged; label and field selectors), then watches from the
list's resourceVersion. A watch that ends (the server's ``timeoutSeconds``) is started again from the
last version seen, bookmarks included, so nothing that changed meanwhile is missed; a watch that breaks
(connection lost, 5xx, garbage, a hang past its deadline) is started again the same way after a
capped, jittered backoff. A 410 Gone (the version is older than the server keeps) lists again, and
objects that vanished meanwhile are deleted from the store.

Every object goes through ``transform(obj) -> T | Exception`` as it arrives and only its result is
kept, so a consumer holds compact derived values, never the raw JSON (the scheduler extender keeps
10,000 NodeResourceTopologies this way). A transform that raises or returns an Exception keeps that
error as the object's value: one bad object never stops the stream. ``on_upsert(key, value)`` and
``on_delete(key, value)`` are called on the loop as the store changes (a relist calls them for what
it changed only); a callback that raises is logged, not fatal. :meth:`Informer.status` says whether
the store is synced, since when it has been stale, the last error, and how often it relisted and
restarted its watch, for ``/readyz`` and metrics.

Keys are client-go's: ``namespace/name``, or ``name`` for cluster-scoped objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import structlog

from memtopo.backoff import Backoff
from memtopo.k8s.kubeapi import (
    DEFAULT_PAGE_SIZE,
    DEFAULT_WATCH_SECONDS,
    ApiPath,
    KubeApi,
    KubeApiError,
    error_of_status,
)
from memtopo.text import excerpt, shorten

log = structlog.get_logger("memtopo.k8s.informer")

# A watch that ends this soon with nothing in it is a failure (backoff), not a normal end: a server
# closing every watch at once would otherwise be asked again in a tight loop.
MIN_WATCH_SECONDS: Final = 1.0
ERROR_CHARS: Final = 200
DEFAULT_BACKOFF: Final = Backoff(0.5, 30.0)


@dataclass(frozen=True)
class InformerStatus:
    """A snapshot of an informer's health. Times are ``time.monotonic()`` seconds (the informer's clock)."""

    synced: bool  # a complete list has been stored (the store may since be stale: see stale_since)
    synced_at: float | None  # when the last complete list was stored
    stale_since: float | None  # when the stream broke; None while a watch is open
    last_error: str  # short, escaped; "" before any error
    relists: int  # lists after the first (410 Gone)
    restarts: int  # watches started again after one ended or broke
    objects: int
    errors: int  # objects whose transform failed (kept as their error)
    resource_version: str

    def stale_for(self, now: float) -> float:
        return 0.0 if self.stale_since is None else now - self.stale_since


def object_key(obj: Mapping[str, Any]) -> str | None:
    """client-go's key: ``namespace/name`` or ``name``; None when the object has no usable name."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return None
    name, namespace = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str) or not name:
        return None
    return f"{namespace}/{name}" if isinstance(namespace, str) and namespace else name


def _version(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return version if isinstance(version, str) else ""


class Informer[T]:
    """One resource (``path``: a collection, e.g. ``kubeapi.nrt_path()`` or ``kubeapi.core("pods")``)
    kept in a store of ``transform``'s results. Run :meth:`run` as a task; :meth:`stop` ends it."""

    def __init__(self, api: KubeApi, path: ApiPath, transform: Callable[[dict[str, Any]], T | Exception], *,
                 label_selector: str = "", field_selector: str = "",
                 on_upsert: Callable[[str, T | Exception], None] | None = None,
                 on_delete: Callable[[str, T | Exception], None] | None = None,
                 page_size: int = DEFAULT_PAGE_SIZE, watch_seconds: int = DEFAULT_WATCH_SECONDS,
                 backoff: Backoff = DEFAULT_BACKOFF, min_watch_seconds: float = MIN_WATCH_SECONDS,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.api = api
        self.path = path
        self.name = str(path)
        self._transform = transform
        self._params = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        self._on_upsert = on_upsert
        self._on_delete = on_delete
        self._page_size = page_size
        self._watch_seconds = watch_seconds
        self._backoff = backoff
        self._min_watch = min_watch_seconds
        self._clock = clock
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self._store: dict[str, T | Exception] = {}
        self._versions: dict[str, str] = {}
        self._errors = 0
        self._version = ""
        self._synced_at: float | None = None
        self._stale_since: float | None = None
        self._last_error = ""
        self._logged_cause = ""
        self._relists = -1  # the first list is not a relist
        self._restarts = -1  # nor the first watch a restart
        self._watch_events = 0  # of the current watch, bookmarks included
        self._stop = asyncio.Event()
        self._synced = asyncio.Event()

    # ---- the store (read on the loop) ---------------------------------------------------------------
    def get(self, key: str) -> T | Exception | None:
        return self._store.get(key)

    def items(self) -> Mapping[str, T | Exception]:
        """A read-only view of the store (it changes as events arrive; copy it to keep a snapshot)."""
        return MappingProxyType(self._store)

    def __len__(self) -> int:
        return len(self._store)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._store))

    def status(self) -> InformerStatus:
        return InformerStatus(self._synced_at is not None, self._synced_at, self._stale_since, self._last_error,
                              max(self._relists, 0), max(self._restarts, 0), len(self._store), self._errors,
                              self._version)

    async def wait_synced(self, timeout: float | None = None) -> bool:
        """True once a complete list is stored (False after ``timeout`` seconds without one)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._synced.wait()
        return self._synced.is_set()

    def stop(self) -> None:
        self._stop.set()

    # ---- the loop -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """List, then watch, forever (until :meth:`stop`); never raises for what the server does."""
        attempts = 0
        must_list = True
        while not self._stop.is_set():
            try:
                if must_list:
                    if not await self._unless_stopped(self._list()):
                        return
                    must_list = False
                started = self._clock()
                self._watch_events = 0
                watched = await self._unless_stopped(self._watch())
                if watched is None:
                    return
                events = watched
                if not events and self._clock() - started < self._min_watch:
                    raise KubeApiError("unreachable", f"watch {self.path}", "the watch ended at once, with nothing")
                attempts = 0
                continue  # a watch that ended in time: watch again from where it stopped
            except KubeApiError as exc:
                if self._watch_events:
                    attempts = 0  # it did work for a while: the next try is a first one again
                self._failed(str(exc))
                if exc.kind == "gone":
                    must_list = True
                    self._version = ""
                    if attempts == 0:  # expected now and then: list again at once, the first time
                        attempts += 1
                        continue
            except Exception as exc:  # a bug here must not end the stream either
                self._failed(f"{type(exc).__name__}: {shorten(str(exc), ERROR_CHARS)}")
            delay = self._backoff.delay(attempts, self._rng)
            attempts += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stop.wait()

    async def _unless_stopped[R](self, work: Coroutine[Any, Any, R]) -> R | None:
        """``work``'s result, or None when a stop came first (``work`` is then cancelled: a watch can
        stay quiet for minutes)."""
        job = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({job, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (job, stop) if not job.done() else (stop,):
                task.cancel()
            await asyncio.gather(stop, return_exceptions=True)
            if not job.done():
                await asyncio.gather(job, return_exceptions=True)
        return job.result() if not job.cancelled() else None

    def _failed(self, error: str) -> None:
        self._last_error = shorten(error, ERROR_CHARS)
        if self._stale_since is None:
            self._stale_since = self._clock()
        # One warning per distinct cause (what the server said, the numbers left in).
        if error != self._logged_cause:
            self._logged_cause = error
            log.warning("informer_failed", resource=self.name, error=self._last_error,
                        objects=len(self._store), resource_version=self._version)

    def _opened(self) -> None:
        """A list stored or a watch open again: what the store holds is current (or on its way)."""
        if self._stale_since is not None:
            log.info("informer_recovered", resource=self.name,
                     stale_seconds=round(self._clock() - self._stale_since, 3), resource_version=self._version)
        self._stale_since = None

    def _value(self, obj: dict[str, Any]) -> T | Exception:
        try:
            return self._transform(obj)
        except Exception as exc:  # the object's own fault: kept as its value, the stream goes on
            return exc

    def _call(self, callback: Callable[[str, T | Exception], None] | None, key: str, value: T | Exception) -> None:
        if callback is None:
            return
        try:
            callback(key, value)
        except Exception as exc:
            log.warning("informer_callback_failed", resource=self.name, key=excerpt(key),
                        error=shorten(f"{type(exc).__name__}: {exc}", ERROR_CHARS))

    async def _list(self) -> bool:
        """A complete list replaces the store; unchanged objects (same resourceVersion) keep their value
        without a transform or a callback."""
        fresh: dict[str, T | Exception] = {}
        versions: dict[str, str] = {}
        version = ""
        async for page in self.api.list_pages(self.path, self._params, page_size=self._page_size):
            for obj in page.items:
                key = object_key(obj)
                if key is None:
                    continue
                rv = _version(obj)
                fresh[key] = (self._store[key] if key in self._store and rv and self._versions.get(key) == rv
                              else self._value(obj))
                versions[key] = rv
            version = page.resource_version
        old, old_versions = self._store, self._versions
        self._store, self._versions, self._version = fresh, versions, version
        self._errors = sum(isinstance(v, Exception) for v in fresh.values())
        self._relists += 1
        self._synced_at = self._clock()
        for key in old.keys() - fresh.keys():
            self._call(self._on_delete, key, old[key])
        for key, value in fresh.items():
            if old_versions.get(key) != versions[key] or key not in old:
                self._call(self._on_upsert, key, value)
        self._synced.set()
        self._opened()
        self._logged_cause = ""
        log.info("informer_listed", resource=self.name, objects=len(fresh), errors=self._errors,
                 resource_version=version, relists=self._relists)
        return True

    async def _watch(self) -> int:
        """One watch from the current version; the number of events it brought (bookmarks included)."""
        self._restarts += 1
        watch = self.api.watch(self.path, self._version, self._params,
                               timeout_seconds=int(self._watch_seconds * self._rng.uniform(1.0, 2.0)),
                               on_open=self._opened)
        async with contextlib.aclosing(watch) as events:
            async for event in events:
                self._watch_events += 1
                self._logged_cause = ""  # the stream works: a failure after this is news
                if event.type == "ERROR":
                    raise error_of_status(event.object, f"watch {self.path}")
                self._version = event.resource_version
                if event.type == "BOOKMARK":
                    continue
                key = object_key(event.object)
                if key is None:
                    continue
                if event.type == "DELETED":
                    old = self._store.pop(key, None)
                    self._versions.pop(key, None)
                    if old is not None:
                        self._errors -= isinstance(old, Exception)
                        self._call(self._on_delete, key, old)
                    continue
                value = self._value(event.object)
                previous = self._store.get(key)
                self._errors += isinstance(value, Exception) - isinstance(previous, Exception)
                self._store[key] = value
                self._versions[key] = event.resource_version
                self._call(self._on_upsert, key, value)
        return self._watch_events
