"""Who may call the extender's verbs: kube-scheduler's client certificate, or a bearer token.

kube-scheduler's extender client authenticates with the client certificate of its ``tlsConfig``
(``certFile``/``keyFile``): the listener verifies it against a client CA (``--extender-client-ca``) and
the request carries its subject; ``--extender-allow-subject CN`` (repeatable) narrows who may call to
those common names. A caller that cannot present a certificate (a proxy in front of the extender, a
test) may send ``Authorization: Bearer TOKEN`` with the token of ``--extender-token-file`` instead.

With either configured, every verb requires an authenticated caller. With neither, filter and
prioritize (which read and change nothing) answer anyone who reaches the port, and bind — which writes
to the cluster — refuses every caller.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from memtopo.text import shorten

MAX_TOKEN_BYTES: Final = 64 << 10
WRITE_VERBS: Final = frozenset({"bind"})


class AuthConfigError(ValueError):
    """The token file or subject list cannot be used."""


@dataclass(frozen=True)
class Caller:
    """What a request says about who sent it: the verified client certificate's subject common name
    (None without one) and the bearer token it sent (None without one)."""

    subject: str | None = None
    token: str | None = None

    @classmethod
    def of(cls, client_subject: str | None, headers: Mapping[str, str]) -> Caller:
        """From the listener's verified client certificate subject (``CN=…,O=…``) and the headers."""
        return cls(common_name(client_subject), bearer(headers))


def common_name(subject: str | None) -> str | None:
    """The subject CN of a verified certificate's subject written as ``CN=a,O=b`` with RFC 4514
    escapes (the last CN when there are several; "" when it has none; None without a certificate)."""
    if subject is None:
        return None
    found: str | None = None
    parts: list[str] = []
    current: list[str] = []
    chars = iter(subject)
    for c in chars:
        if c == "\\":
            current.append(next(chars, ""))
        elif c == ",":
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    for part in parts:
        key, eq, value = part.partition("=")
        if eq and key == "CN":
            found = value
    return found if found is not None else ""


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Authenticator:
    """Decides whether a caller may use a verb; ``refusal`` is None when it may, else why not."""

    def __init__(self, *, client_ca: bool = False, subjects: Iterable[str] = (), token_file: str = "") -> None:
        self.client_ca = client_ca
        self.subjects = frozenset(subjects)
        if self.subjects and not client_ca:
            raise AuthConfigError("--extender-allow-subject needs --extender-client-ca (and the HTTP listener's TLS)")
        self._token_file = Path(token_file) if token_file else None
        self._token = ""
        self._stamp: tuple[int, int] | None = None
        if self._token_file is not None:
            self._read_token()

    @property
    def configured(self) -> bool:
        return self.client_ca or self._token_file is not None

    def _read_token(self) -> str:
        assert self._token_file is not None
        try:
            st = self._token_file.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return self._token
            if st.st_size > MAX_TOKEN_BYTES:
                raise AuthConfigError(f"{self._token_file}: {st.st_size} bytes is no token")
            fd = os.open(self._token_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                raw = f.read(MAX_TOKEN_BYTES + 1)
        except OSError as exc:
            raise AuthConfigError(f"token file {self._token_file}: {exc.strerror or exc}") from None
        try:
            token = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise AuthConfigError(f"token file {self._token_file}: not ASCII") from None
        if not token or any(c.isspace() for c in token):
            raise AuthConfigError(f"token file {self._token_file}: empty, or more than one word")
        self._token, self._stamp = token, stamp
        return token

    def refusal(self, verb: str, caller: Caller) -> str | None:
        if not self.configured:
            if verb in WRITE_VERBS:
                return (f"{verb} writes to the cluster and this extender authenticates no caller: give it "
                        "--extender-client-ca (kube-scheduler's tlsConfig client certificate) or --extender-token-file")
            return None
        if self.client_ca and caller.subject is not None:
            if not self.subjects or caller.subject in self.subjects:
                return None
            return f"client certificate {shorten(caller.subject, 64)!r} is not one --extender-allow-subject names"
        if self._token_file is not None and caller.token is not None:
            try:
                token = self._read_token()
            except AuthConfigError as exc:
                return f"the token cannot be checked: {exc}"
            if hmac.compare_digest(caller.token.encode(), token.encode()):
                return None
            return "the bearer token does not match"
        wanted = " or ".join(w for w, on in (("a client certificate", self.client_ca),
                                             ("a bearer token", self._token_file is not None)) if on)
        return f"{verb} needs {wanted}"
