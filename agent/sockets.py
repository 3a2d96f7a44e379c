"""The agent's socket files on disk: their directory, mode and group, the lock that keeps a second
agent off a live one's path, stale files left by an agent that died, and the private directory the
grpc server listens in."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import tempfile

from memtopo.text import reason

from .peers import TransportError, resolve_gid


class SocketInUseError(TransportError):
    """Another live agent (or another program) owns the Unix socket path."""


class SocketFile:
    """A public socket path, claimed: ``mode`` checked, ``group`` resolved (``gid`` -1 = the
    agent's), the directory created and the path's lock held until :meth:`release`, a stale socket
    left at the path removed. Once a socket is there (:meth:`bind` or :meth:`publish`) its inode is
    remembered, so that release removes our own file and never a successor's."""

    def __init__(self, path: str, mode: int, group: str | None) -> None:
        if not 0 <= mode <= 0o777:
            raise TransportError(f"socket mode {mode:#o} is not a permission mode (0-0777)")
        self.gid = resolve_gid(group) if group else -1
        directory = os.path.dirname(os.path.abspath(path))
        try:
            make_dirs(directory)
        except OSError as exc:
            raise TransportError(f"{directory}: {reason(exc)}") from None
        self.path = path
        self.mode = mode
        self._inode: tuple[int, int] | None = None
        self._lock_fd: int | None = take_lock(path + ".lock")
        try:
            remove_stale_socket(path)
        except BaseException:
            self.release()
            raise

    def bind(self) -> socket.socket:
        """A listening, non-blocking socket at the path."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            # Before listen(): nobody can connect while the umask's mode is on the file.
            self._own(self.path)
            sock.listen(socket.SOMAXCONN)
            self._remember()
        except OSError as exc:
            sock.close()
            raise TransportError(f"{self.path}: {reason(exc)}") from None
        sock.setblocking(False)
        return sock

    def publish(self, bound: str) -> None:
        """Move a socket another listener bound at ``bound`` (on the same file system) to the path,
        with its mode and group set first: the public name never exists with the umask's mode."""
        try:
            self._own(bound)
            os.rename(bound, self.path)  # atomic: the name appears with its final mode
            self._remember()
        except OSError as exc:
            raise TransportError(f"{self.path}: {reason(exc)}") from None

    def release(self) -> None:
        if self._inode is not None:
            with contextlib.suppress(OSError):  # only our own: a successor may have replaced it
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._inode:
                    os.unlink(self.path)
            self._inode = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _own(self, path: str) -> None:
        os.chown(path, -1, self.gid)
        os.chmod(path, self.mode)

    def _remember(self) -> None:
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)


def make_private_dir(base: str) -> str:
    """A fresh 0700 directory in ``base`` (created 0755 if missing) for sockets only the agent uses."""
    try:
        make_dirs(base)
        # mkdtemp: a directory nobody else can have prepared or can enter.
        return tempfile.mkdtemp(prefix=".memtopo-grpc-", dir=base)
    except OSError as exc:
        raise TransportError(f"{base}: cannot create the private socket directory: {reason(exc)}") from None


def make_dirs(path: str) -> None:
    # 0755 whatever the umask: clients of other users must reach the socket inside.
    if os.path.isdir(path):
        return
    make_dirs(os.path.dirname(path))
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
        os.chmod(path, 0o755)  # noqa: S103


def take_lock(path: str) -> int:
    """The flock on a socket's ``PATH.lock`` (its fd), held for the listener's life: two agents
    started together cannot both decide the socket is stale, and ``memtopo apply`` finds the agent
    by it (apply.host.flock_holders)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise TransportError(f"{path}: {reason(exc)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise SocketInUseError(f"{path}: another memtopo agent holds this socket's lock") from None
    return fd


def ensure_socket_free(path: str) -> None:
    """Raise :class:`SocketInUseError` when a live agent holds the lock of the socket at ``path``.
    A check before start-up, for a clear message; the lock taken when listening is what guards."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return  # no lock file (or unreadable): listening will tell
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise SocketInUseError(f"{path}: another memtopo agent is running on this socket "
                               f"(it holds {path}.lock); stop it first") from None
    finally:
        os.close(fd)


def remove_stale_socket(path: str) -> None:
    """Remove a socket nobody listens on; a live one raises :class:`SocketInUseError`, anything
    that is not a socket :class:`TransportError`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TransportError(f"{path}: {reason(exc)}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise TransportError(f"{path}: exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nobody listens: left behind by an agent that died
    except OSError as exc:
        raise TransportError(f"{path}: cannot tell whether it is in use: {reason(exc)}") from None
    else:
        raise SocketInUseError(f"{path}: another process is listening on it")
    finally:
        probe.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise TransportError(f"{path}: cannot remove the stale socket: {reason(exc)}") from None
