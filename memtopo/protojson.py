"""proto3 JSON for every memtopo message, in one place: the .proto's snake_case field names, as the
command line prints them, the agent relays them and the controller serves them."""

from __future__ import annotations

from google.protobuf import json_format
from google.protobuf.message import Message


def to_json(msg: Message, *, defaults: bool = False, indent: int | None = 2) -> str:
    """``defaults``: print every field, zeros included (a topology reads better whole; a plan result
    would drown in empty fields)."""
    return json_format.MessageToJson(msg, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=defaults, indent=indent)


def to_dict(msg: Message) -> dict[str, object]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)
