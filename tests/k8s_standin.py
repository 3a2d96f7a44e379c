"""A STAND-IN for the Kubernetes API server, for the NodeResourceTopology publisher's tests.

No real API server can run on these machines. This one serves exactly what the publisher uses, over
real HTTP, so the publisher's Kubernetes client library is exercised unchanged:

- ``GET /api/v1/nodes/{name}``: a Node with its uid (404 Status for an unknown node);
- ``PATCH /apis/topology.node.k8s.io/v1alpha2/noderesourcetopologies/{name}``: server-side apply only
  (content type ``application/apply-patch+yaml``, else 415), ``fieldManager`` required (400), field
  ownership per manager with 409 Conflict answers unless ``force=true``, fields the manager stopped
  applying removed, and the result validated against the CRD's v1alpha2 schema before it is
  stored (422 Invalid otherwise). The NRT CRD marks no list as a map, so lists are atomic fields.

It is not a Kubernetes API server: no authentication, watches, other resources or list merging.
"""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml
from aiohttp import web
from jsonschema import Draft7Validator

from tests.nrt_crd import nrt_schema

NRT_PATH = "/apis/topology.node.k8s.io/v1alpha2/noderesourcetopologies/{name}"
APPLY = "application/apply-patch+yaml"
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


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    return web.json_response(body, status=code)


@dataclass
class Request:
    method: str
    path: str
    content_type: str
    query: dict[str, str]
    status: int
    body: Any = None


@dataclass
class StandInApiServer:
    nodes: dict[str, str] = field(default_factory=dict)  # name → uid
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    owners: dict[str, dict[str, set[Path]]] = field(default_factory=dict)  # object → manager → fields
    requests: list[Request] = field(default_factory=list)
    # An answer for every request while set (503: the server is overloaded, 403: RBAC refuses).
    fail_with: int = 0
    url: str = ""
    stored: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None
    _resource_version: int = 0

    def add_node(self, name: str) -> str:
        self.nodes[name] = str(uuid.uuid4())
        return self.nodes[name]

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/nodes/{name}", self._get_node)
        app.router.add_patch(NRT_PATH, self._patch_nrt)
        app.router.add_get(NRT_PATH, self._get_nrt)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _record(self, request: web.Request, status: int, body: Any = None) -> None:
        self.requests.append(Request(request.method, request.path, request.content_type,
                                     dict(request.query), status, body))

    async def _get_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if self.fail_with:
            self._record(request, self.fail_with)
            return _status(self.fail_with, "ServiceUnavailable" if self.fail_with == 503 else "Forbidden", "stand-in")
        if name not in self.nodes:
            self._record(request, 404)
            return _status(404, "NotFound", f'nodes "{name}" not found')
        self._record(request, 200)
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
        if self.fail_with:
            self._record(request, self.fail_with)
            return _status(self.fail_with, "ServiceUnavailable" if self.fail_with == 503 else "Forbidden", "stand-in")
        if request.content_type != APPLY:
            self._record(request, 415)
            return _status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                        f"accepted media types include: {APPLY}")
        manager = request.query.get("fieldManager", "")
        if not manager:
            self._record(request, 400)
            return _status(400, "BadRequest", "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required "
                                              "value: is required for apply patch")
        try:
            config = yaml.safe_load(raw)
        except yaml.YAMLError:
            self._record(request, 400)
            return _status(400, "BadRequest", "error decoding YAML")
        if not isinstance(config, dict) or config.get("apiVersion") != "topology.node.k8s.io/v1alpha2" \
                or config.get("kind") != "NodeResourceTopology" or (config.get("metadata") or {}).get("name") != name:
            self._record(request, 400, config)
            return _status(400, "BadRequest", "apiVersion, kind or metadata.name does not match the request")
        status, answer = self.apply_as(manager, config, force=request.query.get("force", "false") in GO_TRUE)
        self._record(request, status, config)
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
        self._resource_version += 1
        meta = obj["metadata"]
        meta["uid"] = current["metadata"]["uid"] if current else str(uuid.uuid4())
        meta["resourceVersion"] = str(self._resource_version)
        spec_changed = current is None or {k: v for k, v in obj.items() if k != "metadata"} != {
            k: v for k, v in current.items() if k != "metadata"}
        meta["generation"] = (current["metadata"]["generation"] if current else 0) + (1 if spec_changed else 0)
        meta["managedFields"] = [{"manager": m, "operation": "Apply", "apiVersion": config["apiVersion"],
                                  "fieldsType": "FieldsV1",
                                  "fieldsV1": _build({tuple(f"f:{x}" for x in p): {} for p in sorted(paths)})}
                                 for m, paths in sorted(owners.items()) if paths]
        self.objects[name] = json.loads(json.dumps(obj))
        self.stored.set()
        return (200 if current else 201), obj

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
                for obj in self.objects.values():
                    if predicate(obj):
                        return obj
                self.stored.clear()
                await self.stored.wait()
        return await asyncio.wait_for(loop(), timeout)
