"""memtopo's one Kubernetes API client (``memtopo.k8s.kubeapi``) against the STAND-IN API server
(bench/k8s_standin.py: real HTTP, list/watch/apply/bind for the resources memtopo uses; not a Kubernetes
API server, none can run here) and against hostile servers written byte by byte (``raw_server``):
trickling, lying about sizes, redirecting, answering garbage, never answering."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.k8s_standin import StandInApiServer, raw_server, read_head
from memtopo.k8s import kubeapi, names
from memtopo.k8s.kubeapi import KubeApi, KubeApiError, WatchEvent, core, nrt_path

WAIT = 60.0  # generous: ends a hang, never a speed assertion
REPO = Path(__file__).resolve().parents[2]


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 120))


def pod(name: str, node: str = "", namespace: str = "default", **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": {}},
            "spec": {"containers": [{"name": "c"}], **({"nodeName": node} if node else {})},
            "status": {"phase": "Running"}}


async def collect(api: KubeApi, path: kubeapi.ApiPath, version: str, *, until: int, **kw: Any) -> list[WatchEvent]:
    out: list[WatchEvent] = []
    async with contextlib.aclosing(api.watch(path, version, **kw)) as events:
        async for event in events:
            out.append(event)
            if len(out) >= until:
                break
    return out


# ---- what it does ------------------------------------------------------------------------------------
def test_get_list_pages_watch_apply_patch_bind_and_events_through_a_kubectl_proxy_style_url() -> None:
    async def main() -> None:
        server = StandInApiServer()
        uid = server.add_node("node-1")
        url = await server.start()
        for i in range(12):
            server.put_pod(pod(f"p{i:02d}", node="node-1" if i % 2 else "", app="x" if i < 6 else "y"))
        api = KubeApi(url)
        try:
            assert (await api.get_node("node-1"))["metadata"]["uid"] == uid
            listed = await api.list(core("pods"), {"labelSelector": "app=x"}, page_size=4)
            assert [p["metadata"]["name"] for p in listed.items] == [f"p{i:02d}" for i in range(6)]
            assert listed.resource_version == str(server.resource_version)
            limits = [r.query.get("limit") for r in server.requests if r.path == "/api/v1/pods"]
            assert limits == ["4", "4"]  # two pages, the second from the continue token
            # Changes after the list, in order, from its resourceVersion.
            server.put_pod(pod("p99"))
            await api.annotate_pod("default", "p00", {"memtopo.io/x": "1"})
            server.delete_pod("default", "p01")
            watching = asyncio.create_task(collect(api, core("pods"), listed.resource_version, until=4))
            while not server.watches():
                await asyncio.sleep(0.01)
            server.bookmark()  # a bookmark goes to the watches open when it is asked for
            events = await asyncio.wait_for(watching, WAIT)
            assert [(e.type, e.object["metadata"].get("name")) for e in events] == [
                ("ADDED", "p99"), ("MODIFIED", "p00"), ("DELETED", "p01"), ("BOOKMARK", None)]
            assert events[-1].resource_version == str(server.resource_version)
            watch = server.watches()[-1].query
            assert watch["allowWatchBookmarks"] == "true" and watch["resourceVersion"] == listed.resource_version
            # Server-side apply of a NodeResourceTopology: content type, field manager, force only when asked.
            nrt = {"apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology",
                   "metadata": {"name": "node-1"}, "zones": [{"name": "node-0", "type": "Node"}]}
            stored = await api.apply_nrt(nrt, field_manager="memtopo")
            assert stored["metadata"]["managedFields"][0]["manager"] == "memtopo"
            await api.apply_nrt(nrt, field_manager="memtopo", force=True)
            applies = [r for r in server.requests if r.method == "PATCH" and r.path.startswith(str(nrt_path()))]
            assert [(r.content_type, r.query.get("fieldManager"), r.query.get("force")) for r in applies] == [
                ("application/apply-patch+yaml", "memtopo", None), ("application/apply-patch+yaml", "memtopo", "true")]
            # Bind, then an Event about the pod.
            p00 = server.pods[("default", "p00")]
            await api.bind_pod("default", "p00", p00["metadata"]["uid"], "node-1")
            assert p00["spec"]["nodeName"] == "node-1" and p00["metadata"]["annotations"] == {"memtopo.io/x": "1"}
            await api.create_event(namespace="default", pod_name="p00", pod_uid=p00["metadata"]["uid"],
                                   reason="Pinned", message="CPUs 2-5, memory node 0", event_type="Normal")
            (event,) = server.events
            assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "p00",
                                               "namespace": "default", "uid": p00["metadata"]["uid"]}
            assert names.is_subdomain(event["metadata"]["name"]) and event["reason"] == "Pinned"
            assert all("authorization" not in {k.lower() for k in r.headers} for r in server.requests)
        finally:
            await api.close()
            await server.stop()
    run(main)


def test_a_bound_pod_cannot_be_bound_again_and_the_conflict_is_typed() -> None:
    async def main() -> None:
        server = StandInApiServer()
        url = await server.start()
        p = server.put_pod(pod("a", node="n1"))
        api = KubeApi(url)
        with pytest.raises(KubeApiError) as info:
            await api.bind_pod("default", "a", p["metadata"]["uid"], "n2")
        assert info.value.kind == "conflict" and info.value.status == 409
        assert str(info.value).startswith("bind pod default/a to n2: HTTP 409: 'Operation cannot be fulfilled")
        with pytest.raises(KubeApiError) as missing:
            await api.get_pod("default", "nobody")
        assert missing.value.kind == "not_found" and "read pod default/nobody: HTTP 404" in str(missing.value)
        await api.close()
        await server.stop()
    run(main)


# ---- names never reach a URL ---------------------------------------------------------------------------
@pytest.mark.parametrize(("call", "fragment"), [
    (lambda api: api.get_pod("..", "a"), "'..' is not a Kubernetes namespace"),
    (lambda api: api.get_pod("default", "../../secrets"), "'../../secrets' is not a Kubernetes pod name"),
    (lambda api: api.get_node("x" * 5000), "(5000 chars) is not a Kubernetes node name"),
    (lambda api: api.get_node("Node_1"), "'Node_1' is not a Kubernetes node name"),
    (lambda api: api.get_node("a%2Fb"), "'a%2Fb' is not a Kubernetes node name"),
    (lambda api: api.get_node(""), "the node name is empty"),
    (lambda api: api.get_node("node\x1b[31m"), r"'node\x1b[31m' is not"),
    (lambda api: api.annotate_pod("kube-system.evil", "a", {}), "'kube-system.evil' is not a Kubernetes namespace"),
    (lambda api: api.bind_pod("default", "a", "", "../nodes"), "'../nodes' is not a Kubernetes node name"),
])
def test_names_kubernetes_refuses_never_reach_a_url(call: Callable[[KubeApi], Coroutine[Any, Any, Any]],
                                                    fragment: str) -> None:
    async def main() -> None:
        server = StandInApiServer()
        url = await server.start()
        api = KubeApi(url)
        with pytest.raises(names.InvalidNameError) as info:
            await call(api)
        assert fragment in str(info.value) and len(str(info.value)) < 200
        assert server.requests == []
        await api.close()
        await server.stop()
    run(main)


@given(st.text(min_size=1, max_size=300))
def test_any_text_is_a_checked_name_or_an_error(text: str) -> None:
    if names.is_subdomain(text):
        assert core("pods", text, namespace="default").path.endswith("/pods/" + text)
        assert "/" not in text and ".." not in text and text == text.lower()
    else:
        with pytest.raises(names.InvalidNameError):
            core("pods", text, namespace="default")


# ---- deadlines -----------------------------------------------------------------------------------------
def test_a_server_that_trickles_a_byte_a_second_ends_at_the_whole_request_deadline() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        body = json.dumps({"metadata": {"name": "n", "uid": "u"}, "pad": "x" * 1000}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        for i in range(len(body)):  # a thousand seconds, one byte at a time
            writer.write(body[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0.5)

    async def main() -> None:
        async with raw_server(trickle) as url:
            api = KubeApi(url, timeout_s=1.5)
            with pytest.raises(KubeApiError) as info:
                await asyncio.wait_for(api.get_node("node-1"), WAIT)
            assert info.value.kind == "timeout"
            assert str(info.value) == "read Node node-1: the answer did not complete within 1.5 s"
            await api.close()
    run(main)


def test_a_server_that_never_answers_is_a_timeout_naming_what_timed_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        await asyncio.sleep(3600)

    async def main() -> None:
        async with raw_server(silent) as url:
            api = KubeApi(url, timeout_s=1.0)
            nrt = {"apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology",
                   "metadata": {"name": "node-1"}, "zones": []}
            with pytest.raises(KubeApiError) as info:
                await asyncio.wait_for(api.apply_nrt(nrt, field_manager="memtopo"), WAIT)
            assert info.value.kind == "timeout" and str(info.value) == "apply NRT node-1: no answer within 1 s"
            await api.close()
    run(main)


def test_nothing_listening_is_unreachable() -> None:
    async def main() -> None:
        async with raw_server(read_head_only) as url:
            pass  # closed again: nothing listens on its port now
        api = KubeApi(url)
        with pytest.raises(KubeApiError) as info:
            await api.get_node("n")
        assert info.value.kind == "unreachable" and info.value.transient
        assert "Connection refused" in str(info.value) and "Traceback" not in str(info.value)
        await api.close()
    run(main)


async def read_head_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)


# ---- what an answer may be -----------------------------------------------------------------------------
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]


def answering(status: str, body: bytes, headers: bytes = b"Content-Type: application/json\r\n",
              length: int | None = None) -> Serve:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        size = len(body) if length is None else length
        writer.write(f"HTTP/1.1 {status}\r\n".encode() + headers + b"Content-Length: %d\r\n\r\n" % size + body)
        await writer.drain()
    return serve


@pytest.mark.parametrize(("status", "body", "kind", "fragment"), [
    ("200 OK", b"\xff\xfe{\"metadata\": \x00\x81}", "garbage", r"not UTF-8 (at byte 0: b'\xff\xfe"),
    ("200 OK", b"<html><body>" + b"A" * 5000 + b"</body></html>", "garbage", "not JSON: '<html><body>AAA"),
    ("200 OK", b"[1, 2, 3]", "garbage", "not a JSON object"),
    ("200 OK", b"", "garbage", "not JSON"),
    ("200 OK", b"[" * 100000 + b"]" * 100000, "garbage", "not JSON: '[[[["),  # nested past the decoder's limit
    ("500 Internal Server Error", b"<pre>" + b"\x1b[31m" * 10000 + b"</pre>", "unreachable", r"HTTP 500: '<pre>\x1b"),
    ("503 Service Unavailable", b'{"kind": "Status", "message": "etcdserver: leader changed", "code": 503}',
     "unreachable", "HTTP 503: 'etcdserver: leader changed'"),
    ("403 Forbidden", b'{"kind": "Status", "message": "nodes \\"n\\" is forbidden: User \\"system:serviceaccount'
     b':memtopo:agent\\" cannot get resource \\"nodes\\""}', "rejected", "HTTP 403: 'nodes \"n\" is forbidden"),
    ("410 Gone", b"{}", "gone", "HTTP 410"),
    ("302 Found", b"", "rejected", "HTTP 302: a redirect"),
])
def test_every_bad_answer_is_a_typed_error_with_a_short_escaped_excerpt(status: str, body: bytes, kind: str,
                                                                        fragment: str) -> None:
    async def main() -> None:
        async with raw_server(answering(status, body)) as url:
            api = KubeApi(url)
            with pytest.raises(KubeApiError) as info:
                await api.get_node("n")
            assert info.value.kind == kind and fragment in str(info.value), str(info.value)
            assert len(str(info.value)) < 260 and str(info.value).isprintable()
            await api.close()
    run(main)


def test_redirects_are_not_followed_and_the_token_goes_nowhere_else() -> None:
    async def main() -> None:
        elsewhere: list[str] = []

        async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            line, headers = await read_head(reader)
            elsewhere.append(f"{line} {headers.get('authorization', '')}")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

        async with raw_server(record) as other:
            location = f"Location: {other}/api/v1/nodes/n\r\n".encode()
            redirect = answering("307 Temporary Redirect", b"", headers=location)
            async with raw_server(redirect) as url:
                api = KubeApi(url, token="secret-token")
                with pytest.raises(KubeApiError) as info:
                    await api.get_node("n")
                assert info.value.kind == "rejected" and info.value.status == 307
                assert f"a redirect to '{other}/api/v1/nodes/n', not followed" in str(info.value)
                await api.close()
        assert elsewhere == []
    run(main)


def test_proxy_variables_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        proxied: list[str] = []

        async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            proxied.append((await read_head(reader))[0])

        async with raw_server(proxy) as proxy_url:
            for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
                monkeypatch.setenv(var, proxy_url)
            monkeypatch.setenv("NO_PROXY", "")
            server = StandInApiServer()
            server.add_node("n")
            url = await server.start()
            api = KubeApi(url)
            assert (await api.get_node("n"))["metadata"]["name"] == "n"
            await api.close()
            await server.stop()
        assert proxied == []
    run(main)


def test_a_declared_overrun_is_refused_before_its_body_is_read() -> None:
    async def main() -> None:
        async with raw_server(answering("200 OK", b"{", length=250_000_000)) as url:
            api = KubeApi(url, max_answer_bytes=1 << 20)
            with pytest.raises(KubeApiError) as info:
                await api.get_node("n")
            assert info.value.kind == "too_large" and "declares 238.4 MiB, over the 1.0 MiB cap" in str(info.value)
            await api.close()
    run(main)


def test_an_answer_shaped_to_decode_to_many_times_its_size_is_refused_and_a_real_one_of_that_size_is_not() -> None:
    shaped = b'{"items": [' + b",".join([b"[]"] * 200_000) + b"]}"  # 0.6 MB of text, 13 MB of Python lists
    real = json.dumps({"items": [pod(f"pod-{i}", node="n") for i in range(3000)]}).encode()
    assert len(shaped) < len(real) < 1 << 20

    async def main() -> None:
        for body, ok in ((shaped, False), (real, True)):
            async with raw_server(answering("200 OK", body)) as url:
                api = KubeApi(url, max_answer_bytes=1 << 20)
                if ok:
                    assert len((await api.get(core("pods")))["items"]) == 3000
                else:
                    with pytest.raises(KubeApiError) as info:
                        await api.get(core("pods"))
                    assert info.value.kind == "too_large" and "decoded, over 12.0 MiB" in str(info.value)
                await api.close()
    run(main)


HUGE_ANSWER = textwrap.dedent("""
    import asyncio, resource, sys
    from memtopo.k8s.kubeapi import KubeApi, KubeApiError
    from bench.k8s_standin import raw_server, read_head

    TOTAL = 250_000_000
    ITEMS = b"1, " * 349_525  # a MiB of a list's items, sent again and again: one valid JSON document

    def chunk(data):
        return b"%x\\r\\n" % len(data) + data + b"\\r\\n"

    async def serve(reader, writer):
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n")
        writer.write(chunk(b'{"items": ['))
        sent = 0
        while sent < TOTAL:
            writer.write(chunk(ITEMS))
            await writer.drain()
            sent += len(ITEMS)
        writer.write(chunk(b"1]}") + b"0\\r\\n\\r\\n")

    async def main():
        async with raw_server(serve) as url:
            api = KubeApi(url, timeout_s=600, max_answer_bytes=int(sys.argv[1]))
            await api.close()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            try:
                await api.get_node("n")
                print("decoded")
            except KubeApiError as exc:
                print(exc.kind)
            await api.close()
            print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)

    asyncio.run(main())
