"""proto3 JSON for every memtopo message, in one place: the .proto's snake_case field names, as the
command line prints them, the agent relays them and the controller serves them.

json_format converts every element of a repeated field with a call of its own, and json's indenting
encoder is pure Python: a 1,024-node topology's SLIT rows (three million numbers) took as long as
its discovery and several times its memory. Long lists of 32-bit integers (which proto3 JSON writes
as plain numbers) are therefore left out while json_format converts the message and written into
the text in one join each, in exactly the layout json_format would have given them. The message is
changed during the call (and restored): a message another thread reads needs a copy of its own.
"""

from __future__ import annotations

import json
import re
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

# Lists at least this long take the fast path: a machine's CPU and SLIT lists; the rest (a domain's
# nodes, a device's IRQs) costs nothing either way.
LONG_LIST = 64
_NUMBER_TYPES = frozenset({FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_UINT32})
_PLACEHOLDER = re.compile(r'"\\u0000(\d+)\\u0000"')


def to_json(msg: Message, *, defaults: bool = False, indent: int | None = 2) -> str:
    """``defaults``: print every field, zeros included (a topology reads better whole; a plan result
    would drown in empty fields)."""
    cut: list[tuple[_Path, list[int]]] = []
    _find_long(msg, (), cut)
    if not cut:
        return json_format.MessageToJson(msg, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=defaults, indent=indent)
    return _with_lists_spliced(msg, cut, defaults, indent)


def to_dict(msg: Message) -> dict[str, object]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


# Where a field is: (name, index in a repeated message field or -1 for a singular one) per level,
# then the list's own name.
_Path = tuple[tuple[str, int], ...]


def _find_long(msg: Message, path: _Path, out: list[tuple[_Path, list[int]]]) -> None:
    """Every long repeated 32-bit integer field under ``msg``, with its path and values."""
    for field, value in msg.ListFields():
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                continue
            if field.is_repeated:
                for k, sub in enumerate(value):
                    _find_long(sub, (*path, (field.name, k)), out)
            else:
                _find_long(value, (*path, (field.name, -1)), out)
        elif field.is_repeated and field.cpp_type in _NUMBER_TYPES and len(value) >= LONG_LIST:
            out.append(((*path, (field.name, -1)), list(value)))


def _message_at(msg: Message, path: _Path) -> Message:
    for name, k in path:
        msg = getattr(msg, name)[k] if k >= 0 else getattr(msg, name)
    return msg


def _dict_at(doc: dict[str, Any], path: _Path) -> dict[str, Any]:
    for name, k in path:
        doc = doc[name][k] if k >= 0 else doc[name]
    return doc


def _with_lists_spliced(msg: Message, cut: list[tuple[_Path, list[int]]], defaults: bool,
                        indent: int | None) -> str:
    # Cut from the message itself for the conversion and put back after: a copy would not do, as a
    # map's entries come out of a copy in another order.
    owners = [(_message_at(msg, path[:-1]), path[-1][0], values) for path, values in cut]
    try:
        for owner, name, _ in owners:
            owner.ClearField(name)
        doc = json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=defaults)
    finally:
        for owner, name, values in owners:
            getattr(owner, name)[:] = values
    for n, ((owner, name, _), (path, _)) in enumerate(zip(owners, cut, strict=True)):
        at = _dict_at(doc, path[:-1])
        at[name] = f"\0{n}\0"
        # Where json_format would have put the list: the set fields come first, by number (without
        # the list, it came behind them, or not at all).
        order = [field.name for field, _ in owner.ListFields()]
        reordered = {key: at.pop(key) for key in order if key in at}
        reordered.update(at)
        at.clear()
        at.update(reordered)
    parts = _PLACEHOLDER.split(json.dumps(doc, indent=indent))
    out: list[str] = []
    for i in range(0, len(parts) - 1, 2):
        before, values = parts[i], cut[int(parts[i + 1])][1]
        out.append(before)
        if indent is None:
            out.append("[" + ", ".join(map(str, values)) + "]")
            continue
        line = before[before.rfind("\n") + 1:]
        inner = "\n" + line[: len(line) - len(line.lstrip(" "))]
        out.append("[" + inner + " " * indent + ("," + inner + " " * indent).join(map(str, values)) + inner + "]")
    out.append(parts[-1])
    return "".join(out)
