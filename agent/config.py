"""The agent's configuration: a TOML file (stdlib ``tomllib``) read into frozen dataclasses.

Every key has an embedded default, so ``memtopo serve`` runs without a file. A file may set any
subset of the keys; anything else in it (an unknown key, a wrong type, a value that cannot work) is a
:class:`ConfigError` naming the dotted key and the reason, which the daemon prints before exiting
with :data:`EXIT_CONFIG` (the systemd unit does not restart on that status: a restart cannot fix a
file). ``docs/config.md`` documents every key; ``systemd/agent.toml`` is the example with every
default (a test keeps both in step with this module).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import socket
import tempfile
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from memtopo.addresses import AddressError, is_host_name, is_loopback, parse_host_port
from memtopo.apply import cgroups
from memtopo.apply.config import IRQBALANCE_POLICIES, ApplyConfig, IrqbalancePolicy
from memtopo.hostfs import NotRegularFileError, read_regular
from memtopo.k8s.defaults import DEFAULT_POD_RESOURCES_SOCKET
from memtopo.text import shorten

from .peers import TransportError, resolve_gid

DEFAULT_CONFIG_PATH = Path("/etc/memtopo/agent.toml")
# sysexits.h EX_CONFIG; the unit's RestartPreventExitStatus= names it.
EXIT_CONFIG = 78

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["json", "console"]
LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
LOG_FORMATS: tuple[LogFormat, ...] = get_args(LogFormat)

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_UNIX_PATH_BYTES = 107
# A config file is a few kilobytes; anything this large is not one.
MAX_CONFIG_BYTES = 1 << 20

# (lowest, highest) accepted value of every duration key. Below the floor a timer spins (a
# heartbeat of 1e-300 s is a busy loop); above the ceiling it never fires (a debounce of 1e308 s
# disables rescans). A day is the longest any of them has a use for.
DAY = 86400.0
DURATION_BOUNDS: dict[str, tuple[float, float]] = {
    "listen.idle_seconds": (1.0, DAY),
    "listen.watch_stall_seconds": (1.0, 3600.0),
    "controller.heartbeat_seconds": (0.1, 3600.0),
    "controller.backoff_initial_seconds": (0.01, 3600.0),
    "controller.backoff_max_seconds": (0.01, DAY),
    "discovery.rescan_seconds": (1.0, DAY),
    "discovery.debounce_seconds": (0.001, 600.0),  # or exactly 0: rescan at once
    "discovery.deadline_seconds": (0.1, 3600.0),
    "kubernetes.pod_resources_seconds": (0.1, 3600.0),
    "kubernetes.backoff_initial_seconds": (0.01, 3600.0),
    "kubernetes.backoff_max_seconds": (0.01, DAY),
    "kubernetes.enforce_interval_seconds": (0.05, 3600.0),
}
# (lowest, highest) of every count key.
COUNT_BOUNDS: dict[str, tuple[int, int]] = {
    "listen.max_connections": (1, 65536),
    "listen.max_connections_per_user": (1, 65536),
    "listen.reserved_connections": (0, 65535),
    "listen.max_watchers": (1, 65536),
}


def _hostname() -> str:
    return socket.gethostname()


@dataclass(frozen=True)
class ListenConfig:
    # "" = no Unix socket listener.
    socket: str = "/run/memtopo/agent.sock"
    socket_mode: int = 0o660
    # Group owning the socket (name or numeric id); its members may ApplyPlan. "" = root only.
    socket_group: str = ""
    # A second Unix socket grpc serves directly, for clients that only read (ApplyPlan is refused
    # on it); same mode and group as `socket`. Unset in a file: beside `socket` (read_socket_beside).
    # "" = none.
    read_socket: str = "/run/memtopo/agent-read.sock"
    # "host:port" (grpc's form: IPv6 in brackets), "" = no TCP listener. Needs tls_cert and tls_key.
    tcp: str = ""
    # Paths below: "" = unset.
    tls_cert: str = ""
    tls_key: str = ""
    # Client CA: with it, TCP clients may present a certificate; ApplyPlan over TCP requires one.
    tls_client_ca: str = ""
    # Relayed connections (listen.socket and listen.tcp): all of them together, per user other
    # than root, and the share only root and socket_group members may take. Root is never refused.
    max_connections: int = 128
    max_connections_per_user: int = 16
    reserved_connections: int = 32
    # A relayed connection that moves no byte either way for this long is closed.
    idle_seconds: float = 300.0
    # WatchTopology streams at once (every socket); more are refused with RESOURCE_EXHAUSTED.
    max_watchers: int = 256
    # A watcher whose event has not left within this long is ended (it stopped reading).
    watch_stall_seconds: float = 60.0


@dataclass(frozen=True)
class ControllerConfig:
    # "host:port" or "unix:PATH"; "" = no controller link.
    address: str = ""
    # Plaintext; only accepted when the address is loopback (or a Unix socket).
    insecure: bool = False
    # Paths: "" = unset (tls_ca "" = the system's trust store).
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    heartbeat_seconds: float = 10.0
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 30.0


@dataclass(frozen=True)
class DiscoveryConfig:
    rescan_seconds: float = 300.0
    # 0 = publish as soon as an event's rescan finishes (the watch benchmark runs with 0).
    debounce_seconds: float = 1.0
    udev: bool = True
    # A discovery still running after this long is reported (readiness, metric, log) as overdue.
    deadline_seconds: float = 60.0
    # Each discovery in a short-lived child process: what it loads (hwloc and its plugins, NVML and
    # libcuda) leaves with it instead of staying resident for the agent's life, and a stuck one can be
    # killed. False: discover on a thread of the agent (no process start per rescan).
    isolate: bool = True


@dataclass(frozen=True)
class HealthConfig:
    # "host:port" of the HTTP /healthz, /readyz, /metrics endpoint; "" = disabled.
    listen: str = "127.0.0.1:9464"
    # Names clients use for it, accepted in Host besides IP addresses and localhost.
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class LogConfig:
    level: LogLevel = "info"
    format: LogFormat = "json"


@dataclass(frozen=True)
class KubernetesConfig:
    # Publish this node's NodeResourceTopology (agent/k8s_publisher.py); off outside a cluster.
    enabled: bool = False
    # metadata.name of the object and the Node it belongs to; "" = $NODE_NAME, else node_name.
    node_name: str = ""
    # "" = the pod's in-cluster service account; else an API server URL (out-of-cluster tests).
    api_server: str = ""
    # KubeletConfiguration file on the node (read under root); "" = the usual places.
    kubelet_config: str = ""
    # The kubelet's PodResources socket; "" = do not ask (available = allocatable).
    pod_resources_socket: str = DEFAULT_POD_RESOURCES_SOCKET
    pod_resources_seconds: float = 10.0
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 60.0
    # Take fields another field manager owns (server-side apply force); off = report the conflict.
    force_conflicts: bool = False
    # Carry the scheduler's CPU decision out through the container runtime (agent/enforce.py).
    enforce: bool = False
    # The runtime's CRI socket; "" = containerd's, else CRI-O's (the first that exists).
    runtime_endpoint: str = ""
    # Reconcile interval: how soon drift is found and put back on a runtime without container events.
    enforce_interval_seconds: float = 1.0


@dataclass(frozen=True)
class AgentConfig:
    node_name: str = field(default_factory=_hostname)
    root: str = "/"
    state_dir: str = "/var/lib/memtopo"
    listen: ListenConfig = field(default_factory=ListenConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    apply: ApplyConfig = field(default_factory=ApplyConfig)
    log: LogConfig = field(default_factory=LogConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    # Where the values came from (a path, or "<defaults>"); not part of equality.
    source: str = field(default="<defaults>", compare=False)

    @property
    def apply_state_dir(self) -> Path:
        """The apply engine's journal and results."""
        return Path(self.state_dir) / "apply"


