"""Reading a host's /sys and /proc under a root, so every probe runs unchanged on a captured tree.

All paths are relative to the root ("sys/devices/system/node"); a path that would leave the root
(``..``, an absolute symlink pointing outside) is refused. Reads return typed errors that the probe
turns into a degraded status: nothing here raises anything but :class:`HostReadError`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from memtopo.cpulist import CpuListError, parse_cpulist, parse_mask

# sysfs attributes are one page at most; a larger file is not what we think it is.
MAX_ATTR_BYTES = 1 << 20
_READ_CHUNK = 1 << 16
# A kernel list attribute is one line; a single read this size that comes back full is read again.
RECORD_CHUNK = 1 << 14


class HostReadError(Exception):
    """A host file that is missing, unreadable or malformed. ``path`` is root-relative."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class HostFS:
    """A filesystem root ("/" on the live host, or a captured tree)."""

    root: Path

    @functools.cached_property
    def _root_str(self) -> str:
        root = str(self.root)
        return "" if root == "/" else root

    @classmethod
    def at(cls, root: str | os.PathLike[str]) -> HostFS:
        return cls(Path(root).absolute())

    @property
    def is_live(self) -> bool:
        return self.root == Path("/")

    def path(self, rel: str) -> Path:
        """The absolute path of ``rel`` under the root, refusing ``..`` components."""
        return Path(self.join(rel))

    def join(self, rel: str) -> str:
        # Plain strings, not pathlib: discovery makes thousands of these per run.
        rel = rel.lstrip("/")
        if ".." in rel and ".." in rel.split("/"):
            raise HostReadError(rel, "path leaves the root")
        return f"{self._root_str}/{rel}" if rel else (self._root_str or "/")

    def exists(self, rel: str) -> bool:
        try:
            return os.path.exists(self.join(rel))
        except (HostReadError, OSError):
            return False

    def is_dir(self, rel: str) -> bool:
        try:
            return os.path.isdir(self.join(rel))
        except (HostReadError, OSError):
            return False

    def listdir(self, rel: str) -> list[str]:
        """Sorted entries of a directory; a missing directory is an empty list, not an error."""
        try:
            return sorted(os.listdir(self.join(rel)))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except OSError as exc:
            raise HostReadError(rel, exc.strerror or type(exc).__name__) from exc

    def _open(self, rel: str) -> int:
        try:
            return os.open(self.join(rel), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise HostReadError(rel, "missing") from exc
        except OSError as exc:
            raise HostReadError(rel, exc.strerror or type(exc).__name__) from exc

    @staticmethod
    def _decode(rel: str, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HostReadError(rel, "not UTF-8 text") from exc

    def read_text(self, rel: str) -> str:
        # os.read with a page-sized buffer: a buffered read(MAX) allocates the whole limit per call,
        # which dominated discovery on machines with thousands of attributes.
        fd = self._open(rel)
        try:
            chunks = []
            total = 0
            while chunk := os.read(fd, _READ_CHUNK):
                chunks.append(chunk)
                total += len(chunk)
                if total > MAX_ATTR_BYTES:
                    raise HostReadError(rel, f"larger than {MAX_ATTR_BYTES} bytes")
        except OSError as exc:
            raise HostReadError(rel, exc.strerror or type(exc).__name__) from exc
        finally:
            os.close(fd)
        return self._decode(rel, chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def read_record(self, rel: str) -> str:
        """A one-record kernel attribute (``/proc/irq/N/*``, a cgroup or sysfs file), unstripped, in
        one read(2): its show routine fills the buffer at once, so a short read is all of it and the
        read that would return 0 is saved. A read that fills the buffer is read again in full."""
        fd = self._open(rel)
        try:
            data = os.read(fd, RECORD_CHUNK)
        except OSError as exc:
            raise HostReadError(rel, exc.strerror or type(exc).__name__) from exc
        finally:
            os.close(fd)
        return self.record_text(rel, data)

    def record_text(self, rel: str, data: bytes) -> str:
        """The text of ``rel`` from one read of at most RECORD_CHUNK bytes (a full one may have more)."""
        return self.read_text(rel) if len(data) >= RECORD_CHUNK else self._decode(rel, data)

    def read_attr(self, rel: str) -> str:
        """A one-value sysfs attribute, stripped (some captured trees pad files with NULs)."""
        return self.read_record(rel).strip().strip("\0").strip()

    def read_int(self, rel: str, base: int = 10) -> int:
        """An integer attribute. ``base=0`` accepts the ``%#llx`` form (``0x…``, or ``0``)."""
        text = self.read_attr(rel)
        try:
            return int(text, base)
        except ValueError as exc:
            raise HostReadError(rel, f"not an integer: {text[:40]!r}") from exc

    def read_cpulist(self, rel: str) -> tuple[int, ...]:
        text = self.read_record(rel)
        try:
            return parse_cpulist(text)
        except CpuListError as exc:
            raise HostReadError(rel, str(exc)) from exc

    def read_mask(self, rel: str) -> tuple[int, ...]:
        text = self.read_record(rel)
        try:
            return parse_mask(text)
        except CpuListError as exc:
            raise HostReadError(rel, str(exc)) from exc

    def readlink(self, rel: str) -> str:
        """A symlink's target text, unresolved (sysfs links are relative: ``../../../devices/…``)."""
        try:
            return os.readlink(self.join(rel))
        except FileNotFoundError as exc:
            raise HostReadError(rel, "missing") from exc
        except OSError as exc:
            raise HostReadError(rel, exc.strerror or type(exc).__name__) from exc

    def readlink_name(self, rel: str) -> str:
        """The last component of a symlink's target (``driver`` → ``nvme``)."""
        return os.path.basename(self.readlink(rel))

    def resolve(self, rel: str) -> str:
        """The root-relative real path of ``rel``; refuses targets outside the root."""
        p = self.path(rel)
        try:
            real = p.resolve(strict=True)
        except FileNotFoundError as exc:
            raise HostReadError(rel, "missing") from exc
        except (OSError, RuntimeError) as exc:
            raise HostReadError(rel, f"cannot resolve: {exc}") from exc
        root = self.root.resolve()
        if real != root and root not in real.parents:
            raise HostReadError(rel, "resolves outside the root")
        return str(real.relative_to(root))
