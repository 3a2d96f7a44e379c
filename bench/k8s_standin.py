"""A STAND-IN for the Kubernetes API server, for the tests of memtopo's API client and its users.

No real API server can run on these machines. This one serves exactly what memtopo uses, over real
HTTP (aiohttp), so the client (``memtopo.k8s.kubeapi``) is exercised unchanged:

- ``GET /api/v1/nodes/{name}``: a Node with its uid (404 Status for an unknown node);
- ``PATCH /apis/topology.node.k8s.io/v1alpha2/noderesourcetopologies/{name}``: server-side apply only
  (content type ``application/apply-patch+yaml``, else 415), ``fieldManager`` required (400), field
  ownership per manager with 409 Conflict answers unless ``force=true``, fields the manager stopped
  applying removed, and the result validated against the CRD's v1alpha2 schema before it is
  stored (422 Invalid otherwise). The NRT CRD marks no list as a map, so lists are atomic fields;
- pods: ``GET`` one, ``PATCH`` (JSON merge patch only; a ``metadata.uid`` other than the pod's is
  422 Invalid, as the immutable field is), ``POST .../binding`` (sets ``spec.nodeName`` and the
  ``PodScheduled`` condition with its transition time, as the API server's binding storage does;
  409 when already bound or when ``fail_binding``), and core/v1 Events (``POST``);
- **list and watch** of pods and NodeResourceTopologies: one resourceVersion counter for every change,
  ``limit``/``continue`` pages from a snapshot taken at the first page, ``fieldSelector`` and
  ``labelSelector`` with ``=``, ``==`` and ``!=`` terms; watches stream newline-delimited events from a
  resourceVersion (bookmarks on :meth:`StandInApiServer.bookmark`), and a version older than the last
  :meth:`StandInApiServer.compact` is 410 Gone (an HTTP status, or an ERROR event with
  ``gone_as_event``). As the API server's watch cache does, a watch with selectors sends ``DELETED``
  for an object that stops matching them and ``ADDED`` for one that starts to;

Faults on demand (:meth:`StandInApiServer.inject`): a status, garbage bytes, a hang, a body trickled a
byte at a time, a connection dropped mid-answer; :meth:`StandInApiServer.drop_watches` breaks every
open watch mid-stream.

It is not a Kubernetes API server: no authentication, admission, other resources, strategic merge,
label-selector sets, or consistency between a list's snapshot and concurrent writes beyond the above.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml
from aiohttp import web
from jsonschema import Draft7Validator

from bench.nrt_crd import nrt_schema

NRT_PREFIX = "/apis/topology.node.k8s.io/v1alpha2/noderesourcetopologies"
NRT_PATH = NRT_PREFIX + "/{name}"
NRTS = "noderesourcetopologies"
PODS = "pods"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
Path = tuple[str, ...]
# Go's strconv.ParseBool, which the API server uses for query booleans.
GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
# Fields the server owns, never a manager's.
_SERVER_FIELDS: frozenset[Path] = frozenset({("apiVersion",), ("kind",), ("metadata", "name")})


def _leaves(obj: Any, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            yield from _leaves(v, (*prefix, str(k)))
    elif prefix:
        yield prefix, obj


def _build(leaves: dict[Path, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in sorted(leaves.items()):
        d = out
        for part in path[:-1]:
            d = d.setdefault(part, {})
        d[path[-1]] = value
    return out


def _now() -> str:
    """RFC 3339 to the second, as the API server writes times."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _status_doc(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(_status_doc(code, reason, message), status=code)


_REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 410: "Expired",
            415: "UnsupportedMediaType", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
            503: "ServiceUnavailable"}


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            current = target.get(key)
            target[key] = _merge(current if isinstance(current, dict) else {}, value)
        else:
            target[key] = value
    return target


def _field(obj: dict[str, Any], dotted: str) -> str:
    value: Any = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def _matches(obj: dict[str, Any], field_selector: str, label_selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}

    def label(key: str) -> str:
        return str(labels.get(key, ""))

    def field_value(key: str) -> str:
        return _field(obj, key)

    readers: tuple[tuple[str, Callable[[str], str]], ...] = ((field_selector, field_value), (label_selector, label))
    for selector, read in readers:
        for term in filter(None, selector.split(",")):
            if "!=" in term:
                key, value = term.split("!=", 1)
                if read(key) == value:
                    return False
            elif "=" in term:
                key, value = term.replace("==", "=").split("=", 1)
                if read(key) != value:
                    return False
            elif read(term) == "":  # a bare key: the label must exist
                return False
    return True