""")


@pytest.mark.parametrize("cap", [8 << 20, 64 << 20])
def test_a_250_mb_answer_leaves_the_process_within_a_few_times_the_cap(cap: int) -> None:
    """Peak RSS, measured in a process of its own (a memory bound, not a speed one)."""
    out = subprocess.run([sys.executable, "-c", HUGE_ANSWER, str(cap)], capture_output=True, text=True,
                         cwd=REPO, timeout=300, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    kind, grown = out.stdout.split()
    assert kind == "too_large"
    assert int(grown) <= 3 * cap, f"peak RSS grew {int(grown) >> 20} MiB for a {cap >> 20} MiB cap"


# ---- watches -------------------------------------------------------------------------------------------
def test_a_410_as_a_status_or_as_an_error_event_is_gone() -> None:
    async def main() -> None:
        server = StandInApiServer()
        url = await server.start()
        server.put_pod(pod("a"))
        old = str(server.resource_version)
        server.put_pod(pod("b"))
        server.compact()
        api = KubeApi(url)
        for as_event in (False, True):
            server.gone_as_event = as_event
            with pytest.raises(KubeApiError) as info:
                await collect(api, core("pods"), old, until=1)
            assert info.value.kind == "gone" and info.value.status == 410
            assert ("ERROR 410" if as_event else "HTTP 410") in str(info.value)
        await api.close()
        await server.stop()
    run(main)


def test_a_watch_line_over_the_event_cap_is_an_error_not_a_growing_buffer() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b'{"type": "ADDED", "object": {"pad": "' + b"x" * 65536
        while True:  # one line that never ends
            writer.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            await writer.drain()

    async def main() -> None:
        async with raw_server(endless) as url:
            api = KubeApi(url, max_event_bytes=1 << 20)
            with pytest.raises(KubeApiError) as info:
                await asyncio.wait_for(collect(api, core("pods"), "1", until=1), WAIT)
            assert info.value.kind == "too_large" and "a watch event is over the 1.0 MiB cap" in str(info.value)
            await api.close()
    run(main)


@pytest.mark.parametrize(("line", "fragment"), [
    (b"\xff\xfe not even text", "not UTF-8"),
    (b'{"type": "ADDED"}', "not a watch event"),
    (b'{"type": "EXPLODED", "object": {}}', "not a watch event"),
    (b'{"type": "ADDED", "object": {"metadata": {}}}', "without a resourceVersion"),
    (b'{"type": "ADDED", "object": {"metadata": {"resourceVersion": 7}}}', "resourceVersion is not a string"),
])
def test_a_garbage_watch_event_is_a_typed_error(line: bytes, fragment: str) -> None:
    async def main() -> None:
        server = StandInApiServer()
        url = await server.start()
        server.inject("watch_line", body=line)
        api = KubeApi(url)
        with pytest.raises(KubeApiError) as info:
            await asyncio.wait_for(collect(api, core("pods"), "0", until=1), WAIT)
        assert info.value.kind == "garbage" and fragment in str(info.value)
        await api.close()
        await server.stop()
    run(main)


def test_a_watch_ends_at_its_timeout_even_when_the_server_keeps_it_open() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(3600)

    async def main() -> None:
        async with raw_server(silent) as url:
            api = KubeApi(url, timeout_s=1.0)
            assert await asyncio.wait_for(collect(api, core("pods"), "5", until=1, timeout_seconds=1), WAIT) == []
            await api.close()
    run(main)


# ---- credentials ---------------------------------------------------------------------------------------
def test_the_token_file_is_read_again_when_it_rotates(tmp_path: Path) -> None:
    async def main() -> None:
        server = StandInApiServer()
        server.add_node("n")
        url = await server.start()
        token = tmp_path / "token"
        token.write_text("first-token\n")
        api = KubeApi(url, token_file=str(token))
        await api.get_node("n")
        token.write_text("second-token-longer\n")  # the kubelet swaps in a new bound token
        await api.get_node("n")
        assert [r.headers.get("Authorization") for r in server.requests] == [
            "Bearer first-token", "Bearer second-token-longer"]
        token.unlink()  # gone for a moment: the last token is still used
        await api.get_node("n")
        assert server.requests[-1].headers.get("Authorization") == "Bearer second-token-longer"
        await api.close()
        await server.stop()
    run(main)


def test_in_cluster_configuration_and_what_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeApiError, match="not in a cluster"):
        KubeApi.from_flag("in-cluster")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    api = KubeApi.in_cluster(service_account=tmp_path)
    assert api.server_url == "https://[fd00::1]"  # port 443, the scheme's own
    for bad in ("ftp://x", "https://user:pw@host", "https://host/?a=b", "not a url", ""):
        with pytest.raises(KubeApiError, match="expected http"):
            KubeApi(bad)
    with pytest.raises(KubeApiError, match="only sent over https"):
        KubeApi("http://10.0.0.1:8080", token="t")
    KubeApi("http://127.0.0.1:8001", token="t")  # kubectl proxy on loopback
    with pytest.raises(KubeApiError, match="not a bearer token"):
        KubeApi("https://host", token="two\nlines")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@given(st.one_of(st.binary(max_size=300),
                 _JSON.map(lambda doc: json.dumps(doc).encode()),
                 st.fixed_dictionaries({"type": st.sampled_from([*sorted(kubeapi.EVENT_TYPES), "x"]),
                                        "object": _JSON}).map(lambda doc: json.dumps(doc).encode())))
def test_any_watch_line_is_an_event_or_a_typed_error(line: bytes) -> None:
    api = KubeApi("http://127.0.0.1:1", max_event_bytes=4096)
    try:
        event = api._event(line, "watch /api/v1/pods")
    except KubeApiError as exc:
        assert exc.kind in ("garbage", "gone", "too_large") and len(str(exc)) < 300
    else:
        assert event.type in kubeapi.EVENT_TYPES and isinstance(event.object, dict)
        assert event.type == "ERROR" or event.resource_version
