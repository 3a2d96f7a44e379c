"""Kubernetes resource quantities (``k8s.io/apimachinery/pkg/api/resource.Quantity``), exactly.

One parser for every quantity memtopo reads: pod requests and limits, NodeResourceTopology zones from
any publisher, the kubelet's configuration. The grammar is apimachinery's::

    quantity ::= sign? digits suffix?
    digits   ::= [0-9]+ | [0-9]+ "." [0-9]* | "." [0-9]+
    suffix   ::= Ki | Mi | Gi | Ti | Pi | Ei | n | u | m | "" | k | M | G | T | P | E
               | (e | E) sign? [0-9]+

The value is a ``Fraction``: ``100m`` is exactly 1/10, ``1.5Gi`` exactly 3·2²⁹, so sums and comparisons
never round. What apimachinery refuses (``lots``, ``1K``, ``1.5.0``) is a :class:`QuantityError`; so is
a magnitude of 2⁶³ or more (apimachinery keeps quantities within int64 when they are used, and a value
that large is no request), and a text over 64 characters.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Final

from memtopo.text import excerpt


class QuantityError(ValueError):
    """Not a Kubernetes quantity, or one memtopo cannot use (negative where a size is meant, out of range)."""


MAX_TEXT: Final = 64
LIMIT: Final = Fraction(1 << 63)
_GRAMMAR: Final = re.compile(r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
                             r"(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?")
_SCALE: Final[dict[str, Fraction]] = {
    "": Fraction(1), "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(1 << 10), "Mi": Fraction(1 << 20), "Gi": Fraction(1 << 30), "Ti": Fraction(1 << 40),
    "Pi": Fraction(1 << 50), "Ei": Fraction(1 << 60),
}
# An exponent beyond this cannot give a value inside the range, either way: refused before 10**e is built.
_MAX_EXPONENT: Final = 40
_BINARY: Final = (("Ei", 1 << 60), ("Pi", 1 << 50), ("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20),
                  ("Ki", 1 << 10))


def parse(value: object) -> Fraction:
    """The exact value of a quantity given as JSON gives it: a string, or an integer (YAML and JSON
    writers emit ``4`` for ``"4"``). Negative values parse; :func:`parse_nonnegative` refuses them."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise QuantityError(f"{excerpt(repr(value))} is not a quantity (a string such as '2', '500m' or '4Gi')")
    if isinstance(value, int):
        number = Fraction(value)
    else:
        match = _GRAMMAR.fullmatch(value) if len(value) <= MAX_TEXT else None
        if match is None:
            raise QuantityError(f"{excerpt(value)} is not a quantity")
        sign, digits, exponent, suffix = match.groups()
        number = Fraction(digits)
        if exponent is not None:
            e = int(exponent[1:])
            if abs(e) > _MAX_EXPONENT:
                raise QuantityError(f"{excerpt(value)} is out of range")
            number *= Fraction(10) ** e
        else:
            number *= _SCALE[suffix or ""]
        if sign == "-":
            number = -number
    if abs(number) >= LIMIT:
        raise QuantityError(f"{excerpt(str(value))} is out of range")
    return number


def parse_nonnegative(value: object) -> Fraction:
    """:func:`parse`, refusing negative values (a capacity, a request, a reservation)."""
    number = parse(value)
    if number < 0:
        raise QuantityError(f"{excerpt(str(value))} is negative")
    return number


def parse_bytes(value: object) -> int:
    """A size in bytes: non-negative and whole (``1.5Gi`` is; ``100m`` bytes is not)."""
    number = parse_nonnegative(value)
    if number.denominator != 1:
        raise QuantityError(f"{excerpt(str(value))} is not a whole number of bytes")
    return int(number)


def ceil_int(number: Fraction) -> int:
    """apimachinery's ``Quantity.Value()``: rounded up to an integer."""
    return math.ceil(number)


def milli(number: Fraction) -> int:
    """apimachinery's ``Quantity.MilliValue()``: thousandths, rounded up (CPU is compared in these)."""
    return math.ceil(number * 1000)


def format_bytes(n: int) -> str:
    """A byte count as Kubernetes writes it: the largest binary suffix that divides it exactly."""
    n = max(n, 0)
    for suffix, size in _BINARY:
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


def format_milli(millis: int) -> str:
    """A CPU amount in thousandths as Kubernetes writes it: ``2`` for 2000, ``1500m`` for 1500."""
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"
