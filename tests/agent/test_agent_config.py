"""agent.config: TOML → AgentConfig, every rejection with its dotted key, the example file and the
documentation kept equal to the embedded defaults."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.addresses import AddressError, is_loopback, parse_host_port
from memtopo.agent import config as cfgmod
from memtopo.agent.config import (
    EXIT_CONFIG,
    AgentConfig,
    ConfigError,
    load_config,
    parse_config,
)
from memtopo.apply.config import ApplyConfig
from tests.fixtures import REPO

EXAMPLE = REPO / "systemd" / "agent.toml"
DOCS = REPO / "docs" / "config.md"

# Every key the agent's configuration defines (the specification this module implements): the example
# file, the docs and the parser must all cover exactly this set.
SPEC_KEYS = {
    "node_name", "root", "state_dir",
    "listen.socket", "listen.socket_mode", "listen.socket_group", "listen.read_socket", "listen.tcp", "listen.tls_cert",
    "listen.tls_key", "listen.tls_client_ca", "listen.max_connections", "listen.max_connections_per_user",
    "listen.reserved_connections", "listen.idle_seconds", "listen.max_watchers", "listen.watch_stall_seconds",
    "controller.address", "controller.insecure", "controller.tls_ca", "controller.tls_cert",
    "controller.tls_key", "controller.heartbeat_seconds", "controller.backoff_initial_seconds",
    "controller.backoff_max_seconds",
    "discovery.rescan_seconds", "discovery.debounce_seconds", "discovery.udev", "discovery.deadline_seconds",
    "discovery.isolate",
    "health.listen", "health.hosts",
    "apply.cgroup_prefixes", "apply.irqbalance", "apply.allow_init", "apply.allow_kernel_threads",
    "apply.allow_self", "apply.cgroup_version",
    "log.level", "log.format",
    "kubernetes.enabled", "kubernetes.node_name", "kubernetes.api_server", "kubernetes.kubelet_config",
    "kubernetes.pod_resources_socket", "kubernetes.pod_resources_seconds", "kubernetes.backoff_initial_seconds",
    "kubernetes.backoff_max_seconds", "kubernetes.force_conflicts", "kubernetes.enforce",
    "kubernetes.runtime_endpoint", "kubernetes.enforce_interval_seconds",
}


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def error_of(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.toml")
    return info.value


@pytest.fixture
def fake_host(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a17")
    return "node-a17"


# --- defaults, example, documentation ----------------------------------------------------------


def test_defaults_need_no_file_and_match_the_brief(fake_host: str) -> None:
    cfg = load_config(None)
    assert cfg.node_name == fake_host  # "" resolves to the host name at load
    assert cfg.root == "/" and cfg.state_dir == "/var/lib/memtopo"
    assert cfg.apply_state_dir == Path("/var/lib/memtopo/apply")
    assert cfg.listen.socket == "/run/memtopo/agent.sock" and cfg.listen.socket_mode == 0o660
    assert (cfg.listen.socket_group, cfg.listen.tcp) == ("", "")
    assert (cfg.controller.address, cfg.controller.insecure) == ("", False)
    assert (cfg.controller.heartbeat_seconds, cfg.controller.backoff_initial_seconds,
            cfg.controller.backoff_max_seconds) == (10.0, 0.5, 30.0)
    assert (cfg.discovery.rescan_seconds, cfg.discovery.debounce_seconds, cfg.discovery.udev) == (300.0, 1.0, True)
    assert cfg.health.listen == "127.0.0.1:9464"
    assert cfg.apply == ApplyConfig()
    assert (cfg.apply.cgroup_prefixes, cfg.apply.irqbalance, cfg.apply.cgroup_version) == (("memtopo",), "ban", 0)
    assert (cfg.log.level, cfg.log.format) == ("info", "json")
    assert cfg == AgentConfig() and cfg.source == "<defaults>"
    assert parse_config("", "empty.toml") == cfg


def test_example_file_sets_every_key_to_its_default(fake_host: str) -> None:
    # Every key is written out (not commented), so equality really compares the values.
    assert set(flatten(tomllib.loads(EXAMPLE.read_text()))) == SPEC_KEYS
    example = load_config(EXAMPLE)
    assert example == load_config(None)
    assert example.source == str(EXAMPLE)


def test_docs_list_every_key_with_the_example_default() -> None:
    rows = re.findall(r"^\| `([a-z_.]+)` \| ([^|]+) \| `([^`]*)` \|", DOCS.read_text(), re.MULTILINE)
    documented = {key: default for key, _, default in rows}
    assert set(documented) == SPEC_KEYS
    example = flatten(tomllib.loads(EXAMPLE.read_text()))
    for key, literal in documented.items():
        assert tomllib.loads(f"v = {literal}")["v"] == example[key], key


def test_every_spec_key_is_accepted_and_nothing_else(fake_host: str) -> None:
    example = tomllib.loads(EXAMPLE.read_text())
    for section, table in example.items():
        if not isinstance(table, dict):
            continue
        err = error_of(f"[{section}]\nbogus_key = 1\n")
        assert err.key == f"{section}.bogus_key" and "unknown key" in err.reason
    assert error_of("[watchdog]\nseconds = 1\n").key == "watchdog"  # systemd owns the watchdog


# --- values ------------------------------------------------------------------------------------


FULL = """
node_name = "gpu-17"
root = "/srv/capture"
state_dir = "/var/lib/mt"
[listen]
socket = "/run/mt/a.sock"
socket_mode = "0600"
socket_group = "memtopo"
tcp = "[::]:7443"
tls_cert = "/etc/mt/server.pem"
tls_key = "/etc/mt/server.key"
tls_client_ca = "/etc/mt/clients.pem"
[controller]
address = "ctl.example.net:7000"
tls_ca = "/etc/mt/ca.pem"
tls_cert = "/etc/mt/c.pem"
tls_key = "/etc/mt/c.key"
heartbeat_seconds = 2
backoff_initial_seconds = 0.25
backoff_max_seconds = 0.25
[discovery]
rescan_seconds = 60
debounce_seconds = 0
udev = false
[health]
listen = ""
[apply]
cgroup_prefixes = ["memtopo", "/jobs/ai/"]
irqbalance = "stop"
allow_init = true
allow_kernel_threads = true
allow_self = true
cgroup_version = 2
[log]
level = "debug"
format = "console"
"""


def test_every_key_is_read_with_its_type() -> None:
    cfg = parse_config(FULL, "full.toml")
    assert (cfg.node_name, cfg.root, cfg.state_dir) == ("gpu-17", "/srv/capture", "/var/lib/mt")
    assert cfg.apply_state_dir == Path("/var/lib/mt/apply")
    lst = cfg.listen
    assert (lst.socket, lst.socket_mode, lst.socket_group, lst.tcp) == ("/run/mt/a.sock", 0o600, "memtopo", "[::]:7443")
    assert (lst.tls_cert, lst.tls_key, lst.tls_client_ca) == ("/etc/mt/server.pem", "/etc/mt/server.key",
                                                             "/etc/mt/clients.pem")
    ctl = cfg.controller
    assert (ctl.address, ctl.insecure, ctl.tls_ca, ctl.tls_cert, ctl.tls_key) == (
        "ctl.example.net:7000", False, "/etc/mt/ca.pem", "/etc/mt/c.pem", "/etc/mt/c.key")
    # Integers are accepted for durations and become floats; max == initial is allowed.
    assert ctl.heartbeat_seconds == 2.0 and isinstance(ctl.heartbeat_seconds, float)
    assert (ctl.backoff_initial_seconds, ctl.backoff_max_seconds) == (0.25, 0.25)
    assert (cfg.discovery.rescan_seconds, cfg.discovery.debounce_seconds, cfg.discovery.udev) == (60.0, 0.0, False)
    assert cfg.health.listen == ""
    ap = cfg.apply
    assert isinstance(ap, ApplyConfig)
    assert ap.cgroup_prefixes == ("memtopo", "/jobs/ai/")
    assert (ap.irqbalance, ap.allow_init, ap.allow_kernel_threads, ap.allow_self, ap.cgroup_version) == (
        "stop", True, True, True, 2)
    assert (cfg.log.level, cfg.log.format) == ("debug", "console")
    assert cfg.source == "full.toml"


@pytest.mark.parametrize(("mode", "value"), [("0660", 0o660), ("660", 0o660), ("0600", 0o600), ("0777", 0o777)])
def test_socket_mode_is_an_octal_string(mode: str, value: int) -> None:
    assert parse_config(f'[listen]\nsocket_mode = "{mode}"', "t").listen.socket_mode == value


def test_insecure_is_fine_on_loopback_and_unix() -> None:
    for address in ("127.0.0.1:7000", "127.8.9.10:7000", "[::1]:7000", "localhost:7000", "unix:/run/ctl.sock",
                    "unix:///run/ctl.sock"):
        cfg = parse_config(f'[controller]\naddress = "{address}"\ninsecure = true', "t")
        assert cfg.controller.insecure and cfg.controller.address == address


def test_tcp_only_agent_and_port_zero_listeners() -> None:
    cfg = parse_config('[listen]\nsocket = ""\ntcp = "127.0.0.1:0"\ntls_cert = "/c"\ntls_key = "/k"\n'
                       '[health]\nlisten = "[::1]:0"', "t")
    assert (cfg.listen.socket, cfg.listen.tcp, cfg.health.listen) == ("", "127.0.0.1:0", "[::1]:0")


# (config text, dotted key, words the reason must contain)
REJECTED = [
    ("x = 1", "x", "unknown key"),
    ("[controller]\nbackof_max_seconds = 3", "controller.backof_max_seconds", "did you mean 'backoff_max_seconds'"),
    ("listen = 5", "listen", "expected a table, got integer"),
    ("node_name = 7", "node_name", "expected a string, got integer"),
    ('node_name = "two words"', "node_name", "not a usable node name"),
    ('root = ""', "root", "must not be empty"),
    ('root = "relative/dir"', "root", "not an absolute path"),
    ('state_dir = "var/lib"', "state_dir", "not an absolute path"),
    ('root = "/a\\u0000b"', "root", "NUL"),
    ("[listen]\nsocket_mode = 0o660", "listen.socket_mode", 'octal string, like "0660"'),
    ("[listen]\nsocket_mode = 660", "listen.socket_mode", "octal string"),
    ('[listen]\nsocket_mode = "0880"', "listen.socket_mode", "not an octal mode"),
    ('[listen]\nsocket_mode = "4755"', "listen.socket_mode", "not an octal mode"),
    ('[listen]\nsocket_mode = "rw-rw----"', "listen.socket_mode", "not an octal mode"),
    ('[listen]\nsocket = "/' + "s" * 107 + '"', "listen.socket", "107 bytes"),
    ('[listen]\nsocket_group = "wheel group"', "listen.socket_group", "not a group name"),
    ('[listen]\nread_socket = "/run/memtopo/agent.sock"', "listen.read_socket", "must differ"),
    ('[listen]\nread_socket = "ro.sock"', "listen.read_socket", "not an absolute path"),
    ('[listen]\nread_socket = "/' + "s" * 107 + '"', "listen.read_socket", "107 bytes"),
    ('[listen]\ntcp = "0.0.0.0:7443"', "listen.tcp", "needs TLS"),
    ('[listen]\ntcp = "0.0.0.0:7443"\ntls_cert = "/c"', "listen.tls_key", "go together"),
    ('[listen]\ntls_key = "/k"', "listen.tls_cert", "go together"),
    ('[listen]\ntcp = "7443"\ntls_cert = "/c"\ntls_key = "/k"', "listen.tcp", "expected HOST:PORT"),
    ('[listen]\ntcp = ":7443"\ntls_cert = "/c"\ntls_key = "/k"', "listen.tcp", "no host"),
    ('[listen]\ntcp = "::1:7443"\ntls_cert = "/c"\ntls_key = "/k"', "listen.tcp", "needs brackets"),
    ('[listen]\ntcp = "host:70000"\ntls_cert = "/c"\ntls_key = "/k"', "listen.tcp", "not a number 0-65535"),
    ('[listen]\ntcp = "host:http"\ntls_cert = "/c"\ntls_key = "/k"', "listen.tcp", "not a number 0-65535"),
    ('[listen]\ntcp = "bad_host!:80"\ntls_cert = "/c"\ntls_key = "/k"', "listen.tcp", "not a host name"),
    ('[listen]\ntcp = "[fe80::zz]:80"\ntls_cert = "/c"\ntls_key = "/k"', "listen.tcp", "not an IPv6 address"),
    ('[listen]\nsocket = ""', "listen", "no listener"),
    ('[listen]\ntls_cert = "cert.pem"\ntls_key = "/k"', "listen.tls_cert", "not an absolute path"),
    ('[controller]\naddress = "http://ctl:80"', "controller.address", "scheme 'http' is not supported"),
    ('[controller]\naddress = "dns:///ctl:80"', "controller.address", "scheme 'dns' is not supported"),
    ('[controller]\naddress = "ipv4:10.0.0.1:80"', "controller.address", "scheme 'ipv4' is not supported"),
    ('[controller]\naddress = "unix-abstract:ctl"', "controller.address", "scheme 'unix-abstract'"),
    ('[controller]\naddress = "unix:ctl.sock"', "controller.address", "absolute path"),
    ('[controller]\naddress = "ctl:0"', "controller.address", "port 0"),
    ('[controller]\naddress = "10.1.2.3:7000"\ninsecure = true', "controller.insecure", "loopback"),
    ('[controller]\naddress = "ctl.example.net:7000"\ninsecure = true', "controller.insecure", "loopback"),
    ('[controller]\naddress = "127.0.0.1:7000"\ninsecure = true\ntls_ca = "/ca"', "controller.insecure",
     "together with TLS"),
    ('[controller]\ninsecure = "yes"', "controller.insecure", "expected true or false, got string"),
    ('[controller]\ntls_cert = "/c"', "controller.tls_key", "go together"),
    ("[controller]\nheartbeat_seconds = 0", "controller.heartbeat_seconds", "> 0"),
    ("[controller]\nheartbeat_seconds = -1.5", "controller.heartbeat_seconds", "> 0"),
    ("[controller]\nbackoff_initial_seconds = 0.0", "controller.backoff_initial_seconds", "> 0"),
    ("[controller]\nbackoff_max_seconds = 0.1", "controller.backoff_max_seconds", "below backoff_initial_seconds"),
    ("[controller]\nbackoff_initial_seconds = 40", "controller.backoff_max_seconds", "below"),
    ('[controller]\nheartbeat_seconds = "10s"', "controller.heartbeat_seconds", "expected a number of seconds"),
    ("[controller]\nheartbeat_seconds = true", "controller.heartbeat_seconds", "got boolean"),
    ("[discovery]\nrescan_seconds = 0", "discovery.rescan_seconds", "> 0"),
    ("[discovery]\nrescan_seconds = inf", "discovery.rescan_seconds", "finite"),
    ("[discovery]\nrescan_seconds = nan", "discovery.rescan_seconds", "finite"),
    ("[discovery]\ndebounce_seconds = -0.1", "discovery.debounce_seconds", "≥ 0"),
    ("[discovery]\nudev = 1", "discovery.udev", "expected true or false, got integer"),
    ("[controller]\nheartbeat_seconds = 1e-300", "controller.heartbeat_seconds", "must be 0.1-3600 seconds"),
    ("[discovery]\ndebounce_seconds = 1e308", "discovery.debounce_seconds", "must be 0 or 0.001-600 seconds"),
    ("[discovery]\nrescan_seconds = 1e9", "discovery.rescan_seconds", "must be 1-86400 seconds"),
    ("[discovery]\ndeadline_seconds = 0", "discovery.deadline_seconds", "> 0"),
    ("[controller]\nbackoff_initial_seconds = 1e-9", "controller.backoff_initial_seconds", "must be 0.01-3600"),
    ("[listen]\nidle_seconds = 0.001", "listen.idle_seconds", "must be 1-86400 seconds"),
    ("[listen]\nwatch_stall_seconds = 1e30", "listen.watch_stall_seconds", "must be 1-3600 seconds"),
    ("[listen]\nmax_connections = 0", "listen.max_connections", "must be 1-65536"),
    ("[listen]\nmax_connections_per_user = 1e3", "listen.max_connections_per_user", "expected an integer"),
    ("[listen]\nmax_watchers = 100000", "listen.max_watchers", "must be 1-65536"),
    ("[listen]\nreserved_connections = 128", "listen.reserved_connections", "leaves no connection"),
    ("[discovery]\nrescan_seconds = 1979-05-27T07:32:00Z", "discovery.rescan_seconds", "got datetime"),
    ('[health]\nlisten = "localhost"', "health.listen", "expected HOST:PORT"),
    ('[health]\nhosts = ["node-1.example", "bad name"]', "health.hosts", "not a host name"),
    ('[apply]\ncgroup_prefixes = "memtopo"', "apply.cgroup_prefixes", "expected an array of strings"),
    ("[apply]\ncgroup_prefixes = [1]", "apply.cgroup_prefixes", "holds integer"),
    ('[apply]\ncgroup_prefixes = ["/"]', "apply.cgroup_prefixes", "hierarchy root"),
    ('[apply]\ncgroup_prefixes = ["a/../b"]', "apply.cgroup_prefixes", "'..'"),
    ('[apply]\nirqbalance = "kill"', "apply.irqbalance", "'kill' is not one of leave, ban, stop"),
    ("[apply]\ncgroup_version = 3", "apply.cgroup_version", "not 0 (detect), 1 or 2"),
    ("[apply]\ncgroup_version = 2.0", "apply.cgroup_version", "expected an integer, got float"),
    ("[apply]\nallow_init = 0", "apply.allow_init", "expected true or false"),
    ("[apply]\nmax_actions = 5", "apply.max_actions", "unknown key"),
    ('[log]\nlevel = "trace"', "log.level", "'trace' is not one of debug, info, warning, error"),
    ('[log]\nlevel = "INFO"', "log.level", "is not one of"),
    ('[log]\nformat = "text"', "log.format", "is not one of json, console"),
]


@pytest.mark.parametrize(("text", "key", "reason"), REJECTED)
def test_invalid_values_name_the_key_and_the_reason(text: str, key: str, reason: str) -> None:
    err = error_of(text)
    assert err.key == key
    assert reason in err.reason
    assert str(err) == f"test.toml: {key}: {err.reason}"
    assert err.source == "test.toml"


@pytest.mark.parametrize("text", ["a = ", "[listen\nsocket = 1", "x = 1\nx = 2", "a = 1979-13-45",
                                  "a = " + "9" * 5000, "a = " + "[" * 3000 + "]" * 3000])
def test_unparsable_toml_is_a_config_error(text: str) -> None:
    err = error_of(text)
    assert err.key == ""
    assert err.reason.startswith(("not valid TOML", "not usable TOML"))
    assert str(err).startswith("test.toml: not ")


def test_exit_status_is_ex_config() -> None:
    assert EXIT_CONFIG == 78


# --- files -------------------------------------------------------------------------------------


def test_load_config_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert info.value.source == str(missing) and "No such file" in info.value.reason

    binary = tmp_path / "bin.toml"
    binary.write_bytes(b'node_name = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)

    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"#" * (cfgmod.MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="larger than"):
        load_config(huge)

    bad = tmp_path / "bad.toml"
    bad.write_text("[discovery]\nrescan_seconds = -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert str(info.value) == f"{bad}: discovery.rescan_seconds: {info.value.reason}"


def test_load_config_refuses_what_is_not_a_regular_file_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(ConfigError, match=r"not a regular file \(a FIFO\)"):
        load_config(fifo)
    with pytest.raises(ConfigError, match=r"not a regular file \(a directory\)"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"not a regular file \(a character device\)"):
        load_config(Path("/dev/zero"))  # endless: never read


def test_check_host_names_the_key(tmp_path: Path) -> None:
    cfg = parse_config(f'state_dir = "{tmp_path / "state"}"\n[listen]\nsocket_group = "memtopo-none-such"', "t")
    with pytest.raises(ConfigError) as info:
        cfgmod.check_host(cfg)
    assert info.value.key == "listen.socket_group" and "does not exist" in info.value.reason
    (tmp_path / "file").write_text("")
    cfg = parse_config(f'state_dir = "{tmp_path / "file" / "state"}"', "t")
    with pytest.raises(ConfigError) as info:
        cfgmod.check_host(cfg)
    assert info.value.key == "state_dir" and "not a writable directory" in info.value.reason
    good = parse_config(f'state_dir = "{tmp_path / "state"}"\n[listen]\nsocket_group = "0"', "t")
    cfgmod.check_host(good)
    assert (tmp_path / "state").is_dir() and not list((tmp_path / "state").iterdir())


def test_check_host_refuses_a_numeric_group_that_is_no_gid(tmp_path: Path) -> None:
    """A number too large for gid_t stops the agent at the check, under the key that named it, not
    later when the socket is bound."""
    cfg = parse_config(f'state_dir = "{tmp_path / "state"}"\n[listen]\nsocket_group = "{2**32 - 1}"', "t")
    with pytest.raises(ConfigError) as info:
        cfgmod.check_host(cfg)
    assert info.value.key == "listen.socket_group" and "not a valid gid" in info.value.reason
    cfgmod.check_host(parse_config(f'state_dir = "{tmp_path / "state"}"\n[listen]\nsocket_group = "{2**32 - 2}"', "t"))


def test_load_config_checks_tls_files_are_readable(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("cert")
    text = f'[listen]\ntcp = "127.0.0.1:0"\ntls_cert = "{cert}"\ntls_key = "{key}"\n'
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "listen.tls_key" and str(key) in info.value.reason
    # parse_config does no I/O: the same text parses.
    assert parse_config(text, "t").listen.tls_key == str(key)
    key.write_text("key")
    assert load_config(path).listen.tls_cert == str(cert)

    ca_dir = tmp_path / "ca-is-a-directory"
    ca_dir.mkdir()
    path.write_text(f'[controller]\naddress = "ctl:7000"\ntls_ca = "{ca_dir}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "controller.tls_ca"


# --- addresses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:9464", ("127.0.0.1", 9464)),
    ("[::1]:80", ("::1", 80)),
    ("[::]:0", ("::", 0)),
    ("ctl.example.net:65535", ("ctl.example.net", 65535)),
    ("localhost:1", ("localhost", 1)),
    ("node-7.:443", ("node-7.", 443)),
    ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
])
def test_parse_host_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize("text", ["", "host", "host:", ":80", "::1:80", "[::1]80", "[::1", "[nope]:80",
                                  "host:65536", "host:-1", "host:+80", "host:８０", "-bad-:80", "a..b:80",
                                  "h" * 64 + ":80", "host:0080000"])
def test_parse_host_port_rejects(text: str) -> None:
    with pytest.raises(AddressError):
        parse_host_port(text)


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1:7000", True), ("127.255.0.9:1", True), ("[::1]:7000", True), ("::1", True), ("127.0.0.1", True),
    ("localhost:7000", True), ("LOCALHOST", True), ("unix:/run/x.sock", True), ("unix:///run/x.sock", True),
    ("[::ffff:127.0.0.1]:80", True),
    ("10.0.0.1:7000", False), ("[::]:7000", False), ("0.0.0.0:1", False), ("ctl:7000", False),
    ("localhost.example.com:1", False), ("[::ffff:10.0.0.1]:80", False), ("", False), ("128.0.0.1:1", False),
])
def test_is_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


# --- property tests ----------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        # JSON's escapes are TOML's, except surrogate pairs (kept out with ensure_ascii=False) and
        # DEL, which TOML wants escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


_scalars = st.one_of(
    st.booleans(), st.integers(), st.integers(min_value=-(10**400), max_value=10**400), st.floats(),
    st.text(max_size=40), st.sampled_from(["", "/", "/run/x.sock", "0660", "127.0.0.1:9464", "[::1]:1",
                                           "unix:/x", "localhost:0", "ban", "debug", "json", "memtopo", "0o660"]),
)
_values = st.one_of(_scalars, st.lists(_scalars, max_size=4))
_odd_keys = st.one_of(st.sampled_from(["listen.bogus", "apply.max_actions", "extra"]),
                      st.from_regex(r"([a-z]{1,6}\.)?[a-z_]{1,8}", fullmatch=True))
# Values of the right kind for each key, so that many drawn configs are accepted and the invariants
# below get exercised, not only the rejections.
_paths = st.sampled_from(["", "/srv/root", "/etc/mt/x.pem"])
_seconds = st.one_of(st.floats(min_value=0, max_value=1e6), st.integers(0, 10**6))
_listen_addr = st.sampled_from(["", "127.0.0.1:9464", "[::1]:0", "0.0.0.0:7443", "host-1:80"])
_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "node_name": st.sampled_from(["", "gpu-1"]), "root": st.sampled_from(["/", "/srv/root"]),
    "state_dir": st.sampled_from(["/var/lib/memtopo", "/tmp/s"]),
    "listen.socket": st.sampled_from(["", "/run/x.sock"]), "listen.socket_mode": st.sampled_from(["0660", "600"]),
    "listen.socket_group": st.sampled_from(["", "memtopo", "1001"]), "listen.tcp": _listen_addr,
    "listen.read_socket": st.sampled_from(["", "/run/x.sock", "/run/ro.sock"]),
    "listen.tls_cert": _paths, "listen.tls_key": _paths, "listen.tls_client_ca": _paths,
    "controller.address": st.sampled_from(["", "127.0.0.1:7000", "ctl.example.net:7000", "unix:/run/c.sock"]),
    "controller.insecure": st.booleans(), "controller.tls_ca": _paths, "controller.tls_cert": _paths,
    "controller.tls_key": _paths, "controller.heartbeat_seconds": _seconds,
    "controller.backoff_initial_seconds": _seconds, "controller.backoff_max_seconds": _seconds,
    "discovery.rescan_seconds": _seconds, "discovery.debounce_seconds": _seconds, "discovery.udev": st.booleans(),
    "discovery.isolate": st.booleans(),
    "discovery.deadline_seconds": _seconds, "listen.idle_seconds": _seconds, "listen.watch_stall_seconds": _seconds,
    "listen.max_connections": st.integers(0, 70000), "listen.max_connections_per_user": st.integers(0, 70000),
    "listen.reserved_connections": st.integers(-1, 70000), "listen.max_watchers": st.integers(0, 70000),
    "health.listen": _listen_addr,
    "health.hosts": st.lists(st.sampled_from(["node-1.example", "bad name", ""]), max_size=2),
    "apply.cgroup_prefixes": st.lists(st.sampled_from(["memtopo", "jobs/ai", "/x/"]), max_size=3),
    "apply.irqbalance": st.sampled_from(["leave", "ban", "stop"]), "apply.allow_init": st.booleans(),
    "apply.allow_kernel_threads": st.booleans(), "apply.allow_self": st.booleans(),
    "apply.cgroup_version": st.integers(0, 2),
    "log.level": st.sampled_from(["debug", "info", "warning", "error"]),
    "log.format": st.sampled_from(["json", "console"]),
    "kubernetes.enabled": st.booleans(), "kubernetes.node_name": st.sampled_from(["", "gpu-1", "Bad_Name"]),
    "kubernetes.api_server": st.sampled_from(["", "https://10.0.0.1:6443", "ftp://x"]),
    "kubernetes.kubelet_config": st.sampled_from(["", "/var/lib/kubelet/config.yaml", "relative.yaml"]),
    "kubernetes.pod_resources_socket": st.sampled_from(["", "/var/lib/kubelet/pod-resources/kubelet.sock"]),
    "kubernetes.pod_resources_seconds": st.floats(0.1, 60), "kubernetes.backoff_initial_seconds": st.floats(0.1, 5),
    "kubernetes.backoff_max_seconds": st.floats(0.1, 120), "kubernetes.force_conflicts": st.booleans(),
    "kubernetes.enforce": st.booleans(), "kubernetes.enforce_interval_seconds": st.floats(0.01, 5),
    "kubernetes.runtime_endpoint": st.sampled_from(["", "unix:///run/containerd/containerd.sock", "tcp://x:1"]),
}


@st.composite
def _entries(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(sorted(SPEC_KEYS)), max_size=8, unique=True))
    if not draw(st.integers(0, 4)):
        keys.append(draw(_odd_keys))
    return {k: draw(_PLAUSIBLE.get(k, _values) if draw(st.integers(0, 9)) else _values) for k in keys}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_entries())
def test_any_schema_shaped_toml_gives_config_or_config_error(entries: dict[str, Any]) -> None:
    top: list[str] = []
    sections: dict[str, list[str]] = {}
    for key, value in entries.items():
        section, _, name = key.rpartition(".")
        line = f"{name} = {_toml_value(value)}"
        (sections.setdefault(section, []) if section else top).append(line)
    text = "\n".join(top) + "\n" + "".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())
    try:
        cfg = parse_config(text, "prop.toml")
    except ConfigError as err:
        assert str(err).startswith("prop.toml: ")
        return
    assert isinstance(cfg, AgentConfig)
    # Whatever was accepted satisfies the invariants the daemon relies on.
    assert cfg.controller.backoff_max_seconds >= cfg.controller.backoff_initial_seconds > 0
    assert cfg.discovery.rescan_seconds > 0 and cfg.discovery.debounce_seconds >= 0
    # Every duration within its bounds (0 only for the debounce): no timer spins or never fires.
    for key, (low, high) in cfgmod.DURATION_BOUNDS.items():
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        assert low <= value <= high or (key == "discovery.debounce_seconds" and value == 0), key
    assert 0 <= cfg.listen.reserved_connections < cfg.listen.max_connections
    assert cfg.listen.socket or cfg.listen.tcp
    assert not cfg.listen.tcp or (cfg.listen.tls_cert and cfg.listen.tls_key)
    assert not (cfg.controller.insecure and cfg.controller.address) or is_loopback(cfg.controller.address)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_text_gives_config_or_config_error(text: str) -> None:
    try:
        assert isinstance(parse_config(text, "p"), AgentConfig)
    except ConfigError as err:
        assert err.source == "p"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_host_port_parser_never_raises_anything_else(text: str) -> None:
    try:
        host, port = parse_host_port(text)
    except AddressError:
        return
    assert 0 <= port <= 65535 and host
    assert isinstance(is_loopback(text), bool)


def test_property_strategies_cover_every_key() -> None:
    assert set(_PLAUSIBLE) == SPEC_KEYS


@pytest.mark.parametrize(("text", "expected"), [
    ("", "/run/memtopo/agent-read.sock"),
    ('[listen]\nsocket = "/srv/m/api.sock"', "/srv/m/api-read.sock"),
    ('[listen]\nsocket = "/srv/m/api"', "/srv/m/api-read.sock"),
    ('[listen]\nsocket = "/srv/m/api.sock"\nread_socket = ""', ""),
    ('[listen]\nsocket = "/srv/m/api.sock"\nread_socket = "/srv/ro.sock"', "/srv/ro.sock"),
    ('[listen]\nsocket = ""\ntcp = "127.0.0.1:7443"\ntls_cert = "/c"\ntls_key = "/k"', ""),
])
def test_read_socket_defaults_to_beside_the_socket(text: str, expected: str) -> None:
    assert parse_config(text, "test.toml").listen.read_socket == expected


def test_kubernetes_section() -> None:
    cfg = parse_config('[kubernetes]\nenabled = true\nnode_name = "gpu-1"\napi_server = "https://10.0.0.1:6443"\n'
                       'pod_resources_seconds = 2\n', "k.toml").kubernetes
    assert (cfg.enabled, cfg.node_name, cfg.api_server, cfg.pod_resources_seconds) == (
        True, "gpu-1", "https://10.0.0.1:6443", 2.0)
    assert cfg.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock" and not cfg.force_conflicts
    assert error_of('[kubernetes]\nnode_name = "GPU_1"\n').key == "kubernetes.node_name"
    assert error_of('[kubernetes]\napi_server = "10.0.0.1:6443"\n').key == "kubernetes.api_server"
    assert error_of('[kubernetes]\nkubelet_config = "config.yaml"\n').key == "kubernetes.kubelet_config"
    assert error_of('[kubernetes]\nruntime_endpoint = "tcp://10.0.0.1:1234"\n').key == "kubernetes.runtime_endpoint"
    assert error_of("[kubernetes]\nenforce_interval_seconds = 0.001\n").key == "kubernetes.enforce_interval_seconds"
    on = parse_config('[kubernetes]\nenforce = true\nruntime_endpoint = "/run/k3s/containerd/containerd.sock"\n',
                      "k.toml").kubernetes
    assert (on.enforce, on.runtime_endpoint, on.enforce_interval_seconds) == (
        True, "/run/k3s/containerd/containerd.sock", 1.0)
    err = error_of("[kubernetes]\nbackoff_initial_seconds = 5\nbackoff_max_seconds = 1\n")
    assert err.key == "kubernetes.backoff_max_seconds"