@dataclass
class Request:
    method: str
    path: str
    content_type: str
    query: dict[str, str]
    status: int
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)


_RECORD = web.RequestKey("record", Request)


@dataclass
class Fault:
    """One injected misbehaviour for the next request matching ``method`` and ``path`` (a prefix).

    ``kind``: ``status`` (answer ``status`` with a Status body), ``garbage`` (200 with ``body``),
    ``hang`` (never answer, until the server stops), ``trickle`` (200 with ``body`` a byte per
    ``interval`` seconds), ``drop`` (headers of a 200 and half of ``body``, then close the connection),
    ``watch_line`` (a watch writes ``body`` as one of its lines)."""

    kind: str
    status: int = 0
    body: bytes = b""
    method: str = ""
    path: str = ""
    interval: float = 1.0
    times: int = 1


@dataclass
class _Change:
    version: int
    resource: str
    type: str
    obj: dict[str, Any]
    prev: dict[str, Any] | None = None  # the object before this change (None: it did not exist)


@dataclass
class StandInApiServer:
    nodes: dict[str, str] = field(default_factory=dict)  # name → uid
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)  # NodeResourceTopologies by name
    owners: dict[str, dict[str, set[Path]]] = field(default_factory=dict)  # object → manager → fields
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (namespace, name) → Pod
    bindings: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    # An answer for every request while set (503: the server is overloaded, 403: RBAC refuses).
    fail_with: int = 0
    fail_binding: bool = False
    # A watch from a compacted version gets an ERROR event with a 410 Status rather than an HTTP 410.
    gone_as_event: bool = False
    # (method, path) → released when set: the request waits for it (a slow API server, held).
    held: dict[tuple[str, str], threading.Event] = field(default_factory=dict)
    url: str = ""
    stored: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None
    _resource_version: int = 0
    _compacted: int = 0
    _history: list[_Change] = field(default_factory=list)
    _snapshots: dict[str, tuple[int, list[dict[str, Any]]]] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _loop: asyncio.AbstractEventLoop | None = None
    _changed: asyncio.Event | None = None
    _bookmarks: int = 0
    _drops: int = 0
    _watches: set[web.StreamResponse] = field(default_factory=set)
    _thread: threading.Thread | None = None

    # ---- setup ------------------------------------------------------------------------------------
    def add_node(self, name: str) -> str:
        self.nodes[name] = str(uuid.uuid4())
        return self.nodes[name]

    async def start(self, port: int = 0) -> str:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/api/v1/nodes/{name}", self._get_node)
        app.router.add_get(NRT_PREFIX, self._list_or_watch_nrts)
        app.router.add_patch(NRT_PATH, self._patch_nrt)
        app.router.add_get(NRT_PATH, self._get_nrt)
        app.router.add_get("/api/v1/pods", self._list_or_watch_pods)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._list_or_watch_pods)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self._get_pod)
        app.router.add_patch("/api/v1/namespaces/{ns}/pods/{name}", self._patch_pod)
        app.router.add_post("/api/v1/namespaces/{ns}/pods/{name}/binding", self._bind_pod)
        app.router.add_post("/api/v1/namespaces/{ns}/events", self._create_event)
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        for event in self.held.values():
            event.set()
        for response in list(self._watches):
            with contextlib.suppress(Exception):
                response.force_close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start_in_thread(self) -> str:
        """Serve from a thread of its own (for tests whose code under test runs ``asyncio.run``)."""
        ready = threading.Event()
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        self._thread = threading.Thread(target=run, name="k8s-standin", daemon=True)
        self._thread.start()
        assert ready.wait(30), "the stand-in did not start"
        return self.url

    def call[R](self, fn: Callable[[], R], timeout: float = 60.0) -> R:
        """``fn()`` run on the loop of a server started with :meth:`start_in_thread` (its state belongs
        to that thread: a pod put from another thread could change a dict a watch is reading)."""
        loop = self._loop
        assert loop is not None
        done: concurrent.futures.Future[R] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except Exception as exc:
                done.set_exception(exc)
        loop.call_soon_threadsafe(run)
        return done.result(timeout)

    def close(self) -> None:
        """Stop a server started with :meth:`start_in_thread`."""
        if self._thread is not None and self._loop is not None:
            for event in self.held.values():
                event.set()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._thread = None

    # ---- changes (any thread) ---------------------------------------------------------------------
    def _notify(self) -> None:
        loop, changed = self._loop, self._changed
        if loop is None or changed is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            changed.set()
        else:
            loop.call_soon_threadsafe(changed.set)

    def _record_change(self, resource: str, kind: str, obj: dict[str, Any],
                       prev: dict[str, Any] | None = None) -> None:
        """Stamp ``obj`` with the next resourceVersion and remember the change for watches."""
        with self._lock:
            self._resource_version += 1
            meta = obj.setdefault("metadata", {})
            meta["resourceVersion"] = str(self._resource_version)
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            self._history.append(_Change(self._resource_version, resource, kind, copy.deepcopy(obj),
                                         copy.deepcopy(prev) if prev is not None else None))
        self._notify()

    def put_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Create or replace a pod, as a write through the API would (a new resourceVersion, an event)."""
        meta = pod.setdefault("metadata", {})
        key = (meta.setdefault("namespace", "default"), meta["name"])
        prev = self.pods.get(key)
        self.pods[key] = pod
        self._record_change(PODS, "MODIFIED" if prev is not None else "ADDED", pod, prev)
        return pod

    def delete_pod(self, namespace: str, name: str) -> None:
        pod = self.pods.pop((namespace, name))
        self._record_change(PODS, "DELETED", pod, pod)

    def put_nrt(self, obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        prev = self.objects.get(name)
        self.objects[name] = obj
        self._record_change(NRTS, "MODIFIED" if prev is not None else "ADDED", obj, prev)
        self.stored.set()
        return obj

    def delete_nrt(self, name: str) -> None:
        obj = self.objects.pop(name)
        self._record_change(NRTS, "DELETED", obj, obj)

    @property
    def resource_version(self) -> int:
        return self._resource_version

    def compact(self) -> None:
        """Forget every change so far: a watch or a continue token from before is 410 Gone."""
        with self._lock:
            self._compacted = self._resource_version
            self._history.clear()
            self._snapshots.clear()
        self._notify()

    def bookmark(self) -> None:
        """Every open watch sends a BOOKMARK at the current resourceVersion."""
        self._bookmarks += 1
        self._notify()

    def drop_watches(self) -> None:
        """Break every open watch mid-stream (the connection closes without the stream's end)."""
        self._drops += 1
        self._notify()

    def inject(self, kind: str, **kwargs: Any) -> Fault:
        fault = Fault(kind, **kwargs)
        self.faults.append(fault)
        return fault

    def watches(self) -> list[Request]:
        return [r for r in self.requests if r.query.get("watch") == "true"]

    # ---- plumbing ---------------------------------------------------------------------------------
    def _take_fault(self, request: web.Request, watching: bool) -> Fault | None:
        for fault in self.faults:
            if fault.method and fault.method != request.method:
                continue
            if fault.path and not request.path.startswith(fault.path):
                continue
            if (fault.kind == "watch_line") != watching:
                continue
            fault.times -= 1
            if fault.times <= 0:
                self.faults.remove(fault)
            return fault
        return None

    @web.middleware
    async def _middleware(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        record = Request(request.method, request.path, request.content_type, dict(request.query), 0,
                         headers=dict(request.headers))
        self.requests.append(record)
        request[_RECORD] = record
        hold = self.held.get((request.method, request.path))
        if hold is not None:
            await asyncio.to_thread(hold.wait, 120)
        if self.fail_with:
            record.status = self.fail_with
            return _status(self.fail_with, _REASONS.get(self.fail_with, "Unknown"), "stand-in")
        fault = self._take_fault(request, watching=False)
        if fault is not None:
            record.status = fault.status or 200
            return await self._misbehave(request, fault)
        response = await handler(request)
        record.status = response.status
        return response

    async def _misbehave(self, request: web.Request, fault: Fault) -> web.StreamResponse:
        if fault.kind == "status":
            return _status(fault.status, _REASONS.get(fault.status, "Unknown"), f"stand-in: injected {fault.status}")
        if fault.kind == "garbage":
            return web.Response(body=fault.body, content_type="application/json")
        if fault.kind == "hang":
            await asyncio.sleep(3600)
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.content_length = len(fault.body)
        await response.prepare(request)
        if fault.kind == "trickle":
            for i in range(len(fault.body)):
                await response.write(fault.body[i:i + 1])
                await asyncio.sleep(fault.interval)
        elif fault.kind == "drop":
            await response.write(fault.body[: len(fault.body) // 2])
            response.force_close()
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write_eof()
        return response

    @staticmethod
    def _record_body(request: web.Request, body: Any) -> None:
        request[_RECORD].body = body

    # ---- nodes and NodeResourceTopologies -----------------------------------------------------------
    async def _get_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.nodes:
            return _status(404, "NotFound", f'nodes "{name}" not found')
        return web.json_response({"apiVersion": "v1", "kind": "Node",
                                  "metadata": {"name": name, "uid": self.nodes[name]}})

    async def _get_nrt(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.objects:
            return _status(404, "NotFound", f'noderesourcetopologies.topology.node.k8s.io "{name}" not found')
        return web.json_response(self.objects[name])

    async def _patch_nrt(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        raw = await request.read()
        if request.content_type != APPLY:
            return _status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                        f"accepted media types include: {APPLY}")
        manager = request.query.get("fieldManager", "")
        if not manager:
            return _status(400, "BadRequest", "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required "
                                              "value: is required for apply patch")
        try:
            config = yaml.safe_load(raw)
        except yaml.YAMLError:
            return _status(400, "BadRequest", "error decoding YAML")
        self._record_body(request, config)
        if not isinstance(config, dict) or config.get("apiVersion") != "topology.node.k8s.io/v1alpha2" \
                or config.get("kind") != "NodeResourceTopology" or (config.get("metadata") or {}).get("name") != name:
            return _status(400, "BadRequest", "apiVersion, kind or metadata.name does not match the request")
        status, answer = self.apply_as(manager, config, force=request.query.get("force", "false") in GO_TRUE)
        if status >= 400:
            return _status(status, answer["reason"], answer["message"])
        return web.json_response(answer, status=status)

    def apply_as(self, manager: str, config: dict[str, Any], *, force: bool = False) -> tuple[int, dict[str, Any]]:
        """Server-side apply of ``config`` by ``manager``: (HTTP status, stored object or Status fields)."""
        name = config["metadata"]["name"]
        current = self.objects.get(name)
        cur_leaves = dict(_leaves(self._strip_server(current))) if current else {}
        new_leaves = {p: v for p, v in _leaves(config) if p not in _SERVER_FIELDS}
        owners = self.owners.setdefault(name, {})
        conflicts = sorted((other, p) for other, paths in owners.items() if other != manager
                           for p in paths & new_leaves.keys() if cur_leaves.get(p) != new_leaves[p])
        if conflicts and not force:
            text = "; ".join(f'conflict with "{m}": .{".".join(p)}' for m, p in conflicts)
            return 409, {"reason": "Conflict", "message": f"Apply failed with {len(conflicts)} conflict(s): {text}"}
        for other, p in conflicts:
            owners[other].discard(p)
        mine_before = owners.get(manager, set())
        others = set().union(*(paths for m, paths in owners.items() if m != manager))
        merged = {p: v for p, v in cur_leaves.items() if p not in mine_before - new_leaves.keys() or p in others}
        merged.update(new_leaves)
        obj = _build(merged)
        obj.update(apiVersion=config["apiVersion"], kind=config["kind"])
        obj.setdefault("metadata", {})["name"] = name
        errors = list(Draft7Validator(nrt_schema()).iter_errors(obj))
        if errors:
            where = ".".join(str(x) for x in errors[0].path)
            return 422, {"reason": "Invalid", "message": f'NodeResourceTopology.topology.node.k8s.io "{name}" is '
                                                         f"invalid: {where}: {errors[0].message[:200]}"}
        owners[manager] = set(new_leaves)
        meta = obj["metadata"]
        meta["uid"] = current["metadata"]["uid"] if current else str(uuid.uuid4())
        spec_changed = current is None or {k: v for k, v in obj.items() if k != "metadata"} != {
            k: v for k, v in current.items() if k != "metadata"}
        meta["generation"] = (current["metadata"]["generation"] if current else 0) + (1 if spec_changed else 0)
        meta["managedFields"] = [{"manager": m, "operation": "Apply", "apiVersion": config["apiVersion"],
                                  "fieldsType": "FieldsV1",
                                  "fieldsV1": _build({tuple(f"f:{x}" for x in p): {} for p in sorted(paths)})}
                                 for m, paths in sorted(owners.items()) if paths]
        stored = json.loads(json.dumps(obj))
        self.put_nrt(stored)
        return (200 if current else 201), stored

    @staticmethod
    def _strip_server(obj: dict[str, Any] | None) -> dict[str, Any]:
        if obj is None:
            return {}
        meta = {k: v for k, v in obj.get("metadata", {}).items()
                if k not in ("uid", "resourceVersion", "generation", "managedFields", "name")}
        return {**{k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}, "metadata": meta}

    async def wait_stored(self, predicate: Any, timeout: float = 30.0) -> dict[str, Any]:
        """The first stored object for which ``predicate(obj)`` holds (a generous event wait)."""
        async def loop() -> dict[str, Any]:
            while True:
                for obj in list(self.objects.values()):
                    if predicate(obj):
                        return obj
                self.stored.clear()
                await self.stored.wait()
        return await asyncio.wait_for(loop(), timeout)

    # ---- pods and events --------------------------------------------------------------------------
    def _pod_or_404(self, request: web.Request) -> tuple[tuple[str, str], dict[str, Any] | web.Response]:
        key = (request.match_info["ns"], request.match_info["name"])
        found = self.pods.get(key)
        if found is None:
            return key, _status(404, "NotFound", f'pods "{key[1]}" not found')
        return key, found

    async def _get_pod(self, request: web.Request) -> web.Response:
        _, pod = self._pod_or_404(request)
        return pod if isinstance(pod, web.Response) else web.json_response(pod)

    async def _patch_pod(self, request: web.Request) -> web.Response:
        if request.content_type != MERGE:
            return _status(415, "UnsupportedMediaType", f"this stand-in takes {MERGE} only")
        patch = json.loads(await request.read())
        self._record_body(request, patch)
        key, pod = self._pod_or_404(request)
        if isinstance(pod, web.Response):
            return pod
        uid = (patch.get("metadata") or {}).get("uid") if isinstance(patch, dict) else None
        if uid is not None and uid != pod["metadata"].get("uid"):
            # metadata.uid is immutable: a patch carrying another pod's uid is its precondition failing.
            return _status(422, "Invalid", f'Pod "{key[1]}" is invalid: metadata.uid: Invalid value: '
                                           f'"{uid}": field is immutable')
        prev = copy.deepcopy(pod)
        _merge(pod, patch)
        self._record_change(PODS, "MODIFIED", pod, prev)
        return web.json_response(pod)

    async def _bind_pod(self, request: web.Request) -> web.Response:
        binding = json.loads(await request.read())
        self._record_body(request, binding)
        key, pod = self._pod_or_404(request)
        if isinstance(pod, web.Response):
            return pod
        if binding.get("kind") != "Binding" or not isinstance(binding.get("target"), dict):
            return _status(400, "BadRequest", "not a Binding")
        uid = (binding.get("metadata") or {}).get("uid")
        if uid and uid != pod["metadata"].get("uid"):
            return _status(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{key[1]}": '
                                            "the UID in the precondition does not match")
        if self.fail_binding or pod.setdefault("spec", {}).get("nodeName"):
            return _status(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{key[1]}": '
                                            f"pod {key[1]} is already assigned to node "
                                            f'"{pod["spec"].get("nodeName", "")}"')
        self.bindings.append(binding)
        prev = copy.deepcopy(pod)
        pod["spec"]["nodeName"] = binding["target"]["name"]
        status = pod.setdefault("status", {})
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
        status["conditions"] = [*conditions, {"type": "PodScheduled", "status": "True",
                                              "lastTransitionTime": _now()}]
        self._record_change(PODS, "MODIFIED", pod, prev)
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201},
                                 status=201)

    async def _create_event(self, request: web.Request) -> web.Response:
        event = json.loads(await request.read())
        self._record_body(request, event)
        if event.get("kind") != "Event" or (event.get("metadata") or {}).get("namespace") != request.match_info["ns"]:
            return _status(400, "BadRequest", "not an Event of this namespace")
        self.events.append(event)
        return web.json_response(event, status=201)

    # ---- list and watch -----------------------------------------------------------------------------
    def _current(self, resource: str, request: web.Request) -> list[dict[str, Any]]:
        if resource == NRTS:
            items = [self.objects[k] for k in sorted(self.objects)]
        else:
            ns = request.match_info.get("ns")
            items = [self.pods[k] for k in sorted(self.pods) if ns is None or k[0] == ns]
        fs, ls = request.query.get("fieldSelector", ""), request.query.get("labelSelector", "")
        return [copy.deepcopy(o) for o in items if _matches(o, fs, ls)]

    async def _list_or_watch_nrts(self, request: web.Request) -> web.StreamResponse:
        return await self._list_or_watch(NRTS, request)

    async def _list_or_watch_pods(self, request: web.Request) -> web.StreamResponse:
        return await self._list_or_watch(PODS, request)

    async def _list_or_watch(self, resource: str, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") in GO_TRUE:
            return await self._watch(resource, request)
        kind = "NodeResourceTopologyList" if resource == NRTS else "PodList"
        token = request.query.get("continue", "")
        with self._lock:
            if token:
                if token not in self._snapshots:
                    return _status(410, "Expired", "The provided continue parameter is too old to display a "
                                                   "consistent list result.")
                version, items = self._snapshots.pop(token)
            else:
                version, items = self._resource_version, self._current(resource, request)
        limit = int(request.query.get("limit", "0") or 0)
        page, rest = (items[:limit], items[limit:]) if limit > 0 else (items, [])
        meta: dict[str, Any] = {"resourceVersion": str(version)}
        if rest:
            next_token = uuid.uuid4().hex
            with self._lock:
                self._snapshots[next_token] = (version, rest)
            meta["continue"] = next_token
        return web.json_response({"apiVersion": "v1", "kind": kind, "metadata": meta, "items": page})

    async def _watch(self, resource: str, request: web.Request) -> web.StreamResponse:
        # Taken before the first await: a bookmark or drop asked for once this watch is recorded is its own.
        bookmarks, drops = self._bookmarks, self._drops
        since_text = request.query.get("resourceVersion", "")
        since = int(since_text) if since_text else self._resource_version
        timeout = float(request.query.get("timeoutSeconds", "300"))
        fs, ls = request.query.get("fieldSelector", ""), request.query.get("labelSelector", "")
        gone = since < self._compacted
        if gone and not self.gone_as_event:
            return _status(410, "Expired", f"too old resource version: {since} ({self._compacted})")
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        request[_RECORD].status = 200  # open now, however long it stays
        self._watches.add(response)
        assert self._changed is not None and self._loop is not None
        deadline = self._loop.time() + timeout
        try:
            if gone:
                status = _status_doc(410, "Expired", f"too old resource version: {since} ({self._compacted})")
                await response.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
                await response.write_eof()
                return response
            while self._loop.time() < deadline:
                fault = self._take_fault(request, watching=True)
                if fault is not None:
                    await response.write(fault.body + b"\n")
                with self._lock:
                    changes = [c for c in self._history if c.version > since and c.resource == resource]
                for change in changes:
                    since = change.version
                    now_in = change.type != "DELETED" and _matches(change.obj, fs, ls)
                    was_in = change.prev is not None and _matches(change.prev, fs, ls)
                    kind = (change.type if now_in == was_in or change.type == "DELETED" else
                            "ADDED" if now_in else "DELETED")
                    if now_in or was_in:
                        line = json.dumps({"type": kind, "object": change.obj}).encode() + b"\n"
                        await response.write(line)
                if self._bookmarks != bookmarks:
                    bookmarks = self._bookmarks
                    since = max(since, self._resource_version)
                    mark = {"type": "BOOKMARK", "object": {"kind": "Pod" if resource == PODS else
                                                           "NodeResourceTopology",
                                                           "metadata": {"resourceVersion": str(since)}}}
                    await response.write(json.dumps(mark).encode() + b"\n")
                if self._drops != drops:
                    assert request.transport is not None
                    request.transport.close()
                    return response
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(0.2, max(deadline - self._loop.time(), 0)))
            await response.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass  # the client went away
        finally:
            self._watches.discard(response)
        return response


# ---- servers that do not speak HTTP properly ------------------------------------------------------------
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    """A loopback TCP server handing each connection to ``handler`` (which writes what it likes);
    yields its ``http://127.0.0.1:PORT``. For answers no web framework would write."""
    tasks: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await handler(reader, writer)
        finally:
            tasks.discard(task)
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def read_head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    """The request line and headers (lower-case names) of one HTTP request; its body is left unread."""
    line = (await reader.readline()).decode("latin-1").strip()
    headers: dict[str, str] = {}
    while (header := (await reader.readline()).decode("latin-1").strip()):
        key, _, value = header.partition(":")
        headers[key.strip().lower()] = value.strip()
    return line, headers

