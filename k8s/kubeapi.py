"""The one Kubernetes API client of memtopo: the few REST calls its components make, over aiohttp.

One :class:`KubeApi` per process or component (the agent's NodeResourceTopology publisher, the scheduler
extender, informers): ``get``, ``list`` (paged), ``watch`` (typed events), server-side ``apply``,
``merge_patch``, ``create``, and the typed helpers the callers need (``get_node``, ``get_pod``,
``annotate_pod``, ``bind_pod``, ``apply_nrt``, ``create_event``). Paths are :class:`ApiPath` values
built from names that passed :mod:`memtopo.k8s.names`, never from raw strings.

What it refuses to do, whatever the server (or whoever answers in its place) sends:

- **No request outlives its deadline** (``timeout_s``: connect, headers and body together; a server
  trickling one byte a second still ends there). A watch gets ``timeout_s`` for its headers and ends
  at ``timeoutSeconds`` plus that margin, as the server should have ended it.
- **Answers are bounded in memory, not only in bytes read.** A body is read in chunks up to
  ``max_answer_bytes`` (a declared or actual overrun is refused before it is buffered); before JSON
  decoding, the decoded size is estimated from the text (its objects, lists, items and bytes) and an
  answer shaped to decode to more than :data:`DECODED_PER_ANSWER_BYTE` times the cap is refused: a
  megabyte of ``[]`` would be 22 MB of Python lists. One watch event is at most ``max_event_bytes``;
  a longer line is an error, not a growing buffer.
- **Redirects are never followed** (a 3xx is an error naming the status), no proxy variable is read
  (``trust_env`` off), no cookie is kept, no compression is asked for: the bearer token goes to the
  configured server and nowhere else, and only over TLS unless the server is on loopback.
- **Every failure is a** :class:`KubeApiError` with a ``kind`` (unreachable, timeout, conflict, gone,
  not_found, rejected, garbage, too_large), the HTTP status and a short escaped excerpt of what the
  server said, its message naming the action (``apply NRT node-1: no answer within 10 s``): never a
  ``UnicodeDecodeError``, a JSON error or a traceback.

In a cluster, :meth:`KubeApi.in_cluster` reads the pod's service account as client-go does, and the
token is read again whenever its file changes (bound service-account tokens rotate). A plain
``http://127.0.0.1:PORT`` (``kubectl proxy``, the tests' stand-in) works too.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import aiohttp
from yarl import URL

from memtopo import __version__
from memtopo.addresses import is_loopback
from memtopo.k8s import names
from memtopo.text import excerpt, human_bytes, shorten
from memtopo.text import reason as exc_reason

if TYPE_CHECKING:
    import ssl

SERVICE_ACCOUNT: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_TIMEOUT_S: Final = 10.0
# A list page of 500 objects is a few MiB; the largest object etcd stores is 1.5 MiB.
DEFAULT_MAX_ANSWER_BYTES: Final = 8 << 20
DEFAULT_MAX_EVENT_BYTES: Final = 4 << 20
# Kubernetes JSON decodes to 5-6 times its size in Python (the estimate below says at most 11); an
# answer estimated above this many times the byte cap is refused before decoding.
DECODED_PER_ANSWER_BYTE: Final = 12
DEFAULT_PAGE_SIZE: Final = 500
DEFAULT_WATCH_SECONDS: Final = 300
MAX_TOKEN_BYTES: Final = 64 << 10
# What is read of an error answer to quote its message.
MAX_ERROR_BYTES: Final = 64 << 10
# Server messages quoted in errors (a Status message, an excerpt of a body that is not JSON).
QUOTE_CHARS: Final = 160
_CHUNK: Final = 64 << 10
APPLY_PATCH: Final = "application/apply-patch+yaml"
MERGE_PATCH: Final = "application/merge-patch+json"
JSON: Final = "application/json"

ErrorKind = Literal["unreachable", "timeout", "conflict", "gone", "not_found", "rejected", "garbage", "too_large"]
EventType = Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]
EVENT_TYPES: Final[frozenset[str]] = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"})


class KubeApiError(Exception):
    """A call that did not succeed. ``kind`` says how; ``status`` is the HTTP status (0 when there was
    none); ``action`` names the call (``apply NRT node-1``); ``reason`` is short and escaped."""

    def __init__(self, kind: ErrorKind, action: str, reason: str, status: int = 0) -> None:
        super().__init__(f"{action}: {reason}")
        self.kind: ErrorKind = kind
        self.action = action
        self.reason = reason
        self.status = status

    @property
    def transient(self) -> bool:
        """True when the same call may well succeed later unchanged (server down, overloaded, slow)."""
        return self.kind in ("unreachable", "timeout")


def kind_of_status(status: int) -> ErrorKind:
    if status == 404:
        return "not_found"
    if status == 409:
        return "conflict"
    if status == 410:
        return "gone"
    if status == 429 or status >= 500:
        return "unreachable"
    return "rejected"


def error_of_status(status: Mapping[str, Any], action: str) -> KubeApiError:
    """The error a Kubernetes Status object (an ERROR watch event's object) stands for."""
    code = status.get("code")
    code = code if isinstance(code, int) and not isinstance(code, bool) and 0 <= code < 1000 else 0
    message = status.get("message")
    said = f": {quote(message)}" if isinstance(message, str) and message else ""
    return KubeApiError(kind_of_status(code) if code else "unreachable", action,
                        f"ERROR {code}{said}" if code else f"ERROR{said}", code)


# ---- paths ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ApiPath:
    """A request path made of checked names only (construct with :func:`core` / :func:`group`)."""

    path: str

    def __str__(self) -> str:
        return self.path


def _path(prefix: str, resource: str, name: str, namespace: str, subresource: str) -> ApiPath:
    parts = [prefix]
    if namespace:
        parts += ["namespaces", names.namespace(namespace)]
    parts.append(names.label(resource, "resource"))
    if name:
        parts.append(names.subdomain(name, f"{resource} name"))
    if subresource:
        if not name:
            raise names.InvalidNameError("subresource", subresource, "allowed without an object name")
        parts.append(names.label(subresource, "subresource"))
    return ApiPath("/".join(parts))


def core(resource: str, name: str = "", *, namespace: str = "", subresource: str = "") -> ApiPath:
    """``/api/v1/[namespaces/NS/]RESOURCE[/NAME[/SUBRESOURCE]]``; :class:`~memtopo.k8s.names.InvalidNameError`
    for any part Kubernetes would refuse."""
    return _path("/api/v1", resource, name, namespace, subresource)


def group(api_group: str, version: str, resource: str, name: str = "", *, namespace: str = "",
          subresource: str = "") -> ApiPath:
    """``/apis/GROUP/VERSION/[namespaces/NS/]RESOURCE[/NAME[/SUBRESOURCE]]``."""
    prefix = f"/apis/{names.subdomain(api_group, 'API group')}/{names.label(version, 'API version')}"
    return _path(prefix, resource, name, namespace, subresource)


NRT_GROUP: Final = "topology.node.k8s.io"
NRT_VERSION: Final = "v1alpha2"
NRT_RESOURCE: Final = "noderesourcetopologies"


def nrt_path(name: str = "") -> ApiPath:
    return group(NRT_GROUP, NRT_VERSION, NRT_RESOURCE, name)


# ---- answers -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ListPage:
    items: list[dict[str, Any]]
    resource_version: str
    continue_token: str


@dataclass(frozen=True)
class ListResult:
    """Every item of a list, and the list's ``resourceVersion`` (where a watch of it starts)."""

    items: list[dict[str, Any]]
    resource_version: str


@dataclass(frozen=True)
class WatchEvent:
    """One watch event. ``object`` is the object (a Status for ERROR); ``resource_version`` its
    ``metadata.resourceVersion`` ("" for ERROR)."""

    type: EventType
    object: dict[str, Any]
    resource_version: str


def decoded_estimate(text: str) -> int:
    """An upper estimate of the bytes ``json.loads(text)`` takes in Python: a dict costs about 200 bytes
    however small, a list 64, an item's pointer and boxed value 64, a key's slot 32, plus the text."""
    return (len(text) + 200 * text.count("{") + 64 * text.count("[") + 64 * text.count(",")
            + 32 * text.count(":"))


def answer_text(raw: bytes | bytearray, action: str, status: int = 200) -> str:
    """The answer as text: UTF-8, as Kubernetes writes JSON; :class:`KubeApiError` (garbage) otherwise."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KubeApiError("garbage", action, f"the answer is not UTF-8 (at byte {exc.start}: "
                                              f"{excerpt(bytes(raw[exc.start:exc.start + 16]))})", status) from None


def parse_json(text: str, action: str, cap: int, status: int = 200) -> Any:
    """``text`` decoded, when it decodes to at most ``DECODED_PER_ANSWER_BYTE × cap`` bytes (estimated
    first); :class:`KubeApiError` (garbage, too_large) otherwise."""
    estimate = decoded_estimate(text)
    if estimate > DECODED_PER_ANSWER_BYTE * cap:
        raise KubeApiError("too_large", action, f"the answer ({human_bytes(len(text))}) would take about "
                                                f"{human_bytes(estimate)} decoded, over "
                                                f"{human_bytes(DECODED_PER_ANSWER_BYTE * cap)}", status)
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise KubeApiError("garbage", action, f"the answer is not JSON: {excerpt(text)}", status) from None


def _object(doc: Any, action: str, what: str = "the answer") -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise KubeApiError("garbage", action, f"{what} is not a JSON object: {excerpt(shorten(doc))}")
    return doc


def _string(obj: Mapping[str, Any], key: str, action: str, what: str) -> str:
    value = obj.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise KubeApiError("garbage", action, f"{what}.{key} is not a string: {excerpt(shorten(value))}")
    return value


def metadata(obj: Mapping[str, Any], action: str = "read an object") -> dict[str, Any]:
    """``obj.metadata``; :class:`KubeApiError` (garbage) when it is not an object."""
    return _object(obj.get("metadata"), action, "metadata")


def _status_message(raw: bytes) -> str:
    """The ``message`` of a Kubernetes Status answer, else the body as text."""
    text = raw.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return text.strip()
    message = doc.get("message") if isinstance(doc, dict) else None
    return message if isinstance(message, str) else text.strip()


# ---- the client ----------------------------------------------------------------------------------------
class KubeApi:
    """An API server at ``server_url`` (``https://HOST:PORT`` or a loopback ``http://127.0.0.1:PORT``).

    ``token`` (or ``token_file``, read again when it changes) is sent as a bearer token; ``ca_file``
    is the CA the server's certificate is verified against (else the system's roots). ``timeout_s``
    bounds each request from connect to the last byte. Construction does no I/O; the HTTP session is
    made on the first call, on the running loop."""

    def __init__(self, server_url: str, *, token: str = "", token_file: str = "", ca_file: str = "",
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
                 max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        action = "configure the API client"
        try:
            url = URL(server_url)
        except (ValueError, TypeError):
            url = None
        if (url is None or url.scheme not in ("http", "https") or not url.host or url.user or url.password
                or url.query_string or url.fragment):
            raise KubeApiError("rejected", action, f"{excerpt(server_url)}: expected http(s)://HOST[:PORT][/PATH]")
        if (token or token_file) and url.scheme == "http" and not is_loopback(url.host):
            raise KubeApiError("rejected", action, f"{excerpt(server_url)}: a token is only sent over https "
                                                   "(or to a loopback address)")
        if not 0 < timeout_s <= 3600 or max_answer_bytes < 1024 or max_event_bytes < 1024:
            raise KubeApiError("rejected", action, "timeout_s must be in (0, 3600], the caps at least 1 KiB")
        self.server_url = str(url).rstrip("/")
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes
        self.max_event_bytes = max_event_bytes
        self._token = token.strip()
        self._token_file = token_file
        self._token_stamp: tuple[int, int, int] | None = None
        self._ca_file = ca_file
        self._ssl: ssl.SSLContext | None = None
        self._https = url.scheme == "https"
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if self._token:
            _check_token(self._token, action, "the token")

    @classmethod
    def in_cluster(cls, service_account: Path = SERVICE_ACCOUNT, **kwargs: Any) -> KubeApi:
        """The API server of the cluster this pod runs in, as its service account (client-go's
        ``InClusterConfig``): ``KUBERNETES_SERVICE_HOST``/``_PORT``, the token file, the CA."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
        if not host or not port:
            raise KubeApiError("rejected", "find the API server",
                               "not in a cluster: KUBERNETES_SERVICE_HOST/PORT are not set")
        netloc = f"[{host}]" if ":" in host else host
        return cls(f"https://{netloc}:{port}", token_file=str(service_account / "token"),
                   ca_file=str(service_account / "ca.crt"), **kwargs)

    @classmethod
    def from_flag(cls, value: str, **kwargs: Any) -> KubeApi:
        """``in-cluster`` or an API server URL, as ``--kube-api`` and ``kubernetes.api_server`` take it."""
        return cls.in_cluster(**kwargs) if value in ("", "in-cluster") else cls(value, **kwargs)

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed and self._loop is asyncio.get_running_loop():
            await session.close()

    # ---- typed helpers --------------------------------------------------------------------------------
    async def get_node(self, name: str) -> dict[str, Any]:
        return await self.get(core("nodes", names.node_name(name)), action=f"read Node {name}")

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        path = core("pods", names.pod_name(name), namespace=namespace)
        return await self.get(path, action=f"read pod {namespace}/{name}")

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str | None], *,
                           uid: str = "") -> dict[str, Any]:
        """Set (or, with None, remove) annotations of a pod: a JSON merge patch of its metadata. With
        ``uid``, only while the pod under that name is still that pod: the patch carries the uid, which
        the API server refuses to change (422), as the kubelet guards its status patches."""
        path = core("pods", names.pod_name(name), namespace=namespace)
        meta: dict[str, Any] = {"annotations": dict(annotations)}
        if uid:
            meta["uid"] = uid
        return await self.merge_patch(path, {"metadata": meta}, action=f"annotate pod {namespace}/{name}")

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        """Create the pod's ``Binding`` to ``node`` (what kube-scheduler's bind does); with ``uid``, only
        while the pod under that name is still that pod."""
        path = core("pods", names.pod_name(name), namespace=namespace, subresource="binding")
        binding = {"apiVersion": "v1", "kind": "Binding",
                   "metadata": {"name": name, "namespace": namespace, **({"uid": uid} if uid else {})},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": names.node_name(node)}}
        await self.create(path, binding, action=f"bind pod {namespace}/{name} to {node}")

    async def apply_nrt(self, obj: Mapping[str, Any], *, field_manager: str, force: bool = False) -> dict[str, Any]:
        """Server-side apply of a NodeResourceTopology (named by its ``metadata.name``)."""
        name = metadata(obj, "apply NRT").get("name")
        path = nrt_path(names.node_name(name))
        return await self.apply(path, obj, field_manager=field_manager, force=force, action=f"apply NRT {name}")

    async def create_event(self, *, namespace: str, pod_name: str, pod_uid: str, reason: str, message: str,
                           event_type: Literal["Normal", "Warning"] = "Normal", component: str = "memtopo",
                           host: str = "") -> dict[str, Any]:
        """A core/v1 Event about a pod (``kubectl describe pod`` shows it). ``reason`` is a short
        UpperCamelCase word; ``message`` is cut to 1,024 characters."""
        names.pod_name(pod_name)
        if not (0 < len(reason) <= 128 and reason.isascii() and reason.isalnum()):
            raise names.InvalidNameError("event reason", reason, "a short alphanumeric word")
        # The recorder's naming: the object's name and a unique suffix, within 253 characters.
        event_name = f"{pod_name[:236].rstrip('.-')}.{secrets.token_hex(8)}"
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"name": event_name, "namespace": namespace},
                 "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "namespace": namespace,
                                    **({"uid": pod_uid} if pod_uid else {})},
                 "reason": reason, "message": message[:1024], "type": event_type,
                 "source": {"component": component, **({"host": host} if host else {})},
                 "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
                 "reportingComponent": component, "reportingInstance": host or component}
        return await self.create(core("events", namespace=namespace), event,
                                 action=f"create Event {reason} for pod {namespace}/{pod_name}")

    # ---- verbs ----------------------------------------------------------------------------------------
    async def get(self, path: ApiPath, params: Mapping[str, str] | None = None, *, action: str = "") -> dict[str, Any]:
        action = action or f"GET {path}"
        return _object(await self._request("GET", path, action, params=params), action)

    async def apply(self, path: ApiPath, obj: Mapping[str, Any], *, field_manager: str, force: bool = False,
                    action: str = "") -> dict[str, Any]:
        """Server-side apply: ``application/apply-patch+yaml`` with a JSON body (JSON is YAML)."""
        params = {"fieldManager": field_manager, **({"force": "true"} if force else {})}
        action = action or f"apply {path}"
        return _object(await self._request("PATCH", path, action, params=params, body=_encode(obj, action),
                                           content_type=APPLY_PATCH), action)

    async def merge_patch(self, path: ApiPath, patch: Mapping[str, Any], *, action: str = "") -> dict[str, Any]:
        action = action or f"patch {path}"
        return _object(await self._request("PATCH", path, action, body=_encode(patch, action),
                                           content_type=MERGE_PATCH), action)

    async def create(self, path: ApiPath, obj: Mapping[str, Any], *, action: str = "") -> dict[str, Any]:
        action = action or f"create in {path}"
        return _object(await self._request("POST", path, action, body=_encode(obj, action), content_type=JSON),
                       action)

    async def watch(self, path: ApiPath, resource_version: str, params: Mapping[str, str] | None = None, *,
                    timeout_seconds: int = DEFAULT_WATCH_SECONDS,
                    on_open: Callable[[], None] | None = None) -> AsyncGenerator[WatchEvent, None]:
        """The changes after ``resource_version`` (with bookmarks), until the server ends the watch,
        ``timeout_seconds`` (plus ``timeout_s``) pass, or an ERROR event (yielded, then the end).
        ``on_open`` is called once the server has accepted the watch (a quiet watch yields nothing).

        A 410 Gone (the version is older than the server keeps), as an HTTP status or as an ERROR
        event, raises :class:`KubeApiError` of kind ``gone``: list again. Use it under
        ``contextlib.aclosing`` so that leaving early closes the connection."""
        action = f"watch {path}"
        query = {**(params or {}), "watch": "true", "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(int(timeout_seconds)),
                 **({"resourceVersion": resource_version} if resource_version else {})}
        loop = asyncio.get_running_loop()
        response = await self._open("GET", path, action, params=query)
        try:
            if response.status >= 300:
                raise await self._status_error(response, action, loop.time() + self.timeout_s)
            if on_open is not None:
                on_open()
            deadline = loop.time() + timeout_seconds + self.timeout_s
            pending = bytearray()
            while True:
                chunk = await self._read_chunk(response, action, deadline, watching=True)
                if chunk is None:
                    return  # the watch's time is up: the caller watches again from its last version
                if not chunk:
                    if pending.strip():
                        raise KubeApiError("garbage", action,
                                           f"the watch ended inside an event: {excerpt(bytes(pending))}")
                    return
                pending += chunk
                while (end := pending.find(b"\n")) >= 0:
                    line = bytes(pending[:end])
                    del pending[:end + 1]
                    if len(line) > self.max_event_bytes:
                        raise self._event_too_large(action)
                    if line.strip():
                        event = self._event(line, action)
                        yield event
                        if event.type == "ERROR":
                            return
                if len(pending) > self.max_event_bytes:
                    raise self._event_too_large(action)
        finally:
            response.close()

    async def list_pages(self, path: ApiPath, params: Mapping[str, str] | None = None, *,
                         page_size: int = DEFAULT_PAGE_SIZE, action: str = "") -> AsyncGenerator[ListPage, None]:
        """The list in pages of at most ``page_size`` items (``limit``/``continue``); a page over the
        answer cap is asked for again at half the size. Every page carries the list's resourceVersion."""
        action = action or f"list {path}"
        token, size = "", max(1, page_size)
        while True:
            query = {**(params or {}), "limit": str(size), **({"continue": token} if token else {})}
            try:
                doc = _object(await self._request("GET", path, action, params=query), action)
            except KubeApiError as exc:
                if exc.kind == "too_large" and size > 1:
                    size //= 2
                    continue
                raise
            items = doc.get("items")
            if items is None:
                items = []
            if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
                raise KubeApiError("garbage", action, "the answer's items is not a list of objects")
            meta = metadata(doc, action)
            page = ListPage(items, _string(meta, "resourceVersion", action, "metadata"),
                            _string(meta, "continue", action, "metadata"))
            del doc
            yield page
            if not page.continue_token:
                return
            token = page.continue_token

    async def list(self, path: ApiPath, params: Mapping[str, str] | None = None, *,
                   page_size: int = DEFAULT_PAGE_SIZE, action: str = "") -> ListResult:
        """Every item (all pages) and the list's resourceVersion."""
        items: list[dict[str, Any]] = []
        version = ""
        async for page in self.list_pages(path, params, page_size=page_size, action=action):
            items.extend(page.items)
            version = page.resource_version
        return ListResult(items, version)

    # ---- plumbing -------------------------------------------------------------------------------------
    def _session_now(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            if self._https and self._ssl is None:
                from memtopo import tls

                try:
                    self._ssl = tls.client_context(self._ca_file or None)
                except tls.TlsError as exc:
                    raise KubeApiError("rejected", "connect", str(exc)) from None
            connector = aiohttp.TCPConnector(ssl=self._ssl or True, limit=32)
            self._session = aiohttp.ClientSession(
                connector=connector, trust_env=False, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s),
                headers={"User-Agent": f"memtopo/{__version__}", "Accept": JSON, "Accept-Encoding": "identity"})
            self._loop = loop
        return self._session

    def _headers(self, action: str, content_type: str) -> dict[str, str]:
        headers = {"Content-Type": content_type} if content_type else {}
        token = self._bearer(action)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _bearer(self, action: str) -> str:
        """The token; a token file is read again when its inode, size or modification time changes."""
        if not self._token_file:
            return self._token
        try:
            st = os.stat(self._token_file)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp != self._token_stamp:
                with open(self._token_file, "rb") as f:
                    raw = f.read(MAX_TOKEN_BYTES + 1)
                text = raw.decode("ascii", "replace").strip()
                _check_token(text, action, f"the token in {self._token_file}")
                self._token, self._token_stamp = text, stamp
        except OSError as exc:
            if not self._token:
                raise KubeApiError("rejected", action, f"cannot read the token {self._token_file}: "
                                                       f"{exc_reason(exc)}") from None
        return self._token

    async def _open(self, method: str, path: ApiPath, action: str, *, params: Mapping[str, str] | None = None,
                    body: bytes | None = None, content_type: str = "") -> aiohttp.ClientResponse:
        """The response, its headers read within ``timeout_s``; the caller reads and closes it."""
        session = self._session_now()
        url = URL(self.server_url + path.path, encoded=True)
        headers = self._headers(action, content_type)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await session.request(method, url, params=dict(params or {}), data=body, headers=headers,
                                             allow_redirects=False)
        except TimeoutError:
            raise KubeApiError("timeout", action, f"no answer within {self.timeout_s:g} s") from None
        except _CONNECTION_FAILURES as exc:  # refused, reset, TLS, a malformed answer head
            raise KubeApiError("unreachable", action, _client_failure(exc)) from None

    async def _request(self, method: str, path: ApiPath, action: str, *, params: Mapping[str, str] | None = None,
                       body: bytes | None = None, content_type: str = "") -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        response = await self._open(method, path, action, params=params, body=body, content_type=content_type)
        try:
            status = response.status
            if status >= 300:
                raise await self._status_error(response, action, deadline)
            raw = await self._read_body(response, action, deadline, self.max_answer_bytes)
        finally:
            response.close()
        if status == 204:
            return {}
        text = answer_text(raw, action, status)
        raw.clear()  # the text is all that is needed now: the bytes are not kept through decoding
        return parse_json(text, action, self.max_answer_bytes, status)

    async def _read_chunk(self, response: aiohttp.ClientResponse, action: str, deadline: float, *,
                          watching: bool = False) -> bytes | None:
        """The next chunk ("" at the end), None when ``deadline`` passed first (a watch's end)."""
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(response.content.readany(), remaining)
        except TimeoutError:
            if watching:
                return None
            raise KubeApiError("timeout", action, f"the answer did not complete within {self.timeout_s:g} s",
                               response.status) from None
        except _CONNECTION_FAILURES as exc:  # the connection broke mid-answer
            raise KubeApiError("unreachable", action, f"the answer broke off: {_client_failure(exc)}",
                               response.status) from None

    async def _read_body(self, response: aiohttp.ClientResponse, action: str, deadline: float, cap: int) -> bytearray:
        declared = response.content_length
        if declared is not None and declared > cap:
            raise KubeApiError("too_large", action, f"the answer declares {human_bytes(declared)}, over the "
                                                    f"{human_bytes(cap)} cap", response.status)
        body = bytearray()
        while chunk := await self._read_chunk(response, action, deadline):
            if len(body) + len(chunk) > cap:
                raise KubeApiError("too_large", action, f"the answer is over the {human_bytes(cap)} cap",
                                   response.status)
            body += chunk
        return body

    async def _status_error(self, response: aiohttp.ClientResponse, action: str, deadline: float) -> KubeApiError:
        status = response.status
        if 300 <= status < 400:
            target = response.headers.get("Location", "")
            to = f" to {quote(target)}" if target else ""
            return KubeApiError("rejected", action, f"HTTP {status}: a redirect{to}, not followed", status)
        try:
            raw = await self._read_body(response, action, deadline, MAX_ERROR_BYTES)
            message = _status_message(bytes(raw))
        except KubeApiError:
            message = ""
        said = f": {quote(message)}" if message else ""
        return KubeApiError(kind_of_status(status), action, f"HTTP {status}{said}", status)

    def _event(self, line: bytes, action: str) -> WatchEvent:
        doc = _object(parse_json(answer_text(line, action), action, self.max_event_bytes), action, "a watch event")
        kind = doc.get("type")
        obj = doc.get("object")
        if kind not in EVENT_TYPES or not isinstance(obj, dict):
            raise KubeApiError("garbage", action, f"not a watch event: {excerpt(line)}")
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise error_of_status(obj, action)
            return WatchEvent("ERROR", obj, "")
        version = _string(metadata(obj, action), "resourceVersion", action, "object.metadata")
        if not version:
            raise KubeApiError("garbage", action, f"a {kind} event without a resourceVersion")
        return WatchEvent(kind, obj, version)

    def _event_too_large(self, action: str) -> KubeApiError:
        return KubeApiError("too_large", action, f"a watch event is over the {human_bytes(self.max_event_bytes)} cap")


