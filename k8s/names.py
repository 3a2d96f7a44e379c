"""Kubernetes object names, checked before they name anything: apimachinery's DNS-1123 rules.

Most objects (nodes, pods, NodeResourceTopologies, events) are named by a **subdomain**: at most 253
characters, lowercase alphanumerics, ``-`` and ``.``, starting and ending with an alphanumeric, and no
empty or dotted segment. Namespaces are **labels**: at most 63 characters, no ``.``. Every path the
API client builds is made of names that passed these checks, so ``..``, ``%2F``, a slash or a
5,000-character name never reaches a URL; a name that fails is an :class:`InvalidNameError` quoting a
short, escaped excerpt of it.
"""

from __future__ import annotations

import re
from typing import Final

from memtopo.text import excerpt

MAX_SUBDOMAIN: Final = 253
MAX_LABEL: Final = 63
_LABEL: Final = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_LABEL_RE: Final = re.compile(_LABEL)
_SUBDOMAIN_RE: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


class InvalidNameError(ValueError):
    """A name Kubernetes would refuse. ``what`` says whose name it is (``node name``, ``namespace``)."""

    def __init__(self, what: str, value: object, rule: str) -> None:
        shown = excerpt(value) if isinstance(value, str | bytes) else type(value).__name__
        super().__init__(f"{shown} is not a Kubernetes {what} ({rule})" if value else f"the {what} is empty")
        self.what = what


def is_subdomain(value: object) -> bool:
    # The length first: the pattern never sees more than 253 characters.
    return (isinstance(value, str) and 0 < len(value) <= MAX_SUBDOMAIN
            and _SUBDOMAIN_RE.fullmatch(value) is not None)


def is_label(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_LABEL and _LABEL_RE.fullmatch(value) is not None


def subdomain(value: object, what: str = "name") -> str:
    """``value`` when it is a DNS-1123 subdomain (an object name), else :class:`InvalidNameError`."""
    if not is_subdomain(value):
        raise InvalidNameError(what, value, "a lowercase DNS-1123 subdomain of at most 253 characters")
    assert isinstance(value, str)
    return value


def label(value: object, what: str = "name") -> str:
    """``value`` when it is a DNS-1123 label (a namespace), else :class:`InvalidNameError`."""
    if not is_label(value):
        raise InvalidNameError(what, value, "a DNS-1123 label: lowercase alphanumerics and '-', at most 63 characters")
    assert isinstance(value, str)
    return value


def node_name(value: object) -> str:
    return subdomain(value, "node name")


def pod_name(value: object) -> str:
    return subdomain(value, "pod name")


def namespace(value: object) -> str:
    return label(value, "namespace")
