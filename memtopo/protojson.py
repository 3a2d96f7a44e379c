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
from typing import Any, cast

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from memtopo.text import excerpt, shorten

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


class ProtoJsonError(ValueError):
    """JSON that is not the message it should be: the message names the field (``actions[0].cpus``),
    what it takes and a short excerpt of what it got."""


_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: ("int32", -(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: ("sint32", -(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: ("sfixed32", -(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: ("uint32", 0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: ("fixed32", 0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: ("int64", -(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: ("sint64", -(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: ("sfixed64", -(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: ("uint64", 0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: ("fixed64", 0, 2**64 - 1),
}
_FLOATS = frozenset({FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT})
_FLOAT_WORDS = frozenset({"NaN", "Infinity", "-Infinity"})
# Well-known types whose JSON form is a string (RFC 3339 time, "1.5s", "a,b"); the others are left
# to protobuf's parser.
_STRING_TYPES = frozenset({"google.protobuf.Timestamp", "google.protobuf.Duration", "google.protobuf.FieldMask"})


def from_json[M: Message](obj: object, msg: M) -> M:
    """``msg`` filled from decoded proto3 JSON (.proto or JSON field names, as protobuf reads them).

    ProtoJsonError for JSON of the wrong shape, naming the field and the type it takes, where
    protobuf's own words ("repeated field cpus must be in [] which is 0 at BindingPlan.actions[0]…")
    name neither plainly."""
    desc = cast(Descriptor, msg.DESCRIPTOR)
    if not isinstance(obj, dict):
        raise _wrong("", f"an object (a {desc.name})", obj)
    try:
        _check_message(obj, desc, "")
        json_format.ParseDict(obj, msg)
    except ProtoJsonError:
        raise
    except RecursionError:
        raise ProtoJsonError("nested too deeply") from None
    except (json_format.ParseError, ValueError, TypeError) as exc:
        raise ProtoJsonError(shorten(str(exc), 200)) from None
    return msg


def _got(value: object) -> str:
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, str):
        return f"a string {excerpt(value)}"
    return f"{'a boolean' if isinstance(value, bool) else 'a number'} {shorten(json.dumps(value))}"


def _wrong(path: str, expected: str, value: object) -> ProtoJsonError:
    return ProtoJsonError(f"{path or 'the document'}: expected {expected}, got {_got(value)}")


def _check_message(obj: object, desc: Descriptor, path: str) -> None:
    if not isinstance(obj, dict):
        raise _wrong(path, f"an object (a {desc.name})", obj)
    by_json = {f.json_name: f for f in desc.fields}
    for key, value in obj.items():
        field = desc.fields_by_name.get(key) or by_json.get(key)
        if field is None:
            names = ", ".join(f.name for f in desc.fields)
            raise ProtoJsonError(f"{path or desc.name}: no field {excerpt(str(key), 60)} (a {desc.name} has: {names})")
        _check_field(value, field, f"{path}.{field.name}" if path else field.name)


def _check_field(value: object, field: FieldDescriptor, path: str) -> None:
    if value is None:
        return  # proto3 JSON's null: the field's default
    sub = field.message_type
    if sub is not None and sub.GetOptions().map_entry:
        if not isinstance(value, dict):
            raise _wrong(path, "an object (a map)", value)
        for key, item in value.items():
            _check_one(item, sub.fields_by_name["value"], f"{path}[{excerpt(str(key))}]")
    elif field.is_repeated:
        if not isinstance(value, list):
            raise _wrong(path, f"a list of {_type_word(field)}", value)
        for i, item in enumerate(value):
            _check_one(item, field, f"{path}[{i}]")
    else:
        _check_one(value, field, path)


def _type_word(field: FieldDescriptor) -> str:
    if field.message_type is not None:
        return f"{field.message_type.name} objects"
    if field.enum_type is not None:
        return f"{field.enum_type.name} names"
    if field.type in _INT_RANGES:
        return f"{_INT_RANGES[field.type][0]} integers"
    return {FieldDescriptor.TYPE_BOOL: "booleans", FieldDescriptor.TYPE_STRING: "strings",
            FieldDescriptor.TYPE_BYTES: "base64 strings"}.get(field.type, "numbers")


def _check_one(value: object, field: FieldDescriptor, path: str) -> None:
    if value is None:
        return
    kind = field.type
    sub, enum = field.message_type, field.enum_type
    if sub is not None:
        if sub.full_name in _STRING_TYPES:
            if not isinstance(value, str):
                raise _wrong(path, f"a string (a {sub.name})", value)
        elif not sub.full_name.startswith("google.protobuf."):
            _check_message(value, sub, path)
    elif enum is not None:
        names = [v.name for v in enum.values]
        if not (isinstance(value, str) and value in names) and not (isinstance(value, int)
                                                                    and not isinstance(value, bool)):
            raise _wrong(path, f"one of {', '.join(names)}", value)
    elif kind == FieldDescriptor.TYPE_BOOL:
        if not isinstance(value, bool):
            raise _wrong(path, "true or false", value)
    elif kind in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
        if not isinstance(value, str):
            raise _wrong(path, "a string" if kind == FieldDescriptor.TYPE_STRING else "a base64 string", value)
    elif kind in _INT_RANGES:
        word, low, high = _INT_RANGES[kind]
        number = _integer(value)
        if number is None or not low <= number <= high:
            raise _wrong(path, f"an integer {low}..{high} ({word})", value)
    elif kind in _FLOATS and not (isinstance(value, int | float) and not isinstance(value, bool)) \
            and value not in _FLOAT_WORDS and _number(value) is None:
        raise _wrong(path, "a number", value)


def _integer(value: object) -> int | None:
    """A proto3 JSON integer: a number without a fraction, or such a number in a string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    number = value if isinstance(value, float) else _number(value)
    if isinstance(number, float) and number.is_integer():
        return int(number)
    return number if isinstance(number, int) else None


def _number(value: object) -> int | float | None:
    if not isinstance(value, str) or len(value) > 40:
        return None
    try:
        return int(value)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        return None
    return number if number == number and abs(number) != float("inf") else None


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