_CONNECTION_FAILURES: Final = (aiohttp.ClientError, OSError, ValueError, EOFError)


def _check_token(token: str, action: str, what: str) -> None:
    # Visible ASCII only: anything else could never be a bearer token, and a newline would split the header.
    if not token or len(token) > MAX_TOKEN_BYTES or not all("!" <= c <= "~" for c in token):
        raise KubeApiError("rejected", action, f"{what} is not a bearer token")


def _encode(obj: Mapping[str, Any], action: str) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise KubeApiError("rejected", action, f"the object is not JSON: {shorten(str(exc))}") from None


def _client_failure(exc: BaseException) -> str:
    """What went wrong on the connection, in words without a traceback (its OS reason when it has one)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        errno = exc.os_error.errno
        why = os.strerror(errno) if errno else exc_reason(exc.os_error)
        return shorten(f"cannot connect to {exc.host}:{exc.port}: {why}", 120)
    return shorten(f"{type(exc).__name__}: {exc_reason(exc)}", 120)


def quote(text: str) -> str:
    """What a server said, quoted and escaped: printable text up to QUOTE_CHARS characters, other text
    less (an escaped control character takes four)."""
    return excerpt(text, QUOTE_CHARS if text[:QUOTE_CHARS].isprintable() else QUOTE_CHARS // 4)
