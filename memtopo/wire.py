"""A serialized topology carried inside another message without being parsed or encoded again.

Protobuf messages concatenate: a message's bytes followed by one more length-delimited field are
the bytes of that message with the field set. So the agent sends the snapshot bytes it serialized
once (per generation) inside every TopologyEvent and AgentMessage (``embed``), and the controller
keeps the bytes it received (``field_bytes``) instead of serializing the message it parsed again.
``length_delimited`` is the scan beneath it: a message's top-level fields read without parsing the
message (the PodResources client takes a kubelet's answer one pod at a time with it).
"""

from __future__ import annotations

from collections.abc import Iterator

_LENGTH_DELIMITED = 2


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def embed(head: bytes, field: int, payload: bytes) -> bytes:
    """``head`` (a serialized message without ``field``) with ``payload`` as its length-delimited
    field number ``field``."""
    return head + varint(field << 3 | _LENGTH_DELIMITED) + varint(len(payload)) + payload


def field_bytes(data: bytes, field: int) -> bytes | None:
    """The bytes of top-level field ``field`` of the serialized message ``data``, when it is there
    exactly once and length-delimited; None otherwise (absent, repeated: protobuf merges repeated
    occurrences of a message field, so no one slice is the value; or ``data`` does not parse)."""
    try:
        found = list(length_delimited(data, field))
    except ValueError:
        return None
    return found[0] if len(found) == 1 else None


def length_delimited(data: bytes | memoryview, field: int) -> Iterator[bytes]:
    """The payloads of every top-level length-delimited field ``field`` of the serialized message
    ``data``, one at a time, the other fields skipped; ValueError (when the scan reaches it) for bytes
    that are not a proto3 message: a truncated or overlong varint, field number 0, a group or unknown
    wire type, a field that runs past the end."""
    i, end = 0, len(data)
    while i < end:
        key, i = _read_varint(data, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            _, i = _read_varint(data, i)
        elif kind == 1:
            i += 8
        elif kind == 5:
            i += 4
        elif kind == _LENGTH_DELIMITED:
            size, i = _read_varint(data, i)
            if number == field and i + size <= end:
                yield bytes(data[i:i + size])
            i += size
        else:  # groups (3, 4) are not in proto3 messages; anything else is not a message
            raise ValueError(f"wire type {kind}")
        if number == 0 or i > end:
            raise ValueError("a field past the end of the message" if i > end else "field number 0")


def _read_varint(data: bytes | memoryview, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("a truncated or overlong varint")
        byte = data[i]
        i += 1
        n |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return n, i
        shift += 7
