"""One reader of a JSON object another party wrote into a string (annotations, CRI verbose info)."""

from __future__ import annotations

import pytest

from memtopo.k8s.jsonvalue import JsonObjectError, json_object, json_object_or_none


@pytest.mark.parametrize("raw,why", [
    (None, "not a string"),
    (7, "not a string"),
    ("x" * 101, "101 bytes, more than a placement (100)"),
    ("nope", "not JSON: 'nope'"),
    ("[" * 50 + "]" * 50, "not a JSON object"),
    ("[" * 100_000, "more than a placement"),  # the bound comes before the decoder's recursion
    ('"\\u001b[2J"', "not a JSON object"),
])
def test_what_is_not_an_object_says_why(raw: object, why: str) -> None:
    with pytest.raises(JsonObjectError) as caught:
        json_object(raw, 100, "a placement")
    assert why in str(caught.value)
    assert len(str(caught.value)) < 200  # an excerpt, never the value
    assert json_object_or_none(raw, 100) is None


def test_nesting_past_the_decoders_depth_is_not_json() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(JsonObjectError, match="not JSON"):
        json_object(deep, len(deep), "a value")


def test_an_object_within_the_bound_is_returned() -> None:
    assert json_object('{"pid": 42, "zones": [0]}', 100, "a value") == {"pid": 42, "zones": [0]}
    assert json_object_or_none('{"a": {}}', 9) == {"a": {}}
