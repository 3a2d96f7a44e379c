"""Raw HTTP/1.1 exchanges with memtopo's HTTP server (memtopo/httpserve.py: the controller's
listener, the agent's health port), so malformed requests reach the server exactly as sent. The
requests name a Host and a media type the server accepts; a test of those checks writes its own."""

from __future__ import annotations

import asyncio


async def exchange(port: int, raw: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw``, read one response (Content-Length or to EOF); (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return await read_response(reader, timeout)
    finally:
        writer.close()


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode()


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def read_response(reader: asyncio.StreamReader, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        else:
            body = await reader.read()
        return status, headers, body


async def read_response_head_only(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The status and headers of an answer with no body (HEAD): the next answer starts right after."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode().split("\r\n")
    return int(lines[0].split(" ")[1]), {k.lower(): v.strip() for k, _, v in
                                         (line.partition(":") for line in lines[1:] if line)}, b""