class ConfigError(Exception):
    """An invalid configuration: ``key`` is dotted (``controller.backoff_max_seconds``; "" when the
    file as a whole is the problem), ``reason`` says what is wrong with it."""

    def __init__(self, key: str, reason: str, source: str = "<config>") -> None:
        self.key = key
        self.reason = reason
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.key:
            return f"{self.source}: {self.key}: {self.reason}"
        return f"{self.source}: {self.reason}"


# --- reading TOML tables -----------------------------------------------------------------------

# A URL-style scheme ("http:", "dns:") where HOST:PORT was expected.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")

_TOML_TYPES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}


def _type_name(value: object) -> str:
    # bool before int: bool is an int subclass.
    for py, name in _TOML_TYPES.items():
        if isinstance(value, py):
            return name
    return type(value).__name__  # datetime, date, time



class _Table:
    """One TOML table being read, with its dotted prefix and the file it came from."""

    def __init__(self, data: dict[str, Any], prefix: str, source: str, known: Iterable[str]) -> None:
        self.data = data
        self.prefix = prefix
        self.source = source
        names = tuple(known)
        for key in data:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(names)})"
                raise self.error(key, f"unknown key{hint}")

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def error(self, name: str, reason: str) -> ConfigError:
        return ConfigError(self.key(name), reason, self.source)

    def _get(self, name: str, default: object, want: type | tuple[type, ...], what: str) -> Any:
        value = self.data.get(name, default)
        # bool is an int subclass: a boolean must not pass as a number.
        if not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
            raise self.error(name, f"expected {what}, got {_type_name(value)} {shorten(value)}")
        return value

    def table(self, name: str, known: Iterable[str]) -> _Table:
        return _Table(self._get(name, {}, dict, "a table"), self.key(name), self.source, known)

    def string(self, name: str, default: str) -> str:
        value: str = self._get(name, default, str, "a string")
        if "\0" in value:
            raise self.error(name, "contains a NUL character")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        return bool(self._get(name, default, bool, "true or false"))

    def integer(self, name: str, default: int) -> int:
        return int(self._get(name, default, int, "an integer"))

    def count(self, name: str, default: int) -> int:
        value = self.integer(name, default)
        low, high = COUNT_BOUNDS[self.key(name)]
        if not low <= value <= high:
            raise self.error(name, f"must be {low}-{high}, got {shorten(value)}")
        return value

    def seconds(self, name: str, default: float, *, zero_ok: bool = False) -> float:
        value = self._get(name, default, (int, float), "a number of seconds")
        try:
            seconds = float(value)
        except OverflowError:
            raise self.error(name, "out of range") from None
        if not math.isfinite(seconds):
            raise self.error(name, f"must be a finite number of seconds, got {seconds}")
        if seconds < 0 or (seconds == 0 and not zero_ok):
            raise self.error(name, f"must be {'≥ 0' if zero_ok else '> 0'} seconds, got {shorten(value)}")
        low, high = DURATION_BOUNDS[self.key(name)]
        if seconds and not low <= seconds <= high:
            zero = "0 or " if zero_ok else ""
            raise self.error(name, f"must be {zero}{low:g}-{high:g} seconds, got {shorten(value)}")
        return seconds

    def choice[T: str](self, name: str, default: T, choices: tuple[T, ...]) -> T:
        value = self.string(name, default)
        if value not in choices:
            raise self.error(name, f"{shorten(value)!r} is not one of {', '.join(choices)}")
        return value

    def strings(self, name: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self._get(name, list(default), list, "an array of strings")
        for item in value:
            if not isinstance(item, str):
                raise self.error(name, f"expected an array of strings, it holds {_type_name(item)} {shorten(item)}")
        return tuple(value)

    def path(self, name: str, default: str) -> str:
        """An absolute path, or "" (unset). Relative paths are refused: under systemd the working
        directory is /, elsewhere it is wherever the agent was started."""
        text = self.string(name, default)
        if text and not text.startswith("/"):
            raise self.error(name, f"{shorten(text)} is not an absolute path")
        return text

    def required_path(self, name: str, default: str) -> str:
        value = self.path(name, default)
        if not value:
            raise self.error(name, "must not be empty")
        return value

    def listen_address(self, name: str, default: str) -> str:
        """"" or host:port to listen on; port 0 = any free port (the agent reports the one bound)."""
        value = self.string(name, default)
        if value:
            try:
                parse_host_port(value)
            except AddressError as exc:
                raise self.error(name, str(exc)) from None
        return value


# --- sections ----------------------------------------------------------------------------------

_TOP_KEYS = ("node_name", "root", "state_dir", "listen", "controller", "discovery", "health", "apply", "log",
             "kubernetes")
_APPLY_KEYS = ("cgroup_prefixes", "irqbalance", "allow_init", "allow_kernel_threads", "allow_self", "cgroup_version")
_GROUP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?|[0-9]+")


def _keys(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _node_name(t: _Table) -> str:
    name = t.string("node_name", "") or _hostname()
    if not name or len(name) > 253 or not name.isprintable() or any(c.isspace() for c in name):
        raise t.error("node_name", f"{shorten(name)} is not a usable node name (1-253 printable characters, "
                                   "no spaces)")
    return name


def read_socket_beside(socket_path: str) -> str:
    """The readers' socket by default: ``agent.sock`` → ``agent-read.sock`` in the same directory,
    so every agent (and every test's agent in its own directory) gets one without a clash."""
    if not socket_path:
        return ""
    stem, ext = os.path.splitext(socket_path)
    return f"{stem}-read{ext or '.sock'}"


def _listen(t: _Table) -> ListenConfig:
    d = ListenConfig()
    sock = t.path("socket", d.socket)
    if len(os.fsencode(sock)) > MAX_UNIX_PATH_BYTES:
        raise t.error("socket", f"longer than the {MAX_UNIX_PATH_BYTES} bytes a Unix socket path may have")
    read_sock = t.path("read_socket", read_socket_beside(sock))
    if len(os.fsencode(read_sock)) > MAX_UNIX_PATH_BYTES:
        raise t.error("read_socket", f"longer than the {MAX_UNIX_PATH_BYTES} bytes a Unix socket path may have")
    if read_sock and read_sock == sock:
        raise t.error("read_socket", "must differ from listen.socket")
    if type(t.data.get("socket_mode")) is int:
        # TOML's 0o660 is an integer: refused so that a decimal 660 can never be taken for a mode.
        raise t.error("socket_mode", "write the mode as an octal string, like \"0660\"")
    mode_text = t.string("socket_mode", f"0{d.socket_mode:o}")
    if not re.fullmatch(r"0?[0-7]{3}", mode_text):
        raise t.error("socket_mode", f"{shorten(mode_text)} is not an octal mode like \"0660\" (a string, "
                                     "no setuid/setgid/sticky bits)")
    group = t.string("socket_group", d.socket_group)
    if group and not _GROUP_NAME.fullmatch(group):
        raise t.error("socket_group", f"{shorten(group)} is not a group name or numeric id")
    tcp = t.listen_address("tcp", d.tcp)
    cfg = ListenConfig(socket=sock, socket_mode=int(mode_text, 8), socket_group=group, tcp=tcp,
                       read_socket=read_sock,
                       tls_cert=t.path("tls_cert", d.tls_cert), tls_key=t.path("tls_key", d.tls_key),
                       tls_client_ca=t.path("tls_client_ca", d.tls_client_ca),
                       max_connections=t.count("max_connections", d.max_connections),
                       max_connections_per_user=t.count("max_connections_per_user", d.max_connections_per_user),
                       reserved_connections=t.count("reserved_connections", d.reserved_connections),
                       idle_seconds=t.seconds("idle_seconds", d.idle_seconds),
                       max_watchers=t.count("max_watchers", d.max_watchers),
                       watch_stall_seconds=t.seconds("watch_stall_seconds", d.watch_stall_seconds))
    if cfg.reserved_connections >= cfg.max_connections:
        raise t.error("reserved_connections", f"{cfg.reserved_connections} leaves no connection of "
                                              f"max_connections ({cfg.max_connections}) to other users")
    _cert_pair(t, cfg.tls_cert, cfg.tls_key)
    if cfg.tcp and not cfg.tls_cert:
        raise t.error("tcp", "a TCP listener needs TLS: set listen.tls_cert and listen.tls_key")
    if not cfg.socket and not cfg.tcp:
        raise ConfigError(t.prefix, "no listener: set listen.socket or listen.tcp", t.source)
    return cfg


def _cert_pair(t: _Table, cert: str, key: str) -> None:
    if bool(cert) != bool(key):
        missing = "tls_cert" if key else "tls_key"
        raise t.error(missing, "tls_cert and tls_key go together: set both or neither")


def _controller_address(t: _Table, default: str) -> str:
    value = t.string("address", default)
    if not value:
        return value
    if value.startswith("unix:"):
        path = value.removeprefix("unix:")
        if path.startswith("//"):
            path = path[2:]
        if not path.startswith("/"):
            raise t.error("address", f"{shorten(value)}: a unix: address needs an absolute path "
                                     "(unix:/PATH or unix:///PATH)")
        return value
    try:
        _, port = parse_host_port(value)
    except AddressError as exc:
        scheme = _SCHEME.match(value)
        if scheme and ("://" in value or not value[scheme.end():].isdigit()):
            raise t.error("address", f"scheme {scheme.group(1)!r} is not supported: use HOST:PORT "
                                     "or unix:PATH") from None
        raise t.error("address", str(exc)) from None
    if port == 0:
        raise t.error("address", f"{shorten(value)}: port 0 cannot be dialled")
    return value


def _controller(t: _Table) -> ControllerConfig:
    d = ControllerConfig()
    address = _controller_address(t, d.address)
    insecure = t.boolean("insecure", d.insecure)
    if insecure and address and not is_loopback(address):
        raise t.error("insecure", f"plaintext is only allowed to a loopback address, not {shorten(address)}")
    cfg = ControllerConfig(
        address=address, insecure=insecure,
        tls_ca=t.path("tls_ca", d.tls_ca), tls_cert=t.path("tls_cert", d.tls_cert),
        tls_key=t.path("tls_key", d.tls_key),
        heartbeat_seconds=t.seconds("heartbeat_seconds", d.heartbeat_seconds),
        backoff_initial_seconds=t.seconds("backoff_initial_seconds", d.backoff_initial_seconds),
        backoff_max_seconds=t.seconds("backoff_max_seconds", d.backoff_max_seconds))
    _cert_pair(t, cfg.tls_cert, cfg.tls_key)
    if cfg.insecure and (cfg.tls_ca or cfg.tls_cert):
        raise t.error("insecure", "true together with TLS files: say which one is meant")
    if cfg.backoff_max_seconds < cfg.backoff_initial_seconds:
        raise t.error("backoff_max_seconds", f"{cfg.backoff_max_seconds:g} is below backoff_initial_seconds "
                                             f"({cfg.backoff_initial_seconds:g})")
    return cfg


def _discovery(t: _Table) -> DiscoveryConfig:
    d = DiscoveryConfig()
    return DiscoveryConfig(rescan_seconds=t.seconds("rescan_seconds", d.rescan_seconds),
                           debounce_seconds=t.seconds("debounce_seconds", d.debounce_seconds, zero_ok=True),
                           udev=t.boolean("udev", d.udev),
                           deadline_seconds=t.seconds("deadline_seconds", d.deadline_seconds),
                           isolate=t.boolean("isolate", d.isolate))


def _apply(t: _Table) -> ApplyConfig:
    d = ApplyConfig()
    prefixes = t.strings("cgroup_prefixes", d.cgroup_prefixes)
    for prefix in prefixes:
        # The engine's own path rules: a prefix must itself be a path a plan could use.
        problem = cgroups.path_problem(prefix, (prefix,))
        if problem:
            raise t.error("cgroup_prefixes", problem)
    version = t.integer("cgroup_version", d.cgroup_version)
    if version not in (0, 1, 2):
        raise t.error("cgroup_version", f"{version} is not 0 (detect), 1 or 2")
    irqbalance: IrqbalancePolicy = t.choice("irqbalance", d.irqbalance, IRQBALANCE_POLICIES)
    return ApplyConfig(cgroup_prefixes=prefixes, irqbalance=irqbalance,
                       allow_init=t.boolean("allow_init", d.allow_init),
                       allow_kernel_threads=t.boolean("allow_kernel_threads", d.allow_kernel_threads),
                       allow_self=t.boolean("allow_self", d.allow_self), cgroup_version=version)


def _health(t: _Table) -> HealthConfig:
    d = HealthConfig()
    hosts = t.strings("hosts", d.hosts)
    for host in hosts:
        if not is_host_name(host):
            raise t.error("hosts", f"{shorten(host)} is not a host name")
    return HealthConfig(listen=t.listen_address("listen", d.listen), hosts=hosts)


def _log(t: _Table) -> LogConfig:
    d = LogConfig()
    return LogConfig(level=t.choice("level", d.level, LOG_LEVELS), format=t.choice("format", d.format, LOG_FORMATS))


def _kubernetes(t: _Table) -> KubernetesConfig:
    d = KubernetesConfig()
    node_name = t.string("node_name", d.node_name)
    if node_name and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", node_name):
        raise t.error("node_name", f"{shorten(node_name)} is not a Kubernetes node name (lowercase DNS subdomain)")
    api_server = t.string("api_server", d.api_server)
    if api_server and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", api_server):
        raise t.error("api_server", f"{shorten(api_server)} is not an http(s):// URL")
    runtime_endpoint = t.string("runtime_endpoint", d.runtime_endpoint)
    if runtime_endpoint and not re.fullmatch(r"(unix://)?/\S+", runtime_endpoint):
        raise t.error("runtime_endpoint", f"{shorten(runtime_endpoint)} is not a unix:///path socket endpoint")
    cfg = KubernetesConfig(
        enabled=t.boolean("enabled", d.enabled), node_name=node_name, api_server=api_server,
        kubelet_config=t.path("kubelet_config", d.kubelet_config),
        pod_resources_socket=t.path("pod_resources_socket", d.pod_resources_socket),
        pod_resources_seconds=t.seconds("pod_resources_seconds", d.pod_resources_seconds),
        backoff_initial_seconds=t.seconds("backoff_initial_seconds", d.backoff_initial_seconds),
        backoff_max_seconds=t.seconds("backoff_max_seconds", d.backoff_max_seconds),
        force_conflicts=t.boolean("force_conflicts", d.force_conflicts),
        enforce=t.boolean("enforce", d.enforce), runtime_endpoint=runtime_endpoint,
        enforce_interval_seconds=t.seconds("enforce_interval_seconds", d.enforce_interval_seconds))
    if cfg.backoff_max_seconds < cfg.backoff_initial_seconds:
        raise t.error("backoff_max_seconds", f"{cfg.backoff_max_seconds:g} is below backoff_initial_seconds "
                                             f"({cfg.backoff_initial_seconds:g})")
    return cfg


def parse_config(text: str, source: str) -> AgentConfig:
    """The configuration in ``text`` (TOML); ``source`` names it in errors. Raises only ConfigError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"not valid TOML: {exc}", source) from None
    except (ValueError, RecursionError) as exc:
        # tomllib lets these through: an integer over Python's 4300-digit conversion limit, and
        # arrays nested deeper than the interpreter's recursion limit.
        raise ConfigError("", f"not usable TOML: {type(exc).__name__}: {shorten(str(exc), 120)}", source) from None
    top = _Table(data, "", source, _TOP_KEYS)
    d = AgentConfig(node_name="")
    return AgentConfig(
        node_name=_node_name(top),
        root=top.required_path("root", d.root),
        state_dir=top.required_path("state_dir", d.state_dir),
        listen=_listen(top.table("listen", _keys(ListenConfig))),
        controller=_controller(top.table("controller", _keys(ControllerConfig))),
        discovery=_discovery(top.table("discovery", _keys(DiscoveryConfig))),
        health=_health(top.table("health", _keys(HealthConfig))),
        apply=_apply(top.table("apply", _APPLY_KEYS)),
        log=_log(top.table("log", _keys(LogConfig))),
        kubernetes=_kubernetes(top.table("kubernetes", _keys(KubernetesConfig))),
        source=source,
    )


def _check_readable(cfg: AgentConfig) -> None:
    """TLS files are read when a listener or the link starts; a missing one is a config error now,
    with its key, rather than a failure later."""
    files = {
        "listen.tls_cert": cfg.listen.tls_cert, "listen.tls_key": cfg.listen.tls_key,
        "listen.tls_client_ca": cfg.listen.tls_client_ca, "controller.tls_ca": cfg.controller.tls_ca,
        "controller.tls_cert": cfg.controller.tls_cert, "controller.tls_key": cfg.controller.tls_key,
    }
    for key, path in files.items():
        if not path:
            continue
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}", cfg.source) from None


def check_host(cfg: AgentConfig) -> None:
    """What the configuration names on this host, checked before anything starts, so that a value
    that cannot work stops the agent with its key (exit 78) instead of a traceback later: the
    socket group exists, and the state directory can be created and written."""
    group = cfg.listen.socket_group
    if group:
        try:
            resolve_gid(group)
        except TransportError as exc:
            raise ConfigError("listen.socket_group", str(exc), cfg.source) from None
    try:
        os.makedirs(cfg.state_dir, mode=0o700, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=cfg.state_dir, prefix=".memtopo-probe-")  # noqa: SIM115
        probe.close()
    except OSError as exc:
        raise ConfigError("state_dir", f"{shorten(cfg.state_dir)} is not a writable directory: "
                                       f"{exc.strerror or exc}", cfg.source) from None


def load_config(path: Path | None) -> AgentConfig:
    """The configuration in ``path`` (its TLS files checked readable), or the embedded defaults when
    None. Raises only ConfigError."""
    if path is None:
        return parse_config("", "<defaults>")
    source = str(path)
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES)
    except NotRegularFileError as exc:
        raise ConfigError("", f"{exc.strerror}: not a config file", source) from None
    except OSError as exc:
        raise ConfigError("", f"cannot read: {exc.strerror or exc}", source) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError("", f"larger than {MAX_CONFIG_BYTES} bytes: not a config file", source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"not UTF-8 text (byte {exc.start})", source) from None
    cfg = parse_config(text, source)
    _check_readable(cfg)
    return cfg
