"""k8s/quantity.py: apimachinery's quantity grammar, exactly, and its bounds."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.k8s import quantity as q


@pytest.mark.parametrize(("text", "value"), [
    ("0", Fraction(0)), ("2", Fraction(2)), ("500m", Fraction(1, 2)), ("100m", Fraction(1, 10)),
    ("1.5", Fraction(3, 2)), (".5", Fraction(1, 2)), ("5.", Fraction(5)), ("+3", Fraction(3)),
    ("-1", Fraction(-1)), ("1k", Fraction(1000)), ("1Ki", Fraction(1024)), ("1.5Gi", Fraction(3 << 29)),
    ("128974848", Fraction(128974848)), ("129e6", Fraction(129_000_000)), ("1E3", Fraction(1000)),
    ("1e-3", Fraction(1, 1000)), ("7n", Fraction(7, 10**9)), ("3u", Fraction(3, 10**6)), ("1E", Fraction(10**18)),
    (4, Fraction(4)),
])
def test_the_grammar_apimachinery_accepts(text: str | int, value: Fraction) -> None:
    assert q.parse(text) == value


@pytest.mark.parametrize("text", ["", "lots", "1K", "1.2.3", "5 Gi", " 5", "Gi", "0x10", "1e", "1Kib", "--1",
                                  "1e999", "1e19", "9Ei", "1" * 100, "１", True, None, 1.5, [], {}])
def test_what_it_refuses_is_a_typed_error(text: object) -> None:
    with pytest.raises(q.QuantityError):
        q.parse(text)


def test_negative_sizes_and_fractional_bytes_are_refused_where_a_size_is_meant() -> None:
    with pytest.raises(q.QuantityError, match="negative"):
        q.parse_nonnegative("-1Gi")
    with pytest.raises(q.QuantityError, match="whole number of bytes"):
        q.parse_bytes("100m")
    assert q.parse_bytes("1.5Gi") == 3 << 29


def test_rounding_as_value_and_milli_value() -> None:
    assert q.ceil_int(q.parse("1500m")) == 2 and q.milli(q.parse("1.0001")) == 1001
    assert q.milli(q.parse("100m")) == 100 and q.ceil_int(q.parse("2")) == 2


def test_messages_quote_a_short_escaped_excerpt() -> None:
    with pytest.raises(q.QuantityError) as info:
        q.parse("\x1b[31m" + "9" * 5000)
    assert "\x1b" not in str(info.value) and len(str(info.value)) < 120


def test_formatting() -> None:
    assert [q.format_bytes(n) for n in (0, 1000, 1 << 30, 1536 << 20, (1 << 40) + 1024, -5)] == [
        "0", "1000", "1Gi", "1536Mi", "1073741825Ki", "0"]
    assert [q.format_milli(m) for m in (0, 1000, 1500, 250)] == ["0", "1", "1500m", "250m"]


@settings(deadline=None)
@given(st.integers(min_value=0, max_value=(1 << 62)))
def test_bytes_round_trip(n: int) -> None:
    assert q.parse_bytes(q.format_bytes(n)) == n


@settings(deadline=None)
@given(st.integers(min_value=0, max_value=10**9))
def test_millis_round_trip(m: int) -> None:
    assert q.milli(q.parse(q.format_milli(m))) == m


@settings(deadline=None)
@given(st.text(max_size=80))
def test_any_text_parses_or_is_refused(text: str) -> None:
    try:
        value = q.parse(text)
    except q.QuantityError:
        return
    assert abs(value) < q.LIMIT
