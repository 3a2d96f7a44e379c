"""Typed errors of the apply engine. Nothing in ``apply/`` lets a bare OSError escape to callers."""

from __future__ import annotations

import errno as errno_mod
import os


class ApplyError(Exception):
    """Base of every error the apply engine raises."""


class HostWriteError(ApplyError):
    """A host file or directory that could not be written. ``path`` is root-relative."""

    def __init__(self, path: str, reason: str, errno: int = 0) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
        self.errno = errno

    @classmethod
    def from_os(cls, path: str, exc: OSError) -> HostWriteError:
        code = exc.errno or 0
        return cls(path, f"{errno_name(code)}: {exc.strerror or os.strerror(code)}", code)


class PathEscapeError(HostWriteError):
    """A write target that would leave the allowed prefixes (``..``, a symlink, an absolute path)."""


class KernelCallError(ApplyError):
    """A system call that failed; ``errno`` is the kernel's answer."""

    def __init__(self, call: str, errno: int) -> None:
        super().__init__(f"{call}: {errno_name(errno)}: {os.strerror(errno)}")
        self.call = call
        self.errno = errno


class PlanFormatError(ApplyError):
    """Plan text that is not a BindingPlan (bad JSON, wrong field types, unknown fields)."""


class PlanNotFoundError(ApplyError):
    """A plan id the state directory has no record of."""


class StateError(ApplyError):
    """The state directory is unusable (unwritable, locked by another process, corrupt)."""


class UnreadableJournalError(StateError):
    """An unfinished plan's journal that cannot be read: what that plan changed cannot be restored
    by memtopo, so nothing more is applied until an operator has dealt with it."""


class LaunchError(ApplyError):
    """``memtopo exec`` could not set up the policy or start the command."""


class CommandNotStartedError(LaunchError):
    """The policy is in place but the command could not be executed; ``errno`` says why (ENOENT: no
    such command; EACCES, ENOEXEC …: found, but not executable)."""

    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno


def errno_name(code: int) -> str:
    return errno_mod.errorcode.get(code, f"errno {code}")
