"""The few Kubernetes API calls the scheduler extender makes, over the standard library's HTTP client.

Three calls, blocking (the extender runs them in a thread): read a pod, list the pods bound to nodes
(for the device annotations the extender wrote), and bind (annotate the pod with its devices, then
create its ``Binding``, as HAMi's extender does). No client library: the calls are four fixed REST
paths, and a library would be the controller's largest dependency for them.

``KubeApi.in_cluster()`` reads the service account the way client-go's ``InClusterConfig`` does;
``KubeApi(url)`` talks to an explicit server (``kubectl proxy``'s ``http://127.0.0.1:8001``, or a
stand-in in tests). Answers are bounded (``MAX_ANSWER_BYTES``) and errors are ``KubeApiError`` with
the HTTP status and a short excerpt of the server's message.
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

SERVICE_ACCOUNT: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MAX_ANSWER_BYTES: Final = 256 << 20
PAGE: Final = 500
TIMEOUT_S: Final = 10.0


class KubeApiError(Exception):
    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class PodApi(Protocol):
    """What the extender needs from an API server (KubeApi, or a test's stand-in)."""

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...

    def bound_pods(self) -> list[dict[str, Any]]: ...

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None: ...

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None: ...


def _excerpt(text: str, limit: int = 160) -> str:
    shown = text if len(text) <= limit else text[:limit] + "…"
    return shown.encode("unicode_escape").decode("ascii")


class KubeApi:
    def __init__(self, server: str, *, token: str = "", ca_file: str = "", timeout: float = TIMEOUT_S) -> None:
        parts = urllib.parse.urlsplit(server)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise KubeApiError(f"{_excerpt(server)}: expected http(s)://HOST[:PORT]")
        self.server = server.rstrip("/")
        self._token = token
        self._timeout = timeout
        self._ssl = ssl.create_default_context(cafile=ca_file or None) if parts.scheme == "https" else None

    @classmethod
    def in_cluster(cls) -> KubeApi:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
        if not host or not port:
            raise KubeApiError("not in a cluster: KUBERNETES_SERVICE_HOST/PORT are not set")
        try:
            token = (SERVICE_ACCOUNT / "token").read_text().strip()
        except OSError as exc:
            raise KubeApiError(f"cannot read the service account token: {exc.strerror}") from exc
        netloc = f"[{host}]" if ":" in host else host
        return cls(f"https://{netloc}:{port}", token=token, ca_file=str(SERVICE_ACCOUNT / "ca.crt"))

    # ---- calls ------------------------------------------------------------------------------------
    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self._call("GET", f"/api/v1/namespaces/{_seg(namespace)}/pods/{_seg(name)}")

    def bound_pods(self) -> list[dict[str, Any]]:
        """Every pod bound to a node and not finished, page by page."""
        selector = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
        return list(self._pages("/api/v1/pods", {"fieldSelector": selector}))

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        self._call("PATCH", f"/api/v1/namespaces/{_seg(namespace)}/pods/{_seg(name)}",
                   {"metadata": {"annotations": dict(annotations)}}, "application/merge-patch+json")

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        binding = {"apiVersion": "v1", "kind": "Binding",
                   "metadata": {"name": name, "namespace": namespace, **({"uid": uid} if uid else {})},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        self._call("POST", f"/api/v1/namespaces/{_seg(namespace)}/pods/{_seg(name)}/binding", binding)

    # ---- plumbing ---------------------------------------------------------------------------------
    def _pages(self, path: str, query: dict[str, str]) -> Iterator[dict[str, Any]]:
        token = ""
        while True:
            page = self._call("GET", path + "?" + urllib.parse.urlencode(
                {**query, "limit": str(PAGE), **({"continue": token} if token else {})}))
            items = page.get("items")
            if not isinstance(items, list):
                raise KubeApiError(f"GET {path}: the answer has no items list")
            yield from (i for i in items if isinstance(i, dict))
            meta = page.get("metadata")
            token = meta.get("continue", "") if isinstance(meta, dict) else ""
            if not token or not isinstance(token, str):
                return

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
              ) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)  # noqa: S310 - http(s) only
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        if self._token:
            req.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(req, timeout=self._timeout, context=self._ssl) as resp:  # noqa: S310
                raw = resp.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as exc:
            detail = exc.read(4096).decode("utf-8", "replace")
            with contextlib.suppress(ValueError, AttributeError):
                detail = str(json.loads(detail).get("message", detail))
            raise KubeApiError(f"{method} {path}: HTTP {exc.code}: {_excerpt(detail)}", exc.code) from None
        except (OSError, ValueError) as exc:  # URLError, timeouts, TLS failures
            raise KubeApiError(f"{method} {path}: {_excerpt(str(getattr(exc, 'reason', exc)))}") from None
        if len(raw) > MAX_ANSWER_BYTES:
            raise KubeApiError(f"{method} {path}: the answer is over {MAX_ANSWER_BYTES} bytes")
        if not raw.strip():
            return {}
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            raise KubeApiError(f"{method} {path}: the answer is not JSON") from None
        if not isinstance(doc, dict):
            raise KubeApiError(f"{method} {path}: the answer is not a JSON object")
        return doc


def _seg(text: str) -> str:
    return urllib.parse.quote(text, safe="")
