"""Raw HTTP/1.1 exchanges with the controller's HTTP listener, so malformed requests reach the
server exactly as sent."""

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
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


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
